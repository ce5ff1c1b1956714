"""
draft_dflash.py -- DFlash: a block-diffusion drafter that fills a whole block in ONE forward
pass.

Paper: Chen, Liang, Liu, "DFlash: Block Diffusion for Flash Speculative Decoding", ICML 2026,
arXiv 2602.06036.

speculative.py's small drafter pays one forward per drafted token, so drafting k tokens costs
k forwards. draft_mtp.py's MTP head reads the target's last hidden state but is still chained:
one forward of its block per drafted token, each fed the token drafted before it. DFlash drafts
a whole block in one forward and reads several target layers: the anchor (the last confirmed
token) plus B-1 learned mask embeddings go through a few bidirectional layers, and every mask
slot comes out as a draft token, all from one denoising step. What makes such a shallow drafter
accurate is that it reads the target's own hidden states: several target layers ("taps") are
concatenated, projected d*n -> d and normalised into a context, and in EVERY draft layer that
context is injected as extra keys/values in front of the block ("KV injection"). Queries come
only from the block. Embedding, ln_f and LM head are the target's, frozen.

Three departures from the paper, all because we train for minutes, not GPU-days (see
DFlash.__init__, alibi_bias and the recipe at "how it learns (2)"): one mask embedding per block
offset instead of one shared mask, an ALiBi distance penalty on top of RoPE, and a narrow block
first: block 8, then widened to 16, which keeps the first slot as good as block 8's.

The file reads in order: the config, the draft layers, the network, the Drafter (how it drafts),
then how it learns: anchors and the training mask, the loss, and the stage train.py runs.

Bookkeeping at inference: the context is the target's hidden states of every confirmed token
BEFORE the anchor t*; t* itself enters the block as a token at its absolute position. Each draft
layer keeps its context K/V in a static cache: computed once per position, appended at commit,
never recomputed (the target's states of a position never change).

Cost. On a small CPU target a drafter pays per ATen call, not per FLOP, so a round does only
what changes: RoPE angles and ALiBi biases are tables built once and sliced; the block's K/V go
into the cache after the context (no concatenation), and the LM head runs on the draft slots
only (docs/experiments.md: DFlash: lean round).

    python train.py --only dflash && python speculative.py --method dflash
"""

import copy
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F

from gpt import MLP, Linear, Packing, Ragged, attention
from gpt import cpu_state_dict, number, save_checkpoint, setting
from draft_small import total_variation
from batched import BatchDrafter, Confirmed
from speculative import Drafter

# -----------------------------------------------------------------------------
# config


@dataclass
class DFlashConfig:
    n_embd: int = 256        # must be the target's width: we use its embedding and LM head
    n_head: int = 8          # head size n_embd / n_head (32 on the CPU preset, as the target's)
    n_layer: int = 2         # draft layers; the paper uses 5 at 8B scale (SETTINGS: 2 on CPU, 3
    #                          on CUDA, to fit their budgets)
    # target layers read as context (network_config picks them with default_taps)
    taps: list = field(default_factory=lambda: [1, 2, 3, 4, 5])
    block: int = 16          # trained block: anchor + block-1 masks; usable at any smaller size
    #                          (the paper's 16; the CPU preset trains block 8 first, then widens
    #                          to 16: load_narrower)
    shift: int = 0           # 0: slot j predicts the token at anchor+j (DFlash: a mask predicts
    #                          itself); 1: slot j predicts anchor+j+1, so the anchor slot drafts too
    rope_base: float = 10000.0  # RoPE in the draft attention (see rope())
    alibi: bool = True       # plus a per-head distance penalty on the scores (see alibi_bias())
    bias: bool = True        # like the target's Linears and LayerNorms
    dropout: float = 0.0     # gpt.MLP wants it; 0 for runs this short

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown DFlash config fields {sorted(unknown)}: "
                             "the checkpoint is not a nanospec DFlash drafter")
        return cls(**d)


def default_taps(n_layer):
    """Which target layers feed the context. The paper spreads 5 taps from the 2nd layer to the
    third-to-last of 36. Our targets have far fewer (6 on the CPU preset, 8 on CUDA), so we
    take every block output but the last (1..n_layer-1): the last block is specialised on
    predicting the *next* token, which at the anchor we already know; the shallower ones still
    carry what the sequence is about. With a tiny 2-layer target that leaves [1], so we keep both
    there."""
    return list(range(1, n_layer)) if n_layer > 2 else list(range(1, n_layer + 1))


# -----------------------------------------------------------------------------
# the draft layers: RoPE, KV-injected attention, a block


