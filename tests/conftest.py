"""Shared fixtures: a tiny float64 target and a factory for every drafter, so that each
equivalence test runs over all of them (add a new drafter to DRAFTER_FACTORIES)."""

import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime import cpu_speed  # noqa: E402
from training import data  # noqa: E402
import train  # noqa: E402
from runtime.cpu_speed import speed_up  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from draft_small import DraftModel  # noqa: E402
from draft_hybrid import HybridDrafter  # noqa: E402

VOCAB = 64

# what train.py, bench.py and sample.py switch on at start: attention written out when training on
# a CPU (cpu_speed.cpu_sdpa). On from the start, so that the drafters fitted below come out the
# same whichever test (or the shared train.py run) comes first
cpu_speed.enable()


def peaked(model, scale):
    """Scale random weights up so distributions are peaked (near-uniform logits would make
    every drafter 'agree' under shared noise, and rejections rare)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return model


def tiny_gpt(seed, n_layer=2, n_embd=32, n_head=2, vocab=VOCAB, sequence_len=96, scale=8.0):
    """With the CPU speed-ups the loaders give every model (cpu_speed.speed_up)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(sequence_len=sequence_len, vocab_size=vocab, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd)
    return speed_up(peaked(GPT(cfg), scale).double().eval())


@pytest.fixture(scope="session")
def target():
    return tiny_gpt(0)


