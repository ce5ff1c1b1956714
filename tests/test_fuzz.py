"""Fuzzing the command lines (train.py, bench.py, sample.py, training/data.py,
formats/pretrained.py, training/forward_cost.py and benchmark/plot.py). Every run ends in
success or in one 'error:' line, never a traceback, and a failed run leaves out/ exactly as it
was:

- damaged files in out/ (truncated, garbage, deleted, a folder in their place): the commands
  that build them (training/data.py, train.py) rebuild them with a one-line notice, byte for byte;
  the ones that only read them (bench.py, sample.py) refuse, naming the file and the command that
  remakes it;
- paths of the wrong kind (a folder for a file, a file for a folder): one error line;
- a seeded random sweep of values at every numeric and path flag of the four commands.

Commands run in this process through their real `if __name__ == "__main__"` block
(tests/commands.py). Runs on copies of conftest.py's tiny trained out/, one thread each: about
15 s beyond that shared training."""

import json
import os
import random

import pytest

from commands import (CHECKPOINTS, DAMAGES, DATA_FILES, PARSERS, damage, fast, refused, run,
                      snapshot, succeeded, with_flag)
import train
from registry import drafters as registry
from training import trainer

# -----------------------------------------------------------------------------
# damaged files in out/


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("name", DATA_FILES)
def test_damaged_data_file_readers_refuse_and_data_py_rebuilds(out, corpus, name, how):
    good = snapshot(out)
    damage(out / name, how)
    damaged = snapshot(out)
    for script in ("bench.py", "sample.py"):
        refused(run(script, *fast(script, out, corpus)), name, "python -m training.data")
        assert snapshot(out) == damaged  # a refusal changes nothing
    res = run("training/data.py", *fast("training/data.py", out, corpus))
    if how == "folder":  # never deleted: it may be the user's
        refused(res, name, "is a folder")
        assert snapshot(out) == damaged
    else:
        assert "data: rebuilding" in succeeded(res)
        assert snapshot(out) == good  # rebuilt byte for byte: every checkpoint still belongs to it


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_damaged_checkpoint_readers_refuse_naming_the_stage(out, corpus, name, how):
    stage = name[:-3]
    damage(out / name, how)
    damaged = snapshot(out)
    methods = "ar" if stage == "target" else f"ar,{stage}"
    bench_argv = with_flag(fast("bench.py", out, corpus), "--methods", methods)
    refused(run("bench.py", *bench_argv), name, f"python train.py --only {stage}")
    method = registry.names()[0] if stage == "target" else stage
    spec_argv = with_flag(fast("sample.py", out, corpus), "--method", method)
    refused(run("sample.py", *spec_argv), name, f"python train.py --only {stage}")
    if how == "folder":
        refused(run("train.py", *fast("train.py", out, corpus)), name, "is a folder")
    assert snapshot(out) == damaged


