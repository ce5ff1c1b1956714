"""
dflash_layers.py -- DFlash's draft layers: attention whose keys and values are [context ; block],
in two families, the lesson's GPT-2 layers and the papers' Qwen3 layers.

draft_dflash.py (read it next) builds its drafter network from these: a few pre-norm layers over
the block (the anchor and its masks), every one of which also attends to the target's states
before the anchor, projected into its own keys and values ("KV injection"). Which parts the layers
are made of follows the target's family, and is chosen once, where the network is built (FAMILIES,
by the config's `arch`); each family is the same set of parts under the same names:

    layer          a draft layer: layer(x, cs, kv, rows, mask) -> the block's states
    norm           the norm of the context (and of the layers' input to their attention and MLP)
    inv_freq       the RoPE angle of each pair of dimensions, per position
    build(net)     the network's own modules of this family, in their order
    masks          what fills the block's mask slots
    final_norm     the norm before the target's LM head
    features       the state a head on the block reads (DSpark's confidence head, draft_dspark.py)
    norm_keys      the context's keys through each layer's per-head norm, if the family has one

GPT2Layers, for the lesson's GPT-2 target: gpt.py's LayerNorm and GELU MLP with biases, RoPE with
ALiBi on top, one learned embedding per mask slot, the target's ln_f before its head; two
departures from the papers for training in minutes (docs/experiments.md: DFlash: the papers'
layers). Qwen3Layers, for a Llama or Qwen target: the DFlash and DSpark papers' and speculators'
(which vLLM serves): llama.py's RMSNorm, SwiGLU and rotation, an RMSNorm on each head of q and k,
grouped K/V heads, no biases, every mask slot one token's embedding, a final norm of their own.
The rotation and the norms are llama.py's, written once.
"""

import math

import torch
import torch.nn as nn

from gpt import MLP, attention
from llama import LlamaConfig, RMSNorm, SwiGLU, rope_frequencies, rotate

# -----------------------------------------------------------------------------
# what both families share: attention over [context ; block], and ALiBi


def alibi_bias(q_pos, k_pos, n_head, dtype=torch.float32):
    """ALiBi (Press et al. 2022): score -= m_h * |distance|, slopes m_h = 2^(-8h/nh), queries at
    q_pos (..., Tq), keys at k_pos (..., Tk) -> (..., nh, Tq, Tk): a recency prior from step 0,
    where uniform attention drowned the last states before the anchor (docs/experiments.md:
    DFlash: ALiBi). A step's largest tensor: distances are one float tensor, only the result per
    head."""
    wide = torch.promote_types(dtype, torch.float32)  # positions and distances exact (< 2^24)
    dist = (q_pos.to(wide)[..., :, None] - k_pos.to(wide)[..., None, :]).abs_()  # (..., Tq, Tk)
    slopes = 2.0 ** (-8.0 * torch.arange(1, n_head + 1, device=q_pos.device, dtype=wide) / n_head)
    return (-slopes.view(n_head, 1, 1) * dist[..., None, :, :]).to(dtype)


def turn(x, cs):
    """x (B, h, T, hs) rotated by its positions' cs (llama.rotate), laid out as (B, h, T, hs): the
    attention's operand, which its kernel, and the gradient's sums in training, read in order."""
    return rotate(x, *cs).contiguous()


