"""
formats/gguf.py -- a GGUF file as the target: the one file llama.cpp, Ollama and LM Studio keep a
model in, opened once with `gguf` (ggml's own reader) and handed on as a File: its config, its
tensors into llama.py's model, its tokenizer's metadata (formats/gguf_vocab.py), the rest of its metadata.

A GGUF holds three things:

    metadata   key-value pairs: general.architecture (llama, qwen2 or qwen3 here), then the shape
               under that name (llama.block_count, llama.embedding_length,
               llama.attention.head_count, ..._kv, llama.rope.freq_base, ...) -> llama.LlamaConfig;
               the tokenizer (tokenizer.ggml.*: formats/gguf_vocab.py) and the chat template
               (tokenizer.chat_template: formats/chat.py)
    tensors    by llama.cpp's names (token_embd, blk.N.attn_q, ..., output_norm, output), each in
               a type of its own: floats (F32, F16, BF16) or blocks of small integers that share a
               scale (Q8_0: 32 weights, one scale; Q4_1: 32 weights, a scale and a minimum; Q4_K:
               256 weights in 8 groups, each with a 6-bit scale and minimum; ...)
    layout     shapes listed innermost first ([576, 49152] is a (49152, 576) matrix); for a Llama,
               the rows of q and k reordered for llama.cpp's rotary kernel (below)

Every tensor is dequantized to float32 here (gguf.quants.dequantize): the model then computes in
float32 or bfloat16, and its logits are those of the quantized weights, exactly, not those of the
model before it was quantized. llama.cpp instead computes on the blocks themselves (its own
kernels, activations rounded to 8 bits): its outputs differ from these in the last digits.

llama.cpp's converter reorders each head's rows of a Llama's q and k projections: dimension i and
i + hs/2, the pair "rotate half" turns together, become neighbours 2i and 2i + 1, the pair its
kernel turns. unpermute() puts them back, so llama.py's rotation applies. Qwen2's and Qwen3's are
stored as trained (llama.cpp turns them the "rotate half" way). No output.weight: the head is the
embedding (tied). A Llama 3.1 file carries its rope scaling as rope_freqs.weight, one factor per
frequency; it is read back as the llama3 scaling that made it.

    python -m formats.pretrained FILE.gguf     # what it holds, does it load
"""

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from llama import Llama, LlamaConfig, rope_frequencies
from runtime.checkpoint import CheckpointError

try:  # an optional dependency: a GGUF without it is one line naming the install
    import gguf
except ImportError:
    gguf = None

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # what llama.py computes, by general.architecture
# the tensor types dequantized here: the floats, the legacy blocks (Ollama's and LM Studio's q4_0,
# q4_1, q5_0, q5_1, q8_0; a K-quant file's fallback for rows not a multiple of 256) and the
# K-quants of their defaults (Q4_K_M and Q5_K_M files hold Q4_K or Q5_K, and Q6_K)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# llama.py's names (after transformer.h.N.) -> the GGUF's (after blk.N.); where llama.py stacks
# several matrices in one, the GGUF's in the order they are stacked
LAYER = {"ln_1.weight": ("attn_norm.weight",),
         "ln_2.weight": ("ffn_norm.weight",),
         "attn.c_attn.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
         "attn.c_attn.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
         "attn.c_proj.weight": ("attn_output.weight",),
         "attn.c_proj.bias": ("attn_output.bias",),
         "attn.q_norm.weight": ("attn_q_norm.weight",),
         "attn.k_norm.weight": ("attn_k_norm.weight",),
         "mlp.c_fc.weight": ("ffn_gate.weight", "ffn_up.weight"),
         "mlp.c_fc.bias": ("ffn_gate.bias", "ffn_up.bias"),
         "mlp.c_proj.weight": ("ffn_down.weight",),
         "mlp.c_proj.bias": ("ffn_down.bias",)}
GLOBAL = {"transformer.wte.weight": ("token_embd.weight",),
          "transformer.ln_f.weight": ("output_norm.weight",),
          "lm_head.weight": ("output.weight",)}