@pytest.mark.parametrize("how", ["truncate", "garbage", "delete"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_train_py_finds_a_damaged_checkpoint_stale(out, corpus, name, how, capsys):
    damage(out / name, how)
    run = train.resolve_args(fast("train.py", out, corpus))
    assert not trainer.is_current(trainer.Trainer(run, registry.stages()), name[:-3])
    assert how == "delete" or "unreadable; retraining it" in capsys.readouterr().out


def test_train_py_retrains_damaged_files_and_a_later_run_works(out, corpus):
    """Garbage in distill.pt, small.pt cut short: one train.py run remakes both, with a notice
    each, and sample.py then runs on them, with no cleanup by hand."""
    damage(out / "distill.pt", "garbage")
    damage(out / "small.pt", "truncate")
    log = succeeded(run("train.py", *fast("train.py", out, corpus), "--only", "small"))
    assert "small.pt is unreadable; retraining it" in log
    assert "distill.pt is unreadable; rewriting it" in log
    succeeded(run("sample.py", *fast("sample.py", out, corpus)))


# -----------------------------------------------------------------------------
# paths of the wrong kind


@pytest.fixture
def things(tmp_path):
    """One path of every kind a user might give by mistake."""
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "notes.txt").write_text("some notes\n")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    return {"missing": tmp_path / "nope", "folder": tmp_path / "empty_folder",
            "file": tmp_path / "notes.txt", "binary": tmp_path / "blob.bin",
            "under_a_file": tmp_path / "notes.txt" / "x", "device": os.devnull, "empty": "",
            "unwritable": UNWRITABLE}


# a folder no one may make a file in, root included (Linux's /proc): a read-only output folder
UNWRITABLE = "/proc/self/nanospec"
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc")


@pytest.mark.parametrize("script, flag, kind, needle", [
    ("bench.py", "--prompts", "folder", "is a folder, not a file"),
    ("bench.py", "--prompts", "missing", "does not exist"),
    ("bench.py", "--prompts", "binary", "is not UTF-8 text"),
    ("bench.py", "--plot", "folder", "not a .png, .svg or .pdf"),
    ("bench.py", "--plot", "file", "not a .png, .svg or .pdf"),
    ("bench.py", "--json", "folder", "is a folder, not a file"),
    ("bench.py", "--markdown", "folder", "is a folder, not a file"),
    ("bench.py", "--json", "under_a_file", "folder that does not exist"),
    ("bench.py", "--out-dir", "file", "is a file, not a folder"),
    ("sample.py", "--out-dir", "file", "is a file, not a folder"),
    ("train.py", "--out-dir", "file", "is a file, not a folder"),
    ("train.py", "--out-dir", "under_a_file", "cannot be made"),
    pytest.param("train.py", "--out-dir", "unwritable", "cannot be written", marks=needs_proc),
    pytest.param("training/data.py", "--out-dir", "unwritable", "cannot be written", marks=needs_proc),
    pytest.param("bench.py", "--json", "unwritable", "cannot be written", marks=needs_proc),
    pytest.param("bench.py", "--plot", "unwritable", "not a .png", marks=needs_proc),
    ("training/data.py", "--out-dir", "file", "is a file, not a folder"),
    ("train.py", "--data", "missing", "does not exist"),
    ("training/data.py", "--data", "device", "neither a file nor a folder"),
    ("training/data.py", "--data", "empty", "is empty"),
    ("train.py", "--data", "folder", "is empty"),   # a folder is fine, but this one holds no text
    ("training/data.py", "--data", "binary", "binary"),
    ("train.py", "--init-from", "file", "GGUF's magic bytes"),  # a file is read as a GGUF
    ("train.py", "--init-from", "folder", "it has no config.json"),
])
def test_a_path_of_the_wrong_kind_is_one_error_line(out, corpus, things, script, flag, kind,
                                                    needle):
    before = snapshot(out)
    refused(run(script, *with_flag(fast(script, out, corpus), flag, things[kind])), needle)
    assert snapshot(out) == before


def test_a_read_only_out_dir_is_refused_before_the_work(out, corpus, tmp_path):
    """Permission bits, as a user who is not root meets them (root may write anyway: skipped)."""
    if os.geteuid() == 0:
        pytest.skip("root writes to a read-only folder")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    refused(run("train.py", *with_flag(fast("train.py", out, corpus), "--out-dir", ro / "out")),
            "cannot be written")
    os.chmod(out, 0o555)
    try:  # bench.py reads its checkpoints there, and would write bench.json beside them
        refused(run("bench.py", *fast("bench.py", out, corpus)), "--json", "cannot be written")
    finally:
        os.chmod(out, 0o755)


def test_bench_py_checks_its_default_outputs_before_the_run(out, corpus):
    """OUT_DIR/bench.json and bench.png, where no flag names them: a folder in the way is found
    before minutes of benchmarking, not after them."""
    before = snapshot(out)
    argv = [a for a in fast("bench.py", out, corpus)]
    argv = argv[:argv.index("--plot")] if "--plot" in argv else argv
    (out / "bench.png").mkdir()
    code, so, se = res = run("bench.py", *argv)
    refused(res, "--plot", "is a folder", "--plot ''")
    assert "tokens/s" not in so  # refused before the bench ran
    os.rmdir(out / "bench.png")
    (out / "serving.json").mkdir()
    refused(run("bench.py", *argv, "--batch-size", "1"), "--json", "is a folder")
    os.rmdir(out / "serving.json")
    assert snapshot(out) == before


def test_bench_py_names_the_new_tokens_that_fit(out, corpus):
    """--max-new-tokens beyond the context window: the header and the JSON give the number every
    prompt got, not the one asked for."""
    argv = with_flag(fast("bench.py", out, corpus), "--max-new-tokens", "500")
    for extra in ([], ["--batch-size", "1"]):
        so = succeeded(run("bench.py", *argv, *extra, "--json", out / "r.json"))
        n = json.loads((out / "r.json").read_text())["max_new_tokens"]
        assert n < 500 and f"x {n} new tokens" in so and "does not fit" in so
    refused(run("bench.py", *with_flag(argv, "--prompt-len", "500")), "--prompt-len 500")


def test_text_that_is_not_unicode_is_one_error_line(out, corpus, tmp_path):
    """A byte from a terminal of another encoding (Python keeps it as a lone surrogate) and a
    JSON lone surrogate escape: refused where the text enters, naming it, not in the tokenizer."""
    argv = fast("sample.py", out, corpus)
    refused(run("sample.py", *with_flag(argv, "--prompt", "caf\udce9")), "--prompt", "0xe9")
    refused(run("sample.py", *with_flag(argv, "--chat", "x\udcff")), "--chat", "0xff")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "a\\ud800b"}\n')
    refused(run("bench.py", *with_flag(fast("bench.py", out, corpus), "--prompts", bad)),
            "line 2", "lone surrogate \\ud800")


