"""Bad input a new user meets on the newer surface and deeper down: a data build that no longer
fits the trained target, a damaged record beside a trained file, `~` in a path flag, Ctrl-C and
SIGTERM, a count flag with a prompts file. Each ends in one line (or works, where the input is
valid), and nothing trained is replaced without --force.

Runs on copies of conftest.py's tiny trained out/, through tests/commands.py (in this process,
as a user's command line would run), except the signals, which a real process receives."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch

from commands import ROOT, damage, fast, refused, run, snapshot, succeeded, with_flag
from conftest import tiny_args
from runtime.checkpoint import load_checkpoint, save_checkpoint

# -----------------------------------------------------------------------------
# a target and a data build that no longer belong together


def rebuild_for_another_vocabulary(out, corpus):
    """What a user does: training/data.py --force, for another vocabulary, over a trained out/."""
    argv = with_flag(fast("training/data.py", out, corpus), "--vocab-size", "300")
    succeeded(run("training/data.py", *argv, "--force"))


def test_readers_refuse_a_target_whose_tokenizer_was_rebuilt_and_name_both_ways_out(out, corpus):
    """bench.py and sample.py stop before the first token, in one line naming the command that
    makes the target's build again; that command works, and then so does bench.py."""
    rebuild_for_another_vocabulary(out, corpus)
    for script in ("bench.py", "sample.py"):
        line = refused(run(script, *fast(script, out, corpus)), "target.pt was trained with "
                       "tokenizer", "(384 tokens)", "(300 tokens)", "python train.py", "--force")
    restore = re.search(r"`python -m training\.data ([^`]*)`", line)
    assert restore, line
    succeeded(run("training/data.py", *shlex.split(restore.group(1))))
    assert "exact" in succeeded(run("bench.py", *fast("bench.py", out, corpus)))


def test_train_py_keeps_a_target_whose_build_was_rebuilt_unless_forced(out, corpus):
    """After a rebuild with --force, train.py does not retrain the target over it on its own."""
    rebuild_for_another_vocabulary(out, corpus)
    target = snapshot(out)["target.pt"]
    argv = with_flag(fast("train.py", out, corpus), "--vocab-size", "300")
    refused(run("train.py", *argv), "target.pt was trained with tokenizer", "--force")
    refused(run("train.py", *argv, "--only", "small"), "target.pt was trained with tokenizer",
            "--only target --force")
    assert snapshot(out)["target.pt"] == target


@pytest.mark.parametrize("how", ["garbage", "delete"])
@pytest.mark.parametrize("script", ["train.py", "training/data.py"])
def test_a_damaged_build_record_does_not_let_the_trained_target_go(out, corpus, script, how):
    """With data_meta.json unreadable, a rebuild for another vocabulary is refused all the same
    (the tokenizer it would make is not the target's), and nothing in out/ changes; one for the
    same settings rebuilds the same build, and keeps the target."""
    damage(out / "data_meta.json", how)
    before = snapshot(out)
    argv = with_flag(fast(script, out, corpus), "--vocab-size", "300")
    refused(run(script, *argv), "target.pt was trained with tokenizer", "--force")
    assert snapshot(out) == before
    succeeded(run(script, *fast(script, out, corpus)))
    assert snapshot(out)["target.pt"] == before["target.pt"]


def test_a_stage_that_records_no_settings_is_kept_not_retrained(out, corpus):
    """A checkpoint without its settings record is unknown, not stale: train.py keeps it."""
    ckpt = load_checkpoint(str(out / "small.pt"), "small")
    del ckpt["settings"]
    save_checkpoint(ckpt, str(out / "small.pt"))
    before = snapshot(out)["small.pt"]
    printed = succeeded(run("train.py", *fast("train.py", out, corpus), "--only", "small"))
    assert "records no settings" in printed and "--force" in printed
    assert snapshot(out)["small.pt"] == before


# -----------------------------------------------------------------------------
# `~` in a path flag: the check and the work read the same path


