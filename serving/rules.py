"""
serving/rules.py -- what a verify costs at batch B, and the rules that spend it: DSpark's and a
serving engine's.

At batch 1 a longer verify costs little more than a short one, so drafting long pays. At batch
32 a verify of 16 tokens a row is a 512-token forward and costs several times a plain batched
step. The rules here decide how many drafts each row verifies; the batched DSpark drafter
(serving.dflash.BatchDSpark) applies them round by round. The paper's (Algorithm 1) and a
serving engine's read each row's prefix survivals (draft_dspark.py's confidence head) and a cost
table profiled on the device in use; the measured rule (Widths), the one the serving sweep
runs, reads what the loop itself measured: tokens each width kept, seconds each round took.
"""

import time

import numpy as np
import torch

import ragged
from serving.batched import plain_steps
from sampler import Sampler
from runtime.devices import synchronize
from runtime.profiling import timed


class CostTable:
    """Seconds of one target forward over a batch carrying N real tokens in all (the verify
    budget, every row's [last, drafts]), profiled once at start-up on the device in use, as the
    DSpark paper's SPS(B) "cost table" and vLLM's verify_cost are: rows of m = 1..width tokens
    each (N = B*m), the fastest of `reps` tries, made non-decreasing, linear in between. Called
    with a number or a numpy array of them."""

    def __init__(self, batch_size, seconds):
        self.batch_size, self.seconds = batch_size, list(seconds)  # seconds[m - 1]: N = B * m
        self.n = np.arange(1, len(seconds) + 1) * batch_size

    def __call__(self, n):
        return np.interp(n, self.n, self.seconds)

    @classmethod
    @torch.inference_mode()
    def profile(cls, target, batch_size, width, context=None, reps=5):
        dev, window = target.lm_head.weight.device, target.config.sequence_len
        n_ctx = min(context if context is not None else window // 2, window - width)
        cache = ragged.new_cache(target, batch_size)
        x = torch.zeros(batch_size, n_ctx + width, dtype=torch.long, device=dev)
        ragged.forward(target, x[:, :n_ctx], cache)
        seconds = []
        for m in range(1, width + 1):
            best = float("inf")
            for _ in range(reps):
                cache.rollback([n_ctx] * batch_size)
                synchronize(dev)
                t0 = time.perf_counter()
                ragged.forward(target, x[:, n_ctx:n_ctx + m], cache)
                synchronize(dev)
                best = min(best, time.perf_counter() - t0)
            seconds.append(best)
        # non-decreasing from the right: m tokens never cost more than any longer forward. (A
        # running max from the left would let one slow try raise every longer entry with it)
        for m in range(len(seconds) - 2, -1, -1):
            seconds[m] = min(seconds[m], seconds[m + 1])
        return cls(batch_size, seconds)


@torch.inference_mode()
def time_plain(target, batch_size, context, steps=8, reps=3):
    """Seconds of one step of plain batched decoding itself (batched.plain_steps: the forward,
    the pick, the loop), every row at `context` tokens, the fastest of `reps` runs of `steps`:
    the measured rule's prior for a plain step, before any plain batch has run."""
    dev, B = target.lm_head.weight.device, batch_size
    cache = ragged.new_cache(target, B)
    x = torch.zeros(B, context, dtype=torch.long, device=dev)
    best = float("inf")
    for _ in range(reps):
        cache.reset()
        ragged.forward(target, x, cache)
        seconds, _ = timed(lambda: plain_steps(
            target, cache, x[:, -1], [0] * B, [steps] * B, [context] * B,
            Sampler("greedy", device=dev)), dev)
        best = min(best, seconds / steps)
    return best


def interpolate(points):
    """{x: y} measured at a few x -> a function of a number or a numpy array, linear in
    between, flat past the ends."""
    xs = sorted(points)
    ys = [points[x] for x in xs]
    return lambda x: np.interp(x, xs, ys)


def as_table(survival):
    """Survivals as (A, L): A (B, K) float array, row r's first L[r] entries its a_{r,1..L[r]}.
    Takes that pair as it is, or a list of rows (the readable form, used by the tests)."""
    if isinstance(survival, tuple):
        return survival
    K = max((len(row) for row in survival), default=0)
    A = np.zeros((len(survival), K))
    for r, row in enumerate(survival):
        A[r, :len(row)] = row
    return A, np.array([len(row) for row in survival], dtype=np.int64)


def best_single_k(survival, base, t_fixed, cost):
    """The serving engines' rule (vLLM's goodput choice; SmartSpec, arXiv 2406.14066): ONE draft
    length l for every row of the batch, the l in 0..K that maximises expected tokens per second
    from the same survivals and cost table. -> a length per row (l, or fewer where a row has
    fewer drafts)."""
    A, L = as_table(survival)
    C = np.cumsum(A * (np.arange(A.shape[1]) < L[:, None]), axis=1)  # tokens expected by l
    best, best_l = base / (t_fixed + float(cost(base))), 0
    for l in range(1, A.shape[1] + 1):
        m = np.minimum(l, L)
        tau = base + C[m > 0, m[m > 0] - 1].sum()
        theta = tau / (t_fixed + float(cost(base + m.sum())))
        if theta > best:
            best, best_l = theta, l
    return np.minimum(best_l, L).tolist()


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
    """DSpark's serving rule, decided by what the loop measures (BatchDSpark, schedule="measured").
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