ROPE_FREQS = "rope_freqs.weight"  # a Llama 3.1's rope scaling, as factors


def refuse(path, why):
    return CheckpointError(f"{path} is not a GGUF file train.py can use: {why}")


# -----------------------------------------------------------------------------
# the file: opened once, every part checked before anything is written


@dataclass
class File:
    """A GGUF opened once, every part read and checked: what the model, the tokenizer and the
    chat format are built from (nothing asks the file by its path again)."""
    path: str
    reader: object        # gguf.GGUFReader: every metadata field (meta() reads one, checked)
    arch: str             # general.architecture: llama, qwen2 or qwen3
    config: LlamaConfig   # sequence_len its context_length
    tensors: dict         # GGUF name -> the reader's tensor (its type, shape and blocks)
    names: dict           # llama.py's name -> the GGUF names stacked into it (name_map)
    vocab: dict           # the tokenizer: {key after tokenizer.ggml.: value}


def read(path):
    """The GGUF at path as a File. One line names what is wrong with a missing, truncated or
    damaged file, a model llama.py does not compute, or a tokenizer it lacks."""
    r = reader(path)
    arch = meta(r, path, "general.architecture", str)
    cfg = read_config(r, path, arch)
    names = name_map(cfg)
    check_tensors(r, path, cfg, names)
    return File(path, r, arch, cfg, {t.name: t for t in r.tensors}, names, vocab_of(r, path))


def reader(path):
    """gguf.GGUFReader of the file, after its magic bytes, its version and its tensors' extents."""
    if gguf is None:
        raise CheckpointError(f"{path} is a GGUF file, which needs the gguf package to read: "
                              "pip install gguf")
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise refuse(path, f"it cannot be read ({e.strerror})") from None
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            version = int.from_bytes(f.read(4), "little")
        if magic != b"GGUF":
            raise refuse(path, f"it does not start with GGUF's magic bytes (it starts with "
                         f"{magic!r}): not a GGUF, or damaged")
        if version not in (2, 3):  # the versions the gguf package reads
            raise refuse(path, f"it is GGUF version {version}; the gguf package here reads "
                         "versions 2 and 3 (a newer file may need: pip install -U gguf)")
        r = gguf.GGUFReader(path)
    except CheckpointError:
        raise
    except Exception as e:  # the reader's errors are ValueError, IndexError, OverflowError, ...
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise refuse(path, f"it is truncated or damaged ({first})") from None
    for t in r.tensors:  # a tensor whose bytes run past the end: a cut download
        if t.data.nbytes != t.n_bytes or t.data_offset + t.n_bytes > size:
            raise refuse(path, f"it is truncated: {t.name}'s data runs past its end")
    return r


def meta(r, path, key, kind, default=None):
    """The value of one metadata key, checked to be of `kind` (int, float, str, bool or list): one
    line names a key of another type. `default` where it is absent (None: it must be there)."""
    field = r.fields.get(key)
    if field is None:
        if default is None:
            raise refuse(path, f"its metadata lacks {key}")
        return default
    try:
        v = field.contents()
    except Exception:  # a field the reader parsed but cannot turn into a value
        raise refuse(path, f"its metadata's {key} is unreadable") from None
    ok = {int: lambda: type(v) is int, float: lambda: type(v) in (int, float) and math.isfinite(v),
          str: lambda: type(v) is str, bool: lambda: type(v) is bool,
          list: lambda: type(v) is list}[kind]()
    if not ok:
        raise refuse(path, f"its metadata's {key} is {str(v)[:40]!r}, not {kind.__name__}")
    return v


