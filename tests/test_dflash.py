"""DFlash: the training mask is the one the definition asks for, training and inference compute
the same block, cached context K/V equal a recomputation, k is bounded by the trained block,
and the drafter can actually learn (a tiny overfit reaches near-full acceptance).
The shared equivalence tests run the drafter drafter_for() builds (conftest.make)."""

from dataclasses import replace

import pytest
import torch

import gpt
from conftest import adam_fit, fitted, target_text, tiny_gpt
from runtime.cpu_speed import cpu_sdpa, speed_up
from draft_dflash import (DFlash, DFlashConfig, DFlashDrafter, dflash_loss, sample_anchors,
                          training_mask, training_states)
from draft_dspark import DSpark, DSparkConfig, dspark_loss
from training.distill import target_continuations
from sampler import Sampler
from speculative import generate_plain, generate_speculative

_FITTED = {}


def fit_block_drafter(target, kind, steps=40, shift=0, arch="gpt2"):
    """A DFlash (kind 'dflash') or DSpark ('dspark') network reading both tiny-target layers:
    random weights, then a few Adam steps on the target's own samples, so it agrees with the
    target some of the time and the loop sees full, partial and no acceptance. shift 0 is what
    train.py builds (the mask slots predict), at block 9; shift 1 (the anchor slot predicts too)
    at block 8. Either way it drafts up to 8, so the shared tests' k = 1..8 are all allowed.
    arch "qwen3": the papers' layers, with two query heads a K/V head."""
    def fit():
        torch.manual_seed(3)
        heads = dict(n_head=4, n_kv_head=2) if arch == "qwen3" else dict(n_head=2)
        cfg = DFlashConfig(n_embd=target.config.n_embd, n_layer=2, taps=[1, 2], block=9 - shift,
                           shift=shift, arch=arch, **heads)
        if kind == "dspark":
            net, loss_fn = DSpark(cfg, DSparkConfig(rank=8), target).double(), dspark_loss
        else:
            net, loss_fn = DFlash(cfg, target).double(), dflash_loss
        x = target_text(target, 3, 40)
        with torch.no_grad():
            logits, _, hid = target(x, hidden_layers=cfg.taps)
        # every third position
        anchors = torch.arange(1, x.size(1) - cfg.block - shift + 1, 3).expand(16, -1)
        return adam_fit(net, lambda: loss_fn(net, x, hid, logits, anchors, gamma=4.0), steps,
                        target)
    return fitted(_FITTED, (id(target), kind, steps, shift, arch), fit)


def drafter_for(target, shift=0, arch="gpt2"):
    """The shared tests' DFlash: fitted a few steps, so that it agrees sometimes."""
    return speed_up(DFlashDrafter(fit_block_drafter(target, "dflash", shift=shift, arch=arch)))


# the shared tests run the papers' layers too, as "dflash-qwen3"
VARIANTS = {"qwen3": lambda target: drafter_for(target, arch="qwen3")}


