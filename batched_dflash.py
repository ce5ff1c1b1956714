"""
batched_dflash.py -- DFlash and DSpark over a batch of requests: one block forward a round for
every row, and DSpark's Markov chain and verify budget over the whole batch.

draft_dflash.py and draft_dspark.py draft for one request; batched.py runs the loop over B
requests, each at its own length. BatchDFlash keeps one static K/V cache per draft layer with a
context length per row and runs every row's block in one forward (the same weights and the same
bookkeeping as DFlashDrafter, one more axis). BatchDSpark adds the Markov chain for every row at
once and the scheduler as the DSpark paper defines it, over the whole batch: the rules and the
cost table they read are batch_rules.py's.
"""

import time

import numpy as np
import torch

import ragged
from batch_rules import (CostTable, admit_batch, best_single_k, fill_budget, interpolate,
                         plan_budget)
from batched import BatchDrafter, Confirmed
from devices import synchronize
from draft_dspark import SCORE_EVERY, markov_chain
from draft_dflash import rope
from gpt import attention


# -----------------------------------------------------------------------------
# DFlash: one block forward a round


def injected_attention(attn, x, cs, kv, rag, mask):
    """draft_dflash.InjectedAttention over a ragged batch. x: the real slots packed (N, C), or
    (B, T, C) with no padding. The projections run on the packed rows, the attention on the padded
    (B, nh, T, hs); K/V written per row."""
    q = rope(attn.heads(rag.unpack(attn.c_q(x))), *cs)  # (B, nh, T, hs)
    k, v = rag.unpack(attn.c_kv(x)).split(x.size(-1), dim=2)
    k, v = rag.write(kv[0], rope(attn.heads(k), *cs)), rag.write(kv[1], attn.heads(v))
    y = attention(q, k, v, mask)  # (B, nh, T, hs)
    B, nh, T, hs = y.shape
    return attn.c_proj(rag.pack(y.transpose(1, 2).reshape(B, T, nh * hs)))


def draft_layer(layer, x, cs, kv, rag, mask):
    """draft_dflash.DraftLayer over a ragged batch: the same two residual steps."""
    x = x + injected_attention(layer.attn, layer.ln_1(x), cs, kv, rag, mask)
    return x + layer.mlp(layer.ln_2(x))


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

    def draft_states(self, ks):
        """Every row's anchor + masks through the draft layers at once -> (B, K, d): the states
        that draft each row's next K = max(ks) tokens (row r's first ks[r] are its own; zeros
        after). A row drafting nothing has no slot at all: the Linears run on real slots only."""
        self.flush()
        shift, K = self.net.config.shift, max(ks)
        slots = K + 1 - shift
        x = self.net.block_input(self.rows.last()[:, None], slots)  # (B, slots, d)
        real = [k + 1 - shift if k > 0 else 0 for k in ks]
        rag = ragged.Ragged(self.n_ctx, real, slots, x.device)
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
            x = draft_layer(layer, x, cs, kv, rag, mask)
        return rag.unpack(x)[:, 1 - shift:1 - shift + K]

    def head(self, h, ks):
        """The target's ln_f and LM head on each row's real draft states only -> (B, K, V)."""
        pk = ragged.Packing(ks, h.size(1), h.device)
        return pk.unpack(self.net.head(pk.pack(h)))

    @torch.inference_mode()
    def propose(self, ks, sampler):
        h = self.draft_states(ks)  # (B, K, d)
        toks, q = sampler.draft(self.head(h, ks), self.rows.lengths, ks)
        return toks, list(ks), q

    @torch.inference_mode()
    def commit(self, kept, new, hidden):
        self.stash(hidden, kept)
        self.rows.extend(new, kept)


# -----------------------------------------------------------------------------
# DSpark: DFlash's block, the Markov chain, and one verify budget for the whole batch

