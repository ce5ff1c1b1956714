"""
gpt.py -- the target model: a GPT-2 (nanoGPT-style) with a static KV cache that can roll back.

data.py gave us the corpus and tokenizer; this file adds the model trained on them, which
speculative.py and every draft_*.py file build on.

This is the model every drafter in nanospec drafts *for*. It is nanoGPT's model.py with
three things added, all of which speculative decoding needs:

1. A static, preallocated KV cache (the attention keys and values of every position so far,
   as in gpt-fast). One forward call takes T new tokens at
   an explicit start position, so prefill (T = prompt length), a one-token decode step
   (T = 1) and a k-token verify (T = k + 1) are literally the same call.
2. Explicit rollback: `cache.rollback(n)` forgets everything at positions >= n. After a
   verify pass in which only some drafted tokens survive, the rejected tail is dropped here.
   Stale K/V past `cache.length` are never attended to and get overwritten by the next call.
3. Hidden states of any requested layers come back with the logits (DFlash taps several
   layers, MTP needs the last one).

And one thing that is only about speed: `Linear`, an nn.Linear that at float32 inference on a
CPU multiplies by a copy of its weight packed for oneDNN, which is much faster at the few rows
a decode step or a verify pass has. Every model here uses it, plain decoding included.

Parameter names are nanoGPT's (transformer.wte, transformer.h.0.attn.c_attn, ...), so a
state_dict maps onto other GPT-2 implementations.

    python gpt.py    # a quick self-check: cached logits == uncached logits, in float64
"""

import argparse
import hashlib
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

# -----------------------------------------------------------------------------
# config


@dataclass
class GPTConfig:
    block_size: int = 256   # context window; also the size of the preallocated KV cache. (nanoGPT's
    #                         name. `Block` below is a transformer layer; in draft_dflash.py a
    #                         "block" is the anchor + masks a drafter fills in one pass)
    vocab_size: int = 4096  # our byte-level BPE, end-of-text included (GPT-2's is 50257)
    n_layer: int = 6        # depth: what makes the target expensive to run token by token
    n_head: int = 8         # head size = n_embd / n_head
    n_embd: int = 256       # width
    dropout: float = 0.0    # 0 for the short runs here: we are far from overfitting
    bias: bool = True       # GPT-2 has biases in Linears and LayerNorms
    activation: str = "gelu"  # the MLP's: "gelu" (exact; nanospec's own targets, and every
    #                           checkpoint written before this field) or "gelu_new" (the tanh
    #                           approximation OpenAI's GPT-2 weights were trained with)

    def to_dict(self):
        d = asdict(self)
        if d["activation"] == "gelu":  # what a config without the field means: checkpoints and
            del d["activation"]        # resume fingerprints of nanospec's targets stay as before
        return d

    @classmethod
    def from_dict(cls, d):
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown GPT config fields {sorted(unknown)}: "
                             "the checkpoint is not a nanospec GPT")
        if d.get("activation", "gelu") not in GELU:
            raise ValueError(f"unknown activation {d['activation']!r} (one of {sorted(GELU)})")
        return cls(**d)


# activation -> nn.GELU's `approximate` (Hugging Face's gelu_pytorch_tanh is gelu_new's function)
GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


# -----------------------------------------------------------------------------
# the KV cache


