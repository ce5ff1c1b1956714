"""Tiny GGUF files for the tests, written as llama.cpp's converter writes them, with every tensor
type formats/gguf.py reads encoded here from integer codes chosen by the test.

Each encoder writes ggml's block layout (ggml-common.h, ggml-quants.c) byte by byte and returns the
float weights those bytes stand for, computed here from the codes by the format's formula (w = d q,
w = d q + m, w = d sc q - dmin m, ...): a reference that does not go through gguf's dequantizer,
which the loader uses. A layout misread anywhere (a nibble order, a scale's packing, the q/k row
permutation) makes the loaded model's logits differ from the reference model's. The file itself is
written here too (tensors_of, write), as llama.cpp's converter lays it out."""

import numpy as np
import torch

from formats import gguf
from llama import Llama, LlamaConfig

QK_K = 256  # a K-quant's super-block
ggml = gguf.gguf  # the gguf package itself (None where it is not installed: the tests skip)


def f16(x):
    """float16 values (the scales' type) and their bytes."""
    h = np.asarray(x, dtype=np.float16)
    return h.astype(np.float32), h.view(np.uint8).reshape(*h.shape, 2)


def scales_of(rng, rows, blocks, lo=0.002, hi=0.02):
    return rng.uniform(lo, hi, size=(rows, blocks))


def q8_0(rng, rows, cols):
    n = cols // 32
    d, db = f16(scales_of(rng, rows, n))
    q = rng.integers(-127, 128, size=(rows, n, 32)).astype(np.int8)
    data = np.concatenate([db, q.view(np.uint8)], -1)
    return data.reshape(rows, -1), (d[..., None] * q).reshape(rows, cols)


def nibbles(q):
    """(..., 32) 4-bit codes -> (..., 16) bytes: element j low, element j + 16 high."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def q4(rng, rows, cols, with_min):
    """Q4_0 (w = d (q - 8)) or Q4_1 (w = d q + m)."""
    n = cols // 32
    d, db = f16(scales_of(rng, rows, n))
    q = rng.integers(0, 16, size=(rows, n, 32)).astype(np.uint8)
    parts, w = [db], None
    if with_min:
        m, mb = f16(rng.uniform(-0.1, 0.0, size=(rows, n)))
        parts.append(mb)
        w = d[..., None] * q + m[..., None]
    else:
        w = d[..., None] * (q.astype(np.float32) - 8)
    data = np.concatenate([*parts, nibbles(q)], -1)
    return data.reshape(rows, -1), w.reshape(rows, cols)


def q5(rng, rows, cols, with_min):
    """Q5_0 (w = d (q - 16)) or Q5_1 (w = d q + m): 4 low bits as Q4's, the fifth in qh."""
    n = cols // 32
    d, db = f16(scales_of(rng, rows, n))
    q = rng.integers(0, 32, size=(rows, n, 32)).astype(np.uint32)
    qh = (((q >> 4) & 1) << np.arange(32, dtype=np.uint32)).sum(-1).astype(np.uint32)
    parts = [db]
    if with_min:
        m, mb = f16(rng.uniform(-0.1, 0.0, size=(rows, n)))
        parts.append(mb)
        w = d[..., None] * q + m[..., None]
    else:
        w = d[..., None] * (q.astype(np.float32) - 16)
    low = nibbles((q & 15).astype(np.uint8))
    data = np.concatenate([*parts, qh[..., None].view(np.uint8), low], -1)
    return data.reshape(rows, -1), w.reshape(rows, cols)


