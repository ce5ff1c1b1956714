"""What a GPU or a Mac run depends on, shown on the CPU: device names are checked up front,
synchronize waits on the device it is given, sampling works without float64 (MPS has none) and
stays exact, plain decoding never reads back until the end, and the speculative loop reads back
once per round (counted by patching every way a value leaves the device).

Device mode: with NANOSPEC_TEST_DEVICE=cuda (or cuda:N, or mps) the tests at the end of this file
also train the tiny preset, run the bench and check token identity ON that device:

    NANOSPEC_TEST_DEVICE=cuda python -m pytest -q tests

Every other test runs on the CPU either way (the bit-identical-retraining ones must: GPU kernels
are not bitwise deterministic)."""

import functools
import inspect
import math
import os
import subprocess
import sys

import pytest
import torch

from registry import drafters as registry
from runtime import settings
from conftest import make, tiny_args, tiny_gpt, within
from runtime.target import load_target
from runtime.devices import check_dtype, pick_device, synchronize
from draft_small import DraftModel
from sampler import Sampler, keyed_gumbel, sampling_dtype
from speculative import generate_plain, generate_speculative

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_DEVICE = os.environ.get("NANOSPEC_TEST_DEVICE")

# -----------------------------------------------------------------------------
# device names and synchronize


def test_pick_device_refuses_a_gpu_that_is_not_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("cuda") == "cuda" and pick_device("cuda:0") == "cuda:0"
    for name in ("cuda:1", "cuda:7"):
        message = f"'{name}' is not available here: this machine has 1 CUDA device "
        with pytest.raises(ValueError, match=message):
            pick_device(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no CUDA device"):
        pick_device("cuda")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert pick_device("mps") == "mps" and pick_device("mps:0") == "mps:0"
    for bad in ("mps:1", "cuda:x", "tpu", ""):
        with pytest.raises(ValueError, match="is not available here"):
            pick_device(bad)


def test_synchronize_waits_on_the_device_it_is_given(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: calls.append(("cuda", device)))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append(("mps", None)))
    for d in ("mps", "mps:0", torch.device("mps", 0)):  # tensors on a Mac report mps:0
        synchronize(d)
    synchronize("cuda:1")
    synchronize(torch.device("cuda", 1))
    synchronize("cpu")
    assert calls == [("mps", None)] * 3 + [("cuda", torch.device("cuda", 1))] * 2


def test_float64_on_mps_is_one_clear_error_before_anything_loads(tmp_path):
    check_dtype("mps", torch.float32)
    check_dtype("cuda:0", torch.float64)
    with pytest.raises(ValueError, match="float64 is not supported on mps"):
        check_dtype("mps:0", torch.float64)
    # not 'target.pt not found'
    with pytest.raises(ValueError, match="float64 is not supported on mps"):
        load_target(str(tmp_path / "target.pt"), "mps", torch.float64)


# -----------------------------------------------------------------------------
# sampling without float64


def test_sampling_dtype_is_float32_only_where_float64_is_missing():
    mps0 = torch.device("mps", 0)
    assert sampling_dtype("mps") == sampling_dtype("mps:0") == sampling_dtype(mps0) == torch.float32
    assert sampling_dtype("cpu") == sampling_dtype("cuda:1") == torch.float64


def test_float32_keyed_noise_is_exact_gumbel():
    g = keyed_gumbel(1, range(200), 1000, "cpu", torch.float32)
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi ** 2 / 6) < 0.03
    a = keyed_gumbel(7, [3, 4, 5], 100, "cpu", torch.float32)
    b = keyed_gumbel(7, [5], 100, "cpu", torch.float32)
    assert torch.equal(a[2], b[0]) and not torch.equal(a[0], a[1])
    # the float32 uniforms are the float64 ones to within their 23 bits: the same noise, rounded
    u32, u64 = (torch.exp(-torch.exp(-keyed_gumbel(3, range(4), 500, "cpu", t).double()))
                for t in (torch.float32, torch.float64))
    assert (u32 - u64).abs().max() < 2 ** -22
    with pytest.raises(ValueError, match="consecutive"):
        keyed_gumbel(0, [1, 3], 10, "cpu")


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_float32_sampling_keeps_coupled_decoding_token_identical(target, drafter_name, temperature):
    """The path MPS takes (sampling in float32), run on the CPU: still token-identical."""
    drafter = make(drafter_name, target)
    f32 = functools.partial(Sampler, dtype=torch.float32)
    for seed, p in enumerate([[1, 2, 3], [5], [9, 8, 7, 6, 5, 4]]):
        ref = generate_plain(target, p, 30, f32("coupled", temperature, None, seed))
        out, _ = generate_speculative(target, drafter, p, 30, within(drafter, 4),
                                      f32("coupled", temperature, None, seed))
        assert out == ref
        assert out != generate_plain(target, p, 30, Sampler("coupled", temperature, None, seed + 1))
        top = generate_plain(target, p, 30, f32("coupled", temperature, 5, seed))
        assert generate_speculative(target, drafter, p, 30, within(drafter, 4),
                                    f32("coupled", temperature, 5, seed))[0] == top


