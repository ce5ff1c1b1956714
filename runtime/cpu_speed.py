"""
runtime/cpu_speed.py -- two CPU speed tricks, applied to the lesson's models from outside.

gpt.py and the draft_*.py files build their networks from torch's own nn.Linear and compute
attention with gpt.attention. Neither is fast on a CPU where it matters here, so this file
changes both from outside, the way gpt-fast's quantize.py swaps the Linears of its model:

1. speed_up(model or drafter): every nn.Linear it holds becomes a PackedLinear, which at float32
   inference on a CPU multiplies by a copy of its weight packed for oneDNN. Why: torch's default
   CPU matmul (MKL) is slow at the few rows a decode step or a verify pass has, and a weight
   packed for oneDNN is not (docs/experiments.md: Packed matmul for inference). The loaders and
   the trainer apply it to every model alike, the target included, so plain decoding gets the
   same speed-up as the speculative paths. The weights and their names do not change.
2. enable(): gpt.attention's kernel, when training on a CPU, becomes one baddbmm, a softmax and
   one bmm instead of SDPA's fused kernel, which is slow to differentiate there, DFlash's masked
   shape most of all (docs/experiments.md: Training attention written out).

Both compute ordinary float32 arithmetic (no reduced precision), only with other kernels and
summation orders.
"""

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
    weight packed for oneDNN. The copy is made on the first inference call and again whenever
    the weight has changed (an optimizer step, a load, a .to()): training itself never uses it."""

    def forward(self, x):
        if (torch.is_grad_enabled() or x.dtype != torch.float32
                or torch.is_autocast_enabled(x.device.type)):
            return super().forward(x)  # training, or another dtype: torch's own path
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
