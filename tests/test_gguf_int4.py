"""The target in a GGUF's own 4-bit codes (formats/gguf_int4.py): the codes read straight from the
file's blocks, and every row of a verify computed bit for bit as a one-row decode computes it
(gpt.attention_by_row and the int4 kernel), for chains of 1 to 16 drafted tokens, token trees and
a ragged batch, on tiny GGUFs of Q4_0, Q4_1, Q8_0 and Q4_K; so every drafter's greedy output is
plain decoding's token for token in that arithmetic, near-ties and all (torch.equal, not a
tolerance)."""

import pytest
import torch

import bench
import gguf_files
from conftest import make, within
from formats import gguf, gguf_int4, pretrained
from gpt import BUCKET, Rows, attention_by_row, chunk_mask
from registry import drafters as registry
import ragged
from serving.batched import serve
from sampler import Sampler
from speculative import generate_plain, generate_speculative, padded
from test_batched import batched_drafter, batches, ragged_prompts
from tree import BlockTree, depths, generate_tree, same_cost, tree_mask

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, gguf_int4.KERNEL),
                                reason="this torch has no int4 CPU kernel")

KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    """(the GGUF's path, its model in float32, the same in its int4 codes)."""
    path = str(tmp_path_factory.mktemp("int4") / f"tiny-{request.param}.gguf")
    gguf_files.write_tiny(path, "llama", request.param)
    src = pretrained.read(path)
    model = pretrained.load(src)
    return path, model, gguf_int4.quantized(model, src.gguf_file)[0]


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("int4") / "tiny-q4_1.gguf")
    gguf_files.write_tiny(path, "qwen3", "Q4_1")
    src = pretrained.read(path)
    model = pretrained.load(src).double()  # as the shared tests fit their drafters
    return model, gguf_int4.quantized(model, src.gguf_file)[0]


def tokens(n, vocab, seed):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# -----------------------------------------------------------------------------
# the codes


@pytest.mark.parametrize("kind", KINDS)
def test_the_codes_are_the_files_weights(tmp_path, kind):
    """Straight from the blocks: (q - 8) scale + zero, in float32, is what gguf's own dequantizer
    reads (Q8_0's two halves added up); a nibble or a scale read from the wrong place shows."""
    path = str(tmp_path / "t.gguf")
    gguf_files.write_tiny(path, "llama", kind)
    for t in gguf.read(path).tensors.values():
        if len(t.shape) != 2:
            continue
        q, scale, zero, exact = gguf_int4.codes(t)
        w = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
        want = gguf.dequantized(t)
        if w.size(1) != want.size(1):
            w = w[:, :want.size(1)] + w[:, want.size(1):]
        assert exact and q.min() >= 0 and q.max() <= 15
        assert torch.allclose(w, want, rtol=1e-5, atol=1e-7), t.name


def test_the_int4_product_is_the_codes_product(tiny):
    path, model, q = tiny
    x = torch.randn(5, model.config.n_embd)
    for name in ("transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"):
        lin = q.get_submodule(name)
        parts = gguf.name_map(model.config)["transformer.wte.weight" if name == "lm_head"
                                            else name + ".weight"]
        got = lin(x)
        want = x.bfloat16().float() @ model.get_submodule(name).weight.t()
        assert got.dtype == torch.float32 and got.shape == want.shape, parts
        assert (got - want).norm() / want.norm() < 1e-2


def test_a_type_without_a_4bit_form_is_rounded_and_says_so(tmp_path):
    path = str(tmp_path / "t.gguf")
    gguf_files.write_tiny(path, "llama", "Q6_K")
    src = pretrained.read(path)
    model = pretrained.load(src)
    q, what = gguf_int4.quantized(model, src.gguf_file)
    assert "Q6_K rounded to 4-bit codes" in what
    w = model.transformer.h[0].mlp.c_proj.weight
    codes = gguf_int4.nearest(w)
    err = (gguf_int4.dequantize(*codes) - w).norm() / w.norm()
    assert 0 < err < 0.15


# -----------------------------------------------------------------------------
# every row of a verify is a decode, bit for bit


