"""
gpt.py -- the target model: a GPT-2 (nanoGPT-style) with a static KV cache that can roll back.

training/data.py gave us the corpus and tokenizer; this file adds the model trained on them, which
speculative.py and every draft_*.py file build on.

This is the model every drafter in nanospec drafts *for*. It is nanoGPT's model.py with
three things added, all of which speculative decoding needs:

1. A static, preallocated KV cache (the attention keys and values of every position so far,
   as in gpt-fast). One forward call takes T new tokens at an explicit start position, so
   prefill (T = prompt length), a one-token decode step (T = 1) and a k-token verify
   (T = k + 1) are literally the same call; tree.py's verify of a tree is the same call too.
2. Explicit rollback: `cache.rollback(n)` forgets everything at positions >= n. After a
   verify pass in which only some drafted tokens survive, the rejected tail is dropped here.
   Stale K/V past `cache.length` are never attended to and get overwritten by the next call.
3. Hidden states of any requested layers come back with the logits (DFlash taps several
   layers, MTP needs the last one).

That is all: many requests at once (ragged.py, which speculative.py's loop runs on) and the CPU's
faster kernels (runtime/cpu_speed.py) are applied to this model from outside, the way gpt-fast's
tp.py and quantize.py change its model.py.
llama.py builds the other target, the Llama / Qwen family, on this file's classes: it replaces the
norm, the attention's projections (heads()), the MLP and the input (embed()), and inherits the rest.

Parameter names are nanoGPT's (transformer.wte, transformer.h.0.attn.c_attn, ...), so a
state_dict maps onto other GPT-2 implementations.

    python gpt.py    # a quick self-check: cached logits == uncached logits, in float64
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

# -----------------------------------------------------------------------------
# config


@dataclass
class GPTConfig:
    sequence_len: int = 256  # context window; also the size of the preallocated KV cache
    #                          (nanoGPT's block_size: in this lesson a "block" is only DFlash's,
    #                          the anchor + masks it fills in one pass)
    vocab_size: int = 4096  # our byte-level BPE, end-of-text included (GPT-2's is 50257)
    n_layer: int = 6        # depth: what makes the target expensive to run token by token
    n_head: int = 8         # head size = n_embd / n_head
    n_embd: int = 256       # width
    dropout: float = 0.0    # 0 for the short runs here: we are far from overfitting
    bias: bool = True       # GPT-2 has biases in Linears and LayerNorms
    activation: str = "gelu"  # the MLP's: "gelu" (exact; nanospec's own targets) or "gelu_new"
    #                           (the tanh approximation OpenAI's GPT-2 weights were trained with)

    @property
    def n_kv_head(self):  # heads of keys and values: every query head has its own here (llama.py
        return self.n_head  # shares them between groups of query heads)

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        """The config a checkpoint recorded: every field of today's, no other (a checkpoint of
        another layout is retrained, not read)."""
        fields = set(cls.__dataclass_fields__)
        missing, unknown = sorted(fields - set(d)), sorted(set(d) - fields)
        if missing or unknown:
            raise ValueError(f"the checkpoint's GPT config is not this version's (missing "
                             f"{missing}, unknown {unknown}): retrain it (python train.py --force)")
        if d["activation"] not in GELU:
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

    def __init__(self, config, batch_size=1, device="cpu", dtype=torch.float32):
        self.max_len = config.sequence_len
        # (n_layer, B, n_kv_head, Tmax, hs)
        shape = (config.n_layer, batch_size, config.n_kv_head, self.max_len, config.head_dim)
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


# -----------------------------------------------------------------------------
# the model: attention -> MLP -> layer -> GPT

# the attention kernel, looked up at every call: cpu_speed.enable() swaps in a faster CPU
# training path from outside, for every model alike
sdpa = F.scaled_dot_product_attention


def attention(q, k, v, mask=None, is_causal=False, dropout_p=0.0):
    """softmax(q k^T / sqrt(hs) + mask) v, by `sdpa`.
    q (B, nh, Tq, hs), k and v (B, nh, Tk, hs); mask broadcastable to (B, nh, Tq, Tk), either
    boolean (True = may attend, SDPA's convention) or additive float (-inf: not visible).
    is_causal: query i sees keys 0..Tk-Tq+i, i.e. the queries are the LAST Tq positions of the
    keys (a chunk after cached keys), aligned bottom-right; SDPA's own is_causal aligns
    top-left, which is the same only when Tq == Tk."""
    Tq, Tk = q.size(2), k.size(2)
    if k.size(1) != q.size(1):  # grouped-query attention (llama.py): each K/V head serves a group
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    if is_causal:
        if mask is not None:
            raise ValueError("attention: give a mask or is_causal, not both")
        if Tq > Tk:
            raise ValueError(f"attention: is_causal with {Tq} queries but only {Tk} keys: the "
                             "first queries would see no key at all")
        if Tq < Tk:  # SDPA would align it top-left: pass the bottom-right mask instead
            mask, is_causal = chunk_mask(Tk - Tq, Tq, q.device), False
    return sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


# -----------------------------------------------------------------------------
# row invariance: every row of a verify computed exactly as a one-row decode computes it
#
# Why speculative decoding changes the text in most engines: a verify computes k + 1 rows in one
# call, plain decoding one row, and kernels pick their tiles, splits and vector paths by shape, so
# row i's sum runs in another order and rounds differently. Where two tokens' logits nearly tie,
# that last bit flips the argmax, and the text leaves plain decoding's. In float64 (the tests'
# proofs) the rounding is too small to flip anything; in float32 it rarely does; in bfloat16 often.
# What it takes not to: every operation computes each row as a decode of that row computes it.
# Norms, the MLP's activation, rotations, residual adds and the head's argmax work row by row
# already. The matmuls need kernels whose sum over K does not depend on the row count (the
# int4 kernels of formats/gguf_int4.py). The attention needs each query row over exactly the keys
# its decode sees, in the decode's order, padded alike: attention_by_row.

BUCKET = 64  # a row's keys are padded (masked) to a multiple of this: the shape a decode uses too


class Rows:
    """Which keys each of a forward's query rows sees, grouped into attention calls; built once a
    forward (GPT.forward, when the model attends by_row) and read by every layer. seen (B, T, S):
    the cache slots each row sees. A row that sees n keys attends over n slots padded to a
    multiple of BUCKET, as its decode does; the rows of a chain (each sees a prefix of the
    cache) share one call per padded size; a tree node (the prefix and its own path) gets its
    keys gathered, in the order a decode keeps them, in a call of its own."""

    def __init__(self, seen, n_head, dtype):
        n = seen.sum(-1)  # (B, T) keys each row sees
        size = ((n + BUCKET - 1) // BUCKET * BUCKET).tolist()
        prefix = torch.equal(seen, torch.arange(seen.size(-1), device=seen.device) < n[..., None])
        # (batch row, padded size L, a slice of query rows, gathered slots or None,
        #  the mask (1, n_head * rows, 1, L): 0 where a row sees the slot, -inf where not)
        self.groups = []
        for b, sizes in enumerate(size):
            runs = ([(L, [t for t, s in enumerate(sizes) if s == L]) for L in sorted(set(sizes))]
                    if prefix else [(L, [t]) for t, L in enumerate(sizes)])
            for L, rows in runs:
                rows = slice(rows[0], rows[-1] + 1)  # a run of rows
                own = None if prefix else seen[b, rows.start].nonzero()[:, 0]  # a node's keys
                idx = None if prefix else F.pad(own, (0, L - own.numel()))  # padded with slot 0
                live = torch.arange(L, device=seen.device) < n[b, rows, None]  # (r, L)
                hide = torch.zeros(live.shape, device=seen.device, dtype=dtype)
                hide = hide.masked_fill(~live, -math.inf).expand(n_head, *live.shape)
                self.groups.append((b, L, rows, idx, hide.reshape(1, -1, 1, L)))

    @classmethod
    def of(cls, mask, B, T, start, cache, n_head):
        """The Rows of T query rows at `start`.. over `cache` (its k: (.., S, hs)): mask None
        (causal: row i sees slots 0..start+i), (T, start+T) (a chunk or a tree) or (B, 1, T, L)
        (a ragged batch)."""
        if mask is None:
            mask = chunk_mask(start, T, cache.k.device)
        mask = mask[:, 0] if mask.dim() == 4 else mask[None]
        seen = F.pad(mask.bool(), (0, cache.k.size(-2) - mask.size(-1))).expand(B, T, -1)
        return cls(seen, n_head, cache.k.dtype)


def attention_by_row(q, k, v, rows):
    """attention(), each query row computed bit for bit as a one-row decode at its position
    computes it. q (B, nh, T, hs); k, v (B, nkv, S, hs) the whole cache; rows: Rows. Each query
    row is a head of its own (every (head, row) pair one head of the call), so no other row changes
    the shape its kernel sees; its keys are the decode's keys, padded alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # SDPA's per-thread buffers round a head by the thread that ran it
    try:
        return by_row(q, k, v, rows)
    finally:
        torch.set_num_threads(threads)


def by_row(q, k, v, rows):
    """attention_by_row's calls, one per group of rows (Rows.groups)."""
    B, nh, T, hs = q.shape
    y = torch.empty_like(q) if len(rows.groups) > 1 else None
    for b, L, r, idx, mask in rows.groups:
        if idx is None and L > k.size(2):  # padded past the cache's end: any slots (masked)
            idx = torch.arange(L, device=q.device).clamp_max(k.size(2) - 1)
        kb, vb = ((k[b:b + 1, :, :L], v[b:b + 1, :, :L]) if idx is None
                  else (k[b:b + 1, :, idx], v[b:b + 1, :, idx]))  # (1, nkv, L, hs)
        n = r.stop - r.start
        qh = q[b:b + 1, :, r].reshape(1, nh * n, 1, hs)
        out = F.scaled_dot_product_attention(qh, kb, vb, attn_mask=mask,
                                             enable_gqa=nh != k.size(1)).view(1, nh, n, hs)
        if y is None:  # one call for every row (a decode, a short verify)
            return out
        y[b:b + 1, :, r] = out
    return y


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # q, k, v in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def heads(self, qkv, at=None):
        """c_attn's output (B, T, 3C) -> q, k, v, each (B, nh, T, hs). GPT-2 needs no positions
        here (wpe added them at the input); llama.py rotates q and k by them (`at`: what
        GPT.positions gave)."""
        B, T, C3 = qkv.size()
        return (t.view(B, T, self.n_head, C3 // 3 // self.n_head).transpose(1, 2)
                for t in qkv.split(C3 // 3, dim=2))

    def forward(self, x, kv=None, start=0, attn_mask=None, at=None):
        B, T, C = x.size()
        q, k, v = self.heads(self.c_attn(x), at)  # each (B, nh, T, hs)
        if kv is not None:
            # write the new K/V at their absolute positions, attend over [0, start + T): no more
            k_cache, v_cache = kv
            k_cache[:, :, start:start + T] = k
            v_cache[:, :, start:start + T] = v
            if isinstance(attn_mask, Rows):  # each row as its decode computes it (above)
                y = attention_by_row(q, k_cache, v_cache, attn_mask)
                return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))
            k, v = k_cache[:, :, :start + T], v_cache[:, :, :start + T]
        dp = self.dropout if self.training else 0.0
        # attn_mask None: plain causal self-attention over these T tokens only
        y = attention(q, k, v, attn_mask, attn_mask is None and T > 1, dp)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # the drafters' own configs, which build this MLP too, have no activation: the exact GELU
        self.gelu = nn.GELU(approximate=GELU[getattr(config, "activation", "gelu")])
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Layer(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv=None, start=0, attn_mask=None, at=None):
        x = x + self.attn(self.ln_1(x), kv, start, attn_mask, at)
        x = x + self.mlp(self.ln_2(x))
        return x


def chunk_mask(start, T, device):
    """Boolean mask (T, start+T) for T new queries at positions start.. over all keys so far:
    query i (absolute position start+i) may see keys at positions <= start+i."""
    q_pos = torch.arange(start, start + T, device=device)
    k_pos = torch.arange(start + T, device=device)
    return k_pos[None, :] <= q_pos[:, None]


class GPT(nn.Module):
    by_row = False  # cached forwards attend by row (Rows): formats/gguf_int4.py sets it

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.sequence_len, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Layer(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
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

    def embed(self, idx, pos):
        """Token ids (B, T) at positions pos -> the first layer's input (B, T, C)."""
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def positions(self, pos):
        """What every layer needs of the positions: nothing here (wpe added them at the input);
        llama.py's layers rotate q and k by them."""
        return pos

    def new_cache(self, batch_size=1, device=None, dtype=None):
        """A KVCache for this model, on its device and in its dtype unless told."""
        p = self.lm_head.weight
        return KVCache(self.config, batch_size, device or p.device, dtype or p.dtype)

    def forward(self, idx, targets=None, cache=None, start=None, hidden_layers=(), last_only=False,
                tree=None):
        """idx (B, T) token ids at absolute positions start .. start+T-1.

        cache=None: an ordinary full-sequence forward from position 0 (training).
        cache given: `start` defaults to cache.length and must equal it (write at a gap or over
          valid entries is a bookkeeping bug: roll back first). After: cache.length == start + T.
        hidden_layers: which hidden states to return; layer 0 is the embedding output, layer i
          the output of layer i (so n_layer is the last layer, before ln_f).
        last_only: compute logits for the last position only (cheap one-token decoding).
        tree: (depth (T,), mask (T, start+T)) of T draft-tree tokens (tree.py): token i sits at
          position start + depth[i] and sees what its row of the mask allows.
        Returns (logits, loss, hiddens) with hiddens a dict {layer: (B, T, n_embd)}.
        """
        B, T = idx.size()
        if cache is not None:
            if start is None:
                start = cache.length
            if start != cache.length:
                raise ValueError(f"forward at position {start} but the cache holds "
                                 f"{cache.length}: roll back first")
        start = start or 0
        if start + T > self.config.sequence_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds the context window of "
                             f"{self.config.sequence_len}")

        pos = torch.arange(start, start + T, device=idx.device) if tree is None else start + tree[0]
        x = self.embed(idx, pos)  # (B, T, C)
        # one-token steps need no mask; prefill from 0 uses is_causal; a chunk after a prefix
        # (the verify pass) needs the explicit rectangular causal mask; a tree brings its own
        chunk_after_prefix = cache is not None and start > 0 and T > 1 and tree is None
        mask = chunk_mask(start, T, idx.device) if chunk_after_prefix else tree and tree[1]
        if self.by_row and cache is not None:  # which keys each row sees, once for every layer
            mask = Rows.of(mask, B, T, start, cache, self.config.n_head)
        hiddens = {0: x} if 0 in hidden_layers else {}
        at = self.positions(pos)
        for i, layer in enumerate(self.transformer.h):
            kv = (cache.k[i], cache.v[i]) if cache is not None else None
            x = layer(x, kv, start, mask, at)
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


# -----------------------------------------------------------------------------
# a self-check you can run by hand (the real proofs live in tests/test_gpt.py)

@torch.no_grad()
def cache_check(model):
    """Max |cached - uncached| logit difference over 40 random tokens: one full forward against
    a 20-token prefill then 20 one-token steps (llama.py runs it too)."""
    idx = torch.randint(0, model.config.vocab_size, (1, 40))
    full, _, _ = model(idx)
    cache = model.new_cache()
    parts = [model(idx[:, :20], cache=cache)[0]]
    parts += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(20, 40)]
    return (torch.cat(parts, 1) - full).abs().max().item()


if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2, n_embd=32)
    err = cache_check(GPT(cfg).double().eval())
    print(f"max |cached - uncached| logit difference in float64: {err:.2e}")
