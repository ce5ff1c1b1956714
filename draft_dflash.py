"""
draft_dflash.py -- DFlash: a block-diffusion drafter that fills a whole block in ONE forward
pass.

Paper: Chen, Liang, Liu, "DFlash: Block Diffusion for Flash Speculative Decoding", ICML 2026,
arXiv 2602.06036.

draft_small.py's small drafter pays one forward per drafted token, so drafting k tokens costs
k forwards. draft_mtp.py's MTP module reads the target's last hidden state but is still chained:
one forward of its block per drafted token, each fed the token drafted before it. DFlash drafts
a whole block in one forward and reads several target layers: the anchor (the last confirmed
token) plus B-1 learned mask embeddings go through a few bidirectional layers, and every mask
slot comes out as a draft token, all from one denoising step. What makes such a shallow drafter
accurate is that it reads the target's own hidden states: several target layers ("taps") are
concatenated, projected d*n -> d and normalised into a context, and in EVERY draft layer that
context is injected as extra keys/values in front of the block ("KV injection"). Queries come
only from the block. Embedding, ln_f and LM head are the target's, frozen.

The draft layers follow the target's family (DraftLayer): for a Llama or Qwen target the
papers' (and speculators', which vLLM serves): Qwen3 decoder layers, every mask slot one mask
token's embedding, a final norm of their own. For the lesson's GPT-2 target GPT-2's, with two
departures for training in minutes: one mask embedding per block offset, and ALiBi on top of
RoPE (docs/experiments.md: DFlash: the papers' layers).

It reads in order: the config, the draft layers, the network, the Drafter (how it drafts), then
how it learns (anchors, mask, loss, narrow-then-full; training/stages_dflash.py runs it). At
inference the context is the target's states of every confirmed token BEFORE the anchor,
which enters the block at its absolute position; each draft layer caches its context K/V once
per position, and a round does only what changes (docs/experiments.md: DFlash: lean round).

    python train.py --only dflash && python sample.py --method dflash
"""

import copy
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F

from gpt import MLP, attention
from llama import LlamaConfig, RMSNorm, SwiGLU, rope_frequencies
from draft_small import total_variation
from registry.declaration import Declaration
from speculative import Drafter, head_rows, to_target_vocab

# -----------------------------------------------------------------------------
# config


@dataclass
class DFlashConfig:
    n_embd: int = 256        # must be the target's width: we use its embedding and LM head
    n_head: int = 8          # head size n_embd / n_head (32 on the CPU preset, as the target's)
    n_layer: int = 2         # draft layers; the paper uses 5 at 8B scale (3 on CUDA here)
    taps: list = field(default_factory=lambda: [1, 2, 3, 4, 5])  # target layers read (default_taps)
    block: int = 16          # trained block: anchor + block-1 masks; usable at any smaller size
    shift: int = 0           # 0: slot j predicts the token at anchor+j (DFlash: a mask predicts
    #                          itself); 1: slot j predicts anchor+j+1, so the anchor slot drafts too
    rope_base: float = 10000.0  # RoPE in the draft attention (see rope())
    arch: str = "gpt2"       # the draft layers: "gpt2" or "qwen3" (the papers'; see DraftLayer)
    alibi: bool | None = None  # ALiBi on top of RoPE (see alibi_bias()); None: "gpt2" only
    bias: bool | None = None   # like the target's Linears and LayerNorms (None: "gpt2" only)
    dropout: float = 0.0     # gpt.MLP wants it; 0 for runs this short
    # "qwen3" layers only (the target's own where it is a Llama or a Qwen; None: as GPT-2's)
    n_kv_head: int | None = None  # key/value heads, each shared by n_head / n_kv_head query heads
    head_dim: int | None = None   # None: n_embd / n_head
    n_hidden: int | None = None   # SwiGLU's inner width; None: 8/3 n_embd, rounded up to 64
    norm_eps: float = 1e-6
    rope_scaling: dict | None = None  # as llama.LlamaConfig's
    mask_token: int | None = None  # whose embedding fills every mask slot; None: the last id
    draft_vocab: int = 0     # tokens it drafts from (its d2t buffer's ids); 0: the target's

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown DFlash layers {self.arch!r}: use {' or '.join(ARCHS)}")
        gpt2 = self.arch == "gpt2"
        self.alibi = gpt2 if self.alibi is None else self.alibi
        self.bias = gpt2 if self.bias is None else self.bias
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        self.n_hidden = self.n_hidden or 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def layer_config(self):
        """The "qwen3" layers' shape as llama.py reads it (its RMSNorm, SwiGLU, RoPE angles)."""
        return LlamaConfig(n_embd=self.n_embd, n_head=self.n_head, n_kv_head=self.n_kv_head,
                           head_dim=self.head_dim, n_hidden=self.n_hidden, norm_eps=self.norm_eps,
                           rope_theta=self.rope_base, rope_scaling=self.rope_scaling, qk_norm=True)

    def to_dict(self):
        d = asdict(self)
        if not self.draft_vocab:  # as written before there was one: old checkpoints stay current
            del d["draft_vocab"]
        if self.arch == "gpt2":  # as written before there were two: old checkpoints stay current
            for name in ("arch",) + QWEN3_ONLY:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d):
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown DFlash config fields {sorted(unknown)}: "
                             "the checkpoint is not a nanospec DFlash drafter")
        return cls(**d)


