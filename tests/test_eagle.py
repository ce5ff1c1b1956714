"""EAGLE-3 and the training-time test it shares with MTP (draft_mtp.unrolled): the unrolled
training forward equals step-by-step drafting on the same inputs, each unrolled step sees
exactly what inference shows it, the fusion reads the three layers it names, and train.py's
eagle stage writes a drafter that loads. The shared equivalence tests run the drafter
drafter_for() builds (conftest.make)."""

import shutil

import pytest
import torch

import train
from conftest import adam_fit, fitted, target_text, tiny_args
from draft_eagle import Eagle, EagleConfig, EagleDrafter, default_taps, eagle_loss
from draft_mtp import MTPDrafter, lm_logits, mtp_loss, unroll_anchors, unrolled
from registry.drafters import load_drafter
from runtime.cpu_speed import speed_up
from sampler import Sampler
from test_mtp import fit_mtp
from training.stages_eagle import eagle_taps
from runtime.target import load_target

_FITTED = {}


def fit_eagle(target, unroll=3, steps=30):
    """An EAGLE-3 head (draft_eagle.Eagle, fusing the tiny target's layers 1, 2, 2), fitted as
    test_mtp.fit_mtp's is, with its training-time test unrolled over `unroll` steps."""
    def fit():
        torch.manual_seed(5)
        net = Eagle(EagleConfig.for_target(target.config)).double()
        x = target_text(target, 5, 44)
        with torch.no_grad():
            logits, _, hid = target(x, hidden_layers=sorted(set(net.config.taps)))
        anchors = unroll_anchors(16, x.size(1) - 1, unroll, 8, torch.Generator().manual_seed(0),
                                 x.device)
        return adam_fit(net, lambda: eagle_loss(net, target, x, logits, hid, anchors, unroll, 0.8,
                                                1.0), steps, target)
    return fitted(_FITTED, (id(target), unroll, steps), fit)


def drafter_for(target):
    """The shared tests' EAGLE-3: fitted a few steps, so that it agrees sometimes."""
    return speed_up(EagleDrafter(fit_eagle(target), target))


class Forced(Sampler):
    """Drafts the text's own tokens (as training feeds them) and records the drafter's logits."""

    def __init__(self, seq):
        super().__init__("greedy")
        self.seq, self.logits = seq, []

    def draft(self, logits, start, ks=None):
        self.logits.append(logits.view(-1))
        if isinstance(start, list):  # a batch (of one): (1, 1)
            return self.seq[start[0]].view(1, 1), None
        return self.seq[start].view(1), None


def drafter_of(kind, target):
    if kind == "eagle":
        return EagleDrafter(fit_eagle(target), target)
    return MTPDrafter(fit_mtp(target, n_modules=1), target)


def text(target, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, target.config.vocab_size, (1, T), generator=g)


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
@torch.inference_mode()
def test_unrolled_training_forward_equals_step_by_step_drafting(target, kind):
    """The training-time test's forward (steps 2.. fed the module's own outputs, at sampled
    anchors) gives, at every anchor and step, the logits the drafter computes when it drafts
    that step on the same prefix and the same tokens."""
    d = drafter_of(kind, target)
    steps, T = 4, 30
    x = text(target, T + 1, 7)  # t_0 .. t_T
    hid = target(x[:, :T], hidden_layers=d.hidden_layers)[2]
    anchors = torch.tensor([[0, 3, 11, T - 1 - steps]])
    out = unrolled(d.mtp.mods[0], target, d.features(hid), x, steps, anchors)
    for a, i in enumerate(anchors[0].tolist()):
        S = i + 2  # confirmed t_0 .. t_{i+1}: step 1 reads (state_i, t_{i+1})
        fresh = d.fresh()
        fresh.begin(x[:, :S], {layer: h[:, :S - 1] for layer, h in hid.items()})
        spy = Forced(x[0])
        fresh.propose(steps, spy)
        for j, (o, pos) in enumerate(out):
            n = i if j == 0 else a  # step 1 runs at every index, later steps at the anchors
            assert pos[0, n].item() == S + j  # step j+1 predicts the token at S + j
            want = lm_logits(target, o[0, n])
            assert torch.allclose(spy.logits[j], want, atol=1e-10, rtol=0), (i, j)