def rope_table(n, hs, base, device=None):
    """cos and sin of the RoPE angles for positions 0..n-1, each (n, hs/2), in float32: built
    once (a bfloat16 angle would turn position 200 by the wrong amount)."""
    inv = base ** (-torch.arange(0, hs, 2, device=device, dtype=torch.float32) / hs)  # (hs/2,)
    ang = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv  # (n, hs/2)
    return ang.cos(), ang.sin()


def rope(x, cos, sin):
    """Rotary position embedding (Su et al. 2021) on x (B, nh, T, hs), with cos/sin the rows of
    rope_table at x's positions: (T, hs/2), or (B, 1, T, hs/2) when rows differ. Why RoPE and not
    the target's wpe: after rotation q.k depends only on the distance between a block slot and a
    context position, so "slot j, j tokens after the anchor, attends to the last few context
    positions" is the same pattern at every position. Keys are rotated once, at their absolute
    position, and cached that way."""
    hs = x.size(-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :hs // 2], x[..., hs // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def alibi_bias(q_pos, k_pos, n_head, dtype=torch.float32):
    """ALiBi (Press et al. 2022): score -= m_h * |distance|, slopes m_h = 2^(-8h/nh), for queries
    at q_pos (..., Tq) and keys at k_pos (..., Tk) -> (..., nh, Tq, Tk). Why: at init the queries
    and keys are near zero, so attention is uniform over the whole context and the few states
    that matter (the last ones before the anchor) are drowned, and learning starts slowly
    (docs/experiments.md: DFlash: ALiBi). The bias gives some
    heads a recency prior from step 0; heads with small slopes stay global.
    Memory: in training this is (batch, nh, Tq, Tk), the largest tensor of a DFlash step, so the
    distances are made in one float tensor (no int64 copies) and only the result is per head."""
    wide = torch.promote_types(dtype, torch.float32)  # positions and distances exact (< 2^24)
    dist = (q_pos.to(wide)[..., :, None] - k_pos.to(wide)[..., None, :]).abs_()  # (..., Tq, Tk)
    slopes = 2.0 ** (-8.0 * torch.arange(1, n_head + 1, device=q_pos.device, dtype=wide) / n_head)
    return (-slopes.view(n_head, 1, 1) * dist[..., None, :, :]).to(dtype)


class InjectedAttention(nn.Module):
    """Queries from the block only; keys/values = [context ; block] along the sequence axis.
    One key/value projection serves both, so context and block live in the same key space."""

    def __init__(self, cfg):
        super().__init__()
        self.c_q = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_kv = Linear(cfg.n_embd, 2 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head

    def heads(self, t):
        B, T, C = t.shape
        return t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

    def kv(self, x, cs):
        """(B, T, C) -> keys (rotated to their absolute positions) and values, (B, nh, T, hs)."""
        k, v = self.c_kv(x).split(x.size(-1), dim=2)
        return rope(self.heads(k), *cs), self.heads(v)

    def forward(self, x, cs, kv, start=None, mask=None):
        """kv = (context keys, context values). Training: start None, the block's own K/V are
        concatenated after them. Inference (gpt-fast style): kv is a static cache whose first
        `start` positions hold the context; the block's K/V are written at start.. (stale past
        the context, overwritten next round) and the prefix is attended to, with no copy."""
        if isinstance(start, Ragged):  # a batch of rows, each at its own position (batched.py)
            return self.forward_ragged(x, cs, kv, start, mask)
        B, T, C = x.shape
        q = rope(self.heads(self.c_q(x)), *cs)  # (B, nh, T, hs)
        k, v = self.kv(x, cs)
        if start is None:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)  # (B, nh, Tc + T, hs)
        else:
            kv[0][:, :, start:start + T], kv[1][:, :, start:start + T] = k, v
            k, v = kv[0][:, :, :start + T], kv[1][:, :, :start + T]
        # mask: the ALiBi bias and/or which keys are visible; None: every key, unweighted
        y = attention(q, k, v, mask)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward_ragged(self, x, cs, kv, rag, mask):
        """x: the real slots packed (N, C), or (B, T, C) with no padding. The projections run on
        the packed rows, the attention on the padded (B, nh, T, hs); K/V written per row."""
        q = rope(self.heads(rag.unpack(self.c_q(x))), *cs)  # (B, nh, T, hs)
        k, v = rag.unpack(self.c_kv(x)).split(x.size(-1), dim=2)
        k, v = rag.write(kv[0], rope(self.heads(k), *cs)), rag.write(kv[1], self.heads(v))
        y = attention(q, k, v, mask)  # (B, nh, T, hs)
        B, nh, T, hs = y.shape
        return self.c_proj(rag.pack(y.transpose(1, 2).reshape(B, T, nh * hs)))


class DraftLayer(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = InjectedAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, cs, kv, start=None, mask=None):
        x = x + self.attn(self.ln_1(x), cs, kv, start, mask)
        return x + self.mlp(self.ln_2(x))


# -----------------------------------------------------------------------------
# the drafter network


class DFlash(nn.Module):
    """Fusion projection + mask embedding + draft layers. The target (embedding, ln_f, LM head)
    is held but not registered as a submodule: its weights stay frozen, out of the optimizer and
    out of our state_dict."""

    def __init__(self, cfg, target):
        super().__init__()
        if cfg.n_embd != target.config.n_embd:
            raise ValueError(f"the drafter width ({cfg.n_embd}) must equal the target's "
                             f"({target.config.n_embd})")
        if not cfg.taps or not all(1 <= t <= target.config.n_layer for t in cfg.taps):
            raise ValueError(f"taps {cfg.taps} must be target layers in 1..{target.config.n_layer}")
        self.config = cfg
        self.__dict__["target"] = target  # plain attribute, not a submodule (see above)
        self.fc = Linear(cfg.n_embd * len(cfg.taps), cfg.n_embd, bias=False)  # d*n -> d, no bias
        self.ctx_norm = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        # one learned mask embedding per block offset 1..block-1. A single shared mask (the paper's)
        # leaves RoPE as the only thing telling slot 3 from slot 9; in our few hundred training
        # steps every slot then made one and the same guess. Initialised at the scale of the
        # target's token embeddings (row norm ~1): at 0.02 the slot identity drowned in the
        # attention output, and the slots still collapsed (docs/experiments.md: DFlash: mask
        # embeddings).
        self.mask_emb = nn.Parameter(torch.randn(cfg.block - 1, cfg.n_embd) / math.sqrt(cfg.n_embd))
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg.n_layer)])
        for pn, p in self.named_parameters():
            if p.dim() == 2 and pn != "mask_emb":
                scale = math.sqrt(2 * cfg.n_layer) if pn.endswith("c_proj.weight") else 1
                nn.init.normal_(p, std=0.02 / scale)
            elif pn.endswith(".bias"):
                nn.init.zeros_(p)
        self._tables = {}  # position tables, built once per device and dtype (see tables())

    def load_narrower(self, state_dict):
        """Load a DFlash trained at this block or a narrower one (the narrow phase). Every
        weight has the same shape at any block but the mask embeddings, one per block offset:
        offsets 1..b-1 take the narrower network's, the later ones keep their initialisation."""
        sd = dict(state_dict)
        m, own = sd["mask_emb"], self.mask_emb.detach()
        if m.size(0) > own.size(0):
            raise ValueError(f"a block-{m.size(0) + 1} DFlash does not fit a block-"
                             f"{own.size(0) + 1} one")
        sd["mask_emb"] = torch.cat([m.to(own), own[m.size(0):]])
        self.load_state_dict(sd)

    def tables(self, device, dtype):
        """RoPE cos/sin for every position a block can reach (float32 angles, then cast), and the
        ALiBi bias between every pair of such positions, (1, nh, N, N): inference slices them, never
        rebuilds them. Plain attributes, not buffers: they are derived, not learned."""
        key = (str(device), dtype)
        if key not in self._tables:
            cfg = self.config
            N = self.target.config.block_size + cfg.block
            cos, sin = rope_table(N, cfg.n_embd // cfg.n_head, cfg.rope_base, device)
            pos = torch.arange(N, device=device)
            # (1, nh, N, N): SDPA takes its fused CPU kernel for a 4-d mask and falls back to
            # the unfused math path, about 1.7x slower per call here, for a 3-d one
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
        return [layer.attn.kv(ctx, cs) for layer in self.layers]

    def block_input(self, anchors, n_slots):
        """anchors (B, A) token ids -> (B, A * n_slots, d): each anchor's embedding, then the
        masks."""
        B, A = anchors.shape
        masks = self.mask_emb[:n_slots - 1].expand(B, A, -1, -1)  # (B, A, n_slots-1, d)
        anchor_emb = self.target.transformer.wte(anchors)[:, :, None]  # (B, A, 1, d)
        x = torch.cat([anchor_emb, masks], dim=2)  # (B, A, n_slots, d)
        return x.view(B, A * n_slots, -1)

    def run(self, x, pos, ctx_kvs, visible):
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

    def run_cached(self, x, start, kv_caches):
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

    def head(self, h):
        """The target's own ln_f and LM head."""
        return self.target.lm_head(self.target.transformer.ln_f(h))


# -----------------------------------------------------------------------------
# the Drafter: one forward per round, context K/V cached per draft layer


class DFlashDrafter(Drafter):
    """propose(k): anchor + k masks at positions S-1 .. S-1+k -> k drafts in one forward. Any
    k <= block-1 works (a smaller block is just fewer masks); more than trained is an error.
    Each draft layer keeps a static K/V cache: positions 0..n_ctx-1 hold the context (computed
    once per position at commit, never again: the target's states of a position never change);
    a round writes its block's K/V after them, where the next commit overwrites them."""
    name = "dflash"

    def __init__(self, net):
        self.net = net
        cfg, tcfg = net.config, net.target.config
        self.hidden_layers = tuple(cfg.taps)
        self.max_k = cfg.block - 1 + cfg.shift
        self.default_k = self.max_k
        # sampling: acceptance falls fast by position, so a short draft pays; 3 was the best of a
        # coupled sweep (docs/experiments.md: DFlash: k)
        self.sampled_k = min(3, self.max_k)
        self.new_caches()
        p = net.fc.weight
        # every layer's c_kv stacked into one Linear, for the commit's single product (a commit is
        # a few dozen tiny ops on a CPU: one product pays, not one per layer). A copy, taken here:
        # a drafter is built after training, never trained itself
        c_kvs = [layer.attn.c_kv for layer in net.layers]
        self.ctx_kv = Linear(cfg.n_embd, cfg.n_layer * 2 * cfg.n_embd, bias=cfg.bias,
                             device=p.device, dtype=p.dtype).requires_grad_(False)
        with torch.no_grad():
            self.ctx_kv.weight.copy_(torch.cat([c.weight for c in c_kvs]))
            if cfg.bias:
                self.ctx_kv.bias.copy_(torch.cat([c.bias for c in c_kvs]))

    def new_caches(self):
        """Its own static K/V caches, (n_layer, 1, nh, Tmax, hs): Tmax = the target's context
        window plus one block."""
        cfg, p = self.net.config, self.net.fc.weight
        shape = (cfg.n_layer, 1, cfg.n_head, self.net.target.config.block_size + cfg.block,
                 cfg.n_embd // cfg.n_head)
        self.k_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.v_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.kv_caches = [(self.k_cache[i], self.v_cache[i]) for i in range(cfg.n_layer)]
        self.n_ctx = 0

    def fresh(self):
        c = copy.copy(self)
        c.new_caches()
        return c

    def batched(self):
        return BatchDFlash(self)

    def _extend(self, hidden):
        """Append the context K/V of the positions whose target states just arrived: every draft
        layer's keys and values from ONE product with the layers' c_kv weights stacked (a commit
        is a few dozen tiny ops on a CPU, so it pays to do it in one pass, not one per layer)."""
        ctx = self.net.context({t: hidden[t] for t in self.hidden_layers})[0]  # (m, d)
        n, m = self.n_ctx, ctx.size(0)
        n_layer, _, nh, _, hs = self.k_cache.shape
        kv = self.ctx_kv(ctx).view(m, n_layer, 2, nh, hs)
        kv = kv.permute(1, 2, 3, 0, 4)  # (n_layer, 2, nh, m, hs)
        cos, sin, _ = self.net.tables(ctx.device, ctx.dtype)
        self.k_cache[:, 0, :, n:n + m] = rope(kv[:, 0], cos[n:n + m], sin[n:n + m])
        self.v_cache[:, 0, :, n:n + m] = kv[:, 1]
        self.n_ctx += m

    @torch.inference_mode()
    def begin(self, tokens, hidden):
        self.seq = tokens.view(-1).clone()
        self.n_ctx = 0
        self._extend(hidden)

    def cached_block_states(self, n_slots):
        """The anchor + (n_slots - 1) masks through the draft layers -> (n_slots, d). The anchor
        sits at position n_ctx (== S - 1: the context is every confirmed token before it)."""
        x = self.net.block_input(self.seq[-1:].view(1, 1), n_slots)
        return self.net.run_cached(x, self.n_ctx, self.kv_caches)[0]

    def check_k(self, k):
        if not 1 <= k <= self.max_k:
            raise ValueError(f"this {self.name} drafter was trained with block "
                             f"{self.net.config.block} and drafts 1..{self.max_k} tokens per "
                             f"round, not k={k}")

    def draft_states(self, k):
        """The k block states that draft the next k tokens: slots 1..k (shift 0), or the anchor
        slot and slots 1..k-1 (shift 1) -> (k, d)."""
        shift = self.net.config.shift
        return self.cached_block_states(k + 1 - shift)[1 - shift:]

    @torch.inference_mode()
    def propose(self, k, sampler):
        self.check_k(k)
        h = self.draft_states(k)  # (k, d)
        S = self.seq.numel()
        return sampler.draft(self.net.head(h), list(range(S, S + k)))

    @torch.inference_mode()
    def commit(self, n, new, hidden):
        self._extend(hidden)
        self.seq = torch.cat([self.seq, new.to(self.seq.device)])


def load_dflash(ckpt, target, device, dtype):
    net = DFlash(DFlashConfig.from_dict(ckpt["config"]), target)
    net.load_state_dict(ckpt["state_dict"])
    return DFlashDrafter(net.to(device=device, dtype=dtype).eval())


# -----------------------------------------------------------------------------
# many requests at once (batched.py): the same drafter over a ragged batch


class BatchDFlash(BatchDrafter):
    """DFlashDrafter over B rows: one static K/V cache per draft layer with a context length per
    row, and one block forward a round for every row. Row r's block (anchor + ks[r] masks at its
    own positions) sees its own context and its own real slots only: the block is bidirectional,
    so a padding slot is masked as a key too, or it would change the real slots' drafts."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.one = drafter  # the batch-1 drafter: its network and stacked context projection
        self.net = drafter.net

    @torch.inference_mode()
    def begin(self, seqs, hidden):
        cfg, p, B = self.net.config, self.net.fc.weight, len(seqs)
        self.slack = cfg.block + 64  # room for a row near the end of the window to write padding
        width = self.net.target.config.block_size + self.slack
        if getattr(self, "states", None) is None or self.states.size(0) != B:
            # made once per batch size: everything past a row's valid length is stale, never read
            shape = (cfg.n_layer, B, cfg.n_head, width, cfg.n_embd // cfg.n_head)
            self.k_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
            self.v_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
            self.kv_caches = [(self.k_cache[i], self.v_cache[i]) for i in range(cfg.n_layer)]
            # the target's tap states of every confirmed position, concatenated: (B, width, taps*d)
            self.states = torch.zeros(B, width, len(self.hidden_layers) * cfg.n_embd,
                                      device=p.device, dtype=p.dtype)
        self.n_ctx = [0] * B
        self.rows = Confirmed(seqs, width)
        self.n_states = [0] * B
        self.stash(hidden, [s.numel() - 1 for s in seqs])

    def stash(self, hidden, kept):
        """Keep row r's first kept[r] target states (at its positions n_states[r]..). They become
        context only when the next block needs them (flush): a round that drafts nothing (a
        scheduler may choose that) then costs one copy, not the context projection."""
        h = torch.cat([hidden[t] for t in self.hidden_layers], dim=-1)  # (B, T, taps * d)
        pos = torch.tensor(self.n_states, device=h.device)[:, None] + torch.arange(
            h.size(1), device=h.device)
        self.states[torch.arange(h.size(0), device=h.device)[:, None], pos] = h
        self.n_states = [n + m for n, m in zip(self.n_states, kept)]

    def flush(self):
        """Every stashed state not yet in the context, through the context projection in one
        pass: DFlashDrafter._extend per row, row r's new context at positions n_ctx[r].. (the
        other slots are written past its end: stale)."""
        kept = [s - n for s, n in zip(self.n_states, self.n_ctx)]
        T = max(kept)
        if T == 0:
            return
        B, dev = len(kept), self.states.device
        t = torch.arange(T, device=dev)
        pos = torch.tensor(self.n_ctx, device=dev)[:, None] + t  # (B, T)
        # a row with fewer pending states than T: its extra slots go to the buffers' last
        # position, past every valid one (a row near the window's end would run off them)
        pos = torch.where(t < torch.tensor(kept, device=dev)[:, None], pos, self.states.size(1) - 1)
        rows = torch.arange(B, device=dev)[:, None]
        ctx = self.net.ctx_norm(self.net.fc(self.states[rows, pos]))  # (B, T, d)
        n_layer, _, nh, _, hs = self.k_cache.shape
        kv = self.one.ctx_kv(ctx).view(B, T, n_layer, 2, nh, hs).permute(2, 3, 0, 4, 1, 5)
        cos, sin, _ = self.net.tables(ctx.device, ctx.dtype)
        pos_rope = pos.clamp_max(cos.size(0) - 1)
        at = (slice(None), rows[:, :, None], torch.arange(nh, device=pos.device)[None, :, None],
              pos[:, None, :])  # (n_layer, B, nh, T) -> each row's positions
        self.k_cache[at] = rope(kv[:, 0], cos[pos_rope][:, None], sin[pos_rope][:, None])
        self.v_cache[at] = kv[:, 1]
        self.n_ctx = list(self.n_states)

    def block_states(self, ks):
        """Every row's anchor + masks through the draft layers at once -> (B, K, d): the states
        that draft each row's next K = max(ks) tokens (row r's first ks[r] are its own; zeros
        after). A row drafting nothing has no slot at all: the Linears run on real slots only."""
        self.flush()
        shift, K = self.net.config.shift, max(ks)
        slots = K + 1 - shift
        x = self.net.block_input(self.rows.last()[:, None], slots)  # (B, slots, d)
        real = [k + 1 - shift if k > 0 else 0 for k in ks]
        rag = Ragged(self.n_ctx, real, slots, x.device)
        # row r's query sees its context and its own real slots: keys < n_ctx[r] + real[r] (at
        # least one key, so that a row with no slot has no empty softmax)
        ends = torch.tensor([max(n + m, 1) for n, m in zip(self.n_ctx, real)], device=x.device)
        visible = (torch.arange(rag.L, device=x.device) < ends[:, None])[:, None, None]
        _, _, bias = self.net.tables(x.device, x.dtype)
        if bias is not None:  # the ALiBi rows of these positions: (B, nh, slots, L)
            mask = bias[0][:, rag.pos, :rag.L].transpose(0, 1).masked_fill(~visible, float("-inf"))
        else:
            mask = visible
        cs = self.net.cs(rag.pos, x.dtype)
        x = rag.pack(x)
        for layer, kv in zip(self.net.layers, self.kv_caches):
            x = layer(x, cs, kv, rag, mask)
        return rag.unpack(x)[:, 1 - shift:1 - shift + K]

    def head(self, h, ks):
        """The target's ln_f and LM head on each row's real draft states only -> (B, K, V)."""
        pk = Packing(ks, h.size(1), h.device)
        return pk.unpack(self.net.head(pk.pack(h)))

    @torch.inference_mode()
    def propose(self, ks, sampler):
        h = self.block_states(ks)  # (B, K, d)
        toks, q = sampler.draft(self.head(h, ks), self.rows.lengths, ks)
        return toks, list(ks), q

    @torch.inference_mode()
    def commit(self, kept, new, hidden):
        self.stash(hidden, kept)
        self.rows.extend(new, kept)


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


def block_states(net, x, hidden, anchors, block=None):
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
    h = net.run(x_blocks, pos, ctx_kvs, training_mask(anchors, T, blk))
    P = blk - 1 + cfg.shift
    h = h.view(B, A, blk, -1)[:, :, 1 - cfg.shift:]
    return h, anchors[..., None] + 1 + torch.arange(P, device=x.device)


def position_weights(P, gamma, device=None):
    """w_k = exp(-(k-1)/gamma): early positions matter most, a miss there ends the round."""
    return torch.exp(-torch.arange(P, device=device, dtype=torch.float32) / gamma)


def soft_labels(t_logits, tpos):
    """The target's distribution for the token at each position tpos (B, A, P): the target's
    logits at tpos - 1, as computed on the training text. -> (B, A, P, V)."""
    b = torch.arange(t_logits.size(0), device=t_logits.device)[:, None, None]
    return F.softmax(t_logits[b, tpos - 1].float(), dim=-1)


def dflash_loss(net, x, hidden, t_logits, anchors, gamma):
    """Position-weighted cross-entropy against the target's own distributions (soft labels),
    plus their total variation distance (draft_small.total_variation: why). The paper's loss is
    the cross-entropy alone; adding TV drafted better (docs/experiments.md: DFlash: loss (CE + TV))."""
    h, tpos = block_states(net, x, hidden, anchors)
    logp = F.log_softmax(net.head(h).float(), dim=-1)  # (B, A, P, V)
    p_t = soft_labels(t_logits, tpos)
    loss = -(p_t * logp).sum(-1) + total_variation(logp, p_t)  # (B, A, P)
    w = position_weights(loss.size(-1), gamma, loss.device)
    return (loss * w).sum(-1).mean() / w.sum()


# -----------------------------------------------------------------------------
# how it learns (2): train.py runs train_dflash(trainer) as its "dflash" stage.
#
# The recipe: a narrow block first, then the full block. The first slots of a block decide
# whether a round goes on at all, and a narrow block (8) teaches them with twice the anchors a
# step; the full block (16) then starts from that network (DFlash.load_narrower) and learns its
# later slots. Trained at block 16 from the start, the first slot stayed worse
# (docs/experiments.md: DFlash: narrow block first). On the way, the stage saves its state at
# the step where DSpark branches off (out/dflash.branch.pt): draft_dspark.py starts there, so the
# two drafters train the same number of steps.

SETTINGS = {
    "dflash_layers": setting(2, "dflash: draft layers (the paper: 5 at 8B scale)",
                             cuda=3, gpt2=4, tiny=1),
    "dflash_heads": setting(8, "dflash: attention heads (its width is the target's)", gpt2=12,
                            tiny=2),
    "dflash_block": setting(16, "dflash and dspark: the block they draft with, anchor + "
                            "block-1 masks (so up to block-1 drafts a round)",
                            type=number(int, 2), quick=8),
    "dflash_gamma": setting(3.0, "dflash and dspark: position weight decay, w_k = "
                            "exp(-(k-1)/gamma) (the paper: 4 at block 8, 7 at 16)", cuda=7.0),
    "dflash_anchors": setting(8, "dflash and dspark: random anchors (blocks) per training "
                              "sequence at the full block", cuda=32, quick=16, tiny=4),
    "dflash_iters": setting(1000, "dflash: steps at the full block, after the narrow phase "
                            "(DFlash trains --dflash-narrow-iters + these in all)",
                            cuda=2000, gpt2=6000, quick=500, tiny=6),
    "dflash_lr": setting(1e-3, "dflash: peak learning rate at the full block",
                         quick=2e-3, tiny=3e-3),
    "dflash_narrow_block": setting(8, "dflash: the block of the narrow phase it trains first",
                                   type=number(int, 2)),
    "dflash_narrow_anchors": setting(16, "dflash: anchors per training sequence in the narrow "
                                     "phase", tiny=4),
    "dflash_narrow_iters": setting(5000, "dflash: steps at --dflash-narrow-block before the "
                                   "full block (0: no narrow phase)", type=number(int, 0),
                                   cuda=0, quick=0, tiny=8),
    "dflash_narrow_lr": setting(2e-3, "dflash: peak learning rate of the narrow phase",
                                tiny=3e-3),
    "dflash_text": setting("gen", "dflash and dspark: training text, 'gen' (the distillation set "
                           "the target wrote) or 'data' (the corpus); soft labels from the "
                           "target either way", choices=["gen", "data"]),
    "dflash_taps": setting("auto", "dflash and dspark: target layers read as context, e.g. "
                           "'1,2,3,4,5' ('auto': every block but the last)"),
}


def training_phases(a):
    """DFlash's training as phases (train_loop name, block, anchors a sequence, steps, peak lr):
    with --dflash-narrow-iters, the narrow block first, then the full block."""
    if a.n_embd % a.dflash_heads:
        raise ValueError(f"--dflash-heads ({a.dflash_heads}) must divide the target's width, "
                         f"--n-embd ({a.n_embd})")
    full = ("dflash", a.dflash_block, a.dflash_anchors, a.dflash_iters, a.dflash_lr)
    if a.dflash_narrow_iters == 0:
        return [full]
    if a.dflash_narrow_block >= a.dflash_block:
        raise ValueError(f"--dflash-narrow-block ({a.dflash_narrow_block}) must be smaller than "
                         f"--dflash-block ({a.dflash_block}), or use --dflash-narrow-iters 0")
    return [("dflash-narrow", a.dflash_narrow_block, a.dflash_narrow_anchors,
             a.dflash_narrow_iters, a.dflash_narrow_lr), full]


def check_anchors(a, block, n_anchors, flag):
    """A training window of --block-size tokens holds block_size - block anchors at most (each
    needs a context position before it and its whole block inside the window)."""
    if n_anchors > a.block_size - block:
        raise ValueError(f"a --block-size {a.block_size} window holds at most "
                         f"{max(0, a.block_size - block)} anchors of block {block}, not "
                         f"{n_anchors} ({flag}): use fewer, or a longer --block-size")


def phases(a):
    """The train_loop phases this stage runs: (name, steps). Checks the settings too."""
    plan = training_phases(a)
    for name, block, n_anchors, _, _ in plan:
        check_anchors(a, block, n_anchors, "--dflash-narrow-anchors" if "narrow" in name
                      else "--dflash-anchors")
    return [(name, steps) for name, _, _, steps, _ in plan]


def total_steps(a):
    return sum(steps for _, steps in phases(a))


def branch_step(a):
    """Where DSpark branches off DFlash's training (--dspark-init dflash): after total_steps -
    dspark_iters steps, counted across the phases, so that DSpark's steps (the backbone's from
    DFlash, then its own) equal DFlash's. None: no branch (DSpark starts from scratch, or it
    gets as many steps as DFlash or more and starts from DFlash's final weights)."""
    n = total_steps(a) - a.dspark_iters
    return n if a.dspark_init == "dflash" and n >= 1 else None