ARCHS = ("gpt2", "qwen3")
QWEN3_ONLY = ("n_kv_head", "head_dim", "n_hidden", "norm_eps", "rope_scaling", "mask_token")


def default_taps(n_layer, arch="gpt2"):
    """Which target layers feed the context. The paper spreads 5 taps over 36 layers, from the
    first block to three before the last: a target deeper than 8 layers gets the same. Our own
    targets have few: every block output but the last (specialised on the *next* token, known
    at the anchor); a 2-layer one keeps both, but for "qwen3" layers (speculators.exportable)."""
    if n_layer > 8:
        return [round(1 + i * (n_layer - 4) / 4) for i in range(5)]
    return list(range(1, n_layer + (n_layer == 1 or n_layer == 2 and arch == "gpt2")))


# -----------------------------------------------------------------------------
# the draft layers: RoPE, KV-injected attention, a block


def rope_table(n, cfg, device=None):
    """cos and sin of the RoPE angles for positions 0..n-1, each (n, hs/2), in float32 (a
    bfloat16 angle would turn position 200 by the wrong amount): pair i of dimensions turns by
    base^(-2i/hs) a position; "qwen3" layers take llama.py's angles, rope scaling included."""
    hs = cfg.head_dim
    if cfg.arch == "qwen3":
        inv = rope_frequencies(cfg.layer_config()).to(device)
    else:
        inv = cfg.rope_base ** (-torch.arange(0, hs, 2, device=device, dtype=torch.float32) / hs)
    ang = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv  # (n, hs/2)
    return ang.cos(), ang.sin()


def rope(x, cos, sin):
    """Rotary position embedding (Su et al. 2021) on x (B, nh, T, hs), cos/sin rope_table's rows at
    x's positions: (T, hs/2), or (B, 1, T, hs/2). After rotation q.k depends only on the distance
    between a slot and a context position, so "slot j attends to the last few context positions"
    is one pattern at every position. Keys are rotated once, at their absolute position."""
    hs = x.size(-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :hs // 2], x[..., hs // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


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


class InjectedAttention(nn.Module):
    """Queries from the block only; keys/values = [context ; block] along the sequence axis.
    One key/value projection serves both, so context and block live in the same key space.
    "qwen3" layers add what Qwen3's attention has: n_kv_head K/V heads, each shared by a group of
    query heads (gpt.attention repeats them), and an RMSNorm on each head of q and k, before the
    rotation (the context's keys too)."""

    def __init__(self, cfg):
        super().__init__()
        nh, nkv, hs = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.c_q = nn.Linear(cfg.n_embd, nh * hs, bias=cfg.bias)
        self.c_kv = nn.Linear(cfg.n_embd, 2 * nkv * hs, bias=cfg.bias)  # keys, then values
        self.c_proj = nn.Linear(nh * hs, cfg.n_embd, bias=cfg.bias)
        if cfg.arch == "qwen3":
            self.q_norm, self.k_norm = RMSNorm(hs, cfg.norm_eps), RMSNorm(hs, cfg.norm_eps)
        self.head_dim = hs

    def heads(self, t):
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)

    def queries(self, q, cs):
        """c_q's output (B, T, nh*hs) -> queries, normed ("qwen3") and rotated, (B, nh, T, hs)."""
        q = self.heads(q)
        return rope(self.q_norm(q) if hasattr(self, "q_norm") else q, *cs)

    def keys_values(self, kv, cs):
        """c_kv's output (B, T, 2*nkv*hs) -> keys (normed, rotated to their absolute positions)
        and values, each (B, nkv, T, hs)."""
        k, v = self.heads(kv).chunk(2, dim=1)
        return rope(self.k_norm(k) if hasattr(self, "k_norm") else k, *cs), v

    def forward(self, x, cs, kv, start=None, mask=None):
        """kv = (context keys, context values). Training: start None, the block's K/V are appended
        to them. Inference (gpt-fast style): kv is a static cache whose first `start` positions
        hold the context; the block's K/V are written at start.. (overwritten next round)."""
        B, T, _ = x.shape
        q = self.queries(self.c_q(x), cs)  # (B, nh, T, hs)
        k, v = self.keys_values(self.c_kv(x), cs)
        if start is None:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)  # (B, nkv, Tc+T, hs)
        else:
            kv[0][:, :, start:start + T], kv[1][:, :, start:start + T] = k, v
            k, v = kv[0][:, :, :start + T], kv[1][:, :, :start + T]
        # mask: the ALiBi bias and/or which keys are visible; None: every key, unweighted
        y = attention(q, k, v, mask)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


