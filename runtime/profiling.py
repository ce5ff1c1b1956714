"""
runtime/profiling.py -- what a round costs on the device in use, measured at start-up: the target's
verify forward by length, a drafter's draft, and from them the start-up profiles of what weighs
expected tokens against seconds: DSpark's scheduler, the hybrid's rule, a sized token tree. The
drafters take them from outside (the registry's loader readies DSpark and the hybrid; bench.py
and sample.py a sized tree), never measure in their constructors; their rounds then correct them
by their own timings. Nothing here imports a drafter: each is read through what it offers. """

import statistics
import time

import numpy as np
import torch

import ragged
from runtime.devices import synchronize
from sampler import Sampler


def profile_verify(target, m_max, context=None, reps=9, between=None, as_tree=False):
    """Seconds of one target forward over m = 1..m_max new tokens after a context of `context`
    tokens (default: half the window), on the target's own device and dtype. The fastest of
    `reps` tries: interference from other processes only ever adds time (a median was thrown
    off by a busy shared CPU). Made non-decreasing in m. Returns a list indexed by m (0 unused).
    between(): run, untimed, before each try: the drafter's own forward, so the target runs as it
    does in the loop. Why: where the two models' weights do not fit in the cache together, a
    verify right after a draft costs more, and grows less with its length, than the same forward
    timed back to back; the back-to-back slope made the scheduler cut blocks that paid
    (docs/experiments.md: DSpark: scheduler at batch 1). as_tree: through a tree's mask (a chain
    of m tokens as tree.py verifies it), whose kernels are not the chain's."""
    dev = target.lm_head.weight.device
    if not 1 <= m_max < target.config.sequence_len:
        raise ValueError(f"a verify of {m_max} tokens does not fit the target's window of "
                         f"{target.config.sequence_len} after a context")
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
                tree = chain_as_tree(m, n_ctx, dev) if as_tree else None
                synchronize(dev)
                t0 = time.perf_counter()
                target(x[:, n_ctx:n_ctx + m], cache=cache, tree=tree)
                synchronize(dev)
                ts.append(time.perf_counter() - t0)
            t.append(max(min(ts), t[-1]))
    return t


def profile_propose(drafter, target, k, reps=9, batch_size=1):
    """Seconds for one draft of k tokens in each of batch_size rows by `drafter` (a greedy pick)
    after begin_batch() on a dummy context of half the target's window, the fastest of `reps`
    (as profile_verify: interference only adds). Leaves that dummy context begun."""
    tcfg, w = target.config, target.lm_head.weight
    n_ctx, B = tcfg.sequence_len // 2, batch_size
    hid = {t: torch.zeros(B, n_ctx, tcfg.n_embd, device=w.device, dtype=w.dtype)
           for t in drafter.hidden_layers}
    drafter.begin_batch([torch.zeros(n_ctx + 1, dtype=torch.long, device=w.device)] * B, hid)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        drafter.propose_batch([k] * B, Sampler("greedy"))
        synchronize(w.device)
        ts.append(time.perf_counter() - t0)
    return min(ts)


def chain_as_tree(m, start, device):
    """The forward's tree argument (depths, mask) for m tokens in a row after `start` cached ones:
    what tree.depths and tree.tree_mask give a chain (tests/test_tree.py checks it), so that the
    forward runs a tree's kernels on a chain's shape."""
    depths = torch.arange(m, device=device)
    mask = torch.ones(m, start + m, dtype=torch.bool, device=device).tril(start)
    return depths, mask


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


def profile_dspark(drafter, reps=9):
    """DSpark's scheduler weighs expected tokens against seconds (DSparkDrafter.use_costs): its
    costs at batch size 1 now, at another batch size when a batch of that size first begins
    (DSparkCosts); and how to wait for its device before scoring is timed."""
    costs = DSparkCosts(drafter, reps)
    costs(1)
    drafter.use_costs(costs, sync=lambda: synchronize(drafter.net.target.lm_head.weight.device))
    return drafter


class DSparkCosts:
    """costs(B) -> (t_draft, t_verify), DSpark's scheduler's costs at batch size B, profiled the
    first time B is asked for (a drafter's copies share them):
      t_draft      one full-block draft of B rows by a copy that scores and admits every draft
                   (the full cost), on a dummy context;
      t_verify[n]  seconds of a verify of n tokens in all: at batch 1 by length, each try after
                   that copy's own forward, as in the loop; over B rows from a cost table of
                   rows of 1..k+1 tokens (table(B)), linear in between."""

    def __init__(self, drafter, reps=9):
        self.scoring, self.reps, self.at, self.tables = drafter.scoring_every_draft(), reps, {}, {}

    def table(self, B):
        """The CostTable of a verify over B rows of 1..k+1 tokens, profiled once (DSpark's
        measured rule reads it too: serving/batched.py)."""
        if B not in self.tables:
            self.tables[B] = CostTable.profile(self.scoring.net.target, B, self.scoring.max_k + 1)
        return self.tables[B]

    def __call__(self, B):
        if B not in self.at:
            d, k = self.scoring, self.scoring.max_k
            target = d.net.target
            t_draft = profile_propose(d, target, k, self.reps, batch_size=B)
            if B == 1:
                t_verify = profile_verify(
                    target, k + 1, between=lambda: d.net.target_logits(d.draft_states([k])[0]))
            else:
                t_verify = self.table(B)(np.arange(B * (k + 1) + 1)).tolist()
            self.at[B] = (t_draft, t_verify)
        return self.at[B]


