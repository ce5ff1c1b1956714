"""
serving/drafters.py -- the batched twins of the network drafters, and the twin any drafter has.

serving/batched.py runs the draft-then-verify loop over B requests, each at its own length; a
drafter there is a batched.BatchDrafter. Any batch-1 drafter can be batched row by row (PerRow,
below); the drafters with a network draft every row in one pass instead, with the same weights and
the same bookkeeping as their batch-1 selves, one more axis:
  BatchSmall   draft_small.DraftModel: one ragged cache for the small GPT
  BatchMTP     draft_mtp.MTPDrafter (and EAGLE-3's): one module over a ragged batch
  BatchDFlash, BatchDSpark (serving/dflash.py): DFlash's and DSpark's, one block forward a
               round for every row, and DSpark's rules over the whole batch
Which twin batches which drafter is said once, in the drafter's line of registry/drafters.py.
"""

import torch

from serving import ragged
from serving.batched import BatchDrafter, Confirmed
from draft_mtp import lm_logits

# -----------------------------------------------------------------------------
# any drafter, row by row


class PerRow(BatchDrafter):
    """Any batch-1 Drafter batched the simple way: one copy of it per row (Drafter.fresh), each
    asked in turn. Exact by construction, the reference the native batched drafters are tested
    against, and what prompt lookup (a dictionary per row, on the host) is anyway. Its draft cost
    grows with B: a network drafter run this way pays B forwards a round."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.proto, self.rows = drafter, []

    def begin(self, seqs, hidden):
        self.device = seqs[0].device
        while len(self.rows) < len(seqs):
            self.rows.append(self.proto.fresh())  # state of its own, the same weights
        self.rows = self.rows[:len(seqs)]
        for r, (d, s) in enumerate(zip(self.rows, seqs)):
            d.begin(s.view(1, -1), {k: h[r:r + 1, :s.numel() - 1] for k, h in hidden.items()})

    def propose(self, ks, sampler):
        got = [d.propose(k, sampler.row(r)) if k > 0 else (None, None)
               for r, (d, k) in enumerate(zip(self.rows, ks))]
        counts = [0 if t is None else t.numel() for t, _ in got]
        K = max(counts)
        drafts = torch.zeros(len(ks), K, dtype=torch.long, device=self.device)
        q = None
        for r, ((t, _), c) in enumerate(zip(got, counts)):
            if c:
                drafts[r, :c] = t
        if sampler.mode == "rejection" and K > 0:
            V = next(x for t, x in got if t is not None and t.numel()).size(-1)
            q = torch.zeros(len(ks), K, V, device=self.device, dtype=torch.float64)
            for r, ((_, x), c) in enumerate(zip(got, counts)):
                if c:
                    q[r, :c] = x
            q = q.to(next(x for _, x in got if x is not None).dtype)
        return drafts, counts, q

    def commit(self, kept, new, hidden):
        for r, (d, m) in enumerate(zip(self.rows, kept)):
            if m:
                d.commit(m - 1, new[r, :m], {k: h[r:r + 1, :m] for k, h in hidden.items()})


# -----------------------------------------------------------------------------
# the small GPT


class BatchSmall(BatchDrafter):
    """DraftModel over B rows in one pass: one RaggedCache for the small GPT, each row at its own
    length. A round feeds every row its pending confirmed tokens (1 or 2) and then its drafts one
    step at a time, all rows together; a row that wants fewer drafts gets zero tokens in the
    later steps (packed away). The cache bookkeeping is DraftModel's, per row."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.model = drafter.model

    def begin(self, seqs, hidden):
        self.cache = ragged.new_cache(self.model, len(seqs))
        self.rows = Confirmed(seqs, self.model.config.sequence_len + self.cache.slack)

    @torch.inference_mode()
    def propose(self, ks, sampler):
        S, B, K = self.rows.lengths, len(ks), max(ks)
        pending = [s - n for s, n in zip(S, self.cache.lengths)]  # not yet in the cache (>= 1)
        x = self.rows.at(self.cache.lengths, max(pending))
        counts = [p if k > 0 else 0 for p, k in zip(pending, ks)]
        drafts, qs = [], []
        for j in range(K):
            logits = ragged.forward(self.model, x, self.cache, counts, last_only=True)[0]  # (B, 1, V)
            x, q = sampler.draft(logits, [s + j for s in S], [int(k > j) for k in ks])  # (B, 1)
            drafts.append(x)
            qs.append(q)
            counts = [1 if k > j + 1 else 0 for k in ks]  # the last draft is never fed
        q = torch.cat(qs, 1) if qs[0] is not None else None
        return torch.cat(drafts, 1), list(ks), q

    def commit(self, kept, new, hidden):
        S = self.rows.lengths
        # row r keeps its confirmed prefix plus the surviving drafts it was fed
        self.cache.rollback([min(n, s + max(m - 1, 0)) if m else n
                             for n, s, m in zip(self.cache.lengths, S, kept)])
        self.rows.extend(new, kept)


