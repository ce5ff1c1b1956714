"""
runtime/cpu_speed.py -- two CPU speed tricks, applied to the lesson's models from outside.

gpt.py and the draft_*.py files build their networks from torch's own nn.Linear and compute
attention with gpt.attention. Neither is fast on a CPU where it matters here, so this file
changes both from outside, the way gpt-fast's quantize.py swaps the Linears of its model:

1. speed_up(model or drafter): every nn.Linear it holds becomes a PackedLinear, which at float32
   inference on a CPU multiplies by a copy of its weight packed for oneDNN. Why: torch's default
   CPU matmul (MKL) is slow at the few rows a verify pass has on every chip measured, and at the
   one row of a decode step on some (an AMD EPYC), while a weight packed for oneDNN is not
   (docs/experiments.md: Packed matmul for inference). The loaders and the trainer apply it to
   every model alike, the target included, so plain decoding gets the same speed-up as the
   speculative paths. The weights and their names do not change. pick_one_row(model) then times
   a one-token forward both ways on this machine and keeps the faster for single rows (where
   MKL's matrix-vector product is fast: an Intel Xeon).
2. enable(): gpt.attention's kernel, when training on a CPU, becomes one baddbmm, a softmax and
   one bmm instead of SDPA's fused kernel, which is slow to differentiate there, DFlash's masked
   shape most of all (docs/experiments.md: Training attention written out).

Both compute ordinary float32 arithmetic (no reduced precision), only with other kernels and
summation orders.
"""

import statistics
import time

import torch
import torch.nn as nn
from torch.nn import functional as F

import gpt

# -----------------------------------------------------------------------------
# PackedLinear: nn.Linear plus a faster CPU inference path


def pack_weight(weight):
    """weight (out, in) in float32 on the CPU -> the same matrix in oneDNN's own blocked layout,
    or None where this torch has no oneDNN (or the weight is anything else)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    try:
        # the layout is tuned for a verify pass's ~8 rows; a one-token step runs as fast on it,
        # so one copy serves both (docs/experiments.md: Packed matmul for inference)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
        packed_linear(weight.new_zeros(1, weight.size(1)), packed, None)  # runs here at all?
        return packed
    except (AttributeError, RuntimeError, NotImplementedError):  # a torch without oneDNN
        return None


def packed_linear(x, packed, bias):
    """F.linear(x, weight, bias) computed by oneDNN from pack_weight(weight): ordinary float32
    arithmetic (no reduced precision), only a different kernel and summation order."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """nn.Linear, except at float32 inference on a CPU, where it multiplies by a copy of its
    weight packed for oneDNN (from packed_rows rows on: a single row may do better on torch's
    path, pick_one_row). The copy is made on the first inference call and again whenever the
    weight has changed (an optimizer step, a load, a .to()): training itself never uses it."""
    packed_rows = 1  # the fewest rows multiplied by the packed copy

    def forward(self, x):
        if (torch.is_grad_enabled() or x.dtype != torch.float32
                or torch.is_autocast_enabled(x.device.type)
                or x.numel() < self.packed_rows * x.size(-1)):
            return super().forward(x)  # training, another dtype, too few rows: torch's own path
        w = self.weight
        key = (w.data_ptr(), None if w.is_inference() else w._version, w.dtype, w.device)
        if self.__dict__.get("_packed_key") != key:
            self._packed, self._packed_key = pack_weight(w), key
        if self._packed is None:
            return super().forward(x)
        return packed_linear(x, self._packed, self.bias)


def modules_of(obj):
    """The nn.Modules `obj` holds: itself if it is one, else (a drafter) its attributes that are."""
    if isinstance(obj, nn.Module):
        return [obj]
    return [m for m in vars(obj).values() if isinstance(m, nn.Module)]


def speed_up(*objs):
    """Turn every nn.Linear of these models or drafters into a PackedLinear, in place; returns the
    first. A Linear with one output column stays torch's own: there the packed product is the
    slower one (docs/experiments.md: DSpark: confidence head)."""
    for obj in objs:
        for top in modules_of(obj):
            for m in top.modules():
                if type(m) is nn.Linear and m.out_features > 1:
                    m.__class__ = PackedLinear
    return objs[0] if objs else None


def pick_one_row(model, reps=7):
    """Time `model`'s one-token forward (after a short cached context) with its Linears' packed
    copies and on torch's own path, interleaved, and keep the faster for single rows (both
    compute ordinary float32). Returns "packed" or "torch". Where nothing is packed (a GPU, another
    dtype) it changes nothing."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    dev = model.lm_head.weight.device
    if not linears or dev.type != "cpu" or model.lm_head.weight.dtype != torch.float32:
        return "packed"
    cache, ctx = model.new_cache(), min(32, model.config.sequence_len - 2)
    x = torch.zeros(1, 1, dtype=torch.long)
    times = {1: [], 2: []}
    with torch.inference_mode():
        model(torch.zeros(1, ctx, dtype=torch.long), cache=cache)
        for rep in range(reps + 1):  # the first round warms up both paths
            for rows in (1, 2) if rep % 2 else (2, 1):
                for m in linears:
                    m.packed_rows = rows
                t0 = time.perf_counter()
                model(x, cache=cache)
                times[rows].append(time.perf_counter() - t0)
                cache.rollback(ctx)
    torch_wins = statistics.median(times[2][1:]) < 0.97 * statistics.median(times[1][1:])
    for m in linears:
        m.packed_rows = 2 if torch_wins else 1
    return "torch" if torch_wins else "packed"


# -----------------------------------------------------------------------------
# attention written out, for training on a CPU


def cpu_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
    """F.scaled_dot_product_attention, except when training on a CPU (gradients on, no dropout),
    where it is written out as one baddbmm, a softmax and one bmm (SDPA's top-left is_causal)."""
    if not (q.device.type == "cpu" and torch.is_grad_enabled() and dropout_p == 0.0):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal)
    (B, nh, Tq, hs), Tk, mask = q.shape, k.size(2), attn_mask
    if is_causal:
        mask = torch.full((Tq, Tk), float("-inf"), device=q.device).triu(1)
    elif mask is None:
        mask = torch.zeros((), device=q.device)
    elif mask.dtype == torch.bool:  # which keys are visible -> the additive form
        mask = torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float("-inf"))
    bias = mask.to(q.dtype).expand(B, nh, Tq, Tk).reshape(B * nh, Tq, Tk)
    att = torch.baddbmm(bias, q.reshape(B * nh, Tq, hs), k.reshape(B * nh, Tk, hs).transpose(1, 2),
                        alpha=hs ** -0.5)  # (B * nh, Tq, Tk)
    y = att.softmax(-1).to(v.dtype) @ v.reshape(B * nh, Tk, hs)
    return y.view(B, nh, Tq, hs)


def enable():
    """Every attention of every model (gpt.attention) computed by cpu_sdpa from now on."""
    gpt.sdpa = cpu_sdpa