def norm_of(cfg, dim):
    """A norm of the draft layers: GPT-2's LayerNorm, or (qwen3) RMSNorm."""
    return nn.LayerNorm(dim, bias=cfg.bias) if cfg.arch == "gpt2" else RMSNorm(dim, cfg.norm_eps)


class DraftLayer(nn.Module):
    """A pre-norm block: attention over [context ; block], then an MLP. Its parts are the
    target's family's: "gpt2" layers are gpt.py's (LayerNorm, GELU, biases, with ALiBi on top of
    RoPE); "qwen3" layers are the DFlash and DSpark papers' and speculators' (llama.py's RMSNorm
    and SwiGLU, per-head q/k RMSNorm, grouped K/V, no biases), which vLLM serves."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = norm_of(cfg, cfg.n_embd)
        self.attn = InjectedAttention(cfg)
        self.ln_2 = norm_of(cfg, cfg.n_embd)
        self.mlp = MLP(cfg) if cfg.arch == "gpt2" else SwiGLU(cfg.layer_config())

    def forward(self, x, cs, kv, start=None, mask=None):
        x = x + self.attn(self.ln_1(x), cs, kv, start, mask)
        return x + self.mlp(self.ln_2(x))


# -----------------------------------------------------------------------------
# the drafter network


class DFlash(nn.Module):
    """Fusion projection + mask embedding + draft layers. The target (embedding, ln_f, LM head)
    is held, not registered as a submodule: frozen, out of the optimizer and our state_dict."""

    def __init__(self, cfg, target):
        super().__init__()
        if cfg.n_embd != target.config.n_embd:
            raise ValueError(f"the drafter width ({cfg.n_embd}) must equal the target's "
                             f"({target.config.n_embd})")
        if not cfg.taps or not all(1 <= t <= target.config.n_layer for t in cfg.taps):
            raise ValueError(f"taps {cfg.taps} must be target layers in 1..{target.config.n_layer}")
        self.config = cfg
        self.__dict__["target"] = target  # plain attribute, not a submodule (see above)
        self.fc = nn.Linear(cfg.n_embd * len(cfg.taps), cfg.n_embd, bias=False)  # d*n -> d, no bias
        self.ctx_norm = norm_of(cfg, cfg.n_embd)
        if cfg.arch == "gpt2":
            # one learned mask embedding per offset, at the embeddings' scale (row norm ~1): with
            # one shared mask every slot made the same guess (experiments.md: DFlash: mask embeddings)
            self.mask_emb = nn.Parameter(torch.randn(cfg.block - 1, cfg.n_embd) /
                                         math.sqrt(cfg.n_embd))
        else:  # the papers': every mask slot is one token's embedding, the target's own, frozen
            V = target.config.vocab_size
            self.mask_token = V - 1 if cfg.mask_token is None else cfg.mask_token
            if not 0 <= self.mask_token < V:
                raise ValueError(f"mask token {self.mask_token} is not a target token (0..{V - 1})")
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg.n_layer)])
        if cfg.arch == "qwen3":
            self.norm = norm_of(cfg, cfg.n_embd)  # its own final norm before the target's LM head
        if not 0 <= cfg.draft_vocab <= target.config.vocab_size:
            raise ValueError(f"a draft vocabulary of {cfg.draft_vocab} tokens does not fit the "
                             f"target's {target.config.vocab_size}")
        if cfg.draft_vocab:  # the target ids of the tokens it drafts (its stage sets them)
            self.register_buffer("d2t", torch.arange(cfg.draft_vocab))
        for pn, p in self.named_parameters():
            if p.dim() == 2 and pn != "mask_emb":
                scale = math.sqrt(2 * cfg.n_layer) if pn.endswith("c_proj.weight") else 1
                nn.init.normal_(p, std=0.02 / scale)
            elif pn.endswith(".bias"):
                nn.init.zeros_(p)
        self._tables = {}  # position tables, built once per device and dtype (see tables())

    def tables(self, device, dtype):
        """RoPE cos/sin for every position a block can reach (float32 angles, then cast), and the
        ALiBi bias between every pair of them, (1, nh, N, N): inference slices them, never rebuilds
        them. Plain attributes, not buffers: derived, not learned."""
        key = (str(device), dtype)
        if key not in self._tables:
            cfg = self.config
            N = self.target.config.sequence_len + cfg.block
            cos, sin = rope_table(N, cfg, device)
            pos = torch.arange(N, device=device)
            # (1, nh, N, N): 4-d, as SDPA's fused CPU kernel wants it (for a 3-d mask it falls
            # back to its slower unfused path; docs/experiments.md: DFlash: lean round)
            bias = alibi_bias(pos, pos, cfg.n_head).to(dtype)[None] if cfg.alibi else None
            self._tables[key] = (cos.to(dtype), sin.to(dtype), bias)
        return self._tables[key]

    def cs(self, pos, dtype):
        """RoPE rows for positions pos ((T,) or (B, T)) -> (cos, sin), each (T, hs/2) or
        (B, 1, T, hs/2)."""
        cos, sin, _ = self.tables(pos.device, dtype)
        return (cos[pos], sin[pos]) if pos.dim() == 1 else (cos[pos][:, None], sin[pos][:, None])

    def context(self, hidden):
        """{layer: (B, T, d)} target states -> projected, normalised context (B, T, d)."""
        return self.ctx_norm(self.fc(torch.cat([hidden[t] for t in self.config.taps], dim=-1)))

    def context_kv(self, ctx, pos):
        """Every draft layer's keys/values for these context positions: [(k, v)] * n_layer."""
        cs = self.cs(pos, ctx.dtype)
        return [layer.attn.keys_values(layer.attn.c_kv(ctx), cs) for layer in self.layers]

    def block_input(self, anchors, n_slots):
        """anchors (B, A) token ids -> (B, A * n_slots, d): each anchor's embedding, then the
        masks."""
        B, A = anchors.shape
        wte = self.target.transformer.wte
        if self.config.arch == "gpt2":
            masks = self.mask_emb[:n_slots - 1]  # (n_slots-1, d)
        else:
            masks = wte(torch.full((n_slots - 1,), self.mask_token, device=anchors.device))
        masks = masks.expand(B, A, -1, -1)  # (B, A, n_slots-1, d)
        x = torch.cat([wte(anchors)[:, :, None], masks], dim=2)  # (B, A, n_slots, d)
        return x.view(B, A * n_slots, -1)

    def forward_training(self, x, pos, ctx_kvs, visible):
        """Training: blocks at positions pos (B, Tq) over context positions 0..Tc-1, each query
        seeing only the keys `visible` (B, 1, Tq, Tc + Tq) allows, ALiBi on top."""
        if self.config.alibi:
            ctx_pos = torch.arange(ctx_kvs[0][0].size(2), device=pos.device).expand(pos.size(0), -1)
            k_pos = torch.cat([ctx_pos, pos], 1)
            mask = alibi_bias(pos, k_pos, self.config.n_head, x.dtype)  # (B, nh, Tq, Tk)
        else:
            mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device)  # (B, 1, Tq, Tk)
        mask.masked_fill_(~visible, float("-inf"))  # in place: no second (B, nh, Tq, Tk) copy
        cs = self.cs(pos, x.dtype)
        for layer, ckv in zip(self.layers, ctx_kvs):
            x = layer(x, cs, ckv, None, mask)
        return x

    def forward_cached(self, x, start, kv_caches):
        """Inference: one block of T slots at positions start.. over a context of `start` cached
        positions; every slot sees every key (bidirectional block, whole context), with the
        ALiBi bias, when on, down-weighting the distant ones."""
        T = x.size(1)
        cos, sin, bias = self.tables(x.device, x.dtype)
        cs = (cos[start:start + T], sin[start:start + T])
        # (1, nh, T, start + T) ALiBi slice; None (no ALiBi): every key visible, unweighted
        mask = bias[:, :, start:start + T, :start + T] if bias is not None else None
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cs, kv, start, mask)
        return x

    def final_norm(self, h):
        """The norm before the LM head: the target's own ln_f, or ("qwen3") the drafter's."""
        return self.target.transformer.ln_f(h) if self.config.arch == "gpt2" else self.norm(h)

    def logits(self, h):
        """The target's LM head on the final norm of h -> (..., V), or only its draft
        vocabulary's rows -> (..., draft_vocab) (speculative.head_rows; docs/experiments.md: A
        real target's draft vocabulary)."""
        h, head = self.final_norm(h), self.target.lm_head.weight
        if not self.config.draft_vocab:
            return self.target.lm_head(h)
        return F.linear(h, head_rows(head, self.d2t, self._tables, h.dtype))

    def target_logits(self, h):
        """logits(h) over the target's whole vocabulary (what a Sampler drafts from)."""
        z = self.logits(h)
        if not self.config.draft_vocab:
            return z
        return to_target_vocab(z, self.d2t, self.target.config.vocab_size)


