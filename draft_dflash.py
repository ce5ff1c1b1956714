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

The draft layers follow the target's family (dflash_layers.py, read before this file): for a
Llama or Qwen target the papers' (and speculators', which vLLM serves): Qwen3 decoder layers,
every mask slot one mask token's embedding, a final norm of their own. For the lesson's GPT-2
target GPT-2's, with two departures for training in minutes: one mask embedding per block offset,
and ALiBi on top of RoPE (docs/experiments.md: DFlash: the papers' layers).

It reads in order: the config, the network (its layers dflash_layers.py's), the Drafter (how it
drafts), then how it learns (anchors, mask, loss, narrow-then-full; training/stages_dflash.py runs
it). At inference the context is the target's states of every confirmed token BEFORE the anchor,
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

import ragged
from llama import rotate, rotation
from dflash_layers import FAMILIES, alibi_bias
from draft_small import total_variation
from speculative import Drafter

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
    rope_base: float = 10000.0  # RoPE in the draft attention (see tables())
    arch: str = "gpt2"       # the draft layers: "gpt2" or "qwen3" (the papers'; dflash_layers.py)
    alibi: bool | None = None  # ALiBi on top of RoPE (dflash_layers.alibi_bias); None: "gpt2" only
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
        if self.arch not in FAMILIES:
            raise ValueError(f"unknown DFlash layers {self.arch!r}: use {' or '.join(FAMILIES)}")
        family = FAMILIES[self.arch]
        self.alibi = family.alibi if self.alibi is None else self.alibi
        self.bias = family.bias if self.bias is None else self.bias
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        self.n_hidden = self.n_hidden or 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        """The config a checkpoint recorded: every field of today's, no other (a checkpoint of
        another layout is retrained, not read)."""
        fields = set(cls.__dataclass_fields__)
        missing, unknown = sorted(fields - set(d)), sorted(set(d) - fields)
        if missing or unknown:
            raise ValueError(f"the checkpoint's DFlash config is not this version's (missing "
                             f"{missing}, unknown {unknown}): retrain it (python train.py "
                             "--only dflash --force; a DSpark drafter: --only dspark --force)")
        return cls(**d)


def default_taps(n_layer, arch="gpt2"):
    """Which target layers feed the context. The paper spreads 5 taps over 36 layers, from the
    first block to three before the last: a target deeper than 8 layers gets the same. Our own
    targets have few: every block output but the last (specialised on the *next* token, known
    at the anchor); a 2-layer one keeps both, but for "qwen3" layers (speculators.exportable)."""
    if n_layer > 8:
        return [round(1 + i * (n_layer - 4) / 4) for i in range(5)]
    return list(range(1, n_layer + (n_layer == 1 or n_layer == 2 and arch == "gpt2")))


# -----------------------------------------------------------------------------
# the drafter network


class DFlash(nn.Module):
    """Fusion projection + mask embedding + draft layers, of the family cfg.arch names
    (dflash_layers.FAMILIES). The target (embedding, ln_f, LM head) is held, not registered as a
    submodule: frozen, out of the optimizer and our state_dict."""

    def __init__(self, cfg, target):
        super().__init__()
        if cfg.n_embd != target.config.n_embd:
            raise ValueError(f"the drafter width ({cfg.n_embd}) must equal the target's "
                             f"({target.config.n_embd})")
        if not cfg.taps or not all(1 <= t <= target.config.n_layer for t in cfg.taps):
            raise ValueError(f"taps {cfg.taps} must be target layers in 1..{target.config.n_layer}")
        self.config = cfg
        self.__dict__["target"] = target  # plain attribute, not a submodule (see above)
        self.family = FAMILIES[cfg.arch](cfg)  # its layers' parts, chosen here once
        self.fc = nn.Linear(cfg.n_embd * len(cfg.taps), cfg.n_embd, bias=False)  # d*n -> d, no bias
        self.family.build(self, target)  # ctx_norm, what fills a mask slot, the layers, ...
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
            pos = torch.arange(N, device=device)
            cos, sin = (t[0, 0] for t in rotation(pos, self.family.inv_freq(device)))  # (N, hs)
            # (1, nh, N, N): 4-d, as SDPA's fused CPU kernel wants it (for a 3-d mask it falls
            # back to its slower unfused path; docs/experiments.md: DFlash: lean round)
            bias = alibi_bias(pos, pos, cfg.n_head).to(dtype)[None] if cfg.alibi else None
            self._tables[key] = (cos.to(dtype), sin.to(dtype), bias)
        return self._tables[key]

    def cs(self, pos, dtype):
        """RoPE rows for positions pos ((T,) or (B, T)) -> (cos, sin), each (T, hs) or
        (B, 1, T, hs)."""
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
        masks = self.family.masks(self, n_slots - 1, anchors.device)  # (n_slots-1, d)
        masks = masks.expand(B, A, -1, -1)  # (B, A, n_slots-1, d)
        x = torch.cat([self.target.transformer.wte(anchors)[:, :, None], masks], dim=2)
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

    def final_norm(self, h):
        """The norm before the LM head: the target's own ln_f, or ("qwen3") the drafter's."""
        return self.family.final_norm(self, h)

    def norm_keys(self, k):
        """Stacked context keys k (n_layer, ..., hs) through each layer's per-head norm (the
        "qwen3" layers'), as a layer's keys_values norms its own."""
        return self.family.norm_keys(self, k)

    def logits(self, h):
        """The target's LM head on the final norm of h -> (..., V), or only its draft
        vocabulary's rows -> (..., draft_vocab) (head_rows, below; docs/experiments.md: A real
        target's draft vocabulary)."""
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


def head_rows(head, d2t, cache, dtype):
    """A draft vocabulary (EAGLE-3's reduced vocabulary): the rows of the target's LM head `head`
    (V, d) at its target ids d2t (Vd,), what a drafter's head multiplies by (a wide vocabulary's
    head is most of a small drafter's cost; the rare tokens it leaves out are seldom what the
    target says next). Gathered once per weight and dtype at inference, into `cache`."""
    if torch.is_grad_enabled():
        return head[d2t]
    key = ("head", head.data_ptr(), d2t.data_ptr(), head.device, dtype)
    if key not in cache:
        cache[key] = head[d2t].to(dtype)
    return cache[key]


def to_target_vocab(z, d2t, V):
    """Logits over a draft vocabulary (..., Vd) -> over the target's V tokens: each at its id
    d2t[i], every other token -inf (never drafted; the target still verifies over all V)."""
    full = z.new_full((*z.shape[:-1], V), float("-inf"))
    return full.index_copy_(-1, d2t, z)


# -----------------------------------------------------------------------------
# the Drafter: one forward per round, context K/V cached per draft layer


class DFlashDrafter(Drafter):
    """propose(k): anchor + k masks at positions S-1 .. S-1+k -> k drafts in one forward. Any
    k <= block-1 works (a smaller block is just fewer masks); more than trained is an error.
    Each draft layer keeps a static K/V cache: positions 0..n_ctx-1 hold the context; a round
    writes its block's K/V after them, where the next round's context overwrites them.

    It drafts for many requests at once (speculative.Drafter's batch calls), one block forward a
    round for every row, each row at its own length (ragged.py); one request is a batch of one.
    A commit only keeps the target's states (stash); they become context, through the context
    projection, when the next block needs them (flush).

    A round on its own, run as written (tests/test_layout.py runs every example of the lesson):
    a tiny random target in float64, whose two layers it reads, and a block of 8.

        >>> from gpt import GPT, GPTConfig
        >>> from sampler import Sampler
        >>> from speculative import generate_plain, generate_speculative
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
        # sampling: acceptance falls fast by position, so a short draft pays; how short, a coupled
        # sweep chose (docs/experiments.md: DFlash: k)
        self.sampled_k = min(3, self.max_k)
        p = net.fc.weight
        # every layer's c_kv stacked into one Linear, for the context's single product (flush). A
        # copy, taken here: a drafter is built after training, never trained itself
        c_kvs = [layer.attn.c_kv for layer in net.layers]
        self.ctx_kv = nn.Linear(cfg.n_embd, cfg.n_layer * c_kvs[0].out_features, bias=cfg.bias,
                                device=p.device, dtype=p.dtype).requires_grad_(False)
        with torch.no_grad():
            self.ctx_kv.weight.copy_(torch.cat([c.weight for c in c_kvs]))
            if cfg.bias:
                self.ctx_kv.bias.copy_(torch.cat([c.bias for c in c_kvs]))
        self.states = None  # its caches: made at the first begin (and for each new batch size)

    def fresh(self):
        c = copy.copy(self)
        c.states = None  # caches of its own; the weights, and the stacked ctx_kv, are shared
        return c

    def new_caches(self, B):
        """Its static buffers for B rows, (.., B, .., width, ..): width = the target's context
        window plus room for a block and a row's padding past it (stale, never read)."""
        cfg, p = self.net.config, self.net.fc.weight
        width = self.net.target.config.sequence_len + cfg.block + 64
        shape = (cfg.n_layer, B, cfg.n_kv_head, width, cfg.head_dim)
        self.k_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.v_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.kv_caches = [(self.k_cache[i], self.v_cache[i]) for i in range(cfg.n_layer)]
        # the target's tap states of every confirmed position, concatenated: (B, width, taps*d)
        self.states = torch.zeros(B, width, len(self.hidden_layers) * cfg.n_embd,
                                  device=p.device, dtype=p.dtype)

    @torch.inference_mode()
    def begin_batch(self, seqs, hidden):
        B = len(seqs)
        if self.states is None or self.states.size(0) != B:
            self.new_caches(B)  # else reused: everything past a row's valid length is stale
        self.n_ctx = [0] * B  # row r's context: positions 0..n_ctx[r]-1 of its caches
        self.n_states = [0] * B  # ... and the target states kept for it so far
        self.rows = ragged.Confirmed(seqs, self.states.size(1))
        self.stash(hidden, [s.numel() - 1 for s in seqs])

    @property
    def seq(self):
        """One request's confirmed tokens (a batch of one row)."""
        (S,) = self.rows.lengths
        return self.rows.toks[0, :S]

    def stash(self, hidden, kept):
        """Keep row r's first kept[r] target states (at its positions n_states[r]..). They become
        context only when the next block needs them (flush): a round that drafts nothing (a
        scheduler may choose that) then costs one copy, not the context projection."""
        h = torch.cat([hidden[t] for t in self.hidden_layers], dim=-1)  # (B, T, taps * d)
        pos = ragged.offsets(self.n_states, h.size(1), h.device)
        self.states[torch.arange(h.size(0), device=h.device)[:, None], pos] = h
        self.n_states = [n + m for n, m in zip(self.n_states, kept)]

    def flush(self):
        """Every stashed state not yet in the context, through the context projection in one
        pass, every draft layer's keys and values from ONE product with the layers' c_kv weights
        stacked (a round is a few dozen tiny ops on a CPU, so it pays to do it in one pass, not
        one per layer): row r's new context at positions n_ctx[r].. (its other slots are
        written past its end: stale)."""
        kept = [s - n for s, n in zip(self.n_states, self.n_ctx)]
        T = max(kept)
        if T == 0:
            return
        B, dev = len(kept), self.states.device
        pos = ragged.offsets(self.n_ctx, T, dev)  # (B, T)
        if len(set(kept)) > 1:  # a row with fewer: its extra slots go to the buffers' last
            # position, past every valid one (a row near the window's end would run off them)
            live = torch.arange(T, device=dev) < torch.tensor(kept, device=dev)[:, None]
            pos = torch.where(live, pos, self.states.size(1) - 1)
        rows = torch.arange(B, device=dev)[:, None]
        ctx = self.net.ctx_norm(self.net.fc(self.states[rows, pos]))  # (B, T, d)
        n_layer, _, nh, _, hs = self.k_cache.shape
        kv = self.ctx_kv(ctx).view(B, T, n_layer, 2, nh, hs).permute(2, 3, 0, 4, 1, 5)
        cos, sin, _ = self.net.tables(ctx.device, ctx.dtype)
        turn = pos.clamp_max(cos.size(0) - 1)
        at = (slice(None), rows[:, :, None], torch.arange(nh, device=dev)[None, :, None],
              pos[:, None, :])  # (n_layer, B, nh, T) -> each row's positions
        self.k_cache[at] = rotate(self.net.norm_keys(kv[:, 0]), cos[turn][:, None],
                                  sin[turn][:, None])
        self.v_cache[at] = kv[:, 1]
        self.n_ctx = list(self.n_states)

    def check_block(self, k):
        if not 1 <= k <= self.max_k:
            raise ValueError(f"this {self.name} drafter was trained with block "
                             f"{self.net.config.block} and drafts 1..{self.max_k} tokens per "
                             f"round, not k={k}")

    def draft_states(self, ks):
        """Every row's anchor + masks through the draft layers at once -> (B, K, d): the states
        that draft each row's next K = max(ks) tokens, slots 1..k (shift 0) or the anchor slot
        and slots 1..k-1 (shift 1); row r's first ks[r] are its own (the rest padding). A row drafting
        nothing has no slot at all: the Linears run on real slots only. The anchor sits at
        position n_ctx[r] (== S - 1: the context is every confirmed token before it); every slot
        sees its row's whole context and its own block (bidirectional), with the ALiBi bias,
        when on, down-weighting the distant keys."""
        self.check_block(max(ks))
        self.flush()
        shift, K = self.net.config.shift, max(ks)
        slots = K + 1 - shift
        x = self.net.block_input(self.rows.last()[:, None], slots)  # (B, slots, d)
        real = [k + 1 - shift if k > 0 else 0 for k in ks]
        rag = ragged.Ragged(self.n_ctx, real, slots, x.device)
        # row r's query sees its context and its own real slots: keys < n_ctx[r] + real[r] (at
        # least one key, so that a row with no slot has no empty softmax); a padding slot is
        # masked as a key too, or it would change the real slots' drafts
        ends = [max(n + m, 1) for n, m in zip(self.n_ctx, real)]
        mask = None  # every row sees every key (always so for one request)
        if any(e != rag.L for e in ends):
            ends = torch.tensor(ends, device=x.device)
            mask = (torch.arange(rag.L, device=x.device) < ends[:, None])[:, None, None]
        _, _, bias = self.net.tables(x.device, x.dtype)
        if bias is not None:  # the ALiBi rows of these positions: (B, nh, slots, L)
            alibi = bias[0][:, rag.pos, :rag.L].transpose(0, 1)
            mask = alibi if mask is None else alibi.masked_fill(~mask, float("-inf"))
        cs = self.net.cs(rag.pos, x.dtype)
        x = rag.pack(x)
        for layer, kv in zip(self.net.layers, self.kv_caches):
            x = layer(x, cs, kv, rag, mask)
        return rag.unpack(x)[:, 1 - shift:1 - shift + K]

    def head(self, h, ks):
        """The target's ln_f and LM head on each row's real draft states only -> (B, K, V)."""
        pk = ragged.Packing(ks, h.size(1), h.device)
        return pk.unpack(self.net.target_logits(pk.pack(h)))

    @torch.inference_mode()
    def propose_batch(self, ks, sampler):
        h = self.draft_states(ks)  # (B, K, d)
        toks, q = sampler.draft(self.head(h, ks), self.rows.lengths, ks)
        return toks, list(ks), q

    @torch.inference_mode()
    def commit_batch(self, kept, new, hidden):
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

DRAFTER = dict(
    name="dflash",
    network=lambda config, target: DFlash(DFlashConfig.from_dict(config), target),
    drafter=lambda net, target: DFlashDrafter(net),
    pairs=True, trees=True,
)
