"""train.py end to end on the tiny preset: the loss goes down, checkpoints are complete and
written atomically, an interrupted stage resumes to the very same weights, a NaN loss stops
with a message, and the same seed gives the same checkpoints."""

import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import dataclasses

import train
from conftest import tiny_args
from registry import drafters as registry
from registry.drafters import load_drafter
from runtime import devices
from runtime.checkpoint import load_checkpoint
from runtime.settings import flag_type, settings_of
from training import flags, tokenizer, trainer
from runtime.target import load_target


def preset(name):
    """{setting: value} of every setting (by its flag's name) in one preset."""
    return flags.values_in(registry.stages(), name)


def test_target_checkpoint_is_complete_and_learned(trained):
    ckpt = load_checkpoint(str(trained / "target.pt"), "target")
    for key in ("config", "state_dict", "model_hash", "tokenizer_hash", "step", "optimizer",
                "val_loss"):
        assert key in ckpt
    assert ckpt["step"] == preset("tiny")["target_iters"]
    # a random model scores about ln(V); training must have beaten that clearly
    assert ckpt["val_loss"] < math.log(ckpt["config"]["vocab_size"]) - 0.5
    assert not [f for f in os.listdir(trained) if ".tmp" in f or f.endswith(".resume.pt")]
    model, _ = load_target(str(trained / "target.pt"))
    assert model.config.n_layer == preset("tiny")["n_layer"]


def test_every_stage_wrote_a_matching_checkpoint(trained):
    t = load_checkpoint(str(trained / "target.pt"), "target")
    for stage in registry.stages():
        if stage == "target":
            continue
        ck = load_checkpoint(str(trained / f"{stage}.pt"), stage)
        assert ck["target_hash"] == t["model_hash"] and ck["tokenizer_hash"] == t["tokenizer_hash"]


def test_existing_stages_are_skipped(trained, corpus, capsys):
    before = {s: os.path.getmtime(trained / f"{s}.pt") for s in registry.stages()}
    train.main(tiny_args(corpus, trained))
    assert "exists, skipping" in capsys.readouterr().out
    assert before == {s: os.path.getmtime(trained / f"{s}.pt") for s in registry.stages()}


class Interrupt(Exception):
    pass


def test_interrupted_stage_resumes_to_the_same_weights(corpus, tmp_path, monkeypatch, capsys):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    train.main(tiny_args(corpus, ref_dir, "--only", "target"))
    real_lr_at = trainer.lr_at

    def dying_lr_at(step, *args):  # the process "dies" at step 20, after a resume file was written
        if step == 20:
            raise Interrupt
        return real_lr_at(step, *args)

    monkeypatch.setattr(trainer, "lr_at", dying_lr_at)
    with pytest.raises(Interrupt):
        train.main(tiny_args(corpus, run_dir, "--only", "target", "--ckpt-interval", "0"))
    assert not (run_dir / "target.pt").exists()  # no half-finished checkpoint masquerades as done
    assert load_checkpoint(str(run_dir / "target.resume.pt"), "resume")["step"] == 20
    monkeypatch.setattr(trainer, "lr_at", real_lr_at)
    capsys.readouterr()
    train.main(tiny_args(corpus, run_dir, "--only", "target"))
    assert "resuming an interrupted run at step 20" in capsys.readouterr().out
    a = load_checkpoint(str(ref_dir / "target.pt"), "target")
    b = load_checkpoint(str(run_dir / "target.pt"), "target")
    assert a["model_hash"] == b["model_hash"]
    assert not (run_dir / "target.resume.pt").exists()


def test_nan_loss_stops_the_stage_and_keeps_the_last_good_state(corpus, tmp_path, monkeypatch):
    real_fit = trainer.Trainer.fit

    def poisoned_fit(tr, name, module, loss, *args, **kwargs):  # the loss turns NaN at step 12
        return real_fit(tr, name, module, lambda s: loss(s) * (float("nan") if s >= 12 else 1.0),
                        *args, **kwargs)

    monkeypatch.setattr(trainer.Trainer, "fit", poisoned_fit)
    with pytest.raises(trainer.TrainingError, match="became nan at step 12.*step 12.*kept in"):
        train.main(tiny_args(corpus, tmp_path, "--only", "target", "--ckpt-interval", "0"))
    assert not (tmp_path / "target.pt").exists()
    kept = load_checkpoint(str(tmp_path / "target.resume.pt"), "resume")
    assert kept["step"] == 12 and all(torch.isfinite(v).all() for v in kept["state_dict"].values())


