"""
serving/batched.py -- many requests at once as a server decodes them: serve(), and DSpark's
measured rule, the one the serving sweep runs.

speculative.generate_batch decodes B prompts of different lengths together, every target
forward shared by all of them (ragged.py), and generate_plain_batch is the baseline at batch B.
What changes with load: at batch 1 a 16-token verify costs little more than a 1-token step, so
drafting long always pays. At batch 32 the same verify is a 512-token forward and costs several
times a plain batched step: a fixed draft length turns into a slowdown. draft_dspark.py's
scheduler (the paper's Algorithm 1) spends one verify over the batch by the confidence head's
survivals and a cost table profiled at start-up; over batches on a CPU the profile misses much
of what a round costs, and the head is far from calibrated on short prompts
(docs/experiments.md: Batched: the measured rule). The measured rule (Widths, run by Measured
around DSpark's own drafter) reads only what the rounds showed: tokens each width kept, seconds
each round took, and whole batches against plain decoding, which it may choose (serve()).

Rows are exact one by one: greedy and coupled sampling give each row the tokens its own batch-1
decoding gives (the coupled noise is keyed on the row's own seed and absolute positions);
rejection sampling gives each row the target's distribution, from the row's own generator.

    python bench.py --batch-size 1,4,16,32     # the serving sweep: every method, batched
"""

import time

import numpy as np
import torch

import ragged
from sampler import Sampler
from runtime.devices import synchronize
from runtime.profiling import DSparkCosts
from speculative import Stats, generate_batch, generate_plain_batch


def time_plain(target, batch_size, context, steps=8, reps=3):
    """Seconds of one step of plain batched decoding itself (speculative.generate_plain_batch:
    the forward, the pick, the loop), every row at `context` tokens, the fastest of `reps` runs
    of `steps`: the measured rule's prior for a plain step, before any plain batch has run."""
    dev, best = target.lm_head.weight.device, float("inf")
    cache, prompts = ragged.new_cache(target, batch_size), [[0] * context] * batch_size
    for _ in range(reps):
        stats = Stats.of(1, batch_size)
        generate_plain_batch(target, prompts, steps + 1, Sampler("greedy", device=dev), cache,
                             stats)
        best = min(best, stats.verify_time / steps)
    return best


def interpolate(points):
    """{x: y} measured at a few x -> a function of a number or a numpy array, linear in
    between, flat past the ends."""
    xs = sorted(points)
    ys = [points[x] for x in xs]
    return lambda x: np.interp(x, xs, ys)


# -----------------------------------------------------------------------------
# the measured rule: one width a round for every row, or plain batches, by what the loop measures

# the widths it chooses among (at most the drafter's max_k): few, because each width it may choose
# costs exploring, and wider ones did not pay in the serving sweep (docs/experiments.md: Batched:
# the measured rule)
WIDTHS = (1, 2, 4, 8)
# every 12th round starts two rounds at one width wider than the best, the next time one narrower,
# to keep their numbers fresh (a profile can be far off the loop: docs/experiments.md); two,
# because a round after a change of width pays for the new shapes and is not timed
EXPLORE_EVERY, EXPLORE_ROUNDS = 12, 2
DECAY = 0.995  # per round: the survival counts of earlier text fade (a new batch is other text)
# per batch size, the last KEEP batches drafted there judge drafting. Prior for their spread: one
# pseudo-batch at SPREAD / sqrt(B), as if a batch's rate were the mean of B prompts' with SPREAD
# each (roughly what a CPU sweep measured at batch 2 to 32: docs/experiments.md)
KEEP, SPREAD = 16, 0.4
RATE = 0.3  # running averages of round times: the host's speed can change under a server