def test_float32_rejection_sampling_has_the_target_distribution(target8):
    from test_speculative import chi2_critical, chi_square, empirical_pairs, exact_pair_distribution
    prompt, n = [1, 5, 2], 3000
    expected = exact_pair_distribution(target8, prompt, 1.0) * n
    counts = empirical_pairs(target8, make("small", target8), prompt, n,
                             functools.partial(Sampler, dtype=torch.float32))
    stat, dof = chi_square(counts.view(-1), expected.view(-1))
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} over {dof} dof"


@pytest.fixture(scope="module")
def target8():
    return tiny_gpt(3, vocab=8, scale=3.0)


# -----------------------------------------------------------------------------
# host syncs, counted


class HostSyncs:
    """Counts every way a value leaves the device for the host (reads: .item(), .tolist(), a
    tensor's bool/int/float/index) and every tensor made from host data (uploads: torch.tensor,
    torch.as_tensor; on a GPU the copy waits for the queue too). On a CPU none of these costs
    anything, but each one is a place where a GPU run would stall."""

    def __init__(self, monkeypatch):
        self.reads = self.uploads = 0
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self.counted(original, "reads"))
        for name in ("tensor", "as_tensor"):
            monkeypatch.setattr(torch, name, self.counted(getattr(torch, name), "uploads"))

    def counted(self, fn, what):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            setattr(self, what, getattr(self, what) + 1)
            return fn(*args, **kwargs)
        return wrapper


def counting_calls(obj, name):
    """Wrap obj.name so obj.calls[name] counts its calls."""
    real, obj.calls = getattr(obj, name), getattr(obj, "calls", {})
    obj.calls[name] = 0

    def wrapper(*args, **kwargs):
        obj.calls[name] += 1
        return real(*args, **kwargs)
    setattr(obj, name, wrapper)


def own_syncs(name):
    """What a drafter itself reads back or uploads per call, {call: (reads, uploads)}, as its
    declaration says (its DRAFTER's syncs): DSpark's scheduler reads its confidences in a
    round it scores; prompt lookup keeps the text on the host."""
    return registry.entry(name).declared.syncs or {}


CALLS = ("begin", "propose", "commit", "begin_batch", "propose_batch", "commit_batch")


@pytest.mark.parametrize("mode", ["greedy", "coupled", "rejection"])
def test_one_host_sync_per_round(target, drafter_name, mode, monkeypatch):
    drafter = make(drafter_name, target)
    kind = drafter_name.split("-")[0]  # a variant ("dspark-qwen3") syncs as its drafter
    if kind == "dspark":
        # its greedy chain on the host (greedy_chain, draft_dspark.host_greedy_chain) runs only
        # where the Markov table is in CPU memory, where reading back costs nothing; on a GPU the
        # chain stays on the device, which is what this test counts
        drafter.greedy_chain = None
    for name in CALLS:
        counting_calls(drafter, name)
    # the loop waits for the device only when given a sync (below): by default, never
    assert inspect.signature(generate_speculative).parameters["sync"].default is None
    syncs = HostSyncs(monkeypatch)
    out, stats = generate_speculative(target, drafter, [1, 2, 3], 40, within(drafter, 4),
                                      Sampler(mode, 0.9, None, 0))
    monkeypatch.undo()
    own = {what: own_syncs(kind).get(what, (0, 0)) for what in CALLS}
    calls = dict(drafter.calls)
    if kind == "dspark":
        assert 1 <= drafter.scored <= calls["propose_batch"]
        calls["propose_batch"] = drafter.scored
    if drafter_name.startswith("hybrid"):
        # as the lookup: the prompt at begin, the new tokens at commit, its draft on its rounds
        # (its learned drafter, DFlash, reads and uploads nothing)
        own = {what: own_syncs("lookup").get(what, (0, 0)) for what in CALLS}
        calls["propose"] = drafter.rounds["lookup"]
        assert 0 < drafter.rounds["lookup"] < stats.rounds or drafter_name == "hybrid"
    # 1: the token after the prefill
    reads = 1 + stats.rounds + sum(own[w][0] * calls[w] for w in own)
    uploads = 1 + sum(own[w][1] * calls[w] for w in own)  # 1: the prompt
    assert stats.rounds > 3 and len(out) == 40
    counted = (syncs.reads, syncs.uploads)
    assert counted == (reads, uploads), (
        f"{kind} read back {syncs.reads} and uploaded {syncs.uploads} times in {stats.rounds} "
        f"rounds, where the loop's and its declaration's (its DRAFTER's syncs) make {reads} "
        f"and {uploads}: declare what it syncs itself, or keep it on the device")


