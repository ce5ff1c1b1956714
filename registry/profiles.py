"""
registry/profiles.py -- the start-up profiles of the drafters that weigh expected tokens against
seconds: DSpark's scheduler, the hybrid's rule, a sized token tree. Each is measured here, on the
device in use, once before its first round (the registry's loader readies DSpark and the hybrid
with them; bench.py and sample.py a sized tree), then corrected by the rounds' own timings.
runtime/profiling.py times the forwards they are made of.
"""

import statistics

import torch

from runtime.devices import synchronize
from runtime.profiling import profile_propose, profile_verify, timed
from speculative import Sampler
from tree import Branches, depths, tree_mask


def chain_shape(m, start, device):
    """The (depths, mask) tree argument of m tokens in a row after `start` cached ones."""
    parents = list(range(m - 1))
    return torch.tensor(depths(parents), device=device), tree_mask(parents, start, device)


def profile_dspark(drafter, reps=9):
    """DSpark's scheduler weighs expected tokens against seconds: t_draft, one full-block propose
    (every position scored and admitted: the full cost) on a dummy context, then t_verify by
    length, each try after the drafter's own forward, as in the loop. From then on its rounds
    measure t_draft (drafter.measured), waiting for its device before scoring is timed
    (drafter.sync). Leaves the dummy context begun."""
    device = drafter.net.fc.weight.device
    drafter.sync = lambda: synchronize(device)
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


def profile_hybrid(hybrid, reps=5):
    """The hybrid's starting costs, which its rounds then fit (HybridDrafter.measured): t_verify
    by length up to its longest verify, and the learned drafter's propose at its own k."""
    learned, target = hybrid.learned, hybrid.target
    t_verify = profile_verify(target, hybrid.default_k + 1, reps=reps)
    hybrid.measured((t_verify, profile_propose(learned, target, learned.default_k, reps=reps)))
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


def profile_tree(tree, target, reps=5):
    """A sized tree's starting costs (sets tree.cost, a TreeCost): a block tree's drafting with one
    node and with all `nodes` (the difference is its per-node cost), a two-branch tree's learned
    draft, then the verify of m = 1..nodes + 1 tokens as a chain and through the tree mask, each
    try after the tree's own drafting, as in the loop. Leaves a dummy context begun."""
    tcfg, w = target.config, target.lm_head.weight
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
              if isinstance(tree, Branches) else 0.0)
    between = lambda: tree.propose_tree(depth, cap, greedy)  # noqa: E731
    t_chain = profile_verify(target, cap + 1, context=n_ctx, reps=reps, between=between)
    t_tree = profile_verify(target, cap + 1, context=n_ctx, reps=reps, between=between,
                            shape=chain_shape)
    tree.cost = TreeCost(t_chain, t_tree, one - t_node, t_node, second)
    return tree
