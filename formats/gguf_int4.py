"""
formats/gguf_int4.py -- the target in the GGUF's own 4-bit codes, every row of a verify computed
bit for bit as a one-row decode computes it: applied to the lesson's model from outside, as
gpt-fast's quantize.py swaps its Linears.

gpt.py explains why speculative decoding changes the text in most engines (a verify's k + 1 rows
round differently from a decode's one) and holds the attention that does not (attention_by_row).
This file gives the matmuls the same property and the speed of the file's own weights:

  Int4Linear   nn.Linear's product by torch's int4 kernel (`_weight_int4pack_mm_for_cpu`:
               its input rounded to bfloat16, weights in groups of 32, w = (q - 8) scale + zero,
               the product back in the model's dtype). Its sum over K runs in one fixed order
               whatever the row count, so row i of a verify equals the same row decoded alone
               (tests/test_gguf_int4.py: every shape the loops use).
  codes        a GGUF tensor -> the kernel's codes, scales and zeros, straight from its blocks:
               Q4_0 (scale d, zero 0), Q4_1 (w = d q + m: scale d, zero m + 8 d), Q4_K (each group
               of 32: scale d sc, zero 8 d sc - dmin m), Q8_0 (q = 16 hi + lo: two 4-bit halves
               side by side, the row's input fed twice). Exact up to the scales rounded to
               bfloat16. Other types (F32, F16, BF16, Q5_*, Q6_K) are rounded to the nearest
               4-bit codes of groups of 32, each group's own minimum and step (the run says so).
  quantized    a copy of the target: every Linear an Int4Linear from the GGUF it was imported
               from, everything else as it was (float32: the embedding, the norms, the attention
               and its cache), every attention by row (gpt.attention_by_row).
  row_invariant  the start-up check: a verify's logits against one-row decodes, bit for bit.
  pick         --arithmetic: float (the target as loaded), int4, or auto (int4 where the target
               came from a GGUF, the kernels are row-invariant here and a decode step is faster).
"""

import os

import numpy as np
import torch
import torch.nn as nn

from formats import gguf
from runtime import cpu_speed
from runtime.profiling import profile_verify
from runtime.target import load_target

GROUP = 32  # weights per scale: every legacy GGUF block and every K-quant group
KERNEL = "_weight_int4pack_mm_for_cpu"
int4_mm = getattr(torch.ops.aten, KERNEL, None)


# -----------------------------------------------------------------------------
# a GGUF tensor's blocks -> the int4 kernel's codes, scales and zeros