def test_a_stage_that_writes_no_checkpoint_is_an_error_not_a_success(trained, corpus, tmp_path,
                                                                       monkeypatch):
    """train.py says a stage wrote out/<name>.pt only where it did: a stage's train() that forgot
    tr.save ends in one error naming the call."""
    out = shutil.copytree(trained, tmp_path / "out")

    def forgetful(tr, settings):  # trains nothing, saves nothing
        return 0.0
    small = registry.entry("small")
    monkeypatch.setattr(small, "stage", dataclasses.replace(small.stage, train=forgetful))
    os.remove(out / "small.pt")
    with pytest.raises(trainer.TrainingError, match=r"small: its stage ended without writing .*"
                       r"small.pt: its train\(\) saves it, tr.save\(config, net, ...\)"):
        train.main(tiny_args(corpus, out, "--only", "small"))


def test_same_seed_same_checkpoints(trained, corpus, tmp_path):
    train.main(tiny_args(corpus, tmp_path))
    for stage in registry.stages():
        a = load_checkpoint(str(trained / f"{stage}.pt"), stage)["state_dict"]
        b = load_checkpoint(str(tmp_path / f"{stage}.pt"), stage)["state_dict"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), stage
    ranks = "tokenizer.tiktoken"
    assert tokenizer.file_sha256(trained / ranks) == tokenizer.file_sha256(tmp_path / ranks)