@pytest.mark.parametrize("mode", ["greedy", "coupled", "rejection"])
def test_plain_decoding_reads_back_only_at_the_end(target, mode, monkeypatch):
    syncs = HostSyncs(monkeypatch)
    out = generate_plain(target, [1, 2, 3], 40, Sampler(mode, 0.9, None, 0))
    monkeypatch.undo()
    assert len(out) == 40 and (syncs.reads, syncs.uploads) == (1, 1)  # the result; the prompt


def test_a_sync_waits_once_more_per_round(target):
    """sync (what sample.py passes, so that the draft/verify split is true on a GPU): one wait a
    round, between the draft and the verify."""
    waits = []
    small = make("small", target)
    _, stats = generate_speculative(target, small, [1, 2, 3], 20, 4, Sampler(),
                                    sync=lambda: waits.append(1))
    assert len(waits) == stats.rounds


# -----------------------------------------------------------------------------
# flags the mode cannot use


def test_sampling_flags_greedy_ignores_are_one_warning_line(tmp_path):
    assert settings.sampling_flag_problems("greedy", False, False) is None
    assert settings.sampling_flag_problems("coupled", True, True) is None
    problems = settings.sampling_flag_problems("greedy", True, True)
    assert "--temperature and --top-k unused" in problems
    p = subprocess.run([sys.executable, "sample.py", "--temperature", "0.5",
                        "--out-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = p.stderr.splitlines()
    assert lines[0].startswith("warning: --temperature unused") and lines[1].startswith("error: ")


# -----------------------------------------------------------------------------
# device mode: NANOSPEC_TEST_DEVICE=cuda|cuda:N|mps runs these on that device

on_device = pytest.mark.skipif(
    not TEST_DEVICE, reason="set NANOSPEC_TEST_DEVICE=cuda or mps to run on a GPU or a Mac")


def device_dtype():
    return torch.float32 if torch.device(TEST_DEVICE).type == "mps" else torch.float64


@on_device
def test_device_token_identity():
    """Greedy and coupled decoding on the device equal plain decoding on the device (float64 on
    CUDA; float32 on MPS, where only a near-tie below float32's resolution could flip a token)."""
    dev, dt = pick_device(TEST_DEVICE), device_dtype()
    target = tiny_gpt(0).to(dev, dt)
    small = DraftModel(tiny_gpt(1, n_layer=1, n_embd=16).to(dev, dt))
    from draft_lookup import LookupDrafter
    for drafter in (small, DraftModel(target), LookupDrafter(target.config.vocab_size)):
        for mode in ("greedy", "coupled"):
            for seed, p in enumerate([[1, 2, 3], [5], [9, 8, 7, 6, 5, 4]]):
                ref = generate_plain(target, p, 40, Sampler(mode, 0.8, None, seed, dev))
                assert generate_speculative(target, drafter, p, 40, 4,
                                            Sampler(mode, 0.8, None, seed, dev))[0] == ref
        # rejection sampling: it runs
        generate_speculative(target, drafter, [1, 2, 3], 40, 4,
                             Sampler("rejection", 0.8, None, 0, dev))
    synchronize(dev)


@on_device
def test_device_pipeline_trains_benches_and_decodes(corpus, tmp_path):
    """The tiny preset trained on the device, then bench.py and sample.py on it."""
    import bench
    import train
    out = tmp_path / "out"
    train.main(tiny_args(corpus, out, "--device", TEST_DEVICE))
    for sampling in ("greedy", "coupled", "rejection"):
        r = bench.main(["--out-dir", str(out), "--device", TEST_DEVICE, "--n-prompts", "2",
                        "--max-new-tokens", "12", "--repeats", "1", "--sweep", "",
                        "--sampling", sampling, "--dtype", "float32"])
        assert all(m["tau"] >= 1.0 for m in r["methods"].values())
    # CUDA: float64 is exact, so every drafter reproduces plain decoding
    if device_dtype() == torch.float64:
        r = bench.main(["--out-dir", str(out), "--device", TEST_DEVICE, "--n-prompts", "2",
                        "--max-new-tokens", "12", "--repeats", "1", "--sweep", "",
                        "--dtype", "float64"])
        assert all(m["exact_match"] == 1.0 for m in r["methods"].values())
    p = subprocess.run([sys.executable, "sample.py", "--out-dir", str(out),
                        "--device", TEST_DEVICE, "--sampling", "coupled", "--max-new-tokens", "16",
                        "--no-color"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
