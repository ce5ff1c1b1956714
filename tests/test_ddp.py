"""Training across processes (training/ddp.py): one DDP step over 2 gloo ranks is one single-process
step
on the union of their batches (float64, 1e-10); torchrun with 2 processes trains the tiny
preset, its checkpoints load, a failing rank ends the run with one error line, and the rerun
resumes to the very weights of an uninterrupted run."""

import contextlib
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training import ddp, trainer
import train
from gpt import GPT, GPTConfig
from registry import drafters as registry
from registry.drafters import load_drafter
from tests.conftest import tiny_args
from runtime.target import load_target

LEARNED = [name for name in registry.stages() if name != "target"]  # every drafter that trains

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

# -----------------------------------------------------------------------------
# the split of a batch


@pytest.mark.parametrize("size,accum", [(1, 1), (2, 1), (2, 2), (4, 2), (1, 4)])
def test_the_shards_of_a_step_cover_its_batch_once(size, accum):
    B = 16
    rows = []
    for rank in range(size):
        for micro in range(accum):
            s = ddp.shard(ddp.World(rank, size), accum, B, micro)
            rows += list(range(B))[s] if s is not None else list(range(B))
    assert sorted(rows) == list(range(B))


def test_a_batch_that_does_not_split_is_refused_naming_the_multiple():
    with pytest.raises(ValueError, match="multiple of 6"):
        ddp.check_split(ddp.World(0, 3), 2, 8)


def test_one_process_is_untouched():
    w = ddp.World()
    assert ddp.shard(w, 1, 8, 0) is None and ddp.mean(w, 2.5) == 2.5
    x = torch.arange(6).view(3, 2)
    assert ddp.my_rows(w, 3) == (0, 3) and ddp.gather_rows(w, x, 3) is x
    fn = lambda step: step  # noqa: E731
    assert ddp.wrap(w, torch.nn.Linear(2, 2), fn) is fn


# -----------------------------------------------------------------------------
# one DDP step == one step on the union (float64)


def model_and_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=50, n_layer=2, n_head=2, n_embd=16)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (8, 16), generator=g)
    return model, x, torch.roll(x, -1, 1)


class OneStep:
    """What Trainer.fit asks of its Trainer, for one step on model_and_batch()'s batch: the rows
    of this process's micro-step, no autocast, and a clock that keeps the step's logged loss."""

    def __init__(self, world, accum, out_dir):
        self.world, self.rows, self.losses, self.stage_steps = world, None, [], 0
        self.run = types.SimpleNamespace(warmup=0, grad_accum=accum, batch_size=8,
                                         out_dir=out_dir, ckpt_interval=float("inf"),
                                         eval_interval=1, log_interval=1)
        self.clock = self

    def lr_flag(self, name):
        return "--lr"

    def set_rows(self, rows):
        self.rows = rows

    def autocast(self):
        return contextlib.nullcontext()

    def tick(self, name, done, steps, loss, *rest):
        self.losses.append(loss)

    def finish(self, *phases):
        pass

    def evaluate(self, name, step, module, eval_fn):
        return eval_fn()


def one_step(world, accum, out_dir):
    """One optimizer step of the training loop itself (Trainer.fit: the shards, DDP, the AdamW and
    the clip) on the batch model_and_batch() gives -> (its logged loss, the new parameters)."""
    model, x, y = model_and_batch()
    tr = OneStep(world, accum, out_dir)

    def loss_fn(step):
        r = tr.rows if tr.rows is not None else slice(None)
        return model(x[r], y[r])[1]
    trainer.Trainer.fit(tr, "step", model, loss_fn, lambda: 0.0, steps=1, lr=1e-2, fingerprint={},
                        tokens_per_step=1)
    return tr.losses[0], {k: v.detach().clone() for k, v in model.state_dict().items()}


