"""The target's KV cache: cached == uncached in float64, and rollback is exact; cpu_speed's
PackedLinear (what speed_up makes of every nn.Linear) computes what nn.Linear does."""

import os

import pytest
import torch

import gpt
from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, state_hash
from runtime.target import load_target
from conftest import tiny_gpt
from runtime.cpu_speed import PackedLinear, cpu_sdpa, pack_weight, speed_up


@pytest.fixture
def written_out(monkeypatch):
    """gpt.attention's kernel as cpu_speed.enable() sets it: cpu_sdpa, the written-out path when
    training on a CPU."""
    monkeypatch.setattr(gpt, "sdpa", cpu_sdpa)


@pytest.fixture(scope="module")
def model():
    return tiny_gpt(0, scale=1.0)


@pytest.fixture(scope="module")
def seq():
    torch.manual_seed(1)
    return torch.randint(0, 64, (2, 60))


def full_logits(model, seq):
    with torch.no_grad():
        return model(seq)[0]


def test_prefill_matches_uncached(model, seq):
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        logits = model(seq, cache=cache)[0]
    assert torch.allclose(logits, full_logits(model, seq), atol=1e-10, rtol=0)
    assert cache.length == seq.size(1)


def test_step_by_step_matches_uncached(model, seq):
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        parts = [model(seq[:, t:t + 1], cache=cache)[0] for t in range(seq.size(1))]
    assert torch.allclose(torch.cat(parts, 1), full_logits(model, seq), atol=1e-10, rtol=0)


@pytest.mark.parametrize("chunk", [2, 3, 5, 17])
def test_chunks_match_uncached(model, seq, chunk):
    """A k-token verify pass after a prefix is the same call as a prefill."""
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        parts = [model(seq[:, :7], cache=cache)[0]]
        for t in range(7, seq.size(1), chunk):
            parts.append(model(seq[:, t:t + chunk], cache=cache)[0])
    assert torch.allclose(torch.cat(parts, 1), full_logits(model, seq), atol=1e-10, rtol=0)


def test_hidden_states_match_uncached(model, seq):
    cache = model.new_cache(batch_size=2)
    layers = (0, 1, 2)
    with torch.no_grad():
        _, _, h_full = model(seq, hidden_layers=layers)
        _, _, h_a = model(seq[:, :30], cache=cache, hidden_layers=layers)
        _, _, h_b = model(seq[:, 30:], cache=cache, hidden_layers=layers)
    for l in layers:
        assert torch.allclose(torch.cat([h_a[l], h_b[l]], 1), h_full[l], atol=1e-10, rtol=0)


def test_rollback_then_forward_equals_fresh_prefill(model, seq):
    torch.manual_seed(2)
    junk = torch.randint(0, 64, (2, 9))
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        model(seq[:, :40], cache=cache)
        model(junk, cache=cache)            # a rejected draft...
        cache.rollback(25)                  # ...and more: roll back into the prompt itself
        after = model(seq[:, 25:50], cache=cache)[0]
    assert cache.length == 50
    assert torch.allclose(after, full_logits(model, seq[:, :50])[:, 25:], atol=1e-10, rtol=0)


def test_cache_bookkeeping_errors(model, seq):
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        model(seq[:, :10], cache=cache)
        with pytest.raises(ValueError, match="roll back first"):
            model(seq[:, 10:12], cache=cache, start=5)
        with pytest.raises(ValueError, match="cannot roll back"):
            cache.rollback(11)
        with pytest.raises(ValueError, match="context window"):
            model(torch.zeros(2, model.config.sequence_len, dtype=torch.long), cache=cache)


def test_float32_close_to_float64(model, seq):
    m32 = tiny_gpt(0, scale=1.0).float()
    with torch.no_grad():
        cache = m32.new_cache(batch_size=2)
        a = torch.cat([m32(seq[:, :30], cache=cache)[0], m32(seq[:, 30:], cache=cache)[0]], 1)
    assert a.dtype == torch.float32
    assert torch.allclose(a.double(), full_logits(model, seq), atol=1e-4)