def test_a_killed_train_py_resumes_where_it_stopped(corpus, tmp_path):
    """A real SIGKILL mid-stage, not an exception: the next run resumes, and nothing half-written
    loads."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = tiny_args(corpus, tmp_path, "--only", "target", "--target-iters", "3000",
                      "--ckpt-interval", "0.5")
    cmd = [sys.executable, "train.py", *flags]
    p = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    resume = tmp_path / "target.resume.pt"
    deadline = time.time() + 120
    while not resume.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    time.sleep(1.0)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (tmp_path / "target.pt").exists()
    step = load_checkpoint(str(resume), "resume")["step"]  # loads: the file was never half-written
    assert 0 < step < 3000
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "resuming an interrupted run at step" in out.stdout
    assert load_checkpoint(str(tmp_path / "target.pt"), "target")["step"] == 3000


def test_the_distillation_set_is_written_once_and_shared(trained, corpus, tmp_path, capsys):
    """Every drafter stage learns from one set the target wrote (out/distill.pt): retraining a
    drafter reuses it; other --gen-* settings rewrite it."""
    # a copy: the shared fixture stays as it is
    trained = shutil.copytree(trained, tmp_path / "out")
    ck = load_checkpoint(str(trained / "distill.pt"), "distill")
    P = preset("tiny")
    assert tuple(ck["tokens"].shape) == (P["gen_seqs"], P["block_size"])
    target_hash = load_checkpoint(str(trained / "target.pt"), "target")["model_hash"]
    assert ck["settings"]["target"] == target_hash
    before = os.path.getmtime(trained / "distill.pt")
    capsys.readouterr()
    train.main(tiny_args(corpus, trained, "--only", "mtp", "--force"))
    assert "the target wrote" not in capsys.readouterr().out
    assert os.path.getmtime(trained / "distill.pt") == before
    train.main(tiny_args(corpus, trained, "--only", "mtp", "--force", "--gen-seqs", "12"))
    assert "the target wrote 12 x" in capsys.readouterr().out
    assert load_checkpoint(str(trained / "distill.pt"), "distill")["tokens"].shape[0] == 12


def test_bf16_autocast_is_measured_and_can_be_forced_off(corpus, tmp_path):
    assert devices.fast_bf16("cpu") in (True, False) and devices.fast_bf16("mps") is False
    run = train.resolve_args(tiny_args(corpus, tmp_path, "--bf16", "off"))
    assert run.use_bf16 is False
    assert train.resolve_args(tiny_args(corpus, tmp_path, "--bf16", "on")).use_bf16 is True


def test_drafters_train_without_the_feature_cache_and_on_corpus_text(trained, corpus, tmp_path):
    """--feature-cache 0 (the target runs every step) and --*-text data (corpus windows) are
    the other two ways a drafter stage gets its batches: both must train and write a checkpoint."""
    out = shutil.copytree(trained, tmp_path / "out")
    train.main(tiny_args(corpus, out, "--only", "dflash", "--force", "--feature-cache", "0"))
    train.main(tiny_args(corpus, out, "--only", "mtp", "--force", "--mtp-text", "data"))
    for stage in ("dflash", "mtp"):
        ck = load_checkpoint(str(out / f"{stage}.pt"), stage)
        P = preset("tiny")
        assert ck["budget"]["steps"] == P[f"{stage}_iters"] + P.get(f"{stage}_narrow_iters", 0)
        assert all(torch.isfinite(v).all() for v in ck["state_dict"].values())


def test_dspark_branches_off_dflash_at_an_equal_step_budget(trained, corpus, tmp_path):
    """--dspark-init dflash: DFlash saves its state after dflash_steps - dspark_iters steps
    (out/dflash.branch.pt) and DSpark starts there, so both have trained the same number of
    steps; a branch from another DFlash run is refused, naming the fix."""
    P = preset("tiny")
    branch = load_checkpoint(str(trained / "dflash.branch.pt"), "dflash-branch")
    steps = P["dflash_narrow_iters"] + P["dflash_iters"]
    assert branch["budget"]["steps"] == steps - P["dspark_iters"] >= 1
    dflash = load_checkpoint(str(trained / "dflash.pt"), "dflash")
    assert branch["fingerprint"] == dflash["fingerprint"]
    # an earlier state, not the final one
    assert any(not torch.equal(branch["state_dict"][k], v)
               for k, v in dflash["state_dict"].items())
    dspark = load_checkpoint(str(trained / "dspark.pt"), "dspark")
    assert dspark["init_budget"]["steps"] + dspark["budget"]["steps"] == steps
    out = shutil.copytree(trained, tmp_path / "out")
    branch["fingerprint"] = {**branch["fingerprint"], "seed": -1}
    torch.save(branch, out / "dflash.branch.pt")
    with pytest.raises(ValueError, match="not from the run.*--only dflash --force"):
        train.main(tiny_args(corpus, out, "--only", "dspark", "--force"))


def test_dflash_trains_a_narrow_block_first_then_widens(trained, corpus, tmp_path, monkeypatch,
                                                        capsys):
    """--dflash-narrow-iters: DFlash trains at the narrow block, then at the full block from
    those weights. DSpark's branch, taken in the narrow phase here, is widened when DSpark loads
    it. A process that dies after the narrow phase reruns only the full block, to the same
    weights."""
    P = preset("tiny")
    dflash = load_checkpoint(str(trained / "dflash.pt"), "dflash")
    assert dflash["config"]["block"] == P["dflash_block"]
    assert dflash["state_dict"]["mask_emb"].size(0) == P["dflash_block"] - 1
    branch = load_checkpoint(str(trained / "dflash.branch.pt"), "dflash-branch")
    assert branch["budget"]["steps"] < P["dflash_narrow_iters"]  # this test's premise
    assert branch["state_dict"]["mask_emb"].size(0) == P["dflash_narrow_block"] - 1
    dspark = load_checkpoint(str(trained / "dspark.pt"), "dspark")
    assert dspark["state_dict"]["backbone.mask_emb"].size(0) == P["dflash_block"] - 1

    out = shutil.copytree(trained, tmp_path / "out")
    real_fit = trainer.Trainer.fit

    def dying_fit(tr, name, *args, **kwargs):  # dies as the full block starts
        if name == "dflash":
            raise Interrupt
        return real_fit(tr, name, *args, **kwargs)
    monkeypatch.setattr(trainer.Trainer, "fit", dying_fit)
    with pytest.raises(Interrupt):
        train.main(tiny_args(corpus, out, "--only", "dflash", "--force"))
    monkeypatch.setattr(trainer.Trainer, "fit", real_fit)
    assert (out / "dflash-narrow.resume.pt").exists()
    capsys.readouterr()
    train.main(tiny_args(corpus, out, "--only", "dflash", "--force"))
    n = P["dflash_narrow_iters"]
    assert f"dflash-narrow: resuming an interrupted run at step {n}/{n}" in capsys.readouterr().out
    again = load_checkpoint(str(out / "dflash.pt"), "dflash")["state_dict"]
    assert all(torch.equal(again[k], v) for k, v in dflash["state_dict"].items())
    assert not (out / "dflash-narrow.resume.pt").exists()
    with pytest.raises(ValueError, match="--dflash-narrow-block .* must be smaller"):
        train.main(tiny_args(corpus, out, "--dflash-narrow-block", str(P["dflash_block"])))


def test_dspark_has_sampling_weights_from_the_sampled_text(trained, corpus, tmp_path, monkeypatch,
                                                          capsys):
    """DSpark's sampling weights: a copy fine-tuned on the sampled rows of the distillation set
    only, stored in out/dspark.pt beside the greedy ones; load_drafter hands them out for
    sampling only, their steps added to the budget. A run that dies in those steps resumes them
    without redoing DSpark's own, to the same weights; without sampled text there are none."""
    P = preset("tiny")
    dspark = load_checkpoint(str(trained / "dspark.pt"), "dspark")
    tuned = dspark["sampled"]
    assert tuned["budget"]["steps"] == P["dspark_sampled_iters"]
    assert tuned["state_dict"].keys() == dspark["state_dict"].keys()
    assert any(not torch.equal(tuned["state_dict"][k], v) for k, v in dspark["state_dict"].items())
    target, target_ckpt = load_target(str(trained / "target.pt"))
    for mode, want in (("greedy", dspark["state_dict"]), ("coupled", tuned["state_dict"])):
        d = load_drafter("dspark", str(trained), target, target_ckpt, sampling=mode)
        assert all(torch.equal(d.spark.state_dict()[k], v) for k, v in want.items())
        assert len(d.budget) == (2 if mode == "greedy" else 3)
    # the rows it learns from: the last gen_sampled share, the ones written at a temperature
    ctx = trainer.Trainer(train.resolve_args(tiny_args(corpus, trained)), registry.stages())
    pool, batch = ctx.distill.text(), ctx.distill.batches("gen", sampled_only=True)
    assert len(ctx.corpus("train")) > len(ctx.corpus("val")) > 0  # the corpus, as token ids
    first = len(pool) - round(P["gen_seqs"] * P["gen_sampled"])
    for step in range(5):
        x = batch(step)[0]
        assert all(any(torch.equal(row, s) for s in pool[first:]) for row in x)

    out = shutil.copytree(trained, tmp_path / "out")
    real_lr_at = trainer.lr_at

    def dying_lr_at(step, iters, *args):  # dies in the middle of the sampling steps
        if iters == P["dspark_sampled_iters"] and step == 2:
            raise Interrupt
        return real_lr_at(step, iters, *args)
    monkeypatch.setattr(trainer, "lr_at", dying_lr_at)
    with pytest.raises(Interrupt):
        train.main(tiny_args(corpus, out, "--only", "dspark", "--force", "--ckpt-interval", "0"))
    monkeypatch.setattr(trainer, "lr_at", real_lr_at)
    capsys.readouterr()
    train.main(tiny_args(corpus, out, "--only", "dspark", "--force"))
    log = capsys.readouterr().out
    n = P["dspark_iters"]
    assert f"dspark: resuming an interrupted run at step {n}/{n}" in log
    assert "dspark-sampled: resuming an interrupted run at step 2/" in log
    again = load_checkpoint(str(out / "dspark.pt"), "dspark")
    for k, v in tuned["state_dict"].items():
        assert torch.equal(again["sampled"]["state_dict"][k], v)
    assert not [f for f in os.listdir(out) if f.endswith(".resume.pt")]
    train.main(tiny_args(corpus, out, "--only", "dspark", "--force", "--gen-sampled", "0"))
    assert "no sampling weights" in capsys.readouterr().out
    assert "sampled" not in load_checkpoint(str(out / "dspark.pt"), "dspark")