# -----------------------------------------------------------------------------
# the Drafter: one forward per round, context K/V cached per draft layer


class DFlashDrafter(Drafter):
    """propose(k): anchor + k masks at positions S-1 .. S-1+k -> k drafts in one forward. Any
    k <= block-1 works (a smaller block is just fewer masks); more than trained is an error.
    Each draft layer keeps a static K/V cache: positions 0..n_ctx-1 hold the context; a round
    writes its block's K/V after them, where the next commit overwrites them.

    A round on its own, run as written (tests/test_layout.py runs every example of the lesson):
    a tiny random target in float64, whose two layers it reads, and a block of 8.

        >>> from gpt import GPT, GPTConfig
        >>> from speculative import Sampler, generate_plain, generate_speculative
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> cfg = DFlashConfig(n_embd=32, n_head=2, taps=[1, 2], block=8)
        >>> drafter = DFlashDrafter(DFlash(cfg, target).double().eval())
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_speculative(target, drafter, prompt, 12, 4, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    name = "dflash"

    def __init__(self, net):
        self.net = net
        cfg = net.config
        self.hidden_layers = tuple(cfg.taps)
        self.max_k = cfg.block - 1 + cfg.shift
        self.default_k = self.max_k
        # sampling: acceptance falls fast by position, so a short draft pays; 3 was the best of a
        # coupled sweep (docs/experiments.md: DFlash: k)
        self.sampled_k = min(3, self.max_k)
        self.new_caches()
        p = net.fc.weight
        # every layer's c_kv stacked into one Linear, for the commit's single product (_extend). A
        # copy, taken here: a drafter is built after training, never trained itself
        c_kvs = [layer.attn.c_kv for layer in net.layers]
        self.ctx_kv = nn.Linear(cfg.n_embd, cfg.n_layer * c_kvs[0].out_features, bias=cfg.bias,
                                device=p.device, dtype=p.dtype).requires_grad_(False)
        with torch.no_grad():
            self.ctx_kv.weight.copy_(torch.cat([c.weight for c in c_kvs]))
            if cfg.bias:
                self.ctx_kv.bias.copy_(torch.cat([c.bias for c in c_kvs]))

    def new_caches(self):
        """Its own static K/V caches, (n_layer, 1, nkv, Tmax, hs): Tmax = the target's context
        window plus one block."""
        cfg, p = self.net.config, self.net.fc.weight
        Tmax = self.net.target.config.sequence_len + cfg.block
        shape = (cfg.n_layer, 1, cfg.n_kv_head, Tmax, cfg.head_dim)
        self.k_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.v_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.kv_caches = [(self.k_cache[i], self.v_cache[i]) for i in range(cfg.n_layer)]
        self.n_ctx = 0

    def fresh(self):
        c = copy.copy(self)
        c.new_caches()  # caches of its own; the weights, and the stacked ctx_kv, are shared
        return c

    def _extend(self, hidden):
        """Append the context K/V of the positions whose target states just arrived: every draft
        layer's keys and values from ONE product with the layers' c_kv weights stacked (a commit
        is a few dozen tiny ops on a CPU, so it pays to do it in one pass, not one per layer)."""
        ctx = self.net.context({t: hidden[t] for t in self.hidden_layers})[0]  # (m, d)
        n, m = self.n_ctx, ctx.size(0)
        n_layer, _, nkv, _, hs = self.k_cache.shape
        kv = self.ctx_kv(ctx).view(m, n_layer, 2, nkv, hs).permute(1, 2, 3, 0, 4)  # (L,2,nkv,m,hs)
        cos, sin, _ = self.net.tables(ctx.device, ctx.dtype)
        self.k_cache[:, 0, :, n:n + m] = rope(self.norm_keys(kv[:, 0]), cos[n:n + m], sin[n:n + m])
        self.v_cache[:, 0, :, n:n + m] = kv[:, 1]
        self.n_ctx += m

    def norm_keys(self, k):
        """The stacked keys k (n_layer, ..., hs) through each layer's per-head norm ("qwen3")."""
        if self.net.config.arch == "gpt2":
            return k
        return torch.stack([layer.attn.k_norm(k[i]) for i, layer in enumerate(self.net.layers)])

    @torch.inference_mode()
    def begin(self, tokens, hidden):
        self.seq = tokens.view(-1).clone()
        self.n_ctx = 0
        self._extend(hidden)

    def block_states(self, n_slots):
        """The anchor + (n_slots - 1) masks through the draft layers -> (n_slots, d). The anchor
        sits at position n_ctx (== S - 1: the context is every confirmed token before it)."""
        x = self.net.block_input(self.seq[-1:].view(1, 1), n_slots)
        return self.net.forward_cached(x, self.n_ctx, self.kv_caches)[0]

    def check_block(self, k):
        if not 1 <= k <= self.max_k:
            raise ValueError(f"this {self.name} drafter was trained with block "
                             f"{self.net.config.block} and drafts 1..{self.max_k} tokens per "
                             f"round, not k={k}")

    def draft_states(self, k):
        """The k block states that draft the next k tokens: slots 1..k (shift 0), or the anchor
        slot and slots 1..k-1 (shift 1) -> (k, d)."""
        shift = self.net.config.shift
        return self.block_states(k + 1 - shift)[1 - shift:]

    @torch.inference_mode()
    def propose(self, k, sampler):
        self.check_block(k)
        h = self.draft_states(k)  # (k, d)
        S = self.seq.numel()
        return sampler.draft(self.net.target_logits(h), S)

    @torch.inference_mode()
    def commit(self, n, new, hidden):
        self._extend(hidden)
        self.seq = torch.cat([self.seq, new.to(self.seq.device)])