def test_plot_py_checks_where_it_draws_before_it_reads(out, tmp_path, things):
    """The figure's file, named or beside the JSON: one error line, never a traceback."""
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"methods": {}}))
    (tmp_path / "d.png").mkdir()
    refused(run("benchmark/plot.py", results, tmp_path / "d.png"), "is a folder")
    refused(run("benchmark/plot.py", results, tmp_path / "r.txt"), "not a .png")
    if os.path.isdir("/proc/self"):
        refused(run("benchmark/plot.py", results, UNWRITABLE + ".png"), "cannot be written")
    (tmp_path / "r.png").mkdir()
    refused(run("benchmark/plot.py", results), "is a folder", "name an image")


def test_sample_py_shows_a_tree_and_refuses_its_bad_pairings(out, corpus):
    argv = with_flag(fast("sample.py", out, corpus), "--method", "dspark")
    assert "a tree of at most 6 nodes" in succeeded(run("sample.py", *argv, "--tree", "6", "--k", "3"))
    refused(run("sample.py", *argv, "--tree", "6", "--sampling", "rejection"), "rejection",
            "multi-candidate")
    refused(run("sample.py", *with_flag(argv, "--method", "small"), "--tree", "6"),
            "--method dflash or dspark")
    refused(run("sample.py", *argv, "--tree", "6", "--k", "99"), "at most")


# -----------------------------------------------------------------------------
# writers that would replace what is there


def test_pretrained_py_random_keeps_a_folder_that_holds_files(tmp_path):
    real = tmp_path / "gpt2"
    real.mkdir()
    (real / "model.safetensors").write_bytes(b"a user's real weights")
    before = snapshot(real)
    refused(run("formats/pretrained.py", real, "--random", "tiny"), "already holds files", "--force")
    assert snapshot(real) == before
    (tmp_path / "f").write_text("x")
    refused(run("formats/pretrained.py", tmp_path / "f", "--random", "tiny"), "is a file")
    refused(run("formats/pretrained.py", tmp_path / "nope"), "no such folder")
    assert "GPT-2 2 layers" in succeeded(run("formats/pretrained.py", real, "--random", "tiny", "--force"))
    assert snapshot(real) != before


@pytest.fixture
def gpt2_folder(tmp_path):
    succeeded(run("formats/pretrained.py", tmp_path / "gpt2", "--random", "tiny"))
    return tmp_path / "gpt2"