def vocab_of(r, path):
    """The tokenizer's metadata, {key after tokenizer.ggml.: value}, each checked for its type
    (formats/gguf_vocab.py builds the tokenizer from it)."""
    kinds = {"model": str, "pre": str, "tokens": list, "token_type": list, "merges": list,
             "scores": list, "add_bos_token": bool, "add_eos_token": bool}
    out = {k: meta(r, path, f"tokenizer.ggml.{k}", kind, "") for k, kind in kinds.items()}
    out = {k: v for k, v in out.items() if v != ""}
    for k in ("tokens", "merges"):
        if not all(isinstance(t, str) for t in out.get(k, [])):
            raise refuse(path, f"its tokenizer.ggml.{k} holds something other than text")
    for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
              "eot_token_id", "eom_token_id"):
        if f"tokenizer.ggml.{k}" in r.fields:
            out[k] = meta(r, path, f"tokenizer.ggml.{k}", int)
    if "tokens" not in out:
        raise refuse(path, "its metadata lacks tokenizer.ggml.tokens (no tokenizer)")
    return out


# -----------------------------------------------------------------------------
# metadata -> llama.LlamaConfig


def read_config(r, path, arch):
    """The GGUF's llama.LlamaConfig (sequence_len its context_length: train.py shortens it), after
    checking the architecture, the shape and every tensor: its name, its type, its shape."""
    if arch not in ARCHITECTURES:
        raise refuse(path, f"its architecture is {arch!r}; train.py reads "
                     f"{', '.join(ARCHITECTURES)} (llama.py's model: Llama 2 and 3, SmolLM2, "
                     "TinyLlama, Qwen2, Qwen2.5, Qwen3)")
    def m(key, kind, default=None):  # noqa: E306 -- the architecture's own keys
        return meta(r, path, f"{arch}.{key}", kind, default)
    positive = {}
    for name, key in (("n_layer", "block_count"), ("n_embd", "embedding_length"),
                      ("n_hidden", "feed_forward_length"), ("n_head", "attention.head_count"),
                      ("sequence_len", "context_length")):
        positive[name] = m(key, int)
        if positive[name] < 1:
            raise refuse(path, f"its metadata's {arch}.{key} is {positive[name]}")
    claims_what_it_holds(r, path, arch, positive)
    n_head = positive["n_head"]
    n_kv = m("attention.head_count_kv", int, n_head)
    head_dim = m("attention.key_length", int, positive["n_embd"] // n_head)
    if positive["n_embd"] % n_head and head_dim == positive["n_embd"] // n_head:
        raise refuse(path, f"its {arch}.embedding_length {positive['n_embd']} is not a multiple "
                     f"of its {arch}.attention.head_count {n_head}")
    odd = {"attention.head_count_kv": n_kv < 1 or n_head % max(n_kv, 1),  # key -> is it odd
           "attention.value_length": m("attention.value_length", int, head_dim) != head_dim,
           "rope.dimension_count": m("rope.dimension_count", int, head_dim) != head_dim,
           "expert_count": m("expert_count", int, 0) > 0,
           "attention.sliding_window": m("attention.sliding_window", int, 0) > 0}
    why = {"attention.head_count_kv": f"K/V heads that do not divide its {n_head} heads",
           "attention.value_length": f"values of another width than its {head_dim}-wide keys",
           "rope.dimension_count": f"a rotation of part of its {head_dim}-wide heads",
           "expert_count": "a mixture of experts", "attention.sliding_window": "a sliding window"}
    for key, bad in odd.items():
        if bad:
            raise refuse(path, f"its {arch}.{key} {m(key, int)} asks for {why[key]}, which "
                         "llama.py does not compute")
    if head_dim % 2:
        raise refuse(path, f"its heads are {head_dim} wide, an odd width rotary positions cannot "
                     "turn in pairs")
    names = {t.name for t in r.tensors}
    cfg = LlamaConfig(**positive, n_kv_head=n_kv, head_dim=head_dim,
                      vocab_size=vocab_size(r, path, arch),
                      rope_theta=float(m("rope.freq_base", float, 10000.0)),
                      norm_eps=float(m("attention.layer_norm_rms_epsilon", float)),
                      qkv_bias="blk.0.attn_q.bias" in names,
                      proj_bias="blk.0.attn_output.bias" in names,
                      mlp_bias="blk.0.ffn_down.bias" in names, qk_norm=arch == "qwen3",
                      tie_embeddings="output.weight" not in names)
    if arch == "qwen2" and not cfg.qkv_bias:
        raise refuse(path, "it is a qwen2 without biases on q, k and v (blk.0.attn_q.bias)")
    cfg.rope_scaling = rope_scaling(r, path, arch, cfg)
    return cfg


def claims_what_it_holds(r, path, arch, sizes):
    """The metadata's layer count and width against the tensors the file holds, before a model of
    that shape is built (a claimed 10,000 layers would take minutes and gigabytes to refuse)."""
    layers = {int(t.name.split(".")[1]) for t in r.tensors
              if t.name.startswith("blk.") and t.name.split(".")[1].isdigit()}
    if layers != set(range(sizes["n_layer"])):
        raise refuse(path, f"its {arch}.block_count is {sizes['n_layer']} but it holds tensors "
                     f"of {len(layers)} layers (blk.0 .. blk.{max(layers, default=0)})")
    embd = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    if embd is not None and int(embd.shape[0]) != sizes["n_embd"]:
        raise refuse(path, f"its {arch}.embedding_length is {sizes['n_embd']} but "
                     f"token_embd.weight is {int(embd.shape[0])} wide")


def vocab_size(r, path, arch):
    """The embedding's rows: {arch}.vocab_size, or the tokenizer's count where it is absent."""
    n = meta(r, path, f"{arch}.vocab_size", int, 0)
    tokens = r.fields.get("tokenizer.ggml.tokens")
    n = n or (len(tokens.data) if tokens is not None else 0)
    if n < 1:
        raise refuse(path, f"its metadata has neither {arch}.vocab_size nor "
                     "tokenizer.ggml.tokens")
    return n


def rope_scaling(r, path, arch, cfg):
    """None, a linear scaling ({arch}.rope.scaling.type linear), or Llama 3's: llama.cpp's
    converter writes it as rope_freqs.weight, each frequency's divisor, which the scaling that
    made it (factor, low and high frequency factors over an original context of 8,192: every
    Llama 3.x) reproduces exactly; anything else is refused."""
    kind = meta(r, path, f"{arch}.rope.scaling.type", str, "none")
    factor = float(meta(r, path, f"{arch}.rope.scaling.factor", float, 1.0))
    if kind not in ("none", "linear"):
        raise refuse(path, f"its rope scaling is {kind!r}, which llama.py does not compute "
                     "(linear and Llama 3's are)")
    t = next((t for t in r.tensors if t.name == ROPE_FREQS), None)
    if t is not None and (t.tensor_type.name != "F32" or kind == "linear"):
        raise refuse(path, f"its {ROPE_FREQS} is {t.tensor_type.name}"
                     f"{' beside a linear rope scaling' if kind == 'linear' else ''}: llama.py "
                     "reads Llama 3's factors, in F32, alone")
    if kind == "linear" and factor != 1.0:
        return {"rope_type": "linear", "factor": factor}
    if t is None:
        return None
    factors = dequantized(t).reshape(-1)
    if factors.numel() != cfg.head_dim // 2:
        raise refuse(path, f"its {ROPE_FREQS} holds {factors.numel()} factors, not one per "
                     f"frequency ({cfg.head_dim // 2})")
    for low, high, old in ((1.0, 4.0, 8192), (1.0, 2.0, 8192), (1.0, 4.0, 4096)):
        s = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": low,
             "high_freq_factor": high, "original_max_position_embeddings": old}
        want = rope_frequencies(LlamaConfig(head_dim=cfg.head_dim, rope_theta=cfg.rope_theta))
        got = rope_frequencies(LlamaConfig(head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                                           rope_scaling=s))
        if torch.allclose(want / got, factors, rtol=1e-5):
            return s
    raise refuse(path, f"its {ROPE_FREQS} is not the llama3 rope scaling of any Llama 3.x "
                 "(llama.py computes no other per-frequency factors)")


