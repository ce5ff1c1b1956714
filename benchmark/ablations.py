"""
benchmark/ablations.py -- the rows bench.py runs beside each drafter: the same drafter with one part
switched off or another rule in charge, and the hybrid's ceiling.

A drafter here knows nothing of benchmarks; these are copies of it that share its network and
buffers (every generation starts with begin(), so they can), each with counts of its own:
  DSpark     -full (no scheduler: verify the whole block), -threshold (the static rule),
             -nomarkov (no Markov head: DFlash's parallel picks)
  hybrid     -lookup (the lookup alone at the rule's length), -m1/-m4/-m8 (fixed rules: the
             lookup where m >= 1, 4, 8 tokens match, else the learned drafter), and the oracle
  batched DSpark (benchmark/serving_sweep.py): -cut (its own scheduler), -full, beside the measured
             rule (serving/batched.py)
  trees (tree.py)  dspark-tree, dflash-tree (each drafter's tree beside its chain), two-branch
             (prompt lookup's copy and DSpark's draft as two branches of one tree)
"""

import copy

from draft_dspark import DSparkDrafter
from draft_hybrid import HybridDrafter, outcome
from runtime.profiling import add_stats, profile_tree
from speculative import Stats, generate_speculative
from tree import BlockTree, Branches

MATCH_RULES = (1, 4, 8)  # the hybrid's fixed rules: lookup when m >= each of these
# the fixed trees' shapes, chosen by measurement on a CPU, where each node widens the verify
# (docs/experiments.md: Trees: sized each round): the rows "-fixed", beside the sized trees
TREES = {  # name -> (its shape greedy, its shape sampling: shallower chains, bushier trees)
    "dspark-tree": (dict(nodes=20, width=2), dict(nodes=12, width=2, depth=6)),
    "dflash-tree": (dict(nodes=16, width=2), dict(nodes=8, width=2)),
}
TWO_BRANCH = dict(sure=2, nodes=32)  # DSpark's branch where lookup's match is one token or none
SIZED_CAP = 32  # the most nodes a sized tree may grow to: its verify is profiled that wide


def copies(drafter, rows, reset, cls=None):
    """{name: a copy of drafter with the attributes rows[name] changed, reset(copy) called}; with
    `cls`, each copy is made that subclass (the same drafters and buffers, its own choice)."""
    out = {}
    for name, changes in rows.items():
        v = copy.copy(drafter)
        if cls is not None:
            v.__class__ = cls
        v.__dict__.update(changes)
        reset(v)  # its own counts and its own account
        out[name] = v
    return out


def variants(drafter):
    """The ablation rows of one batch-1 drafter ({} for most)."""
    if isinstance(drafter, DSparkDrafter):
        return copies(drafter, {"dspark-full": dict(schedule="full"),
                                "dspark-threshold": dict(schedule="threshold"),
                                "dspark-nomarkov": dict(markov=False)},
                      DSparkDrafter.reset_account)
    if isinstance(drafter, HybridDrafter):
        out = copies(drafter, {"hybrid-lookup": dict(choices=("lookup",))},
                     HybridDrafter.reset_record)
        out.update(copies(drafter, {f"hybrid-m{m}": dict(min_match=m, measure=False)
                                    for m in MATCH_RULES}, HybridDrafter.reset_record, MatchHybrid))
        return out
    return {}