class InjectedAttention(nn.Module):
    """Queries from the block only; keys/values = [context ; block] along the sequence axis.
    One key/value projection serves both, so context and block live in the same key space. q and
    k are turned by their positions (turn: RoPE, Su et al. 2021): after rotation q.k
    depends only on the distance between a slot and a context position, so "slot j attends to the
    last few context positions" is one pattern at every position. Keys are rotated once, at their
    absolute position; cs = (cos, sin) of the positions (DFlash.cs), (T, hs) or (B, 1, T, hs)."""

    def __init__(self, cfg):
        super().__init__()
        nh, nkv, hs = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.c_q = nn.Linear(cfg.n_embd, nh * hs, bias=cfg.bias)
        self.c_kv = nn.Linear(cfg.n_embd, 2 * nkv * hs, bias=cfg.bias)  # keys, then values
        self.c_proj = nn.Linear(nh * hs, cfg.n_embd, bias=cfg.bias)
        self.head_dim = hs

    def heads(self, t):
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)

    def queries(self, q, cs):
        """c_q's output (B, T, nh*hs) -> queries, rotated, (B, nh, T, hs)."""
        return turn(self.heads(q), cs)

    def keys_values(self, kv, cs):
        """c_kv's output (B, T, 2*nkv*hs) -> keys (rotated to their absolute positions) and
        values, each (B, nkv, T, hs)."""
        k, v = self.heads(kv).chunk(2, dim=1)
        return turn(k, cs), v

    def forward(self, x, cs, kv, rows=None, mask=None):
        """kv = (context keys, context values). Training (rows None): x (B, T, d), the block's K/V
        appended to them. Inference (gpt-fast style), rows a ragged.Ragged: kv is a static cache
        whose first positions of each row hold its context; each row's block K/V are written at
        its positions after them (overwritten next round), and x is every row's real slots
        packed, (N, d), so that the projections run on those only.
        mask: the ALiBi bias and/or which keys are visible; None: every key, unweighted."""
        if rows is None:
            B, T, _ = x.shape
            q = self.queries(self.c_q(x), cs)  # (B, nh, T, hs)
            k, v = self.keys_values(self.c_kv(x), cs)
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)  # (B, nkv, Tc+T, hs)
            y = attention(q, k, v, mask)  # (B, nh, T, hs)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))
        q = self.queries(rows.unpack(self.c_q(x)), cs)  # (B, nh, T, hs)
        k, v = self.keys_values(rows.unpack(self.c_kv(x)), cs)  # (B, nkv, T, hs)
        k, v = rows.write(kv[0], k), rows.write(kv[1], v)  # (B, nkv, L, hs): context and block
        y = attention(q, k, v, mask)
        B, nh, T, hs = y.shape
        return self.c_proj(rows.pack(y.transpose(1, 2).reshape(B, T, nh * hs)))


# -----------------------------------------------------------------------------
# the lesson's GPT-2 layers


class DraftLayer(nn.Module):
    """A pre-norm block: attention over [context ; block], then an MLP; gpt.py's parts (LayerNorm,
    GELU, biases)."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = InjectedAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, cs, kv, rows=None, mask=None):
        x = x + self.attn(self.ln_1(x), cs, kv, rows, mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Layers:
    """The draft layers of the lesson's GPT-2 target (the family's parts: the module docstring)."""
    alibi = bias = True  # the config's defaults for these layers

    def __init__(self, cfg):
        self.cfg = cfg

    def layer(self):
        return DraftLayer(self.cfg)

    def norm(self):
        return nn.LayerNorm(self.cfg.n_embd, bias=self.cfg.bias)

    def inv_freq(self, device):
        """rope_base^(-2i/hs) for pair i, in float32 (a bfloat16 angle would turn position 200 by
        the wrong amount)."""
        hs = self.cfg.head_dim
        return self.cfg.rope_base ** (-torch.arange(0, hs, 2, device=device,
                                                    dtype=torch.float32) / hs)

    def build(self, net, target):
        cfg = self.cfg
        net.ctx_norm = self.norm()
        # one learned mask embedding per offset, at the embeddings' scale (row norm ~1): with one
        # shared mask every slot made the same guess (docs/experiments.md: DFlash: mask embeddings)
        net.mask_emb = nn.Parameter(torch.randn(cfg.block - 1, cfg.n_embd) / math.sqrt(cfg.n_embd))
        net.layers = nn.ModuleList([self.layer() for _ in range(cfg.n_layer)])

    def masks(self, net, n, device):
        """The first n mask slots' inputs, (n, d): their own embeddings."""
        return net.mask_emb[:n]

    def final_norm(self, net, h):
        return net.target.transformer.ln_f(h)

    def features(self, net, h):
        """h as the layers leave it."""
        return h

    def norm_keys(self, net, k):
        """The stacked context keys k (n_layer, ..., hs), as they are: no per-head norm."""
        return k


