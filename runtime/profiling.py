"""
runtime/profiling.py -- what a round costs on the device in use, measured once at start-up: the
target's verify forward by length, a drafter's draft. DSpark's scheduler and the hybrid's rule weigh
expected tokens against these seconds; the drafters take them from here, never measure in their
constructors. """

import time

import torch

from runtime.devices import synchronize
from draft_hybrid import LOOKUP_MAX
from speculative import Sampler


def profile_verify(target, m_max, context=None, reps=9, between=None):
    """Seconds of one target forward over m = 1..m_max new tokens after a context of `context`
    tokens (default: half the window), on the target's own device and dtype. The fastest of
    `reps` tries: interference from other processes only ever adds time (a median was thrown
    off by a busy shared CPU). Made non-decreasing in m. Returns a list indexed by m (0 unused).
    between(): run, untimed, before each try: the drafter's own forward, so the target runs as it
    does in the loop. Why: where the two models' weights do not fit in the cache together, a
    verify right after a draft costs more, and grows less with its length, than the same forward
    timed back to back; the back-to-back slope made the scheduler cut blocks that paid
    (docs/experiments.md: DSpark: scheduler at batch 1)."""
    dev = target.lm_head.weight.device
    n_ctx = context if context is not None else target.config.sequence_len // 2
    n_ctx = min(n_ctx, target.config.sequence_len - m_max)
    cache = target.new_cache()
    x = torch.zeros(1, n_ctx + m_max, dtype=torch.long, device=dev)
    with torch.inference_mode():
        target(x[:, :n_ctx], cache=cache)
        t = [0.0]
        for m in range(1, m_max + 1):
            ts = []
            for _ in range(reps):
                if between is not None:
                    between()
                cache.rollback(n_ctx)
                synchronize(dev)
                t0 = time.perf_counter()
                target(x[:, n_ctx:n_ctx + m], cache=cache)
                synchronize(dev)
                ts.append(time.perf_counter() - t0)
            t.append(max(min(ts), t[-1]))
    return t


def profile_propose(drafter, target, k, reps=9):
    """Seconds for one propose(k) of `drafter` (a greedy pick) after begin() on a dummy context of
    half the target's window, the fastest of `reps` (as profile_verify: interference only adds).
    Leaves that dummy context begun."""
    tcfg, w = target.config, target.lm_head.weight
    n_ctx = tcfg.sequence_len // 2
    hid = {t: torch.zeros(1, n_ctx, tcfg.n_embd, device=w.device, dtype=w.dtype)
           for t in drafter.hidden_layers}
    drafter.begin(torch.zeros(1, n_ctx + 1, dtype=torch.long, device=w.device), hid)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        drafter.propose(k, Sampler("greedy"))
        synchronize(w.device)
        ts.append(time.perf_counter() - t0)
    return min(ts)


def profile_dspark(drafter, reps=9):
    """DSpark's scheduler weighs expected tokens against seconds: t_draft, one full-block propose
    (every position scored and admitted: the full cost) on a dummy context, then t_verify by
    length, each try after the drafter's own forward, as in the loop. From then on its rounds
    measure t_draft (drafter.measured). Leaves the dummy context begun."""
    saved = drafter.schedule, drafter.threshold
    drafter.schedule, drafter.threshold = "threshold", 0.0
    drafter.t_draft = profile_propose(drafter, drafter.net.target, drafter.max_k, reps)
    drafter.schedule, drafter.threshold = saved
    drafter.reset_account()
    k = drafter.max_k
    drafter.t_verify = profile_verify(drafter.net.target, k + 1,
                                      between=lambda: drafter.net.logits(drafter.draft_states(k)))
    drafter.measured = True
    return drafter


def profile_hybrid(learned, target, reps=5):
    """The hybrid's starting costs: (t_verify by length up to its longest draft, the learned
    drafter's propose at its own k) -> draft_hybrid.HybridDrafter's `costs`."""
    t_verify = profile_verify(target, LOOKUP_MAX + 1, reps=reps)
    return t_verify, profile_propose(learned, target, learned.default_k, reps=reps)


def timed(fn, device):
    """(seconds fn() takes on `device`, waiting for it before and after, its result)."""
    synchronize(device)
    t0 = time.perf_counter()
    res = fn()
    synchronize(device)
    return time.perf_counter() - t0, res


def add_stats(total, other):
    """total (a speculative.Stats) += other: the counts and times of more runs of the loop."""
    total.tokens += other.tokens
    total.target_forwards += other.target_forwards
    total.rounds += other.rounds
    for name in ("drafted_at", "accepted_at"):
        mine, theirs = getattr(total, name), getattr(other, name)
        mine.extend([0] * (len(theirs) - len(mine)))
        for i, v in enumerate(theirs):
            mine[i] += v
    total.draft_time += other.draft_time
    total.verify_time += other.verify_time