def parse_taps(spec, n_layer):
    """'auto' or '1,3,5' -> a list of target layers."""
    if spec == "auto":
        return default_taps(n_layer)
    try:
        return [int(t) for t in spec.split(",")]
    except ValueError:
        raise ValueError("--dflash-taps must be 'auto' or comma-separated layer numbers like "
                         f"1,3,5 (got {spec!r})") from None


def network_config(a, target_cfg, block=None):
    """The DFlash network the settings ask for (also DSpark's backbone: the same shape, so DSpark
    can start from it). The mask slots predict (shift 0), as in the DFlash paper: letting the
    anchor slot predict too (DeepSpec's shift 1) drafted worse (docs/experiments.md: DFlash: the
    masks predict (shift 0))."""
    return DFlashConfig(n_embd=target_cfg.n_embd, n_head=a.dflash_heads, n_layer=a.dflash_layers,
                        taps=parse_taps(a.dflash_taps, target_cfg.n_layer),
                        block=block or a.dflash_block)


def anchored(tr, x, t_logits, hid, step, cfg, n_anchors):
    """A training batch for a block drafter: windows x, the target's tapped states on them (the
    context), its logits (the soft labels) and n_anchors random anchors a row. The anchors of
    step s come from a generator seeded with (seed, s), so a resumed run replays them."""
    g = torch.Generator().manual_seed(tr.args.seed * 7_919 + step)
    anchors = tr.per_row(lambda B: sample_anchors(B, x.size(1), n_anchors, cfg.block, cfg.shift,
                                                  g, tr.device), x.size(0))
    return x, {t: hid[t] for t in cfg.taps}, t_logits, anchors