# -----------------------------------------------------------------------------
# the papers' Qwen3 layers: llama.py's parts


def llama_config(cfg):
    """The Qwen3 layers' shape as llama.py reads it (its RMSNorm, SwiGLU, RoPE angles)."""
    return LlamaConfig(n_embd=cfg.n_embd, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                       head_dim=cfg.head_dim, n_hidden=cfg.n_hidden, norm_eps=cfg.norm_eps,
                       rope_theta=cfg.rope_base, rope_scaling=cfg.rope_scaling, qk_norm=True)


class Qwen3Attention(InjectedAttention):
    """InjectedAttention with what Qwen3's attention adds: n_kv_head K/V heads, each shared by a
    group of query heads (gpt.attention repeats them), and llama.py's RMSNorm on each head of q
    and k, before the rotation (the context's keys too)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        hs, eps = cfg.head_dim, cfg.norm_eps
        self.q_norm, self.k_norm = RMSNorm(hs, eps), RMSNorm(hs, eps)

    def queries(self, q, cs):
        return turn(self.q_norm(self.heads(q)), cs)

    def keys_values(self, kv, cs):
        k, v = self.heads(kv).chunk(2, dim=1)
        return turn(self.k_norm(k), cs), v


class Qwen3Layer(DraftLayer):
    """DraftLayer's two residual steps with llama.py's RMSNorm and SwiGLU around Qwen3Attention."""

    def __init__(self, cfg):
        nn.Module.__init__(self)  # DraftLayer's __init__ builds GPT-2's parts: not these
        self.ln_1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Qwen3Attention(cfg)
        self.ln_2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(llama_config(cfg))


class Qwen3Layers:
    """The papers' draft layers (the family's parts: the module docstring)."""
    alibi = bias = False

    def __init__(self, cfg):
        self.cfg = cfg

    def layer(self):
        return Qwen3Layer(self.cfg)

    def norm(self):
        return RMSNorm(self.cfg.n_embd, self.cfg.norm_eps)

    def inv_freq(self, device):
        """llama.py's angles, rope scaling included."""
        return rope_frequencies(llama_config(self.cfg)).to(device)

    def build(self, net, target):
        cfg, V = self.cfg, target.config.vocab_size
        net.ctx_norm = self.norm()
        # every mask slot is one token's embedding, the target's own, frozen
        net.mask_token = V - 1 if cfg.mask_token is None else cfg.mask_token
        if not 0 <= net.mask_token < V:
            raise ValueError(f"mask token {net.mask_token} is not a target token (0..{V - 1})")
        net.layers = nn.ModuleList([self.layer() for _ in range(cfg.n_layer)])
        net.norm = self.norm()  # its own final norm before the target's LM head

    def masks(self, net, n, device):
        """The first n mask slots' inputs, (n, d): the mask token's embedding, n times."""
        return net.target.transformer.wte(torch.full((n,), net.mask_token, device=device))

    def final_norm(self, net, h):
        return net.norm(h)

    def features(self, net, h):
        """h after the final norm, as speculators' DSpark reads it."""
        return net.norm(h)

    def norm_keys(self, net, k):
        """The stacked context keys k (n_layer, ..., hs) through each layer's k_norm."""
        return torch.stack([layer.attn.k_norm(k[i]) for i, layer in enumerate(net.layers)])


FAMILIES = {"gpt2": GPT2Layers, "qwen3": Qwen3Layers}  # the config's `arch` -> its layers