def test_a_tilde_in_every_path_flag_means_the_home_folder(out, corpus, tmp_path, monkeypatch):
    """--flag=~/x (which the shell leaves alone) is the home folder's x for every command, and no
    folder named `~` appears where the command ran."""
    home, here = tmp_path / "home", tmp_path / "here"
    here.mkdir()
    home.mkdir()
    os.replace(out, home / "run")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    (home / "p.jsonl").write_text('{"prompt": "def f(x):"}\n')
    bench_argv = [*with_flag(fast("bench.py", home / "run", corpus), "--out-dir", "~/run"),
                  "--prompts=~/p.jsonl", "--json=~/b.json"]
    succeeded(run("bench.py", *bench_argv))
    assert json.loads((home / "b.json").read_text())["n_prompts"] == 1
    succeeded(run("sample.py", *with_flag(fast("sample.py", home / "run", corpus), "--out-dir",
                                          "~/run")))
    succeeded(run("training/data.py", "--data", corpus, "--vocab-size", "384",
                  "--out-dir=~/built"))
    assert (home / "built" / "data_meta.json").is_file()
    succeeded(run("train.py", *with_flag(fast("train.py", home / "run", corpus), "--out-dir",
                                         "~/run")))
    succeeded(run("benchmark/plot.py", "~/b.json", "~/b.png"))
    assert (home / "b.png").is_file()
    succeeded(run("formats/pretrained.py", "~/gpt2", "--random", "tiny"))
    assert (home / "gpt2" / "config.json").is_file()
    assert os.listdir(here) == []


# -----------------------------------------------------------------------------
# count flags apply to every source of prompts, or are refused with the reason


def test_n_prompts_and_prompt_len_apply_to_a_prompts_file(out, corpus, tmp_path):
    lines = [json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"}) for i in range(5)]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    argv = [*fast("bench.py", out, corpus), "--prompts", tmp_path / "p.jsonl",
            "--json", tmp_path / "r.json"]
    succeeded(run("bench.py", *with_flag(argv, "--n-prompts", "2")))
    assert json.loads((tmp_path / "r.json").read_text())["n_prompts"] == 2
    i = argv.index("--n-prompts")
    argv = argv[:i] + argv[i + 2:]  # the file's prompts, all of them
    succeeded(run("bench.py", *argv))
    assert json.loads((tmp_path / "r.json").read_text())["n_prompts"] == 5
    refused(run("bench.py", *argv, "--n-prompts", "6"), "--n-prompts 6", "5")
    succeeded(run("bench.py", *argv, "--prompt-len", "3"))  # each prompt's last 3 tokens
    refused(run("bench.py", *argv, "--sweep-prompts", "2"), "--sweep-prompts", "--sweep")
    refused(run("bench.py", *with_flag(argv, "--sweep", "1"), "--sweep-prompts", "9"),
            "--sweep-prompts 9", "5")


# -----------------------------------------------------------------------------
# Ctrl-C and SIGTERM: one line, what was kept, the shell's exit status, nothing half-written


def leftovers(folder):
    return [p for p in snapshot(folder) if ".tmp" in p]


def test_ctrl_c_in_training_says_what_it_kept_and_the_same_command_resumes(out, corpus,
                                                                          monkeypatch):
    """Interrupted at step 3 of a stage that saves every step: one line naming the resume file
    and its step, exit status 130, no temporary left; the same command resumes at step 3."""
    from training import trainer
    after = trainer.Phase.after

    def interrupt_at_3(self, done, loss_val, lr):
        after(self, done, loss_val, lr)
        if done == 3:
            raise KeyboardInterrupt

    argv = [*fast("train.py", out, corpus), "--only", "small", "--force", "--ckpt-interval", "0"]
    monkeypatch.setattr(trainer.Phase, "after", interrupt_at_3)
    code, _, err = run("train.py", *argv)
    assert code == 130 and err.count("\n") == 1, err
    assert err.startswith("interrupted: ") and "small.resume.pt" in err and "step 3/" in err
    assert "resumes there" in err and not leftovers(out)
    monkeypatch.setattr(trainer.Phase, "after", after)
    assert "resuming an interrupted run at step 3" in succeeded(run("train.py", *argv))