@torch.inference_mode()
def decodes(model, idx, start):
    """The logits of idx[start:] decoded one row at a time after a prefill of idx[:start]."""
    cache = model.new_cache()
    model(idx[:, :start], cache=cache)
    return torch.cat([model(idx[:, t:t + 1], cache=cache)[0] for t in range(start, idx.size(1))], 1)


@pytest.mark.parametrize("start", [5, BUCKET - 9, BUCKET + 3])
def test_every_verify_row_is_a_one_row_decode(tiny, start):
    """Chains of 1 to 16 drafted tokens, some of them across the edge of a key bucket."""
    _, _, q = tiny
    idx = tokens(start + 17, q.config.vocab_size, start)
    want = decodes(q, idx, start)
    with torch.inference_mode():
        cache = q.new_cache()
        q(idx[:, :start], cache=cache)
        for k in range(1, 17):
            cache.rollback(start)
            got = q(idx[:, start:start + k + 1], cache=cache)[0]
            assert torch.equal(got, want[:, :k + 1]), f"k={k}"
    assert not torch.equal(want[:, 0], want[:, 1])  # not a degenerate model


def test_a_tree_node_is_its_path_decoded(tiny):
    _, _, q = tiny
    parents = [0, 0, 1, 1, 2, 4, 4, 6, 3, 8]  # branches at the root and below
    start, V = BUCKET - 4, q.config.vocab_size
    prefix, nodes = tokens(start + 1, V, 1), tokens(len(parents), V, 2)
    d = depths(parents)
    with torch.inference_mode():
        cache = q.new_cache()
        q(prefix[:, :start], cache=cache)
        tree = (torch.tensor(d), tree_mask(parents, start, "cpu"))
        got = q(torch.cat([prefix[:, start:], nodes], 1), cache=cache, tree=tree)[0][0]
    for i in range(len(parents) + 1):
        path = [i]
        while path[0]:
            path.insert(0, parents[path[0] - 1])
        seq = torch.cat([prefix, nodes[:, [j - 1 for j in path[1:]]]], 1)
        assert torch.equal(got[i], decodes(q, seq, start)[0, -1]), f"node {i}"


@pytest.mark.parametrize("T, start", [(9, 200), (64, 300), (100, 0)])
def test_attention_by_row_on_two_threads_is_one_row_calls(T, start):
    """SmolLM2's attention shapes (9 query heads over 3 K/V heads of 64) on two threads: SDPA's CPU
    kernel rounds a head by the thread that runs it, so a call of many rows must still give each
    row the bits of its one-row call (attention_by_row runs SDPA on one thread)."""
    nh, nkv, hs, S = 9, 3, 64, 512
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, h, n, hs, generator=g) for h, n in ((nh, T), (nkv, S), (nkv, S)))
    cache = type("Cache", (), {"k": k})

    def rows(at, n):
        return Rows.of(chunk_mask(at, n, "cpu") if at else None, 1, n, at, cache, nh)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = attention_by_row(q, k, v, rows(start, T))
        want = torch.cat([attention_by_row(q[:, :, t:t + 1], k, v, rows(start + t, 1))
                          for t in range(T)], 2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want)


def test_a_ragged_batch_row_is_its_own_decode(q4_1):
    """Rows at their own positions, a prefill and a ragged chunk of 3, 0, 5 and 1 new tokens."""
    _, q = q4_1
    prompts = ragged_prompts(4, q.config.vocab_size, seed=3)
    new = [[1, 2, 3], [], [4, 5, 6, 7, 8], [9]]
    cache = ragged.new_cache(q, 4)
    with torch.inference_mode():
        first = ragged.forward(q, padded(prompts, "cpu")[0], cache, [len(p) for p in prompts])[0]
        second = ragged.forward(q, torch.tensor([n + [0] * (5 - len(n)) for n in new]), cache,
                                [len(n) for n in new])[0]
        for r, (p, n) in enumerate(zip(prompts, new)):
            alone = q.new_cache()
            assert torch.equal(first[r, :len(p)], q(torch.tensor([p]), cache=alone)[0][0])
            for j, t in enumerate(n):
                assert torch.equal(second[r, j], q(torch.tensor([[t]]), cache=alone)[0][0, 0])