# -----------------------------------------------------------------------------
# how it learns (1): many random anchors per sequence, each block sees only the context before
# its anchor, every block in one pass


def sample_anchors(B, T, A, block, shift, gen=None, device="cpu"):
    """(B, A) distinct anchor positions per row. An anchor a needs >= 1 context position (a >= 1;
    at inference the prompt always gives one) and its last target a+block-1+shift inside the
    window."""
    hi = T - block - shift  # largest valid anchor
    if hi < 1 or A > hi:
        raise ValueError(f"a window of {T} tokens holds at most {max(0, hi)} anchors for block "
                         f"{block}; asked for {A}")
    return (torch.rand(B, hi, generator=gen).argsort(dim=1)[:, :A] + 1).to(device)


def training_mask(anchors, T, block):
    """(B, 1, A*block, T + A*block) boolean attention mask, True = may attend. A query in the
    block of anchor a sees context position i iff i < a: the context is the target's states of
    the tokens BEFORE the anchor (the anchor's own state is not known at inference: it is the
    first input of the next verify). It sees every slot of its own block (bidirectional) and
    no slot of any other block."""
    B, A = anchors.shape
    anchor_of = anchors.repeat_interleave(block, dim=1)  # (B, A*block): the anchor of each query
    ctx_ok = torch.arange(T, device=anchors.device) < anchor_of[..., None]  # (B, A*block, T)
    blk = torch.arange(A, device=anchors.device).repeat_interleave(block)
    blk_ok = (blk[:, None] == blk[None, :]).expand(B, -1, -1)  # (B, A*block, A*block)
    return torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]