class KVCache:
    """Preallocated keys/values for every layer, written at explicit positions.

    `length` is the number of valid positions. Everything at index >= length is stale:
    forward() only ever attends to [0, start + T), and it refuses to write past a gap.
    """

    def __init__(self, config, batch_size=1, device="cpu", dtype=torch.float32, max_len=None):
        hs = config.n_embd // config.n_head
        self.max_len = max_len or config.block_size
        # (n_layer, B, nh, Tmax, hs)
        shape = (config.n_layer, batch_size, config.n_head, self.max_len, hs)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def rollback(self, n):
        """Forget positions >= n. Rolling 'forward' is an error: those K/V were never written."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {n}")
        self.length = n

    def reset(self):
        self.length = 0


class RaggedCache(KVCache):
    """A KVCache for B rows that each have their own length (many requests at once, batched.py).

    lengths[r]: the valid positions of row r. A forward over a ragged batch writes row r's new
    tokens at lengths[r].. and its padding slots after them: padding and stale K/V always sit past
    every valid query of their row, so the mask built from positions never shows them (Ragged).
    `slack` extra positions past the context window hold the padding of a row that is already
    near the end of it. Rollback is per row and O(1), like KVCache's: a list of new lengths."""

    def __init__(self, config, batch_size, device="cpu", dtype=torch.float32, slack=64):
        super().__init__(config, batch_size, device, dtype, max_len=config.block_size + slack)
        self.slack = slack
        self.lengths = [0] * batch_size

    @property
    def length(self):
        raise AttributeError("a RaggedCache has a length per row: use .lengths")

    @length.setter
    def length(self, n):  # KVCache.__init__ sets it; a ragged cache keeps lengths instead
        pass

    def rollback(self, ns):
        """Row r forgets its positions >= ns[r]."""
        if len(ns) != len(self.lengths) or not all(0 <= n <= m for n, m in zip(ns, self.lengths)):
            raise ValueError(f"cannot roll back rows of lengths {self.lengths} to {list(ns)}")
        self.lengths = list(ns)

    def reset(self):
        self.lengths = [0] * len(self.lengths)


def bucket(n):
    """n rounded up to one of a few sizes, four per octave (8, 16, 24, ..., 64, 80, 96, 112, 128,
    160, ...). Why: oneDNN builds a kernel for every new row count it sees, about half a
    millisecond a Linear, and a ragged batch would show it a new count almost every round
    (docs/experiments.md: Batched: packing in buckets)."""
    step = max(8, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


class Packing:
    """The real slots of a (B, T, ...) batch whose row r has counts[r] real slots (then padding):
      pack / unpack: (B, T, ...) <-> (N, ...) over the real slots, N = sum(counts) rounded up to
      a bucket() size with padding slots. Linears and MLPs run on the packed rows, so their cost
      follows the real tokens. Where that would save nothing (no padding, or a bucket as large
      as the batch) both are the identity, and the whole padded batch runs."""

    def __init__(self, counts, T, device):
        self.B, self.T, self.counts = len(counts), T, list(counts)
        self.index = None
        n = bucket(sum(counts))
        if n < self.B * T:
            flat = [r * T + t for r, c in enumerate(counts) for t in range(c)]
            pad = [r * T + t for r, c in enumerate(counts) for t in range(c, T)]
            self.index = torch.tensor(flat + pad[:n - len(flat)], device=device, dtype=torch.long)

    def pack(self, x):
        """(B, T, ...) -> (N, ...), the real slots only."""
        return x if self.index is None else x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x):
        """(N, ...) -> (B, T, ...); the padding slots hold zeros or what the padding computed."""
        if self.index is None:
            return x
        out = x.new_zeros(self.B * self.T, *x.shape[1:])
        return out.index_copy_(0, self.index, x).view(self.B, self.T, *x.shape[1:])

    def last(self, x):
        """x (B, T, ...) -> (B, 1, ...): each row's last real slot (slot 0 for a row with none)."""
        idx = torch.tensor([max(c - 1, 0) for c in self.counts], device=x.device)
        return x[torch.arange(self.B, device=x.device), idx][:, None]