# -----------------------------------------------------------------------------
# the settings: one dataclass per stage, every preset's value valid, --help showing what a run uses


def test_every_setting_has_one_home_and_every_preset_value_parses():
    """Each setting is a field of exactly one settings dataclass (the run's, the target's, what
    every stage shares, the distillation set's, each drafter stage's), with its help; each preset's
    value passes the setting's own flag type (so a preset can never hold a value the command line
    would refuse)."""
    fields = [(name, f) for _, cls, prefix in flags.groups(registry.stages())
              for name, f in settings_of(cls, prefix)]
    names = [name for name, _ in fields]
    assert len(names) == len(set(names)) == len(preset("cpu"))
    for p in flags.PRESETS:
        values = preset(p)
        for name, f in fields:
            value = values[name]
            assert f.metadata["help"], name
            if f.metadata["choices"]:
                assert value in f.metadata["choices"], (p, name, value)
            elif value is None:  # unset: the flag's own default applies (--threads)
                continue
            else:
                assert flag_type(f)(str(value)) == value, (p, name, value)


def test_help_shows_the_value_each_preset_gives_and_groups_the_flags():
    def help_of(*argv):
        out = subprocess.run([sys.executable, "train.py", *argv, "--help"], capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert out.returncode == 0, out.stderr
        return " ".join(out.stdout.split())  # argparse wraps lines
    for p in ("cpu", "quick", "tiny"):
        text = help_of("--preset", p, "--device", "cpu")
        for name in ("dflash_iters", "target_iters", "gen_seqs"):
            want = preset(p)[name]
            assert f"(default: {want}, preset {p})" in text.split(
                "--" + name.replace("_", "-"))[-1], (p, name)
    text = help_of("--device", "cpu")
    titles = ["start here:"] + [f"{title}:" for title, _, _ in flags.groups(registry.stages())]
    assert "the distillation set (training/distill.py):" in titles
    assert "dflash (training/stages_dflash.py):" in titles
    assert all(t in text for t in titles)
    assert [text.index(t) for t in titles] == sorted(text.index(t) for t in titles)


def test_a_stage_trained_with_other_settings_is_retrained(trained, corpus, tmp_path, capsys,
                                                          monkeypatch):
    """Not only --force retrains: a checkpoint that records other settings is stale (so the full
    run after `--preset quick` retrains everything instead of keeping the quick checkpoints)."""
    out = shutil.copytree(trained, tmp_path / "out")
    before = load_checkpoint(str(out / "small.pt"), "small")
    capsys.readouterr()
    train.main(tiny_args(corpus, out, "--only", "small", "--small-iters", "12"))
    log = capsys.readouterr().out
    assert "small_iters 10 -> 12" in log and "retraining it" in log
    after = load_checkpoint(str(out / "small.pt"), "small")
    assert after["budget"]["steps"] == 12 != before["budget"]["steps"]
    small = registry.entry("small")  # one its stage now writes in another format
    monkeypatch.setattr(small, "stage", dataclasses.replace(small.stage, format=2))
    train.main(tiny_args(corpus, out, "--only", "small", "--small-iters", "12"))
    log = capsys.readouterr().out
    assert "format 1 -> 2" in log and "retraining it" in log
    train.main(tiny_args(corpus, out, "--only", "target", "--target-iters", "31"))
    assert "target_iters 30 -> 31" in capsys.readouterr().out


def test_the_whole_runs_time_is_estimated_as_it_goes(trained, corpus, tmp_path, capsys):
    out = shutil.copytree(trained, tmp_path / "out")
    capsys.readouterr()
    train.main(tiny_args(corpus, out, "--only", "dflash", "--force", "--log-interval", "2"))
    log = capsys.readouterr().out
    assert "left in all (an estimate, updated as it goes)" in log
    assert log.count("| run ~") >= 4  # every progress line, both phases


def test_no_drafter_file_imports_train_py():
    """Each stage (training/stages_<name>.py) gets what it needs from its settings and the Trainer
    it is handed, whose loop (tr.fit) trains its phases: none imports train.py."""
    import ast
    import glob
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for pattern in ("draft_*.py", "training/stage*.py")
             for p in glob.glob(os.path.join(root, pattern))]
    files = {os.path.basename(p) for p in paths}
    assert {f"stages_{name}.py" for name in registry.stages()} <= files
    for path in paths:
        tree = ast.parse(open(path).read())
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for a in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "train" not in imported, path