def test_training_mask_matches_the_definition():
    T, block = 40, 5
    anchors = sample_anchors(3, T, 6, block, 0, torch.Generator().manual_seed(0))
    assert anchors.min() >= 1 and anchors.max() <= T - block
    mask = training_mask(anchors, T, block)[:, 0]  # (B, A*block, T + A*block)
    for b in range(3):
        for qi in range(6 * block):
            a = anchors[b, qi // block].item()
            for ki in range(T + 6 * block):
                if ki < T:  # a context position: only the target states of tokens before the anchor
                    want = ki < a
                else:       # a block slot: only those of the query's own block
                    want = (ki - T) // block == qi // block
                assert mask[b, qi, ki].item() == want, (b, qi, ki)


@torch.no_grad()
def test_a_block_never_sees_past_its_anchor_or_another_block(target):
    """Change everything a block may not see; its output must not move (and the rest must)."""
    net = drafter_for(target).net
    T = 30
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, target.config.vocab_size, (1, T), generator=gen)
    hid = target(x, hidden_layers=net.config.taps)[2]
    anchors = torch.tensor([[7, 15]])
    h, tpos = training_states(net, x, hid, anchors)
    assert tpos[0, 0].tolist() == list(range(8, 8 + net.config.block - 1))
    hid2 = {l: v.clone() for l, v in hid.items()}
    for v in hid2.values():
        v[:, 7:] += 1.0  # every state at or after the first anchor
    x2 = x.clone()
    x2[0, 15] = (x[0, 15] + 1) % target.config.vocab_size  # the other block's anchor token
    h2, _ = training_states(net, x2, hid2, anchors)
    assert torch.allclose(h[0, 0], h2[0, 0], atol=1e-12, rtol=0)
    assert not torch.allclose(h[0, 1], h2[0, 1])


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("alibi", [True, False])
def test_training_path_equals_inference_path(target, alibi, grad, monkeypatch):
    """training_states (all anchors at once, masked) == the drafter's cached one-block forward,
    with the ALiBi bias and without (random weights). With gradients on, as in training (where
    train.py calls cpu_speed.enable()), the masked attention is cpu_sdpa's written-out form;
    without, and in the drafter, it is SDPA."""
    monkeypatch.setattr(gpt, "sdpa", cpu_sdpa)
    d = drafter_for(target)
    if not alibi:
        torch.manual_seed(4)
        d = DFlashDrafter(DFlash(replace(d.net.config, alibi=False), target).double())
    T = 25
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, target.config.vocab_size, (1, T), generator=gen)
    with torch.no_grad():
        hid = target(x, hidden_layers=d.hidden_layers)[2]
    anchors = torch.tensor([[3, 11, 16]])
    with torch.set_grad_enabled(grad):
        h, _ = training_states(d.net, x, hid, anchors)
    assert h.requires_grad == grad
    with torch.inference_mode():
        for i, a in enumerate(anchors[0].tolist()):
            d.begin(x[:, :a + 1], {l: v[:, :a] for l, v in hid.items()})
            hb = d.draft_states([d.net.config.block - 1])[0]  # slots 1.. (a batch of one)
            assert torch.allclose(h[0, i].detach(), hb, atol=1e-10, rtol=0)


@torch.inference_mode()
def test_cached_context_equals_recomputing_from_scratch(target):
    d = drafter_for(target)
    sampler = Sampler("greedy")
    V = target.config.vocab_size
    hid = target(torch.tensor([[5, 6, 7]]), hidden_layers=d.hidden_layers)[2]
    d.begin(torch.tensor([[5, 6, 7, 8]]), hid)
    for rnd in range(12):
        k = [3, 8, 1, 5][rnd % 4]
        draft, _ = d.propose(k, sampler)
        n = [k, 0, min(2, k), 1][rnd % 4]  # pretend verdicts: full acceptance and rejections
        new = torch.cat([draft[:n], torch.tensor([(3 * rnd + 1) % V])])
        S = d.seq.numel()
        full = torch.cat([d.seq, new])
        # the states of all but the last token
        hid_full = target(full[None, :-1], hidden_layers=d.hidden_layers)[2]
        d.commit(n, new, {l: v[:, S - 1:S + n] for l, v in hid_full.items()})
        fresh = drafter_for(target)
        fresh.begin(full[None], hid_full)
        a, b = d.draft_states([8])[0], fresh.draft_states([8])[0]  # the context made first
        assert d.n_ctx == fresh.n_ctx == [full.numel() - 1]
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


def test_a_config_records_every_field_and_an_older_layouts_is_refused():
    """Every field is written, the layers' family too, and read back as it was; a config of an
    older layout (a GPT-2 drafter's, once written without its family's fields) is one error that
    names the retrain command."""
    cfg = DFlashConfig(n_embd=32, n_head=2, taps=[1, 2], block=8)
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["arch"] == "gpt2"
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("arch", "draft_vocab")}
    with pytest.raises(ValueError, match=r"missing \['arch', 'draft_vocab'\].*--only dflash"):
        DFlashConfig.from_dict(old)