@torch.inference_mode()
def test_an_unrolled_step_sees_only_what_inference_shows_it(target):
    """Step j at anchor i must not see step 1's entries past i, nor other anchors' chains: change
    those and its output stays; change step 1's state at i and it moves."""
    net = fit_eagle(target)
    mod, steps, T = net.mods[0], 3, 24
    x = text(target, T + 1, 8)
    h = torch.randn(1, T, target.config.n_embd, dtype=torch.float64)
    anchors = torch.tensor([[4, 9]])
    base = unrolled(mod, target, h, x, steps, anchors)
    h2 = h.clone()
    h2[:, 10:] += 1.0  # after both anchors (step 1 at index 9 reads h_9)
    moved = unrolled(mod, target, h2, x, steps, anchors)
    for j in (1, 2):
        assert torch.allclose(moved[j][0], base[j][0], atol=1e-12, rtol=0)
    h3 = h.clone()
    h3[:, 9] += 1.0  # anchor 9's own step-1 state: its chain moves, anchor 4's does not
    moved = unrolled(mod, target, h3, x, steps, anchors)
    assert torch.allclose(moved[2][0][0, 0], base[2][0][0, 0], atol=1e-12, rtol=0)
    assert not torch.allclose(moved[2][0][0, 1], base[2][0][0, 1])


@torch.no_grad()
def test_one_unrolled_step_is_the_old_depth_one_loss(target):
    """--mtp-unroll 1 trains exactly what MTP trained before (DeepSeek-V3's depth 1)."""
    mtp = fit_mtp(target, n_modules=1)
    last = target.config.n_layer
    x = text(target, 33, 9)
    logits, _, hid = target(x, hidden_layers=(last,))
    args = (mtp, target, hid[last][:, :-1], x[:, :-1], x[:, 1:], logits[:, :-1], 0.5)
    old = mtp_loss(*args)
    anchors = torch.tensor([[2, 5]])
    assert torch.equal(mtp_loss(*args, 1, 0.6, anchors), old)
    assert not torch.equal(mtp_loss(*args, 3, 0.6, anchors), old)


@torch.no_grad()
def test_the_fusion_reads_its_three_layers(target):
    net = fit_eagle(target)
    assert default_taps(6) == [2, 4, 6] and default_taps(2) == [1, 2, 2]
    hid = {t: torch.randn(1, 5, target.config.n_embd, dtype=torch.float64) for t in (1, 2)}
    g = net.features(hid)
    want = net.fuse.weight @ torch.cat([hid[1][0, 3], hid[2][0, 3], hid[2][0, 3]])
    assert torch.allclose(g[0, 3], want, atol=1e-12, rtol=0)
    assert EagleDrafter(net, target).hidden_layers == (1, 2)
    with pytest.raises(ValueError, match="--eagle-taps"):
        eagle_taps("2,9", 6)


def test_the_eagle_stage_trains_a_drafter_that_loads(trained, corpus, tmp_path):
    """train.py's eagle stage, in the tiny pipeline: out/eagle.pt belongs to its target and
    drafts; teacher forcing alone (--eagle-unroll 1, the ablation) trains other weights."""
    target, ckpt = load_target(str(trained / "target.pt"))
    d = load_drafter("eagle", str(trained), target, ckpt)
    assert isinstance(d, EagleDrafter)
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    train.main(tiny_args(corpus, out, "--only", "eagle", "--eagle-unroll", "1"))
    other = load_drafter("eagle", str(out), target, ckpt)
    assert not torch.equal(other.mtp.fuse.weight, d.mtp.fuse.weight)