def k_scales(sc, m):
    """Q4_K's and Q5_K's 12 bytes for 8 six-bit scales and 8 six-bit minimums."""
    b = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    b[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    b[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    b[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return b


def qk45(rng, rows, cols, bits):
    """Q4_K or Q5_K: super-blocks of 8 groups of 32, w = d sc q - dmin m."""
    n = cols // QK_K
    d, db = f16(scales_of(rng, rows, n, 1e-4, 1e-3))
    dmin, dminb = f16(scales_of(rng, rows, n, 1e-4, 1e-3))
    sc = rng.integers(0, 64, size=(rows, n, 8)).astype(np.uint8)
    m = rng.integers(0, 64, size=(rows, n, 8)).astype(np.uint8)
    q = rng.integers(0, 1 << bits, size=(rows, n, 8, 32)).astype(np.uint8)
    low = q & 15
    qs = (low[..., 0::2, :] | (low[..., 1::2, :] << 4)).reshape(rows, n, 128)  # pairs of groups
    parts = [db, dminb, k_scales(sc, m)]
    if bits == 5:  # bit 4 of group g, element t: bit g of qh[t]
        high = ((q >> 4) & 1).astype(np.uint8)
        parts.append((high << np.arange(8, dtype=np.uint8)[:, None]).sum(-2).astype(np.uint8))
    w = (d[..., None, None] * sc[..., None] * q - dmin[..., None, None] * m[..., None])
    data = np.concatenate([*parts, qs], -1)
    return data.reshape(rows, -1), w.reshape(rows, cols)


def q6_k(rng, rows, cols):
    """Q6_K: super-blocks of 16 groups of 16, w = d sc (q - 32), q in 6 bits."""
    n = cols // QK_K
    d, db = f16(scales_of(rng, rows, n, 1e-4, 1e-3))
    sc = rng.integers(-128, 128, size=(rows, n, 16)).astype(np.int8)
    q = rng.integers(0, 64, size=(rows, n, QK_K)).astype(np.uint8)
    e = np.arange(QK_K)
    half, quarter, col = e // 128, (e % 128) // 64, e % 64
    ql = np.zeros((rows, n, 128), dtype=np.uint8)
    qh = np.zeros((rows, n, 64), dtype=np.uint8)
    for i in range(QK_K):  # element i: ql byte 64 half + col, its nibble by quarter
        ql[..., 64 * half[i] + col[i]] |= (q[..., i] & 15) << np.uint8(4 * quarter[i])
        qh[..., 32 * half[i] + i % 32] |= (q[..., i] >> 4) << np.uint8(2 * ((i % 128) // 32))
    w = d[..., None] * sc.repeat(16, -1) * (q.astype(np.float32) - 32)
    data = np.concatenate([ql, qh, sc.view(np.uint8), db], -1)
    return data.reshape(rows, -1), w.reshape(rows, cols)


def floats(kind):
    def encode(rng, rows, cols):
        w = rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32)
        if kind == "F16":
            return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
        if kind == "BF16":
            t = torch.from_numpy(w).to(torch.bfloat16)
            return t.view(torch.uint8).numpy().reshape(rows, -1), t.float().numpy()
        return w, w
    return encode


ENCODERS = {"F32": floats("F32"), "F16": floats("F16"), "BF16": floats("BF16"),
            "Q8_0": q8_0,
            "Q4_0": lambda r, a, b: q4(r, a, b, False), "Q4_1": lambda r, a, b: q4(r, a, b, True),
            "Q5_0": lambda r, a, b: q5(r, a, b, False), "Q5_1": lambda r, a, b: q5(r, a, b, True),
            "Q4_K": lambda r, a, b: qk45(r, a, b, 4), "Q5_K": lambda r, a, b: qk45(r, a, b, 5),
            "Q6_K": q6_k}
assert set(ENCODERS) == set(gguf.TYPES)  # every type the loader reads is tested


# -----------------------------------------------------------------------------
# a tiny model and its file


def tiny_config(arch, width=256, **over):
    """A 2-layer llama.LlamaConfig of `arch`'s switches, its matrices' rows 256 wide (a K-quant's
    super-block)."""
    fields = dict(sequence_len=128, vocab_size=64 + 256 + 8, n_layer=2, n_embd=width,
                  n_hidden=width, n_head=4, n_kv_head=2, head_dim=width // 4,
                  rope_theta=10000.0, norm_eps=1e-5)
    fields.update({"llama": dict(tie_embeddings=False), "qwen2": dict(qkv_bias=True),
                   "qwen3": dict(qk_norm=True, head_dim=32, tie_embeddings=True)}[arch])
    return LlamaConfig(**{**fields, **over})


def encoded(model, arch, kind, seed=0):
    """(GGUF tensors {name: (data, type)}, the reference model): every matrix of `model` replaced
    by `kind`'s encoding of fresh codes (its rows 256 wide or more), the norms, biases and
    vectors kept in F32; the reference holds the weights those codes stand for."""
    rng = np.random.default_rng(seed)
    tensors, ref = {}, {}
    for name, w in tensors_of(model, arch).items():
        if w.ndim == 2 and w.shape[1] % QK_K == 0:
            data, ref[name] = ENCODERS[kind](rng, *w.shape)
            tensors[name] = (data, kind)
        else:
            tensors[name], ref[name] = (w, "F32"), w
    return tensors, reference_model(model.config, arch, ref)


def reference_model(cfg, arch, weights):
    """A llama.Llama holding `weights` ({GGUF name: float32 array in the file's layout}), mapped
    by the test's own reading of llama.cpp's layout."""
    model = Llama(cfg)
    sd = {}
    for ours, parts in gguf.name_map(cfg).items():
        ws = [torch.from_numpy(np.asarray(weights[p], dtype=np.float32)) for p in parts]
        if arch == "llama" and ours.endswith(("c_attn.weight", "c_attn.bias")):
            ws[0], ws[1] = unpermuted(ws[0], cfg.n_head), unpermuted(ws[1], cfg.n_kv_head)
        sd[ours] = torch.cat(ws)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model.load_state_dict(sd)
    return model.eval()


def unpermuted(w, heads):
    """llama.cpp's q/k rows back in order, written out: row (h, 2i + j) -> (h, j hs/2 + i)."""
    rows = w.shape[0] // heads
    out = torch.empty_like(w)
    for h in range(heads):
        for i in range(rows // 2):
            for j in range(2):
                out[h * rows + j * rows // 2 + i] = w[h * rows + 2 * i + j]
    return out


# -----------------------------------------------------------------------------
# the file, as llama.cpp's converter writes it


def permute(w, n_head):
    """llama.cpp's converter's order of a Llama's q or k rows (formats/gguf.py's unpermute undoes
    it)."""
    return w.reshape(n_head, 2, -1, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def tensors_of(model, arch):
    """{GGUF name: float32 numpy array, rows first} of a llama.Llama, as llama.cpp's converter
    lays it out (q and k rows permuted for a Llama)."""
    cfg, sd = model.config, model.state_dict()
    out = {}
    for ours, parts in gguf.name_map(cfg).items():
        w = sd[ours].detach().float()
        ws = list(w.split([s[0] for s in gguf.part_shapes(cfg, w.shape, len(parts))]))
        if arch == "llama" and ours.endswith(("c_attn.weight", "c_attn.bias")):
            ws[0], ws[1] = permute(ws[0], cfg.n_head), permute(ws[1], cfg.n_kv_head)
        out.update({p: x.contiguous().numpy() for p, x in zip(parts, ws)})
    return out


def write(path, cfg, arch, tensors, metadata, rope_freqs=None):
    """A GGUF of a llama.LlamaConfig: its shape's metadata, `tensors` {name: (numpy data, type
    name)} (a float array for F32 and F16; the blocks' bytes, (rows, bytes), for the others), and
    more `metadata` {key: value} (the tokenizer's: tokenizer.ggml.tokens, ...)."""
    w = ggml.GGUFWriter(path, arch)
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.sequence_len)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_hidden)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    if rope_freqs is not None:  # float16 only where a test asks for a type llama.py refuses
        half = np.asarray(rope_freqs).dtype == np.float16
        tensors = {gguf.ROPE_FREQS: (np.asarray(rope_freqs, np.float16 if half else np.float32),
                                "F16" if half else "F32"), **tensors}
    for name, (data, kind) in tensors.items():
        qtype = ggml.GGMLQuantizationType[kind]
        w.add_tensor(name, data, raw_dtype=None if kind in ("F32", "F16") else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def byte_vocab(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """A byte-level BPE vocabulary of the GPT-2 kind: the 256 bytes as GPT-2 spells them, a few
    merges, then `specials` as control tokens -> tokenizer.ggml metadata."""
    from formats.gguf_vocab import byte_spelling
    spell = byte_spelling()
    tokens = [spell[b] for b in range(256)]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"),
              ("o", "n"), ("Ġ", "s"), ("r", "e"), ("a", "t")]
    tokens += [a + b for a, b in merges]
    return {"model": "gpt2", "pre": "smollm", "tokens": [*tokens, *specials],
            "token_type": [1] * len(tokens) + [3] * len(specials),
            "merges": [f"{a} {b}" for a, b in merges],
            "bos_token_id": len(tokens) + 1, "eos_token_id": len(tokens) + 2,
            "add_bos_token": False}


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def metadata(vocab, chat=None, **more):
    """GGUF metadata of a tokenizer ({key after tokenizer.ggml.: value}) and a chat template."""
    return {**{f"tokenizer.ggml.{k}": v for k, v in vocab.items()},
            **({"tokenizer.chat_template": chat} if chat else {}), **more}


def write_tiny(path, arch="llama", kind="Q8_0", seed=0, vocab=None, chat=CHATML, **over):
    """A tiny GGUF of `arch` with matrices of `kind` at path -> the reference model."""
    vocab = vocab or byte_vocab()
    cfg = tiny_config(arch, vocab_size=len(vocab["tokens"]), **over)
    torch.manual_seed(seed)
    model = Llama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    tensors, ref = encoded(model, arch, kind, seed)
    write(str(path), cfg, arch, tensors, metadata(vocab, chat))
    return ref
