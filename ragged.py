"""
ragged.py -- many requests at once: a KV cache with a length per row, the model's forward over it,
and each row's confirmed tokens.

gpt.py runs one sequence (or B of the same length) at one start position, and speculative.py's
loop one request. A server decodes many requests together, so that every weight read from memory
serves all of them, and requests are never the same length: each row sits at its own position and
gets its own number of new tokens a forward (a verify of 5, a plain step of 1, a finished row 0).
This file gives gpt.py's model (and llama.py's) that layout, from outside, with the same weights
and, row by row, the same arithmetic:
  RaggedCache  gpt.KVCache with a length per row, and per-row O(1) rollback
  Ragged       where a forward's real tokens are: positions, the mask built from them, and the
               packing that runs the Linears and MLPs on the real tokens only (Packing)
  forward()    gpt.GPT.forward over a RaggedCache (the attention padded, everything else packed)
  Confirmed    each row's confirmed tokens on the device: what a drafter reads its inputs from
speculative.py's loop runs on it (one request being a batch of one), and so do the drafters that
draft for many rows in one pass (draft_small.py's, draft_mtp.py's, draft_dflash.py's).
"""

import torch

from gpt import Rows, attention, attention_by_row, chunk_mask

# -----------------------------------------------------------------------------
# the cache and the batch layout


class RaggedCache:
    """gpt.KVCache for B rows that each have their own length (many requests at once).

    lengths[r]: the valid positions of row r. A forward over a ragged batch writes row r's new
    tokens at lengths[r].. and its padding slots after them: padding and stale K/V always sit past
    every valid query of their row, so the mask built from positions never shows them (Ragged).
    `slack` extra positions past the context window hold the padding of a row that is already
    near the end of it. Rollback is per row and O(1), like KVCache's: a list of new lengths."""

    def __init__(self, config, batch_size, device="cpu", dtype=torch.float32, slack=64):
        self.max_len, self.slack = config.sequence_len + slack, slack
        # (n_layer, B, n_kv_head, Tmax, hs)
        shape = (config.n_layer, batch_size, config.n_kv_head, self.max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = [0] * batch_size

    def rollback(self, ns):
        """Row r forgets its positions >= ns[r]."""
        if len(ns) != len(self.lengths) or not all(0 <= n <= m for n, m in zip(ns, self.lengths)):
            raise ValueError(f"cannot roll back rows of lengths {self.lengths} to {list(ns)}")
        self.lengths = list(ns)

    def reset(self):
        self.lengths = [0] * len(self.lengths)


def offsets(starts, T, device):
    """(B, T): starts[r] + t for t < T, on the device. Where every row starts alike (always so for
    one request) made there, with nothing uploaded: an upload a forward would be a host round
    trip on a GPU."""
    if len(set(starts)) == 1:
        return torch.arange(starts[0], starts[0] + T, device=device).expand(len(starts), T)
    return torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)


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
        idx = offsets([max(c - 1, 0) for c in self.counts], 1, x.device)  # (B, 1)
        return x[torch.arange(self.B, device=x.device)[:, None], idx]


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
        self.pos = offsets(starts, T, device)
        self.L = max(starts) + T  # keys to attend over: through the last slot written
        # every row at one position (always so at batch 1): the batch-1 path's slice writes and
        # masks, which cost less than per-row indexing
        self.start = starts[0] if len(set(starts)) == 1 else None
        if self.start is not None:
            self.mask = chunk_mask(self.start, T, device) if T > 1 else None
        else:
            self.mask = (torch.arange(self.L, device=device) <= self.pos[..., None])[:, None]
        self.rows = torch.arange(self.B, device=device)[:, None, None]
        self.at = self.pos  # what the layers need of the positions (forward: model.positions)
        self.by_row = None  # gpt.Rows where the model attends by row (forward)

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


def new_cache(model, batch_size, device=None, dtype=None):
    """A RaggedCache for `model` (a gpt.GPT), on its device and in its dtype unless told."""
    p = model.lm_head.weight
    return RaggedCache(model.config, batch_size, device or p.device, dtype or p.dtype)


# -----------------------------------------------------------------------------
# the target's forward over a ragged batch


