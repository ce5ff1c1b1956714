"""
runtime/profiling.py -- what a round costs on the device in use, measured at start-up: the target's
verify forward by length, a drafter's draft. DSpark's scheduler, the hybrid's rule and a sized
tree weigh expected tokens against these seconds (registry/profiles.py measures each with these);
the drafters take them from outside, never measure in their constructors. """

import time

import torch

from runtime.devices import synchronize
from speculative import Sampler


def profile_verify(target, m_max, context=None, reps=9, between=None, shape=None):
    """Seconds of one target forward over m = 1..m_max new tokens after a context of `context`
    tokens (default: half the window), on the target's own device and dtype. The fastest of
    `reps` tries: interference from other processes only ever adds time (a median was thrown
    off by a busy shared CPU). Made non-decreasing in m. Returns a list indexed by m (0 unused).
    between(): run, untimed, before each try: the drafter's own forward, so the target runs as it
    does in the loop. Why: where the two models' weights do not fit in the cache together, a
    verify right after a draft costs more, and grows less with its length, than the same forward
    timed back to back; the back-to-back slope made the scheduler cut blocks that paid
    (docs/experiments.md: DSpark: scheduler at batch 1). shape(m, start, device): the forward's
    tree argument (a chain of m tokens through tree.py's mask, whose kernels are not the
    chain's), or None: a plain chain."""
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
                tree = shape(m, n_ctx, dev) if shape is not None else None
                synchronize(dev)
                t0 = time.perf_counter()
                target(x[:, n_ctx:n_ctx + m], cache=cache, tree=tree)
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