def profile_hybrid(hybrid, reps=5):
    """The hybrid's starting costs, which its rounds then fit (HybridDrafter.use_costs): t_verify
    by length up to its longest verify, and the learned drafter's propose at its own k."""
    learned, target = hybrid.learned, hybrid.target
    t_verify = profile_verify(target, hybrid.default_k + 1, reps=reps)
    hybrid.use_costs(t_verify, profile_propose(learned, target, learned.default_k, reps=reps))
    return hybrid


class TreeCost:
    """Seconds of a sized tree's round by its number of nodes n (tree.py's `cost`): the rest of a
    round (commit, the loop) + drafting (a first pass + a little per node) + the verify of n + 1
    tokens, as a chain (the causal mask's kernels) or a branched tree (the tree mask's, dearer).
    Each part is profiled at start-up (profile_tree) and corrected by the rounds' own timings: the
    median of the last KEEP measured-over-profiled ratios, so that one slow round (another
    process, a page fault) moves nothing. second: the seconds the learned branch of a two-branch
    tree takes to draft (tree.Branches), the median of its last KEEP."""
    KEEP = 15

    def __init__(self, t_chain, t_tree, t_draft, t_node, second=0.0):
        self.t_verify = {False: t_chain, True: t_tree}  # [m]: seconds of an m-token verify
        self.t_draft, self.t_node = t_draft, t_node
        # measured over profiled: a chain's verify, a branched tree's, a tree's growing; seconds of
        # the rest of a round, of the learned branch's draft. `now`: their medians
        self.seen = {"chain": [], "tree": [], "draft": [], "rest": [], "second": [second]}
        self.now = {"chain": 1.0, "tree": 1.0, "draft": 1.0, "rest": 0.0, "second": second}

    def verify(self, n, branched):
        """The profiled seconds of verifying n nodes and the root (linear past the profile)."""
        t, m = self.t_verify[branched], n + 1
        return t[m] if m < len(t) else t[-1] + (m - len(t) + 1) * (t[-1] - t[-2])

    def __call__(self, n, branched=True):
        now = self.now
        # a branched verify not measured yet: as far off its profile as the chain's
        ratio = now["tree"] if branched and self.seen["tree"] else now["chain"]
        return (now["rest"] + now["draft"] * (self.t_draft + self.t_node * n)
                + ratio * self.verify(n, branched))

    @property
    def second(self):
        return self.now["second"]

    def observe(self, n, drafting, verifying, branched):
        if drafting is not None:
            self.keep("draft", drafting / max(self.t_draft + self.t_node * n, 1e-9))
        self.keep("tree" if branched else "chain", verifying / self.verify(n, branched))

    def observe_rest(self, seconds):
        self.keep("rest", seconds)

    def observe_second(self, seconds):
        self.keep("second", seconds)

    def keep(self, what, x):
        """One more measurement of `what`; its median over the last KEEP is what counts now."""
        seen = self.seen[what]
        seen.append(x)
        del seen[:-self.KEEP]
        self.now[what] = statistics.median(seen)


def most_tree_nodes(target):
    """The most nodes a tree can have: a round verifies them and the root after at least one
    token of context, in the target's window."""
    return target.config.sequence_len - 2


def profile_tree(tree, target, reps=5):
    """A sized tree's starting costs (sets tree.cost, a TreeCost): a block tree's drafting with one
    node and with all `nodes` (the difference is its per-node cost), a two-branch tree's learned
    draft, then the verify of m = 1..nodes + 1 tokens as a chain and through the tree mask, each
    try after the tree's own drafting, as in the loop. Leaves a dummy context begun."""
    tcfg, w = target.config, target.lm_head.weight
    if not 1 <= tree.nodes <= most_tree_nodes(target):
        raise ValueError(f"a tree of {tree.nodes} nodes: a round of this target verifies 1 to "
                         f"{most_tree_nodes(target)}")
    cap, n_ctx, depth, greedy = tree.nodes, tcfg.sequence_len // 2, tree.max_k, Sampler("greedy")
    hid = {t: torch.zeros(1, n_ctx, tcfg.n_embd, device=w.device, dtype=w.dtype)
           for t in tree.hidden_layers}
    tree.begin(torch.zeros(1, n_ctx + 1, dtype=torch.long, device=w.device), hid)
    tree.cost = None  # the fixed shape while profiling: exactly the nodes asked for

    def draft(nodes):
        ts = []
        for _ in range(reps):
            ts.append(timed(lambda: tree.propose_tree(depth, nodes, greedy), w.device)[0])
        return min(ts)
    one, many = draft(1), draft(cap)
    t_node = max(0.0, (many - one) / max(1, cap - 1))
    second = (profile_propose(tree.second, target, tree.k_second, reps)
              if getattr(tree, "second", None) is not None else 0.0)  # two branches
    between = lambda: tree.propose_tree(depth, cap, greedy)  # noqa: E731
    t_chain = profile_verify(target, cap + 1, context=n_ctx, reps=reps, between=between)
    t_tree = profile_verify(target, cap + 1, context=n_ctx, reps=reps, between=between,
                            as_tree=True)
    tree.cost = TreeCost(t_chain, t_tree, one - t_node, t_node, second)
    return tree


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