@torch.inference_mode()
def test_k_beyond_the_trained_block_is_an_error(target):
    d = drafter_for(target)
    assert d.max_k == d.net.config.block - 1 == d.default_k == 8
    d.begin(torch.tensor([[1, 2]]), target(torch.tensor([[1]]), hidden_layers=d.hidden_layers)[2])
    with pytest.raises(ValueError, match="trained with block"):
        d.propose(d.max_k + 1, Sampler("greedy"))


def test_tiny_overfit_reaches_near_full_acceptance():
    """Train on the target's own greedy continuation of one prompt (it soon repeats itself);
    drafting that prompt again must then be accepted almost always, and stay token-identical."""
    torch.manual_seed(0)
    target = tiny_gpt(5, scale=3.0)
    for p in target.parameters():
        p.requires_grad_(False)
    prompt = torch.tensor([[3, 1, 4]])
    x = target_continuations(target, prompt, 40)  # (1, 40)
    cfg = DFlashConfig(n_embd=32, n_head=2, n_layer=1, taps=[1, 2], block=5)
    net = DFlash(cfg, target).double()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    t_logits, _, hid = target(x, hidden_layers=cfg.taps)
    # sharper soft labels, same argmax (all greedy acceptance needs): fewer steps
    t_logits = 8 * t_logits
    anchors = torch.arange(1, 40 - cfg.block + 1)[None]  # every anchor
    for _ in range(300):
        loss = dflash_loss(net, x, hid, t_logits, anchors, gamma=4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()
    out, stats = generate_speculative(target, DFlashDrafter(net), prompt[0].tolist(), 30, 4,
                                      Sampler("greedy"))
    assert out == generate_plain(target, prompt[0].tolist(), 30, Sampler("greedy"))
    # of the rounds that drafted a first token, the share in which it survived (acceptance()
    # divides by every round, the prefill's too, so a 30-token run can't reach 0.9 with it)
    first = stats.accepted_at[0] / stats.drafted_at[0]
    assert first > 0.9 and stats.tau > 4.0, (first, stats.tau)


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_a_draft_vocabulary_drafts_only_its_tokens_and_stays_exact(target, mode):
    """A DFlash over the 24 tokens the target's own text holds most often (its head only their
    rows, its soft labels the target's over them): it drafts only those, the target verifies over
    every token, and decoding stays token-identical in float64, greedy and coupled."""
    torch.manual_seed(3)
    x = target_text(target, 3, 40)
    vocab = torch.bincount(x.view(-1), minlength=target.config.vocab_size).topk(24).indices.sort()
    cfg = DFlashConfig(n_embd=target.config.n_embd, n_layer=2, n_head=2, taps=[1, 2], block=9,
                       draft_vocab=24)
    net = DFlash(cfg, target).double()
    net.d2t.copy_(vocab.values)
    with torch.no_grad():
        logits, _, hid = target(x, hidden_layers=cfg.taps)
    anchors = torch.arange(1, x.size(1) - cfg.block + 1, 3).expand(16, -1)
    adam_fit(net, lambda: dflash_loss(net, x, hid, logits[..., net.d2t], anchors, 4.0), 40, target)
    drafter = DFlashDrafter(net.eval())
    full = net.target_logits(torch.randn(3, target.config.n_embd, dtype=torch.float64))
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[net.d2t] = False
    assert full.shape[-1] == target.config.vocab_size and torch.isinf(full[:, outside]).all()
    accepted = 0
    for seed in range(4):
        prompt = x[seed, :6].tolist()
        out, stats = generate_speculative(target, drafter, prompt, 24, 8, Sampler(mode, seed=seed))
        assert out == generate_plain(target, prompt, 24, Sampler(mode, seed=seed))
        accepted += sum(stats.accepted_at)
    assert accepted > 0