@pytest.mark.parametrize("change, needle", [
    ("init_from", "would be imported over it"),
    ("smaller", "this run's target would train on"),
    ("corpus", "the data path and the data contents"),
])
def test_train_py_keeps_a_trained_target_unless_forced(out, corpus, tmp_path, gpt2_folder,
                                                         change, needle):
    """A run that would throw a trained target away (and every drafter trained against it)
    refuses and names --force: an --init-from import over it, a smaller retraining (the quick
    preset over the full run), another corpus in the same out/."""
    argv = fast("train.py", out, corpus)
    if change == "init_from":
        argv = fast("train.py", out, corpus, "--init-from", gpt2_folder)  # the folder's vocabulary
        argv = [*argv, "--block-size", "64", "--mtp-mode", "posthoc"]
    elif change == "smaller":
        argv = with_flag(argv, "--target-iters", "5")
    else:
        (tmp_path / "other.txt").write_text("".join(f"line {i} of other\n" for i in range(2000)))
        argv = with_flag(argv, "--data", tmp_path / "other.txt")
    before = snapshot(out)
    refused(run("train.py", *argv), "target.pt", needle, "--force")
    if change == "corpus":  # the build itself, through training/data.py
        data_argv = with_flag(fast("training/data.py", out, corpus), "--data", tmp_path / "other.txt")
        refused(run("training/data.py", *data_argv), "target.pt", needle, "--force")
    assert snapshot(out) == before


# -----------------------------------------------------------------------------
# a seeded random sweep over every numeric and path flag

JUNK = ["", " ", "-1", "0", "nan", "inf", "-inf", "1e999", "abc", "0x10", "+3", "3.0", "1,2", "٣",
        "--", "-0.5"]
# In-range values stay small (test_cli.py parses the huge ones): a huge count would make a run
# that succeeds slow. These would (re)train every stage from scratch, so they get no good value:
COSTLY = {
    ("train.py", "--vocab-size"), ("training/data.py", "--vocab-size"),  # a new tokenizer
    ("train.py", "--out-dir", "missing"), ("train.py", "--out-dir", "folder"),  # an empty out/
    ("train.py", "--data", "file"),  # a text file is another corpus
    ("training/data.py", "--data", "file"),
}
# runs that succeed cost time
GOOD_RUNS = {"train.py": 12, "training/data.py": 12, "bench.py": 3, "sample.py": 5,
             "training/forward_cost.py": 4}


def sweep_flags(script):
    """[(flag, kind)] for every numeric and path flag of a command; kind is its type's name."""
    kinds = ("an integer", "a number", "list", "a path")
    return [(action.option_strings[0], action.type.__name__)
            for action in PARSERS[script]()._actions
            if action.option_strings and getattr(action.type, "__name__", "") in kinds]


def random_value(rng, script, flag, kind, things, goods, good_ok):
    """(value, meant to be good): a path of a random kind, or a number, mostly junk or out of
    range."""
    if kind == "a path":
        pool = [k for k in things if (script, flag, k) not in COSTLY]
        good = good_ok and rng.random() < 0.3 and flag in goods  # --init-from: never a good one
        return str(goods[flag] if good else things[rng.choice(pool)]), good
    if not good_ok or rng.random() < 0.6 or (script, flag) in COSTLY:
        return rng.choice(JUNK + [str(rng.randint(-10**6, 0)), repr(rng.uniform(-5, 0))]), False
    if kind == "list":
        return ",".join(str(rng.randint(1, 4)) for _ in range(rng.randint(1, 3))), True
    if kind == "an integer":
        return str(rng.randint(1, 4)), True
    return repr(round(rng.uniform(0.01, 1.0), 3)), True


@pytest.mark.parametrize("script", sorted(PARSERS))
def test_random_sweep_of_every_numeric_and_path_flag(out, corpus, things, tmp_path, script):
    """Random values at every numeric and path flag, three each: exit 0, or one error line and
    out/ unchanged; never a traceback."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f(x):"}\n{"prompt": "import os"}\n')
    goods = {"--out-dir": out, "--data": corpus, "--prompts": tmp_path / "p.jsonl",
             "--json": tmp_path / "r.json", "--markdown": tmp_path / "r.md"}
    rng = random.Random(f"sweep {os.path.basename(script)}")
    before, good_left, runs = snapshot(out), GOOD_RUNS[script], 0
    for flag, kind in sweep_flags(script):
        for _ in range(3):
            value, good = random_value(rng, script, flag, kind, things, goods, good_left > 0)
            good_left -= good
            code, so, se = res = run(script, *with_flag(fast(script, out, corpus), flag, value))
            assert "Traceback" not in so + se, (flag, value, res)
            if code != 0:
                refused(res)
                # a failed command changes nothing in out/
                assert snapshot(out) == before, (flag, value)
            else:
                runs, before = runs + 1, snapshot(out)
    assert runs >= min(2, GOOD_RUNS[script])  # it reached real runs, where any can run