class Ragged(Packing):
    """Where the real tokens of a ragged batch are: row r has counts[r] new tokens at absolute
    positions starts[r]..; its other slots, up to T, are padding. Built once per forward and
    handed to every layer (in place of an int `start`):
      pos   (B, T) absolute position of every slot (padding continues its row's count)
      mask  (B, 1, T, L) query at p may see key j iff j <= p: the cached prefix of its own row
            and the new tokens before it. Padding and stale K/V sit past p, so never show.
      pack / unpack (Packing): the Linears and the MLP run on the real tokens; only the attention
            is padded."""

    def __init__(self, starts, counts, T, device):
        super().__init__(counts, T, device)
        self.pos = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)
        self.L = max(starts) + T  # keys to attend over: through the last slot written
        # every row at one position (always so at batch 1): the batch-1 path's slice writes and
        # masks, which cost less than per-row indexing
        self.start = starts[0] if len(set(starts)) == 1 else None
        if self.start is not None:
            self.mask = chunk_mask(self.start, T, device) if T > 1 else None
        else:
            self.mask = (torch.arange(self.L, device=device) <= self.pos[..., None])[:, None]
        self.rows = torch.arange(self.B, device=device)[:, None, None]

    def write(self, cache, new):
        """Write new (B, nh, T, hs) into cache (B, nh, Tmax, hs) at every slot's position, padding
        included (past its row's valid length: stale, overwritten later) -> the (B, nh, L, hs)
        prefix to attend over."""
        if self.start is not None:
            cache[:, :, self.start:self.L] = new
        else:
            heads = torch.arange(new.size(1), device=new.device)[None, :, None]
            cache.index_put_((self.rows, heads, self.pos[:, None, :]), new)  # faster than scatter_
        return cache[:, :, :self.L]


# -----------------------------------------------------------------------------
# Linear: nn.Linear plus a faster CPU inference path


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


class Linear(nn.Linear):
    """nn.Linear, except at float32 inference on a CPU, where it multiplies by a copy of its
    weight packed for oneDNN. Why: torch's default CPU matmul (MKL) is slow at the few rows a
    decode step or a verify pass has, and a weight packed for oneDNN is not (docs/experiments.md:
    Packed matmul for inference). Plain decoding and every drafter use
    this same class, so the baseline gets the same speed-up as the speculative paths.
    The copy is made on the first inference call and again whenever the weight has changed
    (an optimizer step, a load, a .to()): training itself never uses it."""

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


# -----------------------------------------------------------------------------
# the model: attention -> MLP -> block -> GPT