# -----------------------------------------------------------------------------
# the GGUF's tensor names <-> llama.py's


def name_map(cfg):
    """{llama.py's name: [the GGUF's names]} for every tensor of llama.Llama(cfg) (its output
    head only where it is not tied to the embedding)."""
    with torch.device("meta"):  # the names and shapes, nothing allocated
        ours = Llama(cfg).state_dict()
    out = {}
    for name in ours:
        if name.startswith("transformer.h."):
            i, rest = name[len("transformer.h."):].split(".", 1)
            out[name] = [f"blk.{i}.{part}" for part in LAYER[rest]]
        elif name != "lm_head.weight" or not cfg.tie_embeddings:
            out[name] = list(GLOBAL[name])
    return out


def part_shapes(cfg, shape, n):
    """The shapes of the n GGUF tensors stacked into one of llama.py's (rows first)."""
    rows = {1: [shape[0]], 2: [cfg.n_hidden] * 2,
            3: [cfg.n_head * cfg.head_dim] + [cfg.n_kv_head * cfg.head_dim] * 2}[n]
    return [(r, *shape[1:]) for r in rows]


def check_tensors(r, path, cfg, names):
    """Every tensor the model needs is there, of a type dequantized here and of the shape the
    metadata implies; none is left over (it would be silently ignored)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Llama(cfg).state_dict().items()}
    want = {}
    for ours, parts in names.items():
        want.update(zip(parts, part_shapes(cfg, shapes[ours], len(parts))))
    have = {t.name: t for t in r.tensors if t.name != ROPE_FREQS}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing:
        raise refuse(path, f"it lacks {missing[0]} ({len(missing)} tensors missing)")
    if extra:
        raise refuse(path, f"it holds {extra[0]}, which llama.py does not compute "
                     f"({len(extra)} such tensors)")
    for name, t in have.items():
        if t.tensor_type.name not in TYPES:
            raise refuse(path, f"{name} is {t.tensor_type.name}; train.py dequantizes "
                         f"{', '.join(TYPES)}")
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the innermost first
        if shape != want[name]:
            raise refuse(path, f"{name} is {shape}, its metadata implies {want[name]}")


# -----------------------------------------------------------------------------
# the weights


def dequantized(t):
    """One tensor in float32, shaped as torch keeps it (rows first)."""
    a = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(a, dtype=np.float32)).reshape(
        [int(n) for n in reversed(t.shape)])


def unpermute(w, n_head):
    """Undo llama.cpp's order of a Llama's q or k rows: within each head it keeps dimension i of
    the first half and i of the second side by side (rows 2i and 2i + 1), as its rotary kernel
    turns neighbours; "rotate half" turns i with i + hs/2."""
    return w.reshape(n_head, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load(f, cfg):
    """llama.Llama(cfg) with the File's weights, dequantized to float32, in eval mode (cfg its
    config, the sequence_len perhaps shortened)."""
    model = Llama(cfg)
    sd = {}
    for ours, parts in f.names.items():
        ws = [dequantized(f.tensors[p]) for p in parts]
        if f.arch == "llama" and ours.endswith(("c_attn.weight", "c_attn.bias")):
            ws[0], ws[1] = unpermute(ws[0], cfg.n_head), unpermute(ws[1], cfg.n_kv_head)
        sd[ours] = torch.cat(ws) if len(ws) > 1 else ws[0]
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model.load_state_dict(sd)
    return model.eval()


def describe(f):
    """What the File's tensors are stored as, e.g. 'Q4_1 x 210, F32 x 61, Q8_0 x 1'."""
    count = {}
    for t in f.tensors.values():
        count[t.tensor_type.name] = count.get(t.tensor_type.name, 0) + 1
    return ", ".join(f"{k} x {n}" for k, n in sorted(count.items(), key=lambda kv: -kv[1]))