def f16(b):
    """(..., 2) bytes -> (...) float32 of the float16 they hold."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def nibbles(qs):
    """(..., 16) bytes -> (..., 32) codes: element j the low nibble of byte j, j + 16 the high."""
    qs = torch.from_numpy(np.ascontiguousarray(qs)).to(torch.int32)
    return torch.cat([qs & 15, qs >> 4], -1)


def k_scales(b):
    """Q4_K's 12 bytes (..., 12) -> 8 six-bit scales and 8 six-bit minimums, each (..., 8)."""
    b = torch.from_numpy(np.ascontiguousarray(b)).to(torch.int32)
    sc = torch.cat([b[..., 0:4] & 63, (b[..., 8:12] & 15) | ((b[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def codes(t):
    """A GGUF tensor -> (q (N, K') codes 0..15, scale and zero (N, K'/32) float32, exact): K' is
    K, or 2K for Q8_0's two halves (the input then fed twice)."""
    kind, (N, K) = t.tensor_type.name, [int(n) for n in reversed(t.shape)]
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(N, -1)
    if kind in ("Q4_0", "Q4_1"):
        b = blocks.reshape(N, K // GROUP, -1)
        d = f16(b[..., 0:2])
        zero, qs = (f16(b[..., 2:4]) + 8 * d, b[..., 4:]) if kind == "Q4_1" else (0 * d, b[..., 2:])
        return nibbles(qs).reshape(N, K), d, zero, True
    if kind == "Q8_0":
        b = blocks.reshape(N, K // GROUP, 34)
        d, q = f16(b[..., 0:2]), torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8))
        q = q.to(torch.int32)  # q = 16 hi + lo, hi in -8..7, lo in 0..15
        hi, lo = (q >> 4) + 8, q & 15
        return (torch.cat([hi.reshape(N, K), lo.reshape(N, K)], 1),
                torch.cat([16 * d, d], 1), torch.cat([0 * d, 8 * d], 1), True)
    if kind == "Q4_K":
        b = blocks.reshape(N, K // 256, 144)
        d, dmin = f16(b[..., 0:2])[..., None], f16(b[..., 2:4])[..., None]
        sc, m = k_scales(b[..., 4:16])
        qs = torch.from_numpy(np.ascontiguousarray(b[..., 16:])).to(torch.int32).view(N, -1, 4, 32)
        q = torch.stack([qs & 15, qs >> 4], 3).reshape(N, K)  # pairs of groups: low, then high
        scale = (d * sc).reshape(N, -1)
        return q, scale, (8 * d * sc - dmin * m).reshape(N, -1), True
    return (*nearest(gguf.dequantized(t)), False)


def nearest(w):
    """Float weights (N, K) -> the nearest 4-bit codes of groups of 32 (each group's own minimum
    and step): what a type without a 4-bit form becomes."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.reshape(N, K), scale, lo + 8 * scale


def dequantize(q, scale, zero):
    """What the kernel multiplies by: (q - 8) scale + zero, the scales in bfloat16, (N, K')."""
    s, z = (t.bfloat16().float().repeat_interleave(GROUP, 1) for t in (scale, zero))
    return (q.float() - 8) * s + z


# -----------------------------------------------------------------------------
# the Linear


class Int4Linear(nn.Module):
    """y = x W^T + b by the int4 kernel: x in bfloat16, W as packed codes with a scale and a zero
    per group of 32 inputs. `twice`: the codes hold two halves of K each (Q8_0), the input is fed
    twice. Rows padded to a multiple of 16 (the kernel's tile) are sliced off."""

    def __init__(self, q, scale, zero, bias=None, twice=False):
        super().__init__()
        N = q.size(0)
        pad = -N % 16
        q = torch.cat([q, q.new_full((pad, q.size(1)), 8)])  # code 8, scale 0, zero 0: w = 0
        scale, zero = (torch.cat([t, t.new_zeros(pad, t.size(1))]) for t in (scale, zero))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 2))
        # (K'/32, N, 2) scale and zero, in the activations' dtype, as the kernel takes them
        self.register_buffer("scales_and_zeros",
                             torch.stack([scale.t(), zero.t()], -1).bfloat16().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.twice = N, twice

    def forward(self, x):
        x2 = x.reshape(-1, x.size(-1)).bfloat16()  # rounded to bfloat16 only here, as it enters
        if self.twice:
            x2 = torch.cat([x2, x2], -1)
        y = int4_mm(x2, self.packed, GROUP, self.scales_and_zeros)
        if y.size(1) != self.out_features:
            y = y[:, :self.out_features]
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def linear_of(tensors, names, bias, permute=None):
    """One Int4Linear from the GGUF tensors stacked into one of llama.py's Linears (q, k, v; gate,
    up): each part's codes, its q/k rows put back in order where `permute` says (a Llama) -> (the
    Linear, every part exact?)."""
    parts = [codes(tensors[n]) for n in names]
    if len({p[0].size(1) for p in parts}) > 1:  # Q8_0 beside another type: K' of every part 2K
        parts = [p if p[0].size(1) == 2 * int(tensors[n].shape[0]) else twice_zero(*p)
                 for p, n in zip(parts, names)]
    twice = parts[0][0].size(1) != int(tensors[names[0]].shape[0])
    if permute:
        parts = [tuple(f(t) for t in p[:3]) + (p[3],) for p, f in zip(parts, permute)]
    q, scale, zero = (torch.cat([p[i] for p in parts]) for i in range(3))
    return Int4Linear(q, scale, zero, bias, twice), all(p[3] for p in parts)


def twice_zero(q, scale, zero, exact):
    """Codes of K inputs -> of 2K, the second half contributing exactly 0 (code 8, scale 0)."""
    return (torch.cat([q, torch.full_like(q, 8)], 1), torch.cat([scale, 0 * scale], 1),
            torch.cat([zero, 0 * zero], 1), exact)


# -----------------------------------------------------------------------------
# the model


def quantized(model, f):
    """A copy of `model` (a llama.Llama imported from the GGUF f, formats/gguf.py's File) computing
    in the file's own 4-bit codes: every Linear an Int4Linear (its input rounded to bfloat16), the
    rest in the model's dtype, float32 (the embedding, the norms, the attention and its cache),
    attention by row. -> (the copy, a line saying what ran)."""
    cfg, tensors, names = model.config, f.tensors, f.names
    with torch.device("meta"):  # a new model of the same shape (a deep copy would copy the
        out = type(model)(cfg)    # float Linears' packed caches), its weights the target's
    out = out.to_empty(device="cpu").to(model.lm_head.weight.dtype)
    out.load_state_dict(model.state_dict())
    if cfg.tie_embeddings:
        out.lm_head.weight = out.transformer.wte.weight
    kinds, inexact = {}, set()
    for name, mod in list(out.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        source = names["transformer.wte.weight" if name == "lm_head" and cfg.tie_embeddings
                       else f"{name}.weight"]
        permute = None
        if f.arch == "llama" and name.endswith("c_attn"):
            heads = (cfg.n_head, cfg.n_kv_head, None)
            permute = [(lambda t, h=h: gguf.unpermute(t, h)) if h else (lambda t: t)
                       for h in heads]
        new, exact = linear_of(tensors, source, mod.bias, permute)
        if name == "lm_head":
            new.weight = mod.weight  # drafters that read the head's rows (a draft vocabulary)
        parent, _, attr = name.rpartition(".")
        setattr(out.get_submodule(parent) if parent else out, attr, new)
        for n in source:
            kinds[tensors[n].tensor_type.name] = kinds.get(tensors[n].tensor_type.name, 0) + 1
            if not exact:
                inexact.add(tensors[n].tensor_type.name)
    out.by_row = True
    what = ", ".join(f"{k} x {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    note = f"; {', '.join(sorted(inexact))} rounded to 4-bit codes" if inexact else ""
    return out.eval(), f"int4 (the GGUF's codes: {what}{note}; matmul inputs in bfloat16)"


@torch.inference_mode()
def row_invariant(model, context=24, k=8):
    """Do a verify's k + 1 rows equal k + 1 one-row decodes, bit for bit, here? (A prefill of
    `context` tokens first.) The start-up check: about one verify and k decodes of time."""
    V, dev = model.config.vocab_size, model.lm_head.weight.device
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, V, (1, context + k + 1), generator=g).to(dev)
    cache = model.new_cache()
    model(idx[:, :context], cache=cache)
    verify = model(idx[:, context:], cache=cache)[0][0]
    cache.rollback(context)
    decodes = torch.cat([model(idx[:, t:t + 1], cache=cache)[0][0]
                         for t in range(context, context + k + 1)])
    return torch.equal(verify, decodes)


# -----------------------------------------------------------------------------
# --arithmetic


def decoding_target(path, arithmetic, device="cpu", dtype=torch.float32):
    """The target as bench.py and sample.py decode with it -> (that target, its checkpoint, the
    float target, the arithmetic it computes in, the single-row matmul chosen): out/target.pt
    (runtime/target.load_target), the faster single-row matmul on this CPU
    (cpu_speed.pick_one_row), then --arithmetic (pick): on a CPU `auto` re-reads the GGUF the
    target was imported from and decodes in its own int4 codes where they give every verify row
    a one-row decode's bits and run faster here."""
    target, ckpt = load_target(path, device, dtype)
    one_row = cpu_speed.pick_one_row(target)
    decoding, computes_in = pick(target, ckpt, arithmetic, device, dtype)
    return decoding, ckpt, target, computes_in, one_row


def pick(target, ckpt, choice, device, dtype):
    """--arithmetic (float, int4 or auto) -> (the target to decode with, what it computes in). int4
    needs a target imported from a GGUF that is still there, on a CPU; auto takes it where the
    float arithmetic is the default float32 and the int4 step is the faster here. Either way a
    host whose kernels are not row-invariant keeps the float target, saying so."""
    floating = f"{str(dtype).replace('torch.', '')} (the weights dequantized)"
    source = ckpt.get("init_from") or ""
    why = None if choice == "float" else unfit(source, device, dtype, choice)
    if choice == "float" or (why and choice == "auto"):
        return target, floating
    if why:
        raise ValueError(f"--arithmetic int4 computes in a GGUF's own 4-bit codes, but {why}: "
                         "use --arithmetic float")
    q, what = quantized(target, gguf.read(source))
    if not row_invariant(q):
        print(f"note: the int4 kernels here do not give a verify's rows the bits of one-row "
              f"decodes, so speculative decoding could change the text: decoding in {floating}")
        return target, floating
    if choice == "auto" and step(q) >= step(target):
        return target, floating[:-1] + "; int4 is no faster here: --arithmetic int4 asks for it)"
    return q, what


def unfit(source, device, dtype, choice):
    """Why this target cannot decode in int4 here (None: it can)."""
    if not source.endswith(".gguf"):
        return "the target was not imported from a GGUF"
    if not os.path.isfile(source):
        return f"{source} is gone"
    if torch.device(device).type != "cpu":
        return f"it runs on a CPU, not {device}"
    if int4_mm is None:
        return "this torch has no int4 kernel"
    if choice == "auto" and dtype != torch.float32:
        return f"--dtype {str(dtype).replace('torch.', '')} was asked for"
    return None


def step(model):
    """Seconds of a one-token decode after 32 tokens (the fastest of 5)."""
    return profile_verify(model, 1, context=32, reps=5)[1]
