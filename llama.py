"""
llama.py -- the other target: the block of today's small open models (Llama, Qwen2, Qwen3,
SmolLM2), as a few changes to gpt.py's.

gpt.py is GPT-2. The models the papers measure on (DFlash and DSpark on Qwen3, EAGLE-3 on
Llama-3.1) keep its shape -- embedding, n residual blocks of attention then MLP, a final norm, an
output head -- and change five things inside it, each here as a class that replaces GPT-2's:

1. RMSNorm instead of LayerNorm: scale by the root mean square only; no mean, no bias.
2. Rotary position embeddings (RoPE) instead of a learned position table: no wpe at the input;
   each layer turns every (even, odd) pair of q and k by an angle proportional to the position,
   so q.k depends on the distance between two tokens only.
3. Grouped-query attention: fewer key/value heads than query heads (n_kv_head), each shared by a
   group of query heads, so the KV cache is smaller by n_head / n_kv_head.
4. A SwiGLU MLP: silu(x W_gate) * (x W_up), then W_down, instead of GELU(x W_fc) W_proj.
5. The family's switches: biases on q, k, v (Qwen2), an RMSNorm on each head of q and k (Qwen3),
   an output head tied to the embedding or not, a RoPE base and frequency scaling (Llama-3).

Everything else is gpt.py's, inherited: forward() with its static KV cache written at explicit
positions and rolled back, the verify of a chunk or a token tree, the hidden states of any layer.
So every drafter, the loop, trees, batching and the bench run on it unchanged. The names are
gpt.py's too (transformer.wte, transformer.h.i.attn.c_attn, ..., lm_head);
formats/hf_llama.py maps a Hugging Face folder's weights onto them, formats/gguf.py a GGUF's.

    python llama.py    # a quick self-check: cached logits == uncached logits, in float64
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from gpt import GPT, CausalSelfAttention, Layer, cache_check

# -----------------------------------------------------------------------------
# config


@dataclass
class LlamaConfig:
    sequence_len: int = 256   # the KV cache's size (RoPE itself has no limit; the model's
    #                           max_position_embeddings is the longest it was trained on)
    vocab_size: int = 4096
    n_layer: int = 6
    n_head: int = 8           # query heads
    n_kv_head: int = 4        # key/value heads: n_head / n_kv_head query heads share each
    n_embd: int = 256         # width
    head_dim: int = 32        # usually n_embd / n_head; Qwen3 sets it apart (0.6B: 1024 wide,
    #                           16 heads of 128)
    n_hidden: int = 704       # the MLP's inner width (intermediate_size)
    rope_theta: float = 10000.0     # the base of RoPE's wavelengths
    rope_scaling: dict | None = None  # None, or {"rope_type": "linear" | "llama3", "factor", ...}
    norm_eps: float = 1e-6
    qkv_bias: bool = False    # Qwen2: biases on q, k, v
    proj_bias: bool = False   # a bias on the attention's output projection (Llama's attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False     # Qwen3: RMSNorm on each head of q and k, before the rotation
    tie_embeddings: bool = False  # output head = token embedding (SmolLM2, Qwen3-0.6B)
    dropout: float = 0.0      # inherited code reads it; these models train without

    family = "llama"  # what a checkpoint's config says, so that a loader builds this class

    @property
    def bias(self):  # what a drafter built like its target asks (draft_mtp, draft_eagle): the
        return False  # family's Linears have no biases (Qwen2's on q, k and v aside)

    def to_dict(self):
        return {"family": self.family, **asdict(self)}

    @classmethod
    def from_dict(cls, d):
        d = {k: v for k, v in d.items() if k != "family"}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown Llama config fields {sorted(unknown)}")
        return cls(**d)


# -----------------------------------------------------------------------------
# 1. RMSNorm


class RMSNorm(nn.Module):

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # in float32 at least, as the family's own code computes it: half precision would lose
        # the small squares; float64 stays float64
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# -----------------------------------------------------------------------------
# 2. rotary position embeddings


def rope_frequencies(config):
    """(head_dim / 2,) angles per position, one per pair of dimensions, in float32 as the
    models were trained with: 1 / theta^(2i / head_dim), wavelengths from 2 pi to about
    2 pi theta. Llama-3 stretches the long ones by `factor` (its "llama3" scaling), blending
    smoothly between low_freq_factor and high_freq_factor; "linear" stretches all of them."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = config.rope_scaling
    if not s:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]  # the context it was pretrained at
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)  # long: stretched
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def rotation(pos, inv_freq):
    """The positions pos ((T,) or (B, T)) -> cos and sin of their angles, each (B|1, 1, T, hs):
    dimension i and i + hs/2 form a pair, turned by pos * inv_freq[i] (the "rotate half" layout
    of the family's weights). Computed once a forward (Llama.positions), for every layer."""
    angles = pos.view(-1, 1, pos.size(-1), 1).float() * inv_freq.float()  # (B|1, 1, T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """x (B, h, T, hs) turned by the angles whose cos and sin `rotation` gave (DFlash's draft
    layers, dflash_layers.py, turn theirs with it too)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def rotate_half(x):
    """(x1, x2) -> (-x2, x1), the halves of the last dimension: each pair's partner, turned."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# -----------------------------------------------------------------------------
# 3. attention with grouped K/V heads (and 5. its switches)


class Attention(CausalSelfAttention):
    """gpt.CausalSelfAttention with n_kv_head K/V heads, an optional per-head RMSNorm of q and k,
    and q and k rotated by their positions (the cos and sin Llama.positions computed). forward()
    is gpt.py's: the cache holds the rotated keys, and gpt.attention shares each K/V head among
    its group of query heads."""

    def __init__(self, config):
        nn.Module.__init__(self)  # gpt.py's __init__ builds GPT-2's projections: not these
        c, hd = config, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, hd
        if c.n_head % c.n_kv_head:
            raise ValueError(f"n_head {c.n_head} is not a multiple of n_kv_head {c.n_kv_head}")
        self.c_attn = nn.Linear(c.n_embd, (c.n_head + 2 * c.n_kv_head) * hd, bias=c.qkv_bias)
        self.c_proj = nn.Linear(c.n_head * hd, c.n_embd, bias=c.proj_bias)
        if c.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, c.norm_eps), RMSNorm(hd, c.norm_eps)
        self.resid_dropout, self.dropout = nn.Identity(), 0.0

    def heads(self, qkv, rot):
        """c_attn's output (B, T, (nh + 2 nkv) hs) -> q (B, nh, T, hs), k and v (B, nkv, T, hs)."""
        B, T, _ = qkv.size()
        hd, nh, nkv = self.head_dim, self.n_head, self.n_kv_head
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(B, T, nh, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return rotate(q, *rot), rotate(k, *rot), v


# -----------------------------------------------------------------------------
# 4. the SwiGLU MLP, and the block


class SwiGLU(nn.Module):

    def __init__(self, config):
        super().__init__()
        # gate and up in one matmul: (C) -> (2 hidden)
        self.c_fc = nn.Linear(config.n_embd, 2 * config.n_hidden, bias=config.mlp_bias)
        self.c_proj = nn.Linear(config.n_hidden, config.n_embd, bias=config.mlp_bias)

    def forward(self, x):
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up)