def training_states(net, x, hidden, anchors, block=None):
    """Draft-layer outputs for every prediction of every anchor's block, all in one pass.
    x (B, T) tokens, hidden {layer: (B, T, d)} the target's states on x, anchors (B, A); block:
    the slots a block has (default: the network's own; fewer train only its first slots).
    Returns h (B, A, P, d) and the positions they predict (B, A, P): prediction i targets the
    token at anchor + 1 + i, read from slot i + 1 - shift."""
    cfg = net.config
    B, T = x.shape
    A, blk = anchors.size(1), block or cfg.block
    ctx_kvs = net.context_kv(net.context(hidden), torch.arange(T, device=x.device))
    pos = (anchors[..., None] + torch.arange(blk, device=x.device)).view(B, A * blk)
    x_blocks = net.block_input(x.gather(1, anchors), blk)  # (B, A * blk, d)
    h = net.forward_training(x_blocks, pos, ctx_kvs, training_mask(anchors, T, blk))
    P = blk - 1 + cfg.shift
    h = h.view(B, A, blk, -1)[:, :, 1 - cfg.shift:]
    return h, anchors[..., None] + 1 + torch.arange(P, device=x.device)


def position_weights(P, gamma, device=None):
    """w_j = exp(-(j-1)/gamma): early positions matter most, a miss there ends the round."""
    return torch.exp(-torch.arange(P, device=device, dtype=torch.float32) / gamma)