def attend(attn, x, kv, rag):
    """gpt.CausalSelfAttention (or llama.py's) over a ragged batch: x, the real tokens packed,
    (N, C) (or (B, T, C) with no padding); rag: where they are. The projections run on the packed
    rows; the attention on the padded (B, nh, T, hs)."""
    q, k, v = attn.heads(rag.unpack(attn.c_attn(x)), rag.at)  # each (B, heads, T, hs)
    B, T = q.size(0), q.size(2)
    k, v = rag.write(kv[0], k), rag.write(kv[1], v)  # (B, n_kv_head, L, hs)
    if rag.by_row is not None:  # each row as its batch-1 decode computes it: the whole cache
        y = attention_by_row(q, kv[0], kv[1], rag.by_row)
    else:
        y = attention(q, k, v, rag.mask)
    y = y.transpose(1, 2).reshape(B, T, -1)
    return attn.resid_dropout(attn.c_proj(rag.pack(y)))


def layer(lay, x, kv, rag):
    """gpt.Layer `lay` over a ragged batch: the same two residual steps, attention by attend()."""
    x = x + attend(lay.attn, lay.ln_1(x), kv, rag)
    return x + lay.mlp(lay.ln_2(x))


def forward(model, idx, cache, counts=None, hidden_layers=(), last_only=False):
    """gpt.GPT.forward over a RaggedCache: row r's first counts[r] tokens of idx (B, T) are real
    and go at positions cache.lengths[r]..; the rest is padding. The same logits and hidden
    states (B, T, ...) as running each row alone (up to float rounding) at the real slots; the
    padding slots hold zeros or what the padding computed (Packing). -> (logits, None, hiddens)."""
    B, T = idx.size()
    counts = list(counts) if counts is not None else [T] * B
    starts, window = cache.lengths, model.config.sequence_len
    if len(counts) != B or not all(0 <= c <= T for c in counts):
        raise ValueError(f"counts {counts} do not fit a batch of {B} rows of {T} tokens")
    if max(starts) + T > cache.max_len:  # padding slots too are written at their positions
        raise ValueError(f"a ragged forward of {T} slots after {max(starts)} cached positions "
                         f"overruns the cache ({cache.max_len} positions, its slack included)")
    if any(s + c > window for s, c in zip(starts, counts)):
        raise ValueError(f"sequence exceeds the context window of {window}")
    rag = Ragged(starts, counts, T, idx.device)
    rag.at = model.positions(rag.pos)  # what the target's layers need of the positions
    if model.by_row:  # which keys each row sees, as gpt.GPT.forward builds it
        rag.by_row = Rows.of(rag.mask, B, T, rag.start, cache, model.config.n_head)
    pos = rag.pos.clamp_max(window - 1)  # a padding slot past the window: any position will do
    x = rag.pack(model.embed(idx, pos))
    hiddens = {0: rag.unpack(x)} if 0 in hidden_layers else {}
    for i, lay in enumerate(model.transformer.h):
        x = layer(lay, x, (cache.k[i], cache.v[i]), rag)
        if i + 1 in hidden_layers:
            hiddens[i + 1] = rag.unpack(x)
    cache.lengths = [s + c for s, c in zip(starts, counts)]
    x = rag.unpack(model.transformer.ln_f(x))  # (B, T, C)
    if last_only:
        x = rag.last(x)
    return model.lm_head(x), None, hiddens


# -----------------------------------------------------------------------------
# each row's confirmed tokens


class Confirmed:
    """Each row's confirmed tokens, kept on the device as one (B, width) buffer with the lengths
    on the host: what a native batched drafter reads its anchors and pending tokens from."""

    def __init__(self, seqs, width):
        self.lengths = [s.numel() for s in seqs]
        self.toks = torch.zeros(len(seqs), width, dtype=torch.long, device=seqs[0].device)
        for r, s in enumerate(seqs):
            self.toks[r, :s.numel()] = s

    def at(self, starts, T):
        """(B, T): row r's tokens at starts[r] .. starts[r] + T - 1 (past its end: whatever)."""
        idx = offsets(starts, T, self.toks.device)
        return self.toks.gather(1, idx.clamp_max(self.toks.size(1) - 1))

    def last(self):
        """(B,) each row's last confirmed token."""
        return self.at([n - 1 for n in self.lengths], 1)[:, 0]

    def extend(self, new, kept):
        """Row r appends new[r, :kept[r]] (the slots after them land past its end: stale)."""
        T = new.size(1)
        idx = offsets(self.lengths, T, new.device).clamp_max(self.toks.size(1) - 1)
        self.toks.scatter_(1, idx, new)
        self.lengths = [n + m for n, m in zip(self.lengths, kept)]