def attention(q, k, v, mask=None, is_causal=False, dropout_p=0.0):
    """softmax(q k^T / sqrt(hs) + mask) v: F.scaled_dot_product_attention, except when training
    on a CPU, where it is written out as one baddbmm, a softmax and one bmm. Why: there SDPA's
    fused kernel is slow to differentiate, DFlash's masked shape most of all
    (docs/experiments.md: Training attention written out).
    q (B, nh, Tq, hs), k and v (B, nh, Tk, hs); mask broadcastable to (B, nh, Tq, Tk), either
    boolean (True = may attend, SDPA's convention) or additive float (-inf: not visible).
    is_causal: query i sees keys 0..Tk-Tq+i, i.e. the queries are the LAST Tq positions of the
    keys (a block after cached keys), aligned bottom-right; SDPA's own is_causal aligns
    top-left, which is the same only when Tq == Tk."""
    Tq, Tk = q.size(2), k.size(2)
    if is_causal:
        if mask is not None:
            raise ValueError("attention: give a mask or is_causal, not both")
        if Tq > Tk:
            raise ValueError(f"attention: is_causal with {Tq} queries but only {Tk} keys: the "
                             "first queries would see no key at all")
        if Tq < Tk:  # SDPA would align it top-left: pass the bottom-right mask instead
            mask, is_causal = chunk_mask(Tk - Tq, Tq, q.device), False
    if not (q.device.type == "cpu" and torch.is_grad_enabled() and dropout_p == 0.0):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              is_causal=is_causal)
    B, nh, _, hs = q.shape
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


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # q, k, v in one matmul
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x, kv=None, start=0, attn_mask=None):
        if isinstance(start, Ragged):  # many rows at their own positions (batched.py)
            return self.forward_ragged(x, kv, start)
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # each (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv is not None:
            # write the new keys/values at their absolute positions, then attend over the
            # whole valid prefix [0, start + T). Nothing past that is ever read.
            k_cache, v_cache = kv
            k_cache[:, :, start:start + T] = k
            v_cache[:, :, start:start + T] = v
            k, v = k_cache[:, :, :start + T], v_cache[:, :, :start + T]
        dp = self.dropout if self.training else 0.0
        # attn_mask None: plain causal self-attention over these T tokens only
        y = attention(q, k, v, attn_mask, attn_mask is None and T > 1, dp)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def forward_ragged(self, x, kv, rag):
        """x: the real tokens packed, (N, C) (or (B, T, C) with no padding); rag: where they are.
        The projections run on the packed rows; the attention on the padded (B, nh, T, hs)."""
        qkv = rag.unpack(self.c_attn(x))  # (B, T, 3C)
        B, T, C = qkv.size(0), qkv.size(1), qkv.size(2) // 3
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in qkv.split(C, dim=2))  # each (B, nh, T, hs)
        k, v = rag.write(kv[0], k), rag.write(kv[1], v)  # (B, nh, L, hs)
        y = attention(q, k, v, rag.mask).transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(rag.pack(y)))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # the drafters' own configs, which build this MLP too, have no activation: the exact GELU
        self.gelu = nn.GELU(approximate=GELU[getattr(config, "activation", "gelu")])
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv=None, start=0, attn_mask=None):
        x = x + self.attn(self.ln_1(x), kv, start, attn_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


def chunk_mask(start, T, device):
    """Boolean mask (T, start+T) for T new queries at positions start.. over all keys so far:
    query i (absolute position start+i) may see keys at positions <= start+i."""
    q_pos = torch.arange(start, start + T, device=device)
    k_pos = torch.arange(start + T, device=device)
    return k_pos[None, :] <= q_pos[:, None]


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def new_cache(self, batch_size=1, device=None, dtype=None, ragged=False):
        """A KVCache (one length for every row), or with ragged=True a RaggedCache (one per row)."""
        p = self.lm_head.weight
        cls = RaggedCache if ragged else KVCache
        return cls(self.config, batch_size, device or p.device, dtype or p.dtype)

    def forward(self, idx, targets=None, cache=None, start=None, hidden_layers=(), last_only=False,
                counts=None):
        """idx (B, T) token ids at absolute positions start .. start+T-1.

        cache=None: an ordinary full-sequence forward from position 0 (training).
        cache given: `start` defaults to cache.length and must equal it (write at a gap or
          over valid entries is a bookkeeping bug: roll back explicitly first). Afterwards
          cache.length == start + T.
        hidden_layers: which hidden states to return; layer 0 is the embedding output, layer i
          the output of block i (so n_layer is the last block, before ln_f).
        last_only: compute logits for the last position only (cheap one-token decoding).
        counts: with a RaggedCache, how many of the T tokens of each row are real (forward_ragged).
        Returns (logits, loss, hiddens) with hiddens a dict {layer: (B, T, n_embd)}.
        """
        if isinstance(cache, RaggedCache):
            return self.forward_ragged(idx, cache, counts, hidden_layers, last_only)
        B, T = idx.size()
        if cache is not None:
            if start is None:
                start = cache.length
            if start != cache.length:
                raise ValueError(f"forward at position {start} but the cache holds "
                                 f"{cache.length}: roll back first")
        start = start or 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds the context window of "
                             f"{self.config.block_size}")

        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # B, T, C
        # one-token steps need no mask; prefill from 0 uses is_causal; a chunk after a
        # prefix (the verify pass) needs the explicit rectangular causal mask.
        chunk_after_prefix = cache is not None and start > 0 and T > 1
        mask = chunk_mask(start, T, idx.device) if chunk_after_prefix else None
        hiddens = {0: x} if 0 in hidden_layers else {}
        for i, block in enumerate(self.transformer.h):
            kv = (cache.k[i], cache.v[i]) if cache is not None else None
            x = block(x, kv, start, mask)
            if i + 1 in hidden_layers:
                hiddens[i + 1] = x
        if cache is not None:
            cache.length = start + T
        x = self.transformer.ln_f(x)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss, hiddens

    def forward_ragged(self, idx, cache, counts, hidden_layers, last_only):
        """forward() over a RaggedCache: row r's first counts[r] tokens of idx (B, T) are real and
        go at positions cache.lengths[r]..; the rest is padding. The same logits and hidden states
        (B, T, ...) as running each row alone (up to float rounding) at the real slots; the padding
        slots hold zeros or what the padding computed (Packing)."""
        B, T = idx.size()
        counts = list(counts) if counts is not None else [T] * B
        starts, window = cache.lengths, self.config.block_size
        if len(counts) != B or not all(0 <= c <= T for c in counts):
            raise ValueError(f"counts {counts} do not fit a batch of {B} rows of {T} tokens")
        if max(starts) + T > cache.max_len:  # padding slots too are written at their positions
            raise ValueError(f"a ragged forward of {T} slots after {max(starts)} cached positions "
                             f"overruns the cache ({cache.max_len} positions, its slack included)")
        if any(s + c > window for s, c in zip(starts, counts)):
            raise ValueError(f"sequence exceeds the context window of {window}")
        rag = Ragged(starts, counts, T, idx.device)
        pos = rag.pos.clamp_max(window - 1)  # a padding slot past the window: any position will do
        x = rag.pack(self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos)))
        hiddens = {0: rag.unpack(x)} if 0 in hidden_layers else {}
        for i, block in enumerate(self.transformer.h):
            x = block(x, (cache.k[i], cache.v[i]), rag)
            if i + 1 in hidden_layers:
                hiddens[i + 1] = rag.unpack(x)
        cache.lengths = [s + c for s, c in zip(starts, counts)]
        x = rag.unpack(self.transformer.ln_f(x))  # (B, T, C)
        if last_only:
            x = rag.last(x)
        return self.lm_head(x), None, hiddens


