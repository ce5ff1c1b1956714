"""
batch_rules.py -- what a verify costs at batch B, and the rules that spend it: DSpark's and a
serving engine's.

At batch 1 a longer verify costs little more than a short one, so drafting long pays. At batch
32 a verify of 16 tokens a row is a 512-token forward and costs several times a plain batched
step. The rules here decide, from each row's prefix survivals (draft_dspark.py's confidence
head) and a cost table profiled on the device in use, how many drafts each row verifies; the
batched DSpark drafter (batched_drafters.BatchDSpark) applies them round by round.
"""

import time

import numpy as np
import torch

import ragged
from devices import synchronize


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
        dev, window = target.lm_head.weight.device, target.config.block_size
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


def by_survival(survival):
    """Every (row, draft position) pair, most likely to survive first (within a row in order:
    a_{r,j} never rises with j, and ties go to the earlier position) -> numpy arrays (a, j, r)."""
    A, L = as_table(survival)
    r, j = np.nonzero(np.arange(A.shape[1]) < L[:, None])
    a = A[r, j]
    order = np.lexsort((j, -a))
    return a[order], j[order], r[order]


def lengths_of(j, r, K, batch_size):
    """The per-row lengths the first K pairs of by_survival make."""
    lengths = np.zeros(batch_size, dtype=np.int64)
    np.maximum.at(lengths, r[:K], j[:K] + 1)
    return lengths.tolist()


def admit_batch(survival, base, t_fixed, cost):
    """DSpark's scheduler over the batch (paper §3.2.2, Algorithm 1). survival[r]: row r's prefix
    survivals a_{r,1}, a_{r,2}, ... (as many as it drafted); base: rows verified this round (each
    verifies at least its last token). Start with every length 0, admit (row, position) pairs in
    order of a, each one raising the budget N by a token and the expected tokens tau by a; stop
    at the first admission that does not raise theta = tau / (t_fixed + cost(N)). The early stop
    is what keeps sampling lossless (paper, Appendix A). -> a length per row, 0 allowed."""
    a, j, r = by_survival(survival)
    K = np.arange(len(a) + 1)
    theta = (base + np.concatenate([[0.0], np.cumsum(a)])) / (t_fixed + cost(base + K))
    drops = np.flatnonzero(theta[1:] <= theta[:-1])
    stop = int(drops[0]) if len(drops) else len(a)
    return lengths_of(j, r, stop, len(as_table(survival)[1]))


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


def plan_budget(estimate, base, t_draft, t_rest, cost, cap, margin=0.0):
    """The production variant's budget (DSpark §5.2-5.3), set BEFORE drafting from survivals one
    round old: the K in 0..cap that maximises (base + the K best estimated survivals) /
    (t_rest[K > 0] + t_draft(slots) + cost(base + K)), slots = the block slots those K pairs need
    (every row that gets one drafts the widest such row's width), by a full search (the table is
    jagged). K = 0 drafts nothing at all. Lossless because K does not depend on this round's
    tokens. t_rest: the rest of a round, measured apart for rounds without and with a draft.
    margin: draft only where theta beats the no-draft round's by more than this share (the
    tables' own error). -> (K, width, which rows draft)."""
    a, j, r = by_survival(estimate)
    a, j, r = a[:cap], j[:cap], r[:cap]
    B = len(as_table(estimate)[1])
    width = np.maximum.accumulate(j + 1) if len(a) else j
    rows = np.cumsum(j == 0)  # each row's first pair comes first among its own
    K = np.arange(1, len(a) + 1)
    theta = (base + np.cumsum(a)) / (t_rest[1] + t_draft(rows * (width + 1)) + cost(base + K))
    skip = base / (t_rest[0] + float(cost(base)))
    if len(a) == 0 or theta.max() <= skip * (1 + margin):
        return 0, 0, [False] * B
    best = int(theta.argmax())
    lengths = lengths_of(j, r, best + 1, B)
    return best + 1, int(width[best]), [m > 0 for m in lengths]


def fill_budget(survival, K):
    """Which K (row, position) pairs fill a budget: the K most likely to survive, fresh
    confidences, a prefix of each row. -> a length per row."""
    _, j, r = by_survival(survival)
    return lengths_of(j, r, K, len(as_table(survival)[1]))