def test_checkpoint_roundtrip(tmp_path, model):
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    path = str(tmp_path / "target.pt")
    save_checkpoint({"kind": "target", "config": model.config.to_dict(), "state_dict": sd,
                     "model_hash": state_hash(sd), "tokenizer_hash": "x"}, path)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # no temp file left behind
    loaded, ckpt = load_target(path, dtype=torch.float64)
    assert ckpt["model_hash"] == state_hash(loaded.state_dict())
    x = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        assert torch.equal(loaded(x)[0], model(x)[0])


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found.*train.py"):
        load_checkpoint(str(tmp_path / "nope.pt"), "target")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable nanospec checkpoint"):
        load_checkpoint(str(bad), "target")
    other = tmp_path / "other.pt"
    save_checkpoint({"kind": "small", "config": {}, "state_dict": {}}, str(other))
    with pytest.raises(CheckpointError, match="not a target checkpoint"):
        load_checkpoint(str(other), "target")


# cpu_speed.PackedLinear: a packed oneDNN product at float32 CPU inference, torch's own everywhere
# else


def linear_pair(bias=True, dtype=torch.float32):
    torch.manual_seed(3)
    lin = speed_up(torch.nn.Linear(48, 80, bias=bias)).to(dtype)
    assert type(lin) is PackedLinear  # speed_up converted it in place
    ref = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    ref.load_state_dict(lin.state_dict())
    return lin, ref


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (8, 48), (2, 5, 48)])
def test_linear_inference_matches_torch(bias, shape):
    lin, ref = linear_pair(bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        y = lin(x)
        if pack_weight(lin.weight) is not None:  # where this torch has oneDNN, it was used
            assert lin._packed is not None
        assert y.shape == ref(x).shape
        assert torch.allclose(y, ref(x), atol=1e-5, rtol=1e-5)


def test_linear_inference_on_strided_input():
    """Views, as the model passes them (the last position of a batch, a transposed block)."""
    lin, ref = linear_pair()
    x = torch.randn(3, 7, 48)
    with torch.inference_mode():
        for view in (x[:, -1:], x.transpose(0, 1), x[:, ::2]):
            assert torch.allclose(lin(view), ref(view), atol=1e-5, rtol=1e-5)


def test_linear_repacks_after_the_weight_changes():
    """A packed copy must never go stale: after a load or an optimizer step the inference path
    computes with the new weight."""
    lin, ref = linear_pair()
    x = torch.randn(4, 48)
    with torch.no_grad():
        lin(x)  # packs
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin(x).square().sum().backward()  # the training path: autograd works
    opt.step()
    ref.load_state_dict(lin.state_dict())
    with torch.no_grad():
        assert torch.allclose(lin(x), ref(x), atol=1e-5, rtol=1e-5)
        lin.weight.copy_(torch.randn(80, 48))
        ref.weight.copy_(lin.weight)
        assert torch.allclose(lin(x), ref(x), atol=1e-5, rtol=1e-5)


def test_linear_other_dtypes_use_torch_exactly():
    lin, ref = linear_pair(dtype=torch.float64)
    x = torch.randn(3, 48, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(lin(x), ref(x))


@pytest.mark.parametrize("case", ["causal", "none", "mask per head", "mask for all heads"])
def test_training_attention_is_sdpa(case, written_out):
    """gpt.attention under cpu_speed.enable() (cpu_sdpa) writes attention out by hand when
    training on a CPU (gradients on); it must compute what F.scaled_dot_product_attention does,
    values and gradients, in float64."""
    import torch.nn.functional as F
    from gpt import attention
    g = torch.Generator().manual_seed(5)
    B, nh, Tq, Tk, hs = 2, 3, 5, 5 if case == "causal" else 9, 4
    q, k, v = (torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64, requires_grad=True)
               for T in (Tq, Tk, Tk))
    mask = None
    if case.startswith("mask"):
        mask = torch.randn(B, nh if case == "mask per head" else 1, Tq, Tk, generator=g,
                           dtype=torch.float64)
        mask[..., :2, -3:] = float("-inf")  # some keys invisible
    causal = case == "causal"
    got = attention(q, k, v, mask, causal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(grads, want_grads))


@pytest.mark.parametrize("heads", [1, 3])  # one mask for all heads, one per head
@pytest.mark.parametrize("grad", [True, False])  # the written-out path, SDPA
def test_boolean_mask_hides_exactly_the_false_keys(grad, heads, written_out):
    """A boolean mask means True = may attend (SDPA's convention) in every path of gpt.attention;
    a written-out path that added it as 1.0/0.0 would mask nothing. Checked against softmax
    written from the definition, with the False keys left out, and against SDPA itself."""
    import torch.nn.functional as F
    from gpt import attention
    g = torch.Generator().manual_seed(6)
    B, nh, Tq, Tk, hs = 2, 3, 5, 9, 4
    q, k, v = (torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64, requires_grad=grad)
               for T in (Tq, Tk, Tk))
    visible = torch.rand(B, heads, Tq, Tk, generator=g) < 0.5
    visible[..., 0] = True  # every query sees at least one key
    assert not visible.all()
    with torch.set_grad_enabled(grad):
        got = attention(q, k, v, visible)
    scores = (q @ k.transpose(-1, -2) / hs ** 0.5).masked_fill(~visible, float("-inf"))
    assert torch.allclose(got, scores.softmax(-1) @ v, atol=1e-12, rtol=0)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    if grad:
        grads = torch.autograd.grad(got.sum(), (q, k, v))
        want_grads = torch.autograd.grad(want.sum(), (q, k, v))
        assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(grads, want_grads))