def soft_labels(t_logits, tpos):
    """The target's distribution for the token at each position tpos (B, A, P): the target's
    logits at tpos - 1, as computed on the training text. -> (B, A, P, V)."""
    b = torch.arange(t_logits.size(0), device=t_logits.device)[:, None, None]
    return F.softmax(t_logits[b, tpos - 1].float(), dim=-1)


def dflash_loss(net, x, hidden, t_logits, anchors, gamma):
    """Position-weighted cross-entropy against the target's own distributions (soft labels),
    plus their total variation distance (draft_small.total_variation: why). The paper's loss is
    the cross-entropy alone; adding TV drafted better (docs/experiments.md: DFlash: loss
    (CE + TV)). With a draft vocabulary t_logits are the target's over it, (B, T, draft_vocab):
    its distribution renormalised there, as EAGLE-3 trains."""
    h, tpos = training_states(net, x, hidden, anchors)
    logp = F.log_softmax(net.logits(h).float(), dim=-1)  # (B, A, P, V)
    p_t = soft_labels(t_logits, tpos)
    loss = -(p_t * logp).sum(-1) + total_variation(logp, p_t)  # (B, A, P)
    w = position_weights(loss.size(-1), gamma, loss.device)
    return (loss * w).sum(-1).mean() / w.sum()


# -----------------------------------------------------------------------------
# how it learns (2): a narrow block first, then the full block
#
# The first slots decide whether a round goes on at all; trained at block 16 from the start, the
# first slot stayed worse than a block-8 network's (docs/experiments.md: DFlash: narrow block
# first). So block 8 trains first, then block 16 from it, widened: widen(DFlash(cfg, target),
# net.state_dict()). DSpark starts from this same training, part-way (draft_dspark.py).


def widen(net, state_dict):
    """Load into the DFlash network `net` the weights of one trained at its block or a narrower
    one: offsets 1..b-1 of the mask embeddings take the narrower network's, the later ones keep
    their init. ("qwen3" networks have no mask embeddings of their own: the same at any block.)"""
    sd = dict(state_dict)
    if "mask_emb" not in sd:
        return net.load_state_dict(sd)
    m, own = sd["mask_emb"], net.mask_emb.detach()
    if m.size(0) > own.size(0):
        raise ValueError(f"a block-{m.size(0) + 1} DFlash does not fit a block-"
                         f"{own.size(0) + 1} one")
    sd["mask_emb"] = torch.cat([m.to(own), own[m.size(0):]])
    net.load_state_dict(sd)


# -----------------------------------------------------------------------------
# declared once: what the house reads of this file (registry/drafters.py lists it; how it learns
# in train.py, its stage, is training/stages_dflash.py)

DRAFTER = Declaration(
    name="dflash",
    network=lambda config, target: DFlash(DFlashConfig.from_dict(config), target),
    drafter=lambda net, target: DFlashDrafter(net),
    pairs=True, trees=True,
)
