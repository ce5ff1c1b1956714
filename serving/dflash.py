"""
serving/dflash.py -- DSpark over a batch of requests: DFlash's block for every row in one
forward (draft_dflash.py drafts a batch itself), then DSpark's Markov chain and one verify budget
for the whole batch.

draft_dspark.py's scheduler decides for one request, by its own clock. Over a batch the budget is
the batch's verify: BatchDSpark adds the Markov chain for every row at once and the rules that
spend the budget, the paper's scheduler and the measured rule the serving sweep runs (one width a
round, or whole batches decoded plainly); the rules and what they read are serving/rules.py's.
"""

import copy
import time

import numpy as np
import torch

import ragged
from serving.rules import CostTable, Widths, best_single_k, interpolate, time_plain
from serving.batched import BatchDrafter
from runtime.devices import synchronize
from draft_dflash import DFlashDrafter
from draft_dspark import admit, markov_chain


# -----------------------------------------------------------------------------
# DSpark: DFlash's block, the Markov chain, and one verify budget for the whole batch

CALIBRATION_PRIOR = 5.0  # pseudo-rounds at the confidence head's own estimate (recalibrate)


BATCH_SCHEDULES = ("measured", "auto", "goodput", "full")


class BatchDSpark(BatchDrafter):
    """DSparkDrafter over B rows: the batched DFlash block, then the Markov chain for every row at
    once, then one choice of how many drafts each row verifies:
      measured  one width a round for every row, the one with the most tokens per second by what
                the rounds themselves measured (rules.Widths), and whole batches decoded
                plainly where the batches it drafted, timed whole, made fewer tokens a second
                than plain decoding: the production rule;
      auto      DSpark's Algorithm 1 over the whole batch (draft_dspark.admit): (row, position)
                pairs admitted in order of the confidence head's survivals until expected
                throughput stops rising;
      goodput   one length for every row, the best for the batch by the same survivals
                (rules.best_single_k), the rule a serving engine without per-request
                lengths uses;
      full      every row verifies all it drafted (a fixed k).
    The cost table (rules.CostTable), the draft's cost by width (time_draft) and a plain
    step's (rules.time_plain) are profiled once per batch size, at the first begin(): the
    rules' prior."""

    def __init__(self, drafter, schedule="measured"):
        if schedule not in BATCH_SCHEDULES:
            raise ValueError(f"unknown batch schedule {schedule!r}: use {', '.join(BATCH_SCHEDULES)}")
        super().__init__(drafter)
        self.net, self.spark, self.schedule = drafter.net, drafter.spark, schedule
        self.block = DFlashDrafter(drafter.net)  # DFlash's drafting, for every row at once
        self.block.ctx_kv = drafter.ctx_kv  # the stacked context projection, as loaded
        self.markov_table = drafter.markov_table
        self.conf_h, self.conf_code = drafter.conf_h, drafter.conf_code
        self.conf_temp = drafter.spark.conf_temp.to(self.conf_h.dtype)
        self.costs = {}  # batch size -> (CostTable, t_draft, seconds of a plain step)
        self.priors = {}  # batch size -> what they say a round costs at each width (prior)
        self.new_account()

    def one_request(self):
        """The batch-1 DSpark that decodes a batch of one: its own scheduler (the throughput rule
        that asks tree.pays), or every draft where this twin verifies all it drafts (full)."""
        if self.schedule != "full":
            return self.single
        one = copy.copy(self.single)
        one.schedule = "full"
        return one

    def new_account(self):
        """What it learns as it runs, from nothing: the measured rule's numbers (Widths), the
        rounds drafted, the recalibration sums (per draft position: survivals seen, survivals
        predicted), this batch's state."""
        self.widths, self.rounds = Widths(self.max_k), 0
        self.calibration = np.zeros((2, self.max_k))
        self._scored, self._round, self._ks, self.cap = None, None, None, None

    @torch.inference_mode()
    def begin_batch(self, seqs, hidden):
        t0 = time.perf_counter()
        self.block.begin_batch(seqs, hidden)
        B, t1 = len(seqs), time.perf_counter()
        if self.schedule != "full" and B not in self.costs:
            target = self.net.target
            self.costs[B] = (CostTable.profile(target, B, self.max_k + 1), self.time_draft(B),
                             time_plain(target, B, target.config.sequence_len // 2))
        # the batch's clock (measured): its prompts through the drafter count, the profile not
        self.widths.started(B, time.perf_counter() - (t1 - t0))
        self._round = None
        # new requests: the head's confidences taken at their word again
        self.calibration = np.zeros((2, self.max_k))

    def prior(self, B):
        """{width: profiled seconds of a round at B} (0: a plain step), every width 0..max_k: the
        measured rule's prior, made once per batch size (the copies bench.py runs share it, as
        they share the costs)."""
        if B not in self.priors:
            table, t_draft, t_plain = self.costs[B]
            self.priors[B] = {w: float(table(B * (w + 1)) + t_draft(B * (w + 1)))
                              for w in range(1, self.max_k + 1)}
            self.priors[B][0] = t_plain
        return self.priors[B]

    def plain_batch(self, B):
        """measured, asked before each batch (batched.BatchDrafter): plainly, start to end, where
        the batches drafted at this batch size made fewer tokens a second than plain decoding,
        with the benefit of the doubt to drafting (Widths.plain); and once at each batch size, to
        time plain decoding's own step."""
        if self.schedule != "measured" or B not in self.costs:
            return False  # a batch size not seen yet drafts: begin() profiles it
        plain = self.widths.plain(B, self.prior(B))
        return plain or 0 not in self.widths.seconds.get(B, {})

    def timed_plain(self, B, steps, seconds):
        """serving/batched.py timed plain decoding's own path at batch size B (the measured rule)."""
        if self.schedule == "measured" and steps and B in self.costs:
            self.widths.timed(B, 0, seconds / steps, self.prior(B))

    def time_draft(self, B, reps=5):
        """Seconds of one draft of all B rows, w drafts each, at a few w (fastest of reps) ->
        t_draft(slots), slots = B * (w + 1) block slots in all, linear in between (the draft's
        Linears run on real slots only, so its cost follows their total). Each try follows a
        target forward, as a draft does in the loop: timed back to back, the drafter's weights
        stay in the cache and a draft looks several times cheaper than it is. Proposing writes
        only past every row's context, so it runs on the state begin() made."""
        target, dev = self.net.target, self.block.k_cache.device
        scratch = ragged.new_cache(target, B)
        x = torch.zeros(B, 1, dtype=torch.long, device=dev)

        def timed(w):
            best = float("inf")
            for _ in range(reps):
                scratch.reset()
                ragged.forward(target, x, scratch)  # the target's weights back in the cache
                synchronize(dev)
                t0 = time.perf_counter()
                self.draft([w] * B, None)
                synchronize(dev)
                best = min(best, time.perf_counter() - t0)
            return best
        return interpolate({B * (w + 1): timed(w) for w in sorted({1, 2, 4, 8, self.max_k})
                            if w <= self.max_k})

    def draft(self, ks, sampler):
        """The block for every row, then the Markov chain left to right, every row at once ->
        (tokens (B, K), q or None, block states (B, K, d)). sampler None: greedy (profiling)."""
        h = self.block.draft_states(ks)  # (B, K, d)
        S = self.block.rows.lengths

        def draw(logits, j):
            if sampler is None:
                return logits.argmax(-1), None
            tok, q = sampler.draft(logits[:, None], [s + j for s in S], [int(k > j) for k in ks])
            return tok[:, 0], (q[:, 0] if q is not None else None)
        toks, q = markov_chain(self.spark, self.block.head(h, ks), self.block.rows.last(), draw,
                               self.markov_table)
        return toks, q, h

    def survival(self, h, toks, ks):
        """Every row's prefix survivals a_{r,j} = prod_{i<=j} c_{r,i}, capped at ks[r]: one
        product and one host read for the whole batch (as the head gives them: choose() scales
        them by what verification has shown, recalibrate)."""
        prev = torch.cat([self.block.rows.last()[:, None], toks[:, :-1]], 1)
        z = self.spark.features(h) @ self.conf_h + self.conf_code[prev]  # (B, K) logits
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
    def propose_batch(self, ks, sampler):
        B = len(ks)
        if self.schedule == "measured":
            w = self.measured_width(ks)
            ks = self._ks = [min(k, w) for k in ks]
        toks, q, h = self.draft(ks, sampler)
        self.rounds += 1
        if self.schedule in ("measured", "full"):
            lengths = list(ks)
        else:
            lengths = self.choose(h, toks, ks, B)
        L = max(lengths)
        return toks[:, :L], lengths, (q[:, :L] if q is not None else None)

    def measured_width(self, ks):
        """measured: time the round before, then choose this round's width (rules.Widths)."""
        now, B = time.perf_counter(), len(ks)
        prior = self.prior(B)
        if self._round is not None and self._round[1]:
            self.widths.timed(B, self._round[2], now - self._round[0], prior)
        if self._round is None:  # a batch's first round: the loop's k
            self.cap = max(ks)
        w = self.widths.choose(B, prior, cap=self.cap)
        # timed: a round after one at the same width, its last rounds with fewer rows included:
        # not a batch's first (its prompts' context goes through the drafter's projection then),
        # nor one that changed width (new shapes)
        self._round = (now, self._round is not None and self._round[2] == w, w)
        return w

    def choose(self, h, toks, ks, B):
        """auto, goodput: after drafting, every row's survivals (one host read), then the rule ->
        lengths."""
        raw = self.survival(h, toks, ks)
        est = self.recalibrate(raw)
        # the draft is spent already: t_fixed only scales theta
        cost, t_draft, _ = self.costs[B]
        t_fixed = float(t_draft(sum(k + 1 for k in ks if k)))
        base = sum(k > 0 for k in ks)
        if self.schedule == "auto":  # the lesson's scheduler, over the batch
            A, L = est
            lengths = admit([a[:n].tolist() for a, n in zip(A, L)], base, t_fixed, cost)
        else:
            lengths = best_single_k(est, base, t_fixed, cost)
        self._scored = (raw, lengths)  # observe() compares them with what survives
        return lengths

    @torch.inference_mode()
    def commit_batch(self, kept, new, hidden):
        if self._scored is not None:
            self.observe(self._scored[1], self._scored[0], kept)
            self._scored = None
        self.block.commit_batch(kept, new, hidden)
        if self._ks is not None:  # measured: what this round's width showed, and when it ended
            self.widths.verified(len(kept), self._round[2],
                                 [k for k, m in zip(self._ks, kept) if m], [m - 1 for m in kept if m],
                                 time.perf_counter())
            self._ks = None