def ddp_worker(rank, size, init, accum, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        loss, sd = one_step(ddp.World(rank, size), accum, os.path.dirname(out))
        if rank == 0:
            torch.save({"loss": loss, "state": sd}, out)
        dist.barrier()  # neither rank tears its gloo threads down while the other still talks
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("accum", [1, 2])
def test_a_ddp_step_over_two_ranks_is_one_step_on_the_union(accum, tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    out = tmp_path / "rank0.pt"
    mp.spawn(ddp_worker, args=(2, init, accum, str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)
    loss, want = one_step(ddp.World(), 1, str(tmp_path))  # one process, the whole batch at once
    assert abs(got["loss"] - loss) < 1e-10
    before = model_and_batch()[0].state_dict()
    for k in want:
        assert (got["state"][k] - want[k]).abs().max().item() < 1e-10, k
        if k.endswith("weight"):  # and the step did move the weights
            assert (want[k] - before[k]).abs().max().item() > 1e-4, k


# -----------------------------------------------------------------------------
# torchrun: the tiny preset over 2 gloo processes


def torchrun(script, corpus, out, *extra, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           script, *tiny_args(corpus, out, "--threads", "1", *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout, p.stderr


FAIL_ON_RANK_1 = """
import os, sys
sys.path.insert(0, {root!r})
import train
from training import trainer
real = trainer.stop_if_diverged
def fail(name, step, *rest):  # rank 1 dies in the middle of the eagle stage
    if name == "eagle" and step == 5 and os.environ["RANK"] == "1":
        raise RuntimeError("injected failure")
    return real(name, step, *rest)
trainer.stop_if_diverged = fail
train.cli(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def two_process_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_out")
    rc, so, err = torchrun("train.py", corpus, out)
    assert rc == 0, err[-3000:]
    return out, so


def test_torchrun_trains_the_tiny_preset_and_its_checkpoints_load(two_process_run):
    out, so = two_process_run
    assert "2 processes (torchrun)" in so
    assert so.count("train.py finished") == 1  # rank 0 alone prints
    target, ckpt = load_target(str(out / "target.pt"))
    for name in LEARNED:
        d = load_drafter(name, str(out), target, ckpt, "cpu", torch.float32)
        assert d is not None
    assert not [f for f in os.listdir(out) if ".tmp" in f or f.endswith(".resume.pt")]


def test_a_failed_rank_ends_the_run_in_one_line_and_the_rerun_resumes_exactly(
        two_process_run, corpus, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_RANK_1.format(root=ROOT))
    out = tmp_path / "out"
    rc, so, err = torchrun(str(script), corpus, out, "--ckpt-interval", "0", timeout=120)
    assert rc != 0
    ours = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "error: rank 1 of 2: RuntimeError: injected failure" in ours, err[-3000:]
    assert all("rank 1 of 2" in line or "another rank" in line for line in ours), ours
    assert (out / "eagle.resume.pt").exists() and not (out / "eagle.pt").exists()
    rc, so, err = torchrun("train.py", corpus, out)
    assert rc == 0, err[-3000:]
    assert "eagle: resuming an interrupted run at step" in so
    for name in ("target", "eagle", "dspark"):  # the same weights as the uninterrupted run's
        a = torch.load(out / f"{name}.pt", weights_only=True)["state_dict"]
        b = torch.load(two_process_run[0] / f"{name}.pt", weights_only=True)["state_dict"]
        assert all(torch.equal(a[k], b[k]) for k in a), name


# -----------------------------------------------------------------------------
# every stage's loss: the mean over a step's shards is the whole batch's (its anchors included)


@pytest.mark.parametrize("stage", LEARNED)
def test_the_shards_of_a_stages_step_make_the_whole_batchs_loss(trained, corpus, tmp_path,
                                                                  monkeypatch, stage):
    """Each phase's loss, as the training loop calls it: with the rows of --grad-accum 2's (or
    2 ranks') shards set, the two losses average to the whole batch's. A shard drawing its
    anchors for its own rows (not the batch's) would miss by far more than rounding. A stage
    that learns nothing (no phases) fits nothing, and nothing of it is split."""
    out = shutil.copytree(trained, tmp_path / "out")
    seen = []

    def fit(tr, name, module, loss, *rest, **kwargs):  # record the phase, train nothing
        seen.append((tr, name, module, loss))
        return trainer.Fitted(float("nan"), {})
    monkeypatch.setattr(trainer.Trainer, "fit", fit)
    argv = tiny_args(corpus, out, "--only", stage, "--force", "--bf16", "off")
    run = train.resolve_args(argv)
    learns = bool(registry.stages()[stage].phases(run.settings[stage], run))
    train.main(argv)
    assert bool(seen) == learns, stage
    for tr, name, module, loss_fn in seen:
        module.train()
        with torch.no_grad():
            whole = loss_fn(3).item()
            parts = []
            for micro in range(2):
                tr.set_rows(ddp.shard(ddp.World(), 2, tr.run.batch_size, micro))
                parts.append(loss_fn(3).item())
            tr.set_rows(None)
        assert abs(sum(parts) / 2 - whole) < 1e-5 * max(1.0, abs(whole)), (name, parts, whole)
        assert parts[0] != parts[1], name  # the shards are different rows


def test_an_error_every_rank_meets_is_one_line_from_rank_0(corpus, tmp_path):
    rc, so, err = torchrun("train.py", corpus, tmp_path / "out", "--batch-size", "3", timeout=120)
    ours = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc != 0 and len(ours) == 1, err[-3000:]
    assert ours[0].startswith("error: rank 0 of 2: --batch-size 3 does not split into 2 "), ours
    # rank 1, waiting to let rank 0 speak, is stopped by torchrun's SIGTERM, quietly: the one
    # traceback left is torchrun's own report that the job failed (ChildFailedError)
    assert err.count("Traceback (most recent call last)") == 1 and "ChildFailedError" in err, err
    assert "During handling" not in err and "Terminated" not in err, err[-3000:]


def test_torchrun_on_an_apple_gpu_is_refused_before_it_starts():
    with pytest.raises(ValueError, match="one process"):
        ddp.start(ddp.World(0, 2), "mps")