def trees(drafters, sampling):
    """The tree rows, {name: (tree drafter, depth)}, over copies of the chain drafters in
    `drafters` ({name: (drafter, k)}): each tree sized round by round on this device
    (tree.BlockTree, tree.Branches with a profiling.TreeCost), and its fixed shape ("-fixed").
    None under rejection sampling, which tree.py refuses."""
    if sampling == "rejection":
        return {}
    out = {}
    for name, shapes in TREES.items():
        chain_name = name[:-len("-tree")]
        if chain_name in drafters:  # as deep as its chain drafts, unless its shape says
            chain, k = drafters[chain_name]
            target = chain.net.target
            sized = BlockTree(copy.copy(chain), nodes=SIZED_CAP, k=k)  # as deep as it drafts
            out[name] = (profile_tree(sized, target), sized.max_k)
            shape = {"depth": k, **shapes[sampling != "greedy"]}
            out[name + "-fixed"] = (BlockTree(copy.copy(chain), **shape), shape["depth"])
    if "lookup" in drafters and "dspark" in drafters:
        (lookup, k_lookup), (dspark, k_dspark) = drafters["lookup"], drafters["dspark"]
        target = dspark.net.target
        sized = Branches(copy.copy(lookup), copy.copy(dspark), k_lookup, k_dspark,
                         nodes=TWO_BRANCH["nodes"])
        out["two-branch"] = (profile_tree(sized, target), sized.max_k)
        two = Branches(copy.copy(lookup), copy.copy(dspark), k_lookup, k_dspark, **TWO_BRANCH)
        out["two-branch-fixed"] = (two, two.max_k)
    return out


def batch_variants(dspark):
    """DSpark's other rows in the serving sweep: its own scheduler over the batch (Algorithm 1,
    "cut") and its whole block ("full"): copies that share its start-up profiles and buffers."""
    rows = {"dspark-cut": dict(schedule="auto"), "dspark-full": dict(schedule="full")}
    return copies(dspark, rows, DSparkDrafter.reset_account)


class MatchHybrid(HybridDrafter):
    """The literature's fixed rule: the lookup at its own k where its match is at least
    `min_match` tokens long, else the learned drafter at its longest."""
    min_match = 1

    def choose(self, m, copied, k_learned, sampler):
        if copied and m >= self.min_match:
            return "lookup", min(len(copied), self.lookup.default_k)
        return "learned", k_learned


class OracleHybrid(HybridDrafter):
    """The hybrid's ceiling: each round both draft at their longest, and the draft that agrees
    longer with `reference` (the output plain decoding gives) is verified (the lookup's on a tie:
    it is the cheaper). Its time means nothing: both draft."""
    reference = None

    def choose(self, m, copied, k_learned, sampler):
        draft = self.draft_learned(k_learned, sampler)
        self.now["learned_draft"] = draft
        ahead = self.reference[len(self.lookup.seq):]
        if outcome(copied, ahead)[0] >= outcome(draft[0].tolist(), ahead)[0]:
            return "lookup", len(copied)
        return "learned", draft[0].numel()

    def make_draft(self, who, n, copied, sampler):
        if who == "learned":
            return self.now["learned_draft"]
        return super().make_draft(who, n, copied, sampler)

    def miss(self, new, hidden):
        """The lookup's draft was verified, and the learned drafter drafted too: it commits the
        prefix of its own draft the round confirmed (its caches may hold it), and misses the
        rest."""
        draft = self.now.pop("learned_draft", None)
        if draft is None:
            return super().miss(new, hidden)
        ids = new.tolist()
        kept = min(outcome(draft[0].tolist(), ids)[0], len(ids) - 1)
        self.learned.commit(kept, new[:kept + 1], {t: h[:, :kept + 1] for t, h in hidden.items()})
        if kept + 1 < len(ids):
            super().miss(new[kept + 1:], {t: h[:, kept + 1:] for t, h in hidden.items()})


def oracle_stats(hybrid, target, prompts, refs, k, make_sampler, max_new_tokens, stop=()):
    """The ceiling of any choice between the two drafts: OracleHybrid over `prompts`, judged
    against `refs` (plain decoding's outputs, each ending at a stop token or the limit) ->
    {"tau", "lookup_share"}."""
    # its rounds fit no costs
    oracle = copies(hybrid, {"oracle": dict(measure=False)}, HybridDrafter.reset_record,
                    OracleHybrid)["oracle"]
    total = Stats()
    for prompt, ref in zip(prompts, refs):
        oracle.reference = list(prompt) + list(ref)
        add_stats(total, generate_speculative(target, oracle, prompt, max_new_tokens, k,
                                              make_sampler(), stop=stop)[1])
    return {"tau": total.tau, "lookup_share": oracle.lookup_share}