class Widths:
    """DSpark's serving rule, decided by what the loop measures (run by Measured).
    Before each round it picks ONE draft width w for every row: the most tokens per second,
        rate(w) = tokens(w) / seconds(B, w).
    tokens(w) = 1 + S_1 + ... + S_w, S_j the chance that a row's first j drafts all survive, is
    measured from verification itself: every verified round at width w also tells what any
    narrower width would have kept (min(accepted, w') drafts), so all widths are compared on the
    same text. seconds(B, w) is a round's own wall time at that batch size and width (draft,
    verify, commit, the loop), a running average; a width not yet timed at B is priced by the
    start-up profile (prior) times what the timed ones measured over theirs. The choice reads
    earlier rounds only, never this round's drafts: the tokens stay exact.
    Before each batch it decides whether to draft at all, by no model: each batch drafted at B
    is timed whole (the drafter's reading of the prompts, every round, the slowest row's tail)
    and its tokens a row a second divided by plain decoding's, whose step is timed over whole
    plain batches. The batch is decoded plainly where those ratios stay below 1 even with the
    benefit of the doubt: their mean plus their spread over the root of their number, growing
    slowly as plain batches go by without a look (an upper confidence bound, as UCB1's). At small
    B one prompt moves a batch a lot, so one hard batch cannot turn drafting off; where drafting
    clearly loses, looks grow rare."""

    def __init__(self, max_k):
        self.widths = sorted({min(w, max_k) for w in WIDTHS})
        self.reached = np.zeros(max_k)  # rows verified at width >= j whose first j - 1 survived
        self.passed = np.zeros(max_k)  # ... of them, rows whose draft j survived too
        self.seconds = {}  # batch size -> {width: measured seconds a round; 0: a plain step}
        self.ratio = {}  # batch size -> {width: measured over profiled}
        # batch size -> the batch drafting there: [tokens committed, its start, its last commit]
        # (clock seconds); its last KEEP drafted batches' rates over plain decoding's; how many
        # batches it decided
        self.batch, self.drafted, self.decided = {}, {}, {}
        self.rounds = 0

    def survivals(self):
        """S_1..S_max_k: a conditional survival per position, with one pseudo-row at the position
        before's (a position never verified is as likely as the last one seen)."""
        S, c, s = [], 0.9, 1.0
        for reached, passed in zip(self.reached.tolist(), self.passed.tolist()):
            c = (passed + c) / (reached + 1.0)
            s *= c
            S.append(s)
        return S

    def estimate(self, B, w, prior):
        """Seconds of a round at width w (0: a plain step) at batch size B: measured, or the
        prior times the measured-over-profiled ratio of the widths timed (at B, else anywhere)."""
        seconds = self.seconds.get(B, {})
        if w in seconds:
            return seconds[w]
        kind = [r for v, r in self.ratio.get(B, {}).items() if (v > 0) == (w > 0)]
        kind = kind or [r for d in self.ratio.values() for v, r in d.items() if (v > 0) == (w > 0)]
        return prior[w] * (sum(kind) / len(kind) if kind else 1.0)

    def rates(self, B, prior, cap=None):
        """{width: tokens a row per second}, the widths up to cap (the loop's k)."""
        S = self.survivals()
        return {w: (1 + sum(S[:w])) / self.estimate(B, w, prior)
                for w in sorted({min(w, cap or w) for w in self.widths})}

    def choose(self, B, prior, cap=None):
        """The width for this round: the best rate, or now and then a neighbour (exploring)."""
        rate = self.rates(B, prior, cap)
        widths, best = list(rate), max(rate, key=rate.get)
        self.rounds += 1
        if self.rounds % EXPLORE_EVERY < EXPLORE_EVERY - EXPLORE_ROUNDS:
            return best
        i = widths.index(best) + (1 if self.rounds // EXPLORE_EVERY % 2 else -1)
        return widths[min(max(i, 0), len(widths) - 1)]

    def plain(self, B, prior):
        """Asked before each batch of B rows: decode it plainly? (The batch before at B is done.)"""
        self.end_batch(B, self.estimate(B, 0, prior))
        self.decided[B] = self.decided.get(B, 0) + 1
        r = np.array(self.drafted.get(B, []))
        if not len(r):
            return False
        spread = np.sqrt((SPREAD ** 2 / B + ((r - r.mean()) ** 2).sum()) / len(r))
        return r.mean() + spread * np.sqrt(np.log(self.decided[B]) / len(r)) < 1

    def started(self, B, now):
        """A batch of B rows starts drafting at clock `now`."""
        self.batch[B] = [0.0, now, now]

    def end_batch(self, B, step):
        """The batch drafted at B, if any, joins the record: its tokens a row a second over a plain
        step's (`step` seconds a step)."""
        made, start, end = self.batch.pop(B, (0.0, 0.0, 0.0))
        if end > start:
            self.drafted[B] = (self.drafted.get(B, []) + [made / (B * (end - start)) * step])[-KEEP:]

    def timed(self, B, w, seconds, prior):
        """A round at width w (0: a plain step, timed over a whole plain batch) at batch size B
        took `seconds`."""
        at, ratio = self.seconds.setdefault(B, {}), self.ratio.setdefault(B, {})
        at[w] = seconds if w not in at else at[w] + RATE * (seconds - at[w])
        ratio[w] = at[w] / prior[w]

    def verified(self, B, w, counts, accepted, now):
        """After a verify at width w over B rows, its commit done at clock `now`: row r (of those
        still decoding) verified counts[r] drafts and accepted[r] of them survived."""
        made = self.batch.setdefault(B, [0.0, now, now])
        made[0] += len(accepted) + sum(accepted)
        made[2] = now
        K = len(self.reached)
        j = np.arange(1, K + 1)
        c, a = np.asarray(counts)[:, None], np.asarray(accepted)[:, None]
        self.reached *= DECAY
        self.passed *= DECAY
        self.reached += ((j <= c) & (a >= j - 1)).sum(0)
        self.passed += ((j <= c) & (a >= j)).sum(0)


class Measured:
    """DSpark's drafter (draft_dspark.py) under the measured rule: before each round one width w
    for every row (Widths.choose), the drafter drafting min(k, w) a row and verifying all of
    them; before each batch, whether to draft it at all (plain_batch: serve() then decodes it
    plainly, and tells timed_plain). A batch of one runs the drafter as loaded (`single`), with
    its own scheduler. The rule's prior at each batch size (prior) is profiled at the first batch
    of that size: a verify's cost table (DSparkCosts.table, the drafter's own), the draft's cost by width
    (time_draft), a plain step's (time_plain). It drafts what DSpark's drafter would, so it takes
    its name, the target layers it reads, its k and its training record."""

    def __init__(self, drafter):
        for name in ("name", "hidden_layers", "max_k", "default_k", "sampled_k"):
            setattr(self, name, getattr(drafter, name))
        self.budget, self.single = getattr(drafter, "budget", []), drafter
        # the verify's cost tables: the drafter's own profile's where it has one (one per batch
        # size for this rule and DSpark's other rows), else profiled here
        self.costs = drafter.costs or DSparkCosts(drafter)
        self.drafter = drafter.fresh()  # buffers of its own; it drafts what the rule asks, all
        self.drafter.schedule, self.drafter.costs, self.drafter.measured = "full", None, False
        self.priors = {}  # batch size -> {width: profiled seconds of a round; 0: a plain step}
        self.profiles = {}  # batch size -> (the verify's CostTable, draft seconds by slots)
        self.new_account()

    def new_account(self):
        """What it learns as it runs, from nothing: the rule's numbers (Widths), the rounds
        drafted, this batch's state."""
        self.widths, self.rounds = Widths(self.max_k), 0
        self._round, self._ks, self.cap = None, None, None

    @torch.inference_mode()
    def begin_batch(self, seqs, hidden):
        t0 = time.perf_counter()
        self.drafter.begin_batch(seqs, hidden)
        B, t1 = len(seqs), time.perf_counter()
        if B not in self.priors:
            self.priors[B] = self.prior(B)
        # the batch's clock: its prompts through the drafter count, the profile not
        self.widths.started(B, time.perf_counter() - (t1 - t0))
        self._round = None

    def prior(self, B):
        """{width: profiled seconds of a round at B} (0: a plain step), every width 0..max_k."""
        target = self.drafter.net.target
        verify, draft = self.profiles[B] = self.costs.table(B), self.time_draft(B)
        prior = {w: float(verify(B * (w + 1)) + draft(B * (w + 1)))
                 for w in range(1, self.max_k + 1)}
        prior[0] = time_plain(target, B, target.config.sequence_len // 2)
        return prior

    def time_draft(self, B, reps=5):
        """Seconds of one draft of all B rows, w drafts each, at a few w (fastest of reps) ->
        t_draft(slots), slots = B * (w + 1) block slots in all, linear in between (the draft's
        Linears run on real slots only, so its cost follows their total). Each try follows a
        target forward, as a draft does in the loop: timed back to back, the drafter's weights
        stay in the cache and a draft looks several times cheaper than it is. Proposing writes
        only past every row's context, so it runs on the state begin_batch() made."""
        target, dev = self.drafter.net.target, self.drafter.k_cache.device
        scratch = ragged.new_cache(target, B)
        x = torch.zeros(B, 1, dtype=torch.long, device=dev)

        def timed_draft(w):
            best = float("inf")
            for _ in range(reps):
                scratch.reset()
                ragged.forward(target, x, scratch)  # the target's weights back in the cache
                synchronize(dev)
                t0 = time.perf_counter()
                self.drafter.propose_batch([w] * B, Sampler("greedy", device=dev))
                synchronize(dev)
                best = min(best, time.perf_counter() - t0)
            return best
        seconds = {B * (w + 1): timed_draft(w) for w in sorted({1, 2, 4, 8, self.max_k})
                   if w <= self.max_k}
        self.drafter.reset_account()
        return interpolate(seconds)

    def plain_batch(self, B):
        """Asked before each batch (serve()): plainly, start to end, where the batches
        drafted at this batch size made fewer tokens a second than plain decoding, with the
        benefit of the doubt to drafting (Widths.plain); and once at each batch size, to time
        plain decoding's own step."""
        if B not in self.priors:
            return False  # a batch size not seen yet drafts: begin_batch() profiles it
        plain = self.widths.plain(B, self.priors[B])
        return plain or 0 not in self.widths.seconds.get(B, {})

    def timed_plain(self, B, steps, seconds):
        """serve() timed plain decoding's own path at batch size B."""
        if steps and B in self.priors:
            self.widths.timed(B, 0, seconds / steps, self.priors[B])

    def propose_batch(self, ks, sampler):
        w = self.measured_width(ks)
        self._ks = [min(k, w) for k in ks]
        self.rounds += 1
        return self.drafter.propose_batch(self._ks, sampler)

    def measured_width(self, ks):
        """Time the round before, then choose this round's width (Widths)."""
        now, B = time.perf_counter(), len(ks)
        prior = self.priors[B]
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

    def commit_batch(self, kept, new, hidden):
        self.drafter.commit_batch(kept, new, hidden)
        if self._ks is not None:  # what this round's width showed, and when it ended
            counts = [k for k, m in zip(self._ks, kept) if m]
            self.widths.verified(len(kept), self._round[2], counts, [m - 1 for m in kept if m],
                                 time.perf_counter())
            self._ks = None


# -----------------------------------------------------------------------------
# a batch as a server decodes it


def serve(target, drafter, prompts, max_new_tokens, k, sampler, cache=None, stop=()):
    """speculative.generate_batch, with what the measured rule decides (a Measured drafter): a
    batch of one runs DSpark's own drafter (its own scheduler), and a batch where no draft pays
    is decoded plainly, start to end, the rule told the plain steps' time. -> (token lists,
    Stats)."""
    if isinstance(drafter, Measured):
        if len(prompts) == 1:
            drafter = drafter.single
        elif drafter.plain_batch(len(prompts)):
            stats = Stats.of(k, len(prompts))
            out = generate_plain_batch(target, prompts, max_new_tokens, sampler, cache, stats,
                                       stop)
            drafter.timed_plain(len(out), max(len(o) for o in out) - 1, stats.verify_time)
            return out, stats
    return generate_batch(target, drafter, prompts, max_new_tokens, k, sampler, cache, stop=stop)