# the batched budget rule (BatchDSpark) probes with this many drafts a row when it has no estimate
# (and every SCORE_EVERY-th round while it drafts nothing): enough to see whether drafting pays
PROBE_WIDTH = 2
MAX_WAIT = 256
# after OFF_AFTER batches in a row at one batch size skipped the draft in OFF_SHARE of their
# rounds, its batches are decoded plainly from the start (the drafter off), except one in
# OFF_EVERY, which looks again
OFF_AFTER, OFF_SHARE, OFF_EVERY, OFF_COST = 1, 0.9, 16, 2.0
# the budget rule drafts only where its tables promise more than this much over a round without a
# draft: below it, the tables' own error decides, and the rounds it drafted lost
# (docs/experiments.md: Batched: the budget rule's margin)
PLAN_MARGIN = 0.25
CALIBRATION_PRIOR = 5.0  # pseudo-rounds at the confidence head's own estimate (recalibrate)


BATCH_SCHEDULES = ("auto", "goodput", "budget", "full")


class BatchDSpark(BatchDFlash):
    """DSparkDrafter over B rows: the batched DFlash block, then the Markov chain for every row at
    once, then every row's confidences in one product and ONE host read, then one choice of how
    many drafts each row verifies:
      auto     DSpark's Algorithm 1 over the whole batch (batch_rules.admit_batch): (row, position)
               pairs admitted in order of survival until expected throughput stops rising;
      goodput  one length for every row, the best for the batch (batch_rules.best_single_k), the rule
               a serving engine without per-request lengths uses;
      budget   the production variant: the budget is set before drafting from the previous
               round's survivals (batch_rules.plan_budget), so a round the cost table says will not
               pay skips the draft itself; fresh confidences then fill it (batch_rules.fill_budget);
      full     every row verifies all it drafted (a fixed k).
    The cost table (batch_rules.CostTable) and the draft's cost by width (time_draft) are profiled
    once per batch size, at the first begin(); what they miss is measured as the rounds run
    (measure)."""

    def __init__(self, drafter, schedule="auto"):
        if schedule not in BATCH_SCHEDULES:
            raise ValueError(f"unknown batch schedule {schedule!r}: use {', '.join(BATCH_SCHEDULES)}")
        super().__init__(drafter)
        self.spark, self.schedule = drafter.spark, schedule
        self.markov_table = drafter.markov_table
        self.conf_h, self.conf_code = drafter.conf_h, drafter.conf_code
        self.conf_temp = drafter.spark.conf_temp.to(self.conf_h.dtype)
        self.costs = {}  # batch size -> (CostTable, t_draft)
        self.flush_cost = {}  # batch size -> seconds per pending target state a flush takes
        self.new_account()

    def new_account(self):
        """What it learns as it runs, from nothing: per batch size the measured corrections to its
        tables (adapt) and the batches begun; its rounds and skipped rounds; the recalibration
        sums (per draft position: survivals seen, survivals predicted); this batch's state."""
        self.adapt, self.batches, self.rounds, self.skipped = {}, {}, 0, 0
        self.calibration = np.zeros((2, self.max_k))
        self._scored, self.batch_rounds, self.skipped_in_batch, self.batch_size = None, 0, 0, None
        self.estimate = None

    @torch.inference_mode()
    def begin(self, seqs, hidden):
        super().begin(seqs, hidden)
        B = len(seqs)
        if self.schedule != "full" and B not in self.costs:
            table = CostTable.profile(self.net.target, B, self.max_k + 1)
            t_draft, per_state = self.time_draft(B)
            self.costs[B] = (table, t_draft)
            self.flush_cost[B] = per_state
        self.account(B)
        # new requests: no estimate of their own yet (the first round probes), and the head's
        # confidences taken at their word again
        self.estimate, self._last, self.idle, self._plan = None, None, 0, None
        self.calibration = np.zeros((2, self.max_k))

    def plain_batch(self, B):
        """budget, asked before each batch (batched.BatchDrafter): where OFF_AFTER batches in a
        row at this batch size found that no draft pays (they gave OFF_SHARE of their rounds no
        draft), the batch is decoded on plain decoding's own path, start to end, and costs
        nothing; one batch in OFF_EVERY drafts and looks again (only where the widest verify
        costs OFF_COST times a plain step or more: below that a wrong "off" loses most of what
        speculation makes, a wrong "on" only the bookkeeping)."""
        if self.schedule != "budget":
            return False
        if self.batch_rounds:  # the batch before, if it drafted: did it draft at all?
            done = self.skipped_in_batch >= OFF_SHARE * self.batch_rounds
            before = self.adapt[self.batch_size]
            before["failed"] = before["failed"] + 1 if done else 0
        self.batch_rounds, self.skipped_in_batch, self.batch_size = 0, 0, B
        ad = self.account(B)
        self.batches[B] = self.batches.get(B, 0) + 1
        if B not in self.costs:
            return False  # a batch size not seen yet drafts: begin() profiles it
        table = self.costs[B][0]
        dear = table.seconds[-1] >= OFF_COST * table.seconds[0]
        return dear and ad["failed"] >= OFF_AFTER and bool(self.batches[B] % OFF_EVERY)

    def account(self, B):
        """What the rounds at batch size B have measured so far (measure, planned), and the
        batches there that found no draft pays (plain_batch): made at the first batch."""
        return self.adapt.setdefault(B, {"scale": 1.0, "rest": [0.0, 0.0], "wait": SCORE_EVERY,
                                         "failed": 0, "width": PROBE_WIDTH})

    def time_draft(self, B, reps=5):
        """Seconds of one draft of all B rows, w drafts each, at a few w (fastest of reps) ->
        t_draft(slots), slots = B * (w + 1) block slots in all, linear in between (the draft's
        Linears run on real slots only, so its cost follows their total); and the seconds per
        target state a flush takes (a draft after skipped rounds first projects their context).
        Each try follows a target forward, as a draft does in the loop: timed back to back, the
        drafter's weights stay in the cache and a draft looks several times cheaper than it is.
        Proposing writes only past every row's context, so it runs on the state begin() made."""
        target, dev = self.net.target, self.k_cache.device
        scratch = ragged.new_cache(target, B)
        x = torch.zeros(B, 1, dtype=torch.long, device=dev)

        def timed(fn):
            best = float("inf")
            for _ in range(reps):
                scratch.reset()
                ragged.forward(target, x, scratch)  # the target's weights back in the cache
                synchronize(dev)
                t0 = time.perf_counter()
                fn()
                synchronize(dev)
                best = min(best, time.perf_counter() - t0)
            return best
        points = {B * (w + 1): timed(lambda: self.draft([w] * B, None))
                  for w in sorted({1, 2, 4, 8, self.max_k}) if w <= self.max_k}
        n = min(16, self.net.target.config.block_size // 4)

        def flush():
            self.n_ctx = [max(0, c - n) for c in self.n_ctx]  # re-project the last n states
            self.flush()
        per_state = timed(flush) / (n * B)
        return interpolate(points), per_state

    def draft(self, ks, sampler):
        """The block for every row, then the Markov chain left to right, every row at once ->
        (tokens (B, K), q or None, block states (B, K, d)). sampler None: greedy (profiling)."""
        h = self.draft_states(ks)  # (B, K, d)
        S = self.rows.lengths

        def draw(logits, j):
            if sampler is None:
                return logits.argmax(-1), None
            tok, q = sampler.draft(logits[:, None], [s + j for s in S], [int(k > j) for k in ks])
            return tok[:, 0], (q[:, 0] if q is not None else None)
        toks, q = markov_chain(self.spark, self.head(h, ks), self.rows.last(), draw,
                               self.markov_table)
        return toks, q, h

    def survival(self, h, toks, ks):
        """Every row's prefix survivals a_{r,j} = prod_{i<=j} c_{r,i}, capped at ks[r]: one
        product and one host read for the whole batch (as the head gives them: choose() scales
        them by what verification has shown, recalibrate)."""
        prev = torch.cat([self.rows.last()[:, None], toks[:, :-1]], 1)
        z = h @ self.conf_h + self.conf_code[prev]  # (B, K) confidence logits
        surv = torch.sigmoid(z / self.conf_temp[:z.size(1)]).cumprod(1)
        return surv.to("cpu", torch.float64).numpy(), np.array(ks)  # host sync

    def recalibrate(self, row):
        """row: survivals (A, L) as survival() gives them -> the same, recalibrated: a_j times the
        ratio of survivals seen to survivals predicted at position j, so far (kept non-increasing
        in j, at most 1). Why: the confidence head is calibrated on held-out training windows, and
        on other text it can be far off (on short prompts far too hopeful, docs/experiments.md:
        Batched: online recalibration), and every rule here spends the budget by these numbers.
        The ratio comes from earlier rounds only, so a round's choice never depends on its own
        outcome."""
        A, L = row
        seen, said = self.calibration[:, :A.shape[1]]
        # a prior of CALIBRATION_PRIOR rounds at the head's own word: thin evidence moves the
        # estimate little
        ratio = (seen + CALIBRATION_PRIOR) / (said + CALIBRATION_PRIOR)
        return np.minimum.accumulate(np.minimum(A * ratio, 1.0), axis=1), L

    def observe(self, lengths, predicted, kept, decay=0.98):
        """After a verify: which verified drafts survived (row r kept kept[r] - 1 of its
        lengths[r]), against the survivals (A, L) it was predicted (before recalibration)."""
        A, _ = predicted
        j = np.arange(A.shape[1])[None, :]
        verified = j < np.asarray(lengths)[:, None]
        survived = verified & (j < np.asarray(kept)[:, None] - 1)
        cal = self.calibration[:, :A.shape[1]]
        cal *= decay
        cal[0] += survived.sum(0)
        cal[1] += (A * verified).sum(0)

    @torch.inference_mode()
    def propose(self, ks, sampler):
        now, B = time.perf_counter(), len(ks)
        base = sum(k > 0 for k in ks)
        cost, t_draft = self.costs.get(B, (None, None))
        self.measure(now, cost, t_draft, B)
        if self.schedule == "budget" and self.estimate is not None:
            ks = self.planned(ks, base, cost, t_draft, B)
            self.batch_rounds += 1
            if not any(ks):  # the cost table says no draft pays: a plain step, not even drafted
                self.rounds, self.skipped = self.rounds + 1, self.skipped + 1
                self.skipped_in_batch += 1
                self._last = (now, time.perf_counter() - now, 0, base)
                return self.rows.toks[:, :0], [0] * B, None
        elif self.schedule == "budget":  # no estimate yet: a probe, cut by Algorithm 1, as wide as
            # the last plan at this batch size (new requests, but the same cost table)
            ks = [min(k, max(PROBE_WIDTH, self.adapt[B]["width"])) for k in ks]
        toks, q, h = self.draft(ks, sampler)
        lengths = list(ks) if self.schedule == "full" else self.choose(h, toks, ks, base, cost,
                                                                        t_draft, B)
        L = max(lengths)
        self.rounds += 1
        self._last = (now, time.perf_counter() - now, sum(k + 1 for k in ks if k),
                      base + sum(lengths))
        return toks[:, :L], lengths, (q[:, :L] if q is not None else None)

    def choose(self, h, toks, ks, base, cost, t_draft, B):
        """After drafting: every row's survivals (one host read), then the rule -> lengths."""
        raw = self.survival(h, toks, ks)
        est = self.recalibrate(raw)
        # the draft is spent already: t_fixed only scales theta
        t_fixed = self.adapt[B]["scale"] * float(t_draft(sum(k + 1 for k in ks if k)))
        t_fixed += self.adapt[B]["rest"][1]
        if self.schedule == "auto" or (self.schedule == "budget" and self.estimate is None):
            lengths = admit_batch(est, base, t_fixed, cost)
        elif self.schedule == "goodput":
            lengths = best_single_k(est, base, t_fixed, cost)
        else:
            lengths = fill_budget(est, self.budget_k)
        # a row that drafted nothing this round keeps its last estimate
        A, L = est
        A = np.pad(A, ((0, 0), (0, self.max_k - A.shape[1])))
        if self.estimate is not None:
            A = np.where(L[:, None] > 0, A, self.estimate[0])
            L = np.where(L > 0, L, self.estimate[1])
        self.estimate = (A, L)
        self._scored = (raw, lengths)  # observe() compares them with what survives
        return lengths

    @torch.inference_mode()
    def commit(self, kept, new, hidden):
        if self._scored is not None:
            self.observe(self._scored[1], self._scored[0], kept)
            self._scored = None
        super().commit(kept, new, hidden)

    def planned(self, ks, base, cost, t_draft, B):
        """budget: this round's K from last round's survivals (plan_budget) -> what each row
        drafts (the plan's width, or 0). A row's estimate is its last scored one. While K stays
        0, every SCORE_EVERY-th round drafts every row anyway (scored by Algorithm 1), so the
        estimates stay fresh."""
        ad = self.adapt[B]
        pending = sum(s - n for s, n in zip(self.n_states, self.n_ctx))  # a draft flushes these
        key = (id(self.estimate), base, tuple(ks), pending // (8 * B))
        if self._plan is None or self._plan[0] != key or self._plan[1][0]:
            A, L = self.estimate
            est = (A, np.minimum(L, ks))
            flush = pending * self.flush_cost.get(B, 0.0)
            # (a plan of no draft is kept while nothing it depends on moves: a skipped round
            # changes no estimate, so the same search would give the same answer)
            self._plan = (key, plan_budget(est, base, lambda n: ad["scale"] * t_draft(n) + flush,
                                           ad["rest"], cost, sum(ks), PLAN_MARGIN))
        self.budget_k, width, rows = self._plan[1]
        if self.budget_k == 0:
            self.idle += 1
            if self.idle < ad["wait"]:
                return [0] * len(ks)
            # a probe round, scored by Algorithm 1; while probes keep finding that drafting does
            # not pay, each waits twice as long as the last (a probe costs a draft and the
            # context of every skipped round)
            self.estimate, self.idle, ad["wait"] = None, 0, min(2 * ad["wait"], MAX_WAIT)
            return [min(k, PROBE_WIDTH) for k in ks]
        self.idle, ad["wait"], ad["width"] = 0, SCORE_EVERY, width
        # one slot past the plan: the fresh confidences pick which K tokens fill the budget, and
        # the plan can grow a position a round where it pays
        return [min(k, width + 1) if on else 0 for k, on in zip(ks, rows)]

    def measure(self, now, cost, t_draft, B, rate=0.3):
        """What the tables miss, measured as the rounds run (running averages, per batch size:
        they describe the machine, not the text). scale: a draft in the loop over the profiled
        t_draft (inside the loop the target's forward evicts the drafter's weights from the
        cache, and scoring and choosing add to it). rest[0] / rest[1]: the rest of a round
        without / with a draft, apart from its propose and its verify as the table prices it
        (commit, the loop; a round without a draft also its planning)."""
        if cost is None:
            return
        ad = self.adapt[B]
        if self._last is not None:
            start, spent, slots, n = self._last
            if slots:
                ad["scale"] += rate * (spent / float(t_draft(slots)) - ad["scale"])
                rest = now - start - float(cost(n)) - spent
            else:
                rest = now - start - float(cost(n))
            ad["rest"][int(slots > 0)] += rate * (max(0.0, rest) - ad["rest"][int(slots > 0)])