# -----------------------------------------------------------------------------
# checkpoints: {kind, config dict, plain state_dict, hashes, step, ...}, written atomically


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not belong with the others."""


def state_hash(state_dict):
    """A short content hash of a state_dict: drafters record the hash of the target they were
    trained against, so a retrained target can never be silently paired with an old drafter."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(obj, path):
    """torch.save to a temp file in the same folder, then rename: a run killed mid-write
    leaves the previous file intact, never a half-written one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return  # one run over several processes (ddp.py): rank 0 alone writes files
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder where a checkpoint is written; move it away")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, kind, stage=None):
    """Load a checkpoint of the given kind with weights_only=True (a file crafted to run code
    when unpickled is refused, not run). Every failure is one clear CheckpointError."""
    stage = stage or kind
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder, not a checkpoint: move it away and run "
                              f"`python train.py --only {stage}`")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} not found: run `python train.py --only {stage}` "
                              "(or plain `python train.py`) to make it")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupted, or no checkpoint at all (a pickle with code)
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable nanospec checkpoint ({first}); "
                              f"delete it and run `python train.py --only {stage}`") from None
    if not isinstance(ckpt, dict) or ckpt.get("kind") != kind or "state_dict" not in ckpt:
        found = ckpt.get("kind") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{path} is not a {kind} checkpoint (found {found!r}); "
                              f"run `python train.py --only {stage} --force` to remake it")
    return ckpt


def cpu_state_dict(module):
    """A plain state_dict on the CPU: what every checkpoint holds, loadable on any device."""
    return cpu_tree(module.state_dict())


def cpu_tree(obj):
    """obj (e.g. an optimizer's state_dict) with every tensor in it moved to the CPU, so a
    checkpoint written on a GPU holds nothing that loads back onto that GPU."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: cpu_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_tree(v) for v in obj)
    return obj


def load_target(path, device="cpu", dtype=torch.float32):
    """The trained target, in eval mode, plus its checkpoint dict (for the hashes)."""
    check_dtype(device, dtype)
    ckpt = load_checkpoint(path, "target")
    model = GPT(GPTConfig.from_dict(ckpt["config"]))
    try:
        model.load_state_dict(ckpt["state_dict"])
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not match its own config ({str(e).splitlines()[0]}); "
                              "run `python train.py --only target --force`") from None
    return model.to(device=device, dtype=dtype).eval(), ckpt


# -----------------------------------------------------------------------------
# devices: auto-detect, and one clear error for a device that is not there