# -----------------------------------------------------------------------------
# so every drafter is plain decoding, token for token


def test_every_drafter_is_plain_decoding_in_int4(q4_1, drafter_name):
    model, q = q4_1
    drafter = make(drafter_name, model)  # fitted on the float model; it drafts for the int4 one
    rounds = 0
    for seed in range(3):  # k of 4, 8 and 16
        p = tokens(3 + 5 * seed, q.config.vocab_size, seed)[0].tolist()
        ref = generate_plain(q, p, 32, Sampler("greedy"))
        out, stats = generate_speculative(q, drafter, p, 32, within(drafter, 4 << seed),
                                          Sampler("greedy"))
        assert out == ref, f"prompt {seed}"
        rounds += stats.rounds
    assert rounds > 0


def test_trees_and_ragged_batches_are_plain_decoding_in_int4(q4_1):
    model, q = q4_1
    ps = ragged_prompts(4, q.config.vocab_size, seed=3, window=q.config.sequence_len)
    refs = [generate_plain(q, p, 30, Sampler("greedy")) for p in ps]
    for d in (BlockTree(make("dspark", model), nodes=12, width=2),
              BlockTree(make("dflash", model), nodes=16, cost=same_cost)):
        for p, ref in zip(ps, refs):
            assert generate_tree(q, d, p, 30, Sampler("greedy"))[0] == ref
    for name in (n for n in registry.names() if batches(n)):
        d = batched_drafter(name, model, len(ps))
        out, _ = serve(q, d, ps, 30, within(d, 4), Sampler("greedy"))
        assert out == refs, name


# -----------------------------------------------------------------------------
# the flag, the start-up check


def test_a_host_whose_kernels_are_not_row_invariant_falls_back_saying_so(q4_1, tmp_path,
                                                                          monkeypatch, capsys):
    model, _ = q4_1
    path = str(tmp_path / "t.gguf")
    gguf_files.write_tiny(path, "qwen3", "Q4_1")
    ckpt = {"init_from": path}
    q, what = gguf_int4.pick(model, ckpt, "int4", "cpu", torch.float32)
    assert q is not model and what.startswith("int4") and gguf_int4.row_invariant(q)
    monkeypatch.setattr(gguf_int4, "row_invariant", lambda m: False)
    again, what = gguf_int4.pick(model, ckpt, "int4", "cpu", torch.float32)
    assert again is model and what.startswith("float32")
    assert "do not give a verify's rows the bits of one-row decodes" in capsys.readouterr().out


def test_int4_needs_a_gguf_target_and_auto_keeps_the_float_one_elsewhere(q4_1):
    model, _ = q4_1
    with pytest.raises(ValueError, match="--arithmetic int4 .* not imported from a GGUF"):
        gguf_int4.pick(model, {"init_from": "/some/folder"}, "int4", "cpu", torch.float32)
    assert gguf_int4.pick(model, {}, "auto", "cpu", torch.float32)[0] is model
    assert gguf_int4.pick(model, {"init_from": "x.gguf"}, "auto", "cpu", torch.float64)[0] is model


def test_bench_decodes_a_gguf_target_in_int4_and_every_row_is_exact(chat_run, tmp_path):
    res = bench.main(["--out-dir", str(chat_run), "--prompts", "chat", "--n-prompts", "3",
                      "--methods", "ar,lookup", "--max-new-tokens", "12", "--arithmetic", "int4",
                      "--repeats", "1", "--plot", "", "--json", str(tmp_path / "b.json")])
    assert res["arithmetic"].startswith("int4 (the GGUF's codes: Q8_0")
    assert all(r["exact_match"] == 1.0 for r in res["methods"].values())


@pytest.fixture(scope="module")
def chat_run(corpus, tmp_path_factory):
    from conftest import tiny_args
    import train
    out = tmp_path_factory.mktemp("int4-run")
    path = str(out / "tiny.gguf")
    gguf_files.write_tiny(path)
    train.main(tiny_args(corpus, out, "--init-from", path, "--only", "target",
                         "--block-size", "128"))
    return out