def test_ctrl_c_in_bench_writes_no_results_file(out, corpus, tmp_path, monkeypatch):
    import speculative

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(speculative, "generate_speculative", interrupted)
    code, _, err = run("bench.py", *with_flag(fast("bench.py", out, corpus), "--json",
                                              tmp_path / "r.json"))
    assert code == 130 and err.startswith("interrupted: ") and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "r.json") and not leftovers(tmp_path)


def test_a_write_cut_short_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """Interrupted halfway through writing a checkpoint, or any file: the old one stays whole."""
    path = tmp_path / "target.pt"
    save_checkpoint({"kind": "target", "state_dict": {}, "old": True}, str(path))
    real_save = torch.save

    def half_then_ctrl_c(obj, f):
        real_save(obj, f)
        os.truncate(f, os.path.getsize(f) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"kind": "target", "state_dict": {}, "old": False}, str(path))
    assert load_checkpoint(str(path), "target")["old"] and os.listdir(tmp_path) == ["target.pt"]
    from runtime import command
    command.atomic_write(tmp_path / "a.json", "{}")
    with pytest.raises(KeyboardInterrupt), command.replacing(tmp_path / "a.json") as tmp:
        open(tmp, "w").write("{half")
        raise KeyboardInterrupt
    assert (tmp_path / "a.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["a.json", "target.pt"]


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_real_signal_ends_train_py_in_one_line(out, corpus, sig, status):
    """A real Ctrl-C (SIGINT) or SIGTERM, sent to a training process mid-stage."""
    argv = [*tiny_args(corpus, out, "--bf16", "off", "--threads", "1"), "--only", "small",
            "--force", "--log-interval", "1", "--small-iters", "100000"]
    # Ctrl-C reaches a process that does not ignore it: a job started in the background by a
    # shell without job control (a CI runner's, say) inherits SIGINT ignored, as Python respects
    p = subprocess.Popen([sys.executable, "train.py", *map(str, argv)], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in p.stdout:  # signalled once a training step is done
            if line.startswith("small | step"):
                break
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == status, err
    assert err.startswith("interrupted: ") and err.count("\n") == 1, err
    assert not leftovers(out)


# -----------------------------------------------------------------------------
# a tree larger than the context can hold


def test_a_tree_larger_than_the_window_is_capped_and_runs(trained):
    """A tree never asks for a forward over nothing: --tree beyond what a round can verify is
    capped at what it can, and said; a size no count reaches is refused as it is parsed."""
    argv = ["--out-dir", trained, "--method", "dspark", "--max-new-tokens", "8", "--no-color",
            "--prompt", "def f("]
    out = succeeded(run("sample.py", *argv, "--tree", 100_000))
    assert "--tree 100000: at most " in out and "tau =" in out
    refused(run("sample.py", *argv, "--tree", 10 ** 30), "--tree", "below 2^31")


# -----------------------------------------------------------------------------
# a stage whose validation loss is not finite is never written as done


def test_a_target_whose_validation_loss_is_nan_is_not_written_as_done(corpus, tmp_path,
                                                                      monkeypatch):
    from training import trainer
    monkeypatch.setattr(trainer.Trainer, "val_loss", lambda self, fn, n=8: float("nan"))
    out = tmp_path / "out"
    line = refused(run("train.py", *tiny_args(corpus, out, "--only", "target")),
                   "target: its validation loss is nan", "--target-lr")
    assert "kept in" in line
    assert not (out / "target.pt").exists() and (out / "target.resume.pt").exists()


# -----------------------------------------------------------------------------
# flags that cannot apply together: refused in one line, never silently dropped


@pytest.mark.parametrize("flags,needles", [
    (["--trees", "--batch-size", "1,2"], ["--trees", "--batch-size", "drop --trees"]),
    (["--trees", "--sampling", "rejection"], ["--trees", "rejection", "not built"]),
    (["--trees", "--methods", "ar,lookup"], ["--trees", "dflash or dspark", "--methods"]),
    (["--hybrid-with", "dflash", "--methods", "ar,small"], ["--hybrid-with", "hybrid"]),
])
def test_bench_refuses_flags_that_cancel_each_other(trained, flags, needles):
    refused(run("bench.py", "--out-dir", trained, *flags), *needles)


def test_sample_refuses_a_partner_for_a_drafter_built_around_none(trained):
    refused(run("sample.py", "--out-dir", trained, "--method", "small", "--hybrid-with",
                "dflash"), "--hybrid-with", "--method hybrid, not small")


@pytest.mark.parametrize("flag,value", [("--n-embd", "64"), ("--vocab-size", "512"),
                                        ("--n-layer", "3"), ("--target-iters", "5"),
                                        ("--tokenizer", "gpt2")])
def test_a_flag_the_init_from_folder_decides_is_refused(tmp_path, corpus, flag, value):
    folder = tmp_path / "tiny"
    succeeded(run("formats/pretrained.py", folder, "--random", "llama-tiny"))
    out = tmp_path / "out"
    refused(run("train.py", "--init-from", folder, "--preset", "tiny", "--data", corpus,
                "--out-dir", out, "--device", "cpu", flag, value), flag, "--init-from",
            f"drop {flag}")
    assert not out.exists()


def test_a_preset_for_a_folder_without_one_names_init_from_first(tmp_path):
    for preset in ("gpu-small", "gpt2"):
        refused(run("train.py", "--preset", preset, "--out-dir", tmp_path / "out"),
                f"--preset {preset}", "--init-from (a model folder")


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(),
                    reason="a machine with a GPU runs the GPU presets")
def test_a_preset_for_a_gpu_on_a_machine_without_one_says_how_long_and_asks(tmp_path):
    line = refused(run("train.py", "--preset", "cuda", "--out-dir", tmp_path / "out"),
                   "--preset cuda is sized for a GPU", "--device cpu")
    assert re.search(r"about \d+ hours", line), line
    assert not (tmp_path / "out").exists()


def test_a_llama_folder_without_its_tokenizer_names_tokenizer_json(tmp_path, corpus):
    folder = tmp_path / "tiny"
    succeeded(run("formats/pretrained.py", folder, "--random", "llama-tiny"))
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        if (folder / name).exists():
            os.remove(folder / name)
    refused(run("train.py", "--init-from", folder, "--preset", "tiny", "--data", corpus,
                "--out-dir", tmp_path / "out", "--device", "cpu"), "no tokenizer.json")


def test_every_numeric_flag_shows_its_range_in_help():
    for script in ("train.py", "bench.py", "sample.py"):
        out = " ".join(succeeded(run(script, "--help")).split())  # argparse wraps lines
        assert "[an integer >= 1]" in out, script


# -----------------------------------------------------------------------------
# a module a user runs by its path, from another folder


@pytest.mark.parametrize("module", ["formats/pretrained.py", "training/data.py",
                                    "formats/speculators.py", "training/forward_cost.py",
                                    "benchmark/plot.py"])
def test_a_module_runs_by_its_path_from_any_folder(module, tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, module), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "usage:" in p.stdout, p.stderr[-2000:]


# -----------------------------------------------------------------------------
# absurd numbers: one line, whatever the size


@pytest.mark.parametrize("flag,value,needle", [
    ("--k", "100000", "k (tokens drafted per round) must be 1 to"),
    ("--prompt-len", "100000", "leaves no room"),
    ("--n-prompts", "100000000", "the validation text holds"),
    ("--k", str(10 ** 30), "below 2^31"),
])
def test_bench_refuses_an_absurd_number(trained, flag, value, needle):
    refused(run("bench.py", *with_flag(fast("bench.py", trained, None), flag, value)), needle)


@pytest.mark.parametrize("flag,value,needle", [
    ("--block-size", str(10 ** 30), "below 2^31"),
    ("--n-embd", "100000000", "does not fit in this machine's memory"),
])
def test_train_refuses_an_absurd_size(corpus, tmp_path, flag, value, needle):
    out = tmp_path / "out"
    refused(run("train.py", *with_flag(tiny_args(corpus, out, "--only", "target"), flag, value)),
            needle)
    assert not (out / "target.pt").exists()