def pick_device(name="auto"):
    """'auto' -> cuda if present, else mps if it works, else cpu. Anything else must exist here:
    cpu, cuda or cuda:N (N below the number of GPUs), mps or mps:0. One clear ValueError if not,
    rather than a traceback from the first tensor put on it."""
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is not None and dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n and (dev.index is None or dev.index < n):
            return name
        if n:
            have = f"this machine has {n} CUDA device{'s' if n > 1 else ''} (cuda:0..cuda:{n - 1})"
        else:
            have = "this machine has no CUDA device"
        raise ValueError(f"device {name!r} is not available here: {have}; use --device cpu, "
                         "or auto to pick the best one")
    if dev is not None and (dev.type == "cpu" or (dev.type == "mps" and mps
                                                  and dev.index in (None, 0))):
        return name
    raise ValueError(f"device {name!r} is not available here: use --device cpu, "
                     "or auto to pick the best one")


def fast_bf16(device):
    """Does bfloat16 autocast speed training up on this device? CUDA: if the GPU has bfloat16.
    CPU: measured, not assumed -- a (256 x 1024) @ (1024 x 1024) product in both dtypes, the
    fastest of a few tries each: CPUs with AVX512-BF16 or AMX run it about twice as fast, CPUs
    without emulate bfloat16 and would be slower (docs/experiments.md: bfloat16). MPS: no."""
    if str(device).startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    if str(device) != "cpu":
        return False
    # the two dtypes take turns, so a busy moment slows both alike (timed one after the other, a
    # burst of other work during the bfloat16 tries once sent a whole run to float32)
    pairs = {dt: (torch.randn(256, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt))
             for dt in (torch.bfloat16, torch.float32)}
    best = {dt: float("inf") for dt in pairs}
    for _ in range(8):
        for dt, (a, b) in pairs.items():
            t0 = time.perf_counter()
            a @ b
            best[dt] = min(best[dt], time.perf_counter() - t0)
    return best[torch.bfloat16] < 0.7 * best[torch.float32]


def allow_tf32(device):
    """On CUDA, let the float32 matmuls autocast leaves in float32 use TF32 tensor cores (what
    every GPU training recipe does). CPU and MPS: untouched, so CPU runs stay bit-identical.
    Returns whether it was switched on."""
    if not str(device).startswith("cuda"):
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def check_dtype(device, dtype):
    """A dtype the device cannot hold is one clear ValueError, before any weights load."""
    if torch.device(device).type == "mps" and dtype == torch.float64:
        raise ValueError("float64 is not supported on mps (Apple GPUs have no float64): "
                         "use --dtype float32, or --device cpu for float64")