def train_dflash(tr):
    """Every phase of training_phases, each starting from the one before -> out/dflash.pt (and
    out/dflash.branch.pt, DSpark's starting point)."""
    a = tr.args
    target, target_ckpt = tr.target()
    cfg = network_config(a, target.config)
    batches = tr.distill.batches(a.dflash_text)
    plan = training_phases(a)
    fingerprint = {"stage": "dflash", "config": cfg.to_dict(), "target": target_ckpt["model_hash"],
                   "phases": [p[1:] for p in plan], "text": a.dflash_text,
                   "gen": tr.distill.key(a.dflash_text), "gamma": a.dflash_gamma,
                   "seed": a.seed, "branch": branch_step(a)}
    net, done = None, 0
    for i, phase in enumerate(plan):
        net, val = train_phase(tr, fingerprint, batches, i, phase, net, done)
        done += phase[3]
    tr.save("dflash", cfg.to_dict(), net, {"val_loss": val, "text": a.dflash_text,
                                           "fingerprint": fingerprint}, steps=done)
    return val


def train_phase(tr, fingerprint, batches, i, phase, before, done):
    """Phase i, from the network `before` (the previous phase's, or None), after `done` steps of
    the earlier phases -> (its network, its val loss). Every phase but the last keeps its resume
    file when finished: a rerun skips it."""
    a = tr.args
    name, block, n_anchors, steps, lr = phase
    target = tr.target()[0]
    cfg = network_config(a, target.config, block)
    torch.manual_seed(a.seed + 3)
    net = DFlash(cfg, target).to(tr.device)
    if before is not None:
        net.load_narrower(cpu_state_dict(before))
    n_params = sum(p.numel() for p in net.parameters())
    print(f"dflash: {n_params / 1e6:.2f}M trainable parameters, {cfg}, {n_anchors} anchors")

    def loss_of(x, t_logits, hid, step):
        return dflash_loss(net, *anchored(tr, x, t_logits, hid, step, cfg, n_anchors),
                           a.dflash_gamma)

    def after_step(n):
        if done + n == fingerprint["branch"]:  # written once, when reached (a resumed run has it)
            save_checkpoint({"kind": "dflash-branch", "fingerprint": fingerprint,
                             "state_dict": cpu_state_dict(net),
                             "budget": {"steps": done + n, "seconds": tr.elapsed()}},
                            tr.path("dflash.branch"))
    last = i == len(fingerprint["phases"]) - 1
    val, _ = tr.fit(name, net, lambda s: loss_of(*batches(s), s),
                    lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                    steps=steps, lr=lr, fingerprint={**fingerprint, "phase": i},
                    tokens_per_step=a.batch_size * n_anchors * block, after_step=after_step,
                    keep_resume=not last)
    return net, val