# llama.py's family, as tiny targets: grouped K/V heads in both; Llama-3's rope scaling and
# attention biases in one, Qwen3's q/k norms, a head_dim apart from n_embd / n_head and a tied
# head in the other
LLAMAS = {
    "llama": dict(n_head=4, n_kv_head=2, head_dim=8, qkv_bias=True, proj_bias=True,
                  rope_theta=500000.0, rope_scaling={
                      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(n_head=4, n_kv_head=2, head_dim=16, qk_norm=True, tie_embeddings=True,
                  rope_theta=1e6),
}


def tiny_llama(family, seed=0, vocab=VOCAB, sequence_len=96, scale=8.0):
    """A tiny llama.Llama of LLAMAS[family], peaked as tiny_gpt's, its norms and biases moved
    away from their init (so that a weight read into the wrong place shows)."""
    from llama import Llama, LlamaConfig
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(sequence_len=sequence_len, vocab_size=vocab, n_layer=2, n_embd=32,
                              n_hidden=64, **LLAMAS[family]))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return speed_up(peaked(model, scale).double().eval())


def make_small(target):
    """The classic drafter with random weights: it disagrees with the target often."""
    return DraftModel(tiny_gpt(1, n_layer=1, n_embd=16, vocab=target.config.vocab_size,
                               sequence_len=target.config.sequence_len))


def make_self(target):
    """The target drafting for itself: every draft must be accepted (greedy)."""
    return DraftModel(target)


_MTP_FITTED = {}


def fit_mtp(target, n_modules=2, steps=30):
    """A random MTP head, then a few Adam steps distilling the target on its own samples: it
    now agrees with the target SOME of the time (a purely random head never does), so the
    shared tests walk through full acceptance, partial acceptance and rejection alike."""
    key = (id(target), n_modules, steps)
    if key not in _MTP_FITTED:
        # a test may call this inside inference_mode
        with torch.inference_mode(False), torch.enable_grad():
            _MTP_FITTED[key] = _fit_mtp(target, n_modules, steps)
    return _MTP_FITTED[key]


def target_text(target, seed, length):
    """16 sequences the target writes itself (sampled from 4 random tokens): what a drafter
    should learn to predict."""
    g = torch.manual_seed(seed)
    with torch.no_grad():
        x = torch.randint(0, target.config.vocab_size, (16, 4), generator=g)
        while x.size(1) < length:
            probs = torch.softmax(target(x)[0][:, -1], -1)
            x = torch.cat([x, torch.multinomial(probs, 1, generator=g)], 1)
    return x


def adam_fit(net, loss_fn, steps, target):
    """A few Adam steps on loss_fn(); only `net` steps (the target's shared head gets gradients
    too)."""
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
    target.zero_grad(set_to_none=True)
    return net.eval()


def _fit_mtp(target, n_modules, steps):
    from draft_mtp import MTP, MTPConfig, mtp_loss
    torch.manual_seed(2)
    mtp = MTP(MTPConfig.for_target(target.config, n_modules)).double()
    last = target.config.n_layer
    x = target_text(target, 2, 44)
    with torch.no_grad():
        logits, _, hid = target(x[:, :-1], hidden_layers=(last,))

    def loss_fn():
        return mtp_loss(mtp, target, hid[last], x[:, :-1], x[:, 1:], logits, distill=1.0)
    return adam_fit(mtp, loss_fn, steps, target)


def make_mtp(target):
    """Two chained MTP modules, so k >= 3 exercises the chain AND the recursive reuse of the last
    one."""
    from draft_mtp import MTPDrafter
    return speed_up(MTPDrafter(fit_mtp(target), target))


_EAGLE_FITTED = {}


def fit_eagle(target, unroll=3, steps=30):
    """An EAGLE-3 head (draft_eagle.Eagle, fusing the tiny target's layers 1, 2, 2), fitted as
    fit_mtp's is, with its training-time test unrolled over `unroll` steps."""
    key = (id(target), unroll, steps)
    if key not in _EAGLE_FITTED:
        with torch.inference_mode(False), torch.enable_grad():
            from draft_eagle import Eagle, EagleConfig, eagle_loss
            from draft_mtp import unroll_anchors
            torch.manual_seed(5)
            net = Eagle(EagleConfig.for_target(target.config)).double()
            x = target_text(target, 5, 44)
            with torch.no_grad():
                logits, _, hid = target(x, hidden_layers=sorted(set(net.config.taps)))
            anchors = unroll_anchors(16, x.size(1) - 1, unroll, 8, torch.Generator().manual_seed(0),
                                     x.device)
            _EAGLE_FITTED[key] = adam_fit(net, lambda: eagle_loss(
                net, target, x, logits, hid, anchors, unroll, 0.8, 1.0), steps, target)
    return _EAGLE_FITTED[key]


def make_eagle(target):
    from draft_eagle import EagleDrafter
    return speed_up(EagleDrafter(fit_eagle(target), target))


_BLOCK_FITTED = {}


def fit_block_drafter(target, kind, steps=40, shift=0):
    """A DFlash (kind 'dflash') or DSpark ('dspark') network reading both tiny-target layers:
    random weights, then a few Adam steps on the target's own samples, so it agrees with the
    target some of the time and the loop sees full, partial and no acceptance. shift 0 is what
    train.py builds (the mask slots predict), at block 9; shift 1 (the anchor slot predicts too)
    at block 8. Either way it drafts up to 8, so the shared tests' k = 1..8 are all allowed."""
    key = (id(target), kind, steps, shift)
    if key not in _BLOCK_FITTED:
        # callers may be in no-grad or inference mode
        with torch.inference_mode(False), torch.enable_grad():
            _BLOCK_FITTED[key] = _fit_block_drafter(target, kind, steps, shift)
    return _BLOCK_FITTED[key]


def _fit_block_drafter(target, kind, steps, shift):
    from draft_dflash import DFlash, DFlashConfig, dflash_loss
    from draft_dspark import DSpark, DSparkConfig, dspark_loss
    torch.manual_seed(3)
    cfg = DFlashConfig(n_embd=target.config.n_embd, n_head=2, n_layer=2, taps=[1, 2],
                       block=9 - shift, shift=shift)
    if kind == "dspark":
        net, loss_fn = DSpark(cfg, DSparkConfig(rank=8), target).double(), dspark_loss
    else:
        net, loss_fn = DFlash(cfg, target).double(), dflash_loss
    x = target_text(target, 3, 40)
    with torch.no_grad():
        logits, _, hid = target(x, hidden_layers=cfg.taps)
    # every third position
    anchors = torch.arange(1, x.size(1) - cfg.block - shift + 1, 3).expand(16, -1)
    return adam_fit(net, lambda: loss_fn(net, x, hid, logits, anchors, gamma=4.0), steps, target)


def make_dflash(target, shift=0):
    from draft_dflash import DFlashDrafter
    return speed_up(DFlashDrafter(fit_block_drafter(target, "dflash", shift=shift)))


def make_dspark(target, shift=0):
    """DSpark with its Markov head and the throughput scheduler on. At load it profiles the real
    device (profiling.profile_dspark); here it gets a fixed latency table instead (an m-token
    verify costs 1 + 0.5·m draft times: dear enough that it verifies ~4 of 8 drafts), so which
    prefix it verifies -- and with it every test over it -- is deterministic. The CPU speed-ups
    as the loader gives them (cpu_speed.speed_up): greedy drafting takes the chain on the host."""
    from draft_dspark import DSparkDrafter
    d = speed_up(DSparkDrafter(fit_block_drafter(target, "dspark", shift=shift), schedule="auto"))
    d.t_draft, d.t_verify = 1.0, [0.0] + [1.0 + 0.5 * m for m in range(1, d.max_k + 2)]
    return d


def make_lookup(target):
    """Prompt lookup: the tiny target's peaked distributions make it repeat itself, so some rounds
    find an n-gram to copy and others draft nothing at all; the tests see both."""
    from draft_lookup import LookupDrafter
    return LookupDrafter(target.config.vocab_size)


def make_hybrid(target, learned=None, script=None):
    """Prompt lookup and a learned drafter (DFlash unless given) under the hybrid's rule, with a
    fixed cost model instead of the profile and the timed rounds (a verify of m tokens costs
    1 + 0.05 m, a learned draft 0.5, a lookup 0.01), so its choices are deterministic. script:
    a cycle of choices instead of the rule (ScriptedHybrid), so that rounds switch drafters for
    certain."""
    from draft_hybrid import HybridDrafter, LOOKUP_MAX
    learned = learned or make_dflash(target)
    d = ScriptedHybrid(learned, target, script) if script else HybridDrafter(learned, target)
    d.t_verify = [0.0] + [1.0 + 0.05 * m for m in range(1, LOOKUP_MAX + 2)]
    d.start_cost = {"lookup": 0.01, "learned": 0.5}
    d.reset_record()
    return d


class ScriptedHybrid(HybridDrafter):
    """The hybrid with a fixed cycle of choices ('lookup' / 'learned', one round each) instead
    of its rule."""

    def __init__(self, learned, target, script):
        super().__init__(learned, target)
        self.script, self.turn = script, 0

    def choose(self, m, copied, k_learned, sampler):
        who = self.script[self.turn % len(self.script)]
        self.turn += 1
        return who, (len(copied) if who == "lookup" else k_learned)


def make_hybrid_switch(target):
    return make_hybrid(target, script=["lookup", "learned", "learned", "lookup", "lookup"])


DRAFTER_FACTORIES = {"small": make_small, "self": make_self, "mtp": make_mtp, "eagle": make_eagle,
                     "dflash": make_dflash, "dspark": make_dspark, "lookup": make_lookup,
                     "hybrid": make_hybrid, "hybrid-switch": make_hybrid_switch}


@pytest.fixture(params=sorted(DRAFTER_FACTORIES))
def drafter_name(request):
    return request.param


# -----------------------------------------------------------------------------
# a real (tiny) train.py run, shared by the tests that only read its out/ folder


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small, fixed corpus: 40 stdlib files, so tokenizer + data take about a second."""
    d = tmp_path_factory.mktemp("corpus")
    for f in data.stdlib_files()[:40]:
        shutil.copy(f, d / f.name)
    return str(d)


def tiny_args(corpus, out, *extra):
    """train.py flags for a tiny run, on the CPU: the tests that use it prove CPU facts (same
    seed, bit-identical checkpoints). A later --device in `extra` wins (tests/test_device.py's
    device mode). bfloat16 autocast is set, not measured: measured on a busy machine, one run of
    a pair could train in float32 and the other in bfloat16, and their weights would differ."""
    return ["--preset", "tiny", "--data", corpus, "--vocab-size", "384", "--out-dir", str(out),
            "--log-interval", "10", "--eval-interval", "1000", "--device", "cpu", "--bf16", "on",
            *extra]


@pytest.fixture(scope="session")
def trained(corpus, tmp_path_factory):
    """One full tiny pipeline (every stage), shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("out")
    train.main(tiny_args(corpus, out))
    return out


@pytest.fixture
def out(trained, tmp_path):
    """A private copy of the tiny trained out/ folder, free to damage."""
    shutil.copytree(trained, tmp_path / "out")
    return tmp_path / "out"