class Block(Layer):
    """gpt.Layer's two residual steps (x + attn(norm(x)), then x + mlp(norm(x))) with this
    file's norm, attention and MLP."""

    def __init__(self, config):
        nn.Module.__init__(self)
        self.ln_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config)
        self.ln_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config)


# -----------------------------------------------------------------------------
# the model


class Llama(GPT):
    """gpt.GPT with this file's blocks and no position table: forward, the KV cache (n_kv_head
    heads of head_dim), rollback, tree verify and hidden-state taps are gpt.py's.

        >>> model = Llama(LlamaConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=4,
        ...                           n_kv_head=2, n_embd=32, head_dim=8, n_hidden=64))
        >>> logits, _, hidden = model(torch.randint(0, 97, (1, 10)), hidden_layers=(1, 2))
    """

    def __init__(self, config):
        nn.Module.__init__(self)  # gpt.py's __init__ builds GPT-2's modules: not these
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=RMSNorm(config.n_embd, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        for module in self.modules():  # the family's initialisation (initializer_range 0.02)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)

    def _apply(self, fn, *args, **kwargs):
        """.to(), .half(), .bfloat16() move the angles but keep them float32, as the family's
        own code does: rounded to bfloat16 they would be off by radians a few thousand
        positions in."""
        super()._apply(fn, *args, **kwargs)
        self.inv_freq = rope_frequencies(self.config).to(self.inv_freq.device)
        return self

    def embed(self, idx, pos):
        """No position table: the positions enter at every layer, by rotating q and k."""
        return self.transformer.wte(idx)

    def positions(self, pos):
        """What every layer needs of the positions: the cos and sin they rotate q and k by."""
        return rotation(pos, self.inv_freq)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


# -----------------------------------------------------------------------------
# a self-check you can run by hand (the proofs, against transformers' own models, live in
# tests/test_llama.py)

if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = LlamaConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                      head_dim=8, n_hidden=64, qk_norm=True)
    err = cache_check(Llama(cfg).double().eval())
    print(f"max |cached - uncached| logit difference in float64: {err:.2e}")