def synchronize(device):
    """Wait for the queued GPU work of `device` (a str like 'cuda:1' or 'mps:0', or a torch.device)
    before reading a clock; a no-op on CPU. The device type decides, never the exact string:
    tensors on a Mac report 'mps:0', and torch.cuda.synchronize() alone waits on the current GPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


# -----------------------------------------------------------------------------
# command-line values: checked where they are parsed, so a bad one fails before anything loads


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a refusal is one line, 'error: argument --flag: ...' (exit code 2), like every
    other refusal of the project's commands; --help still prints the usage."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def number(kind=int, lo=None, hi=None, above=None):
    """An argparse type: a `kind` (int or float) with lo <= x <= hi, or x > above. A bad value
    ends in one line, 'error: argument --flag: ...', naming the allowed range."""
    what = "an integer" if kind is int else "a number"
    bounds = [f">= {lo}" if lo is not None else None, f"> {above}" if above is not None else None,
              f"<= {hi}" if hi is not None else None]
    rule = " and ".join(b for b in bounds if b)

    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}"
                                             + (f" ({rule})" if rule else "")) from None
        if not (math.isfinite(x) and (lo is None or x >= lo) and (hi is None or x <= hi)
                and (above is None or x > above)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be {what} {rule}")
        return x
    parse.__name__ = what  # argparse names the type by it in its own messages
    return parse


def _made_blocked(p):
    """Can folder p not be made because a file sits where a folder above it must be?"""
    up = os.path.abspath(p)
    while not os.path.exists(up):
        up = os.path.dirname(up)
    return not os.path.isdir(up)


PATH_RULES = {  # kind of path flag -> [(is this value wrong?, why)], checked in order
    "in": [(lambda p: not os.path.exists(p), "does not exist"),
           (os.path.isdir, "is a folder, not a file")],
    "data": [(lambda p: not os.path.exists(p), "does not exist"),
             (lambda p: not (os.path.isfile(p) or os.path.isdir(p)),
              "is neither a file nor a folder")],
    "folder": [(lambda p: not os.path.exists(p), "does not exist"),
               (lambda p: not os.path.isdir(p), "is not a folder")],
    "dir": [(lambda p: os.path.exists(p) and not os.path.isdir(p), "is a file, not a folder"),
            (_made_blocked, "cannot be made: a file is in the way")],
    "out": [(os.path.isdir, "is a folder, not a file"),
            (lambda p: not os.path.isdir(os.path.dirname(os.path.abspath(p))),
             "is in a folder that does not exist")],
}


def path_arg(kind):
    """An argparse type for a path flag: 'in' a file to read, 'data' a file or folder to read,
    'dir' a folder (made if missing), 'out' a file to write. A value of the wrong kind ends in
    one line, 'error: argument --flag: ...', before anything runs."""
    def parse(text):
        p = os.path.expanduser(text)
        if not text:
            why = "is empty"
        else:
            why = next((why for wrong, why in PATH_RULES[kind] if wrong(p)), None)
        if why:
            raise argparse.ArgumentTypeError(f"{text!r} {why}")
        return text
    parse.__name__ = "a path"
    return parse


@dataclass
class Setting:
    """One training setting in its one home: its value in every preset, its type and its help.
    Each drafter's file lists its own (SETTINGS) beside the code that uses them; train.py gathers
    them into its presets and flags. Adding a setting touches that table and the code using it."""
    default: object       # the cpu preset's value (the base every other preset changes)
    help: str
    type: object = None   # the argparse type; None: from the default's (a count >= 1, a rate > 0)
    choices: list = None
    presets: dict = None  # {preset: value} where a preset differs from the cpu preset's

    def value(self, preset):
        """The value in `preset`, or a chain of them (("gpt2", "cuda"): gpt2's where it names
        one, else cuda's), else the cpu preset's."""
        for p in (preset if isinstance(preset, tuple) else (preset,)):
            if p in (self.presets or {}):
                return self.presets[p]
        return self.default

    def flag_type(self):
        """The argparse type: its own, else from its default's (a count >= 1, a rate > 0)."""
        if self.type is not None or self.choices is not None:
            return self.type or str
        return {int: number(int, 1), float: number(float, above=0)}.get(type(self.default), str)


def setting(default, help, type=None, choices=None, **presets):
    """Setting(...), written the way the tables read: setting(1000, "steps", tiny=6, cuda=2000)."""
    return Setting(default, help, type, choices, presets)


def add_settings(parser, groups, preset):
    """One flag per setting (--dflash-iters for dflash_iters), in one argparse group per table
    ({title: {name: Setting}}), each help showing the value `preset` gives it. The flags default
    to None, so a caller can tell a value given from one to take from the preset."""
    for title, table in groups.items():
        group = parser.add_argument_group(title)
        for name, s in table.items():
            value = s.value(preset)
            shown = preset[0] if isinstance(preset, tuple) else preset
            where = f", preset {shown}" if s.presets else ""
            group.add_argument("--" + name.replace("_", "-"), type=s.flag_type(),
                               choices=s.choices, default=None,
                               help=f"{s.help} (default: {'none' if value is None else value}"
                               f"{where})")


def number_list(kind=int, lo=1):
    """An argparse type: comma-separated numbers, each >= lo ('' for none)."""
    one = number(kind, lo)

    def parse(text):
        return [one(t.strip()) for t in text.split(",") if t.strip()]
    parse.__name__ = "list"
    return parse


# -----------------------------------------------------------------------------
# a self-check you can run by hand (the real proofs live in tests/test_gpt.py)

if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, vocab_size=97, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg).double().eval()
    idx = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        full, _, _ = model(idx)
        cache = model.new_cache()
        parts = [model(idx[:, :20], cache=cache)[0]]  # a 20-token prefill, then 20 one-token steps
        parts += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(20, 40)]
    err = (torch.cat(parts, 1) - full).abs().max().item()
    print(f"max |cached - uncached| logit difference in float64: {err:.2e}")