# -----------------------------------------------------------------------------
# MTP and EAGLE-3: one module


class BatchMTP(BatchDrafter):
    """MTPDrafter over B rows, for the one-module head (n_modules = 1, what train.py makes; a
    deeper stack is batched row by row, PerRow): one RaggedCache for the module, each row
    at its own length. A round first lets every row catch up on the target states its last
    commit handed over (a ragged chunk, packed), whose last output drafts its first token; then
    the module recurses on its own outputs, every row at once, a row that wants fewer drafts
    getting zero tokens. Bookkeeping per row exactly as MTPDrafter's (its docstring)."""

    @classmethod
    def takes(cls, drafter):
        return drafter.mtp.config.n_modules == 1  # a deeper stack: row by row

    def __init__(self, drafter):
        if not self.takes(drafter):
            raise ValueError("BatchMTP batches a one-module MTP head; wrap a deeper one in "
                             "PerRow")
        super().__init__(drafter)
        self.mtp, self.target, self.mod = drafter.mtp, drafter.target, drafter.mtp.mods[0]
        self.features = drafter.features

    def begin(self, seqs, hidden):
        cfg, p, B = self.mtp.config, self.target.lm_head.weight, len(seqs)
        self.cache = ragged.RaggedCache(cfg.layer_config(), B, p.device, p.dtype)
        width = cfg.sequence_len + self.cache.slack
        self.rows = Confirmed(seqs, width)
        self.H = torch.zeros(B, width, cfg.n_embd, device=p.device, dtype=p.dtype)  # h_0, h_1, ..
        h = self.features(hidden)  # (B, T, d)
        self.H[:, :h.size(1)] = h

    def step(self, h, toks, counts):
        """The module over row r's counts[r] entries (h, toks) at its next indices -> (B, T, d)."""
        rag = ragged.Ragged(self.cache.lengths, counts, h.size(1), h.device)
        emb = self.target.transformer.wte(toks)
        x = self.mod.mix(rag.pack(h), rag.pack(emb))
        out = ragged.layer(self.mod.layer, x, (self.cache.k[0], self.cache.v[0]), rag)
        self.cache.lengths = [n + c for n, c in zip(self.cache.lengths, counts)]
        return rag.unpack(out), rag

    @torch.inference_mode()
    def propose(self, ks, sampler):
        S, first = self.rows.lengths, self.cache.lengths
        # catch up: entries first..S-2, (h_i, t_{i+1}); the output at S-2 drafts token S
        chunk = [s - 1 - f if k > 0 else 0 for s, f, k in zip(S, first, ks)]
        T = max(max(chunk), 1)
        idx = torch.tensor(first, device=self.H.device)[:, None] + torch.arange(
            T, device=self.H.device)
        h = self.H.gather(1, idx[..., None].expand(-1, -1, self.H.size(2)))
        out, rag = self.step(h, self.rows.at([f + 1 for f in first], T), chunk)
        h_last = rag.last(out)  # (B, 1, d)
        drafts, qs = [], []
        for j in range(max(ks)):
            if j > 0:  # the recursion: its own last output and its own last draft
                h_last, _ = self.step(h_last, drafts[-1], [int(k > j) for k in ks])
            tok, q = sampler.draft(lm_logits(self.target, h_last), [s + j for s in S],
                                   [int(k > j) for k in ks])
            drafts.append(tok)
            qs.append(q)
        q = torch.cat(qs, 1) if qs[0] is not None else None
        return torch.cat(drafts, 1), list(ks), q

    def commit(self, kept, new, hidden):
        S = self.rows.lengths
        # exact entries only (indices < S - 1); the target's states of the kept slots go to H
        self.cache.rollback([min(n, s - 1) if m else n
                             for n, s, m in zip(self.cache.lengths, S, kept)])
        h = self.features(hidden)  # (B, T, d)
        pos = torch.tensor([s - 1 for s in S], device=h.device)[:, None] + torch.arange(
            h.size(1), device=h.device)
        self.H[torch.arange(h.size(0), device=h.device)[:, None], pos] = h
        self.rows.extend(new, kept)