@pytest.mark.parametrize("grad", [True, False])  # the written-out path, SDPA
def test_is_causal_aligns_a_short_query_block_bottom_right(grad, written_out):
    """is_causal with Tq < Tk: the queries are the last Tq positions (a block appended after
    cached keys), so query i sees keys 0..Tk-Tq+i. SDPA's own is_causal aligns top-left (query i
    sees keys 0..i) and would hide most of the cache from it."""
    from gpt import attention
    g = torch.Generator().manual_seed(7)
    B, nh, Tq, Tk, hs = 2, 3, 3, 8, 4
    q, k, v = (torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64, requires_grad=grad)
               for T in (Tq, Tk, Tk))
    with torch.set_grad_enabled(grad):
        got = attention(q, k, v, is_causal=True)
    visible = torch.arange(Tk)[None, :] <= torch.arange(Tk - Tq, Tk)[:, None]  # (Tq, Tk)
    scores = (q @ k.transpose(-1, -2) / hs ** 0.5).masked_fill(~visible, float("-inf"))
    assert torch.allclose(got, scores.softmax(-1) @ v, atol=1e-12, rtol=0)
    # and the same block, computed as the tail of a full causal pass over every key
    with torch.set_grad_enabled(grad):
        full = attention(torch.cat([k[:, :, :Tk - Tq], q], 2), k, v, is_causal=True)
    assert torch.allclose(got, full[:, :, -Tq:], atol=1e-12, rtol=0)


def test_is_causal_refusals():
    """More queries than keys has no causal alignment (the first queries would see nothing), and
    a mask with is_causal is ambiguous: both are errors, not a silent choice."""
    from gpt import attention
    q, kv = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="5 queries but only 3 keys"):
        attention(q, kv, kv, is_causal=True)
    with pytest.raises(ValueError, match="not both"):
        attention(q, q, q, torch.ones(5, 5, dtype=torch.bool), is_causal=True)
