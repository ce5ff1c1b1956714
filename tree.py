"""
tree.py -- verify a tree of drafts in one target forward, not one chain.

speculative.py verified one chain: the target keeps its longest agreeing prefix. When the drafter
is unsure between two tokens, a chain bets on one of them and the round ends at the first wrong
bet. This file adds the idea the serving engines add to the chain (SpecInfer, Medusa, EAGLE-2):
draft several continuations as a tree that shares its prefixes, and check every node at once.

  The tree: node 0 is the last confirmed token (the root); node i (1..N) has a parent p(i) < i
  and sits at depth(i) = depth(p(i)) + 1. One target forward over all N+1 nodes gives the
  target's next token at every node, if two things hold:
    - each node attends to the cache and to its ancestors only (the tree attention mask), and
    - its position is start + depth(i), not start + i.
  Acceptance: from the root, step to the child whose token is the target's choice, while there
  is one, then add the target's own token. At each node at most one child can be the target's
  choice (greedy: the argmax; coupled: the Gumbel-max with noise keyed on the position), so the
  output is exactly plain decoding's, as for a chain.
  The nodes off the accepted path leave holes in the KV cache: the accepted nodes' entries are
  moved down to consecutive slots (compaction), and the rest is rolled back as before.

Rejection sampling over a tree needs its own rule (SpecInfer's multi-candidate rejection
sampling); it is not built, and the tree loop refuses `rejection` in one error line.

Where a tree comes from (the drafters of the files that follow, wrapped; none of them changed):
  BlockTree  a block drafter (draft_dflash.py, draft_dspark.py: read them next) drafts every
             depth at once; the tree is its chain plus each node's runner-ups, grown best-first
             by the drafter's own cumulative log-probability (EAGLE-2's expansion and re-ranking).
             With DSpark's Markov head each branch's next token is conditioned on its own
             previous token: a true tree. DFlash's positions do not see each other, so every
             node at one depth gets the same candidates (Medusa's tree).
  Branches   prompt lookup's copy (draft_lookup.py) and a learned drafter's chain (DSpark's
             in bench.py) as two branches of one tree: the target keeps whichever agrees longer.
             The learned one drafts only where the lookup is not sure.
"""

import heapq
import time

import torch

from speculative import Drafter, Stats, prefill

# -----------------------------------------------------------------------------
# the tree's shape: a parent per node, and what that makes each node see


def depths(parents):
    """parents[i - 1] is node i's parent (node 0 is the root) -> [depth of node 0..N]."""
    d = [0]
    for p in parents:
        d.append(d[p] + 1)
    return d


def tree_mask(parents, start, device):
    """(N+1, start+N+1) bool: node i sees the cached positions [0, start) and its ancestors and
    itself, which sit at cache slots start + their node index."""
    n = len(parents) + 1
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents, 1):
        anc[i] |= anc[p]  # an ancestor of my parent is mine
    return torch.cat([torch.ones(n, start, dtype=torch.bool), anc], 1).to(device)


def children_of(parents):
    kids = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents, 1):
        kids[p].append(i)
    return kids


def trie(chains):
    """Chains of host ints, all after the same root -> (tokens, parents) of the tree that shares
    their common prefixes."""
    tokens, parents, where = [], [], {}  # (parent node, token) -> node
    for chain in chains:
        node = 0
        for t in chain:
            if (node, t) not in where:
                tokens.append(t)
                parents.append(node)
                where[(node, t)] = len(tokens)
            node = where[(node, t)]
    return tokens, parents


# -----------------------------------------------------------------------------
# verifying a tree: the target's choice at every node, the accepted path, compaction


def target_choices(sampler, logits, depth, start):
    """logits (N+1, V) at the nodes -> (N+1,) the target's next token after each node. Node i's
    next token sits at position start + 1 + depth(i): coupled sampling's noise is keyed on it."""
    if sampler.mode == "greedy":
        return logits.argmax(-1)
    noise = sampler.noise(range(start + 1, start + 2 + max(depth)), logits.size(-1),
                          logits.device)
    return (sampler.scaled(logits) + noise[torch.tensor(depth, device=logits.device)]).argmax(-1)


def accept(choices, tokens, parents):
    """Walk from the root to the child that holds the target's choice, while there is one ->
    (path: the accepted nodes from the root, new: the accepted drafts + the target's token).
    choices and tokens: host ints (tokens[i - 1] is node i's)."""
    kids, path = children_of(parents), [0]
    while True:
        nxt = next((c for c in kids[path[-1]] if tokens[c - 1] == choices[path[-1]]), None)
        if nxt is None:
            return path, [tokens[c - 1] for c in path[1:]] + [choices[path[-1]]]
        path.append(nxt)


def compact(cache, start, path):
    """Move the accepted nodes' K/V (cache slots start + node) to slots start .. start + n, where
    the next round expects them, then forget everything after them."""
    if path != list(range(len(path))):  # else they are in place already (the first branch)
        idx = torch.tensor(path, device=cache.k.device) + start
        cache.k[:, :, :, start:start + len(path)] = cache.k[:, :, :, idx]  # (L, B, nh, n+1, hs)
        cache.v[:, :, :, start:start + len(path)] = cache.v[:, :, :, idx]
    cache.rollback(start + len(path))


class TreeDrafter(Drafter):
    """A Drafter that proposes a tree: begin, commit and catch_up as a chain drafter's.
    propose_tree(depth, nodes, sampler) -> (tokens: host ints, parents) of at most `nodes` nodes
    and at most `depth` deep, node i's parent before it."""

    def propose_tree(self, depth, nodes, sampler):
        raise NotImplementedError


@torch.inference_mode()
def generate_tree(target, drafter, prompt, max_new_tokens, sampler, cache=None, trace=None):
    """generate_speculative's loop with a tree in place of the chain -> (tokens, Stats). The
    drafter's own `max_k` bounds the depth and `nodes` the size of each round's tree."""
    if sampler.mode == "rejection":
        raise ValueError("tree verification keeps greedy and coupled sampling exact; rejection "
                         "sampling over a tree needs a multi-candidate rule that is not built: "
                         "use --sampling greedy or coupled")
    dev, layers = target.lm_head.weight.device, drafter.hidden_layers
    seq, out, n_total, cache = prefill(target, drafter, prompt, max_new_tokens, sampler, cache)
    k = drafter.max_k
    stats = Stats(drafted_at=[0] * k, accepted_at=[0] * k, target_forwards=1)
    while len(out) < n_total:
        start = cache.length  # == len(seq) - 1
        depth = min(drafter.max_k, n_total - len(out) - 1)  # never past the tokens asked for
        nodes = min(drafter.nodes, target.config.sequence_len - start - 1)  # nor the cache
        t0 = time.perf_counter()
        tokens, parents = drafter.propose_tree(depth, nodes, sampler) if depth > 0 else ([], [])
        t1 = time.perf_counter()
        d = depths(parents)
        idx = torch.tensor(tokens, dtype=torch.long, device=dev)
        shape = (torch.tensor(d, device=dev), tree_mask(parents, start, dev)) if tokens else None
        logits, _, hid = target(torch.cat([seq[-1:], idx]).view(1, -1), cache=cache,
                                hidden_layers=layers, tree=shape)
        choices = target_choices(sampler, logits[0], d, start).tolist()  # the round's host sync
        path, new_ids = accept(choices, tokens, parents)
        compact(cache, start, path)
        new = torch.tensor(new_ids, dtype=torch.long, device=dev)
        seq = torch.cat([seq, new])
        drafter.commit(len(path) - 1, new, {layer: h[:, path] for layer, h in hid.items()})
        stats.verify_time += time.perf_counter() - t1
        stats.draft_time += t1 - t0
        stats.record(max(d), len(path) - 1)
        out.extend(new_ids)
        if trace is not None:  # as generate_speculative's: was the target's token a bonus?
            trace.append((new_ids[:-1], new_ids[-1], path[-1] not in parents if tokens else None))
    stats.tokens = len(out)
    return out, stats


# -----------------------------------------------------------------------------
# trees from drafters


class BlockTree(TreeDrafter):
    """A DFlash-style drafter's tree: its drafter drafts every depth from one pass (draft_states);
    each node's candidates are its depth's logits, plus, with DSpark's Markov head, the bias of the
    node's own token. First the drafter's own chain (each node's best candidate, from the root), so
    the tree keeps at least what the chain would; then best-first: of every candidate so far the one
    with the highest cumulative log-probability joins next (EAGLE-2), each node offering its `width`
    best. chain=False: best-first from the start (it lost: docs/experiments.md).

    Built on its own (tests/test_layout.py runs this with a tiny GPT as `target`, then a round
    against plain decoding):

        >>> from draft_dflash import DFlash, DFlashConfig, DFlashDrafter
        >>> cfg = DFlashConfig(n_embd=target.config.n_embd, n_head=2, taps=[1, 2], block=8)
        >>> drafter = BlockTree(DFlashDrafter(DFlash(cfg, target)), nodes=12)
    """

    def __init__(self, drafter, nodes=16, width=2, depth=None, chain=True):
        self.drafter, self.nodes, self.width, self.chain = drafter, nodes, width, chain
        self.name, self.max_k = f"{drafter.name}-tree", depth or drafter.max_k
        if not 1 <= self.max_k <= drafter.max_k:
            raise ValueError(f"a {drafter.name} tree is at most {drafter.max_k} deep (its "
                             f"drafter's block holds), not {self.max_k}")
        self.default_k = drafter.default_k
        self.hidden_layers = drafter.hidden_layers
        markov = getattr(drafter, "markov", False)
        self.bias = None if not markov else (
            (lambda prev: drafter.markov_table[prev]) if drafter.markov_table is not None
            else drafter.spark.markov)

    def begin(self, tokens, hidden):
        self.drafter.begin(tokens, hidden)

    def commit(self, n, new, hidden):
        self.drafter.catch_up(new, hidden)  # the drafter's own bookkeeping of a chain is not run

    def node_scores(self, base, j, prev, sampler, noise):
        """Log-probabilities of every token after a node at depth j whose token is prev: the
        drafter's own distribution (coupled: perturbed by the position's noise, noise[j], so its
        best candidate is the drafter's coupled pick)."""
        logits = base[j] if self.bias is None else base[j] + self.bias(prev)
        if noise is not None:
            logits = sampler.scaled(logits) + noise[j]
        return torch.log_softmax(logits.float(), -1)

    @torch.inference_mode()
    def propose_tree(self, depth, nodes, sampler):
        d = self.drafter
        base = d.net.logits(d.draft_states(depth))  # (depth, V): one pass drafts every depth
        S, root = d.seq.numel(), int(d.seq[-1])
        noise = (sampler.noise(range(S, S + depth), base.size(-1), base.device)
                 if sampler.mode == "coupled" else None)  # every depth's row at once
        tokens, parents, score = [], [], [0.0]
        # (off the chain?, -cumulative log-prob, tie-break, parent node, its depth, token): with
        # chain=True the drafter's own chain (each node's best child, from the root) comes first
        heap = []

        def offer(node, j, prev, on_chain):
            top = self.node_scores(base, j, prev, sampler, noise).topk(self.width)
            for i, (lp, t) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                off = not (self.chain and on_chain and i == 0)
                heapq.heappush(heap, (off, -(score[node] + lp), len(heap), node, j, t))
        offer(0, 0, root, True)
        while heap and len(tokens) < nodes:
            off, neg, _, parent, j, t = heapq.heappop(heap)
            tokens.append(t)
            parents.append(parent)
            score.append(-neg)
            if j + 1 < depth:
                offer(len(tokens), j + 1, t, not off)
        return tokens, parents


class Branches(TreeDrafter):
    """Two chains as two branches of one tree: prompt lookup's (`first`, draft_lookup.py) always,
    free; the learned drafter's (`second`) where the lookup is not sure, its match shorter than
    `sure` tokens. A round where the lookup is sure costs what its own round costs: the learned
    drafter does not even catch up on it until it drafts again.

    Built on its own (tests/test_layout.py runs this with a tiny GPT as `target`, then a round
    against plain decoding):

        >>> from draft_lookup import LookupDrafter
        >>> from draft_mtp import MTP, MTPConfig, MTPDrafter
        >>> mtp = MTPDrafter(MTP(MTPConfig.for_target(target.config)), target)
        >>> drafter = Branches(LookupDrafter(target.config.vocab_size), mtp, 6, 3)
    """

    def __init__(self, first, second, k_first, k_second, sure=8, nodes=32):
        self.first, self.second, self.sure, self.nodes = first, second, sure, nodes
        self.k_first, self.k_second = k_first, k_second
        self.name, self.max_k = "two-branch", max(k_first, k_second)
        self.default_k = self.max_k
        self.hidden_layers = tuple(sorted({*first.hidden_layers, *second.hidden_layers}))
        self.drafted = 0  # rounds the second drafter drafted

    def begin(self, tokens, hidden):
        self.first.begin(tokens, {t: hidden[t] for t in self.first.hidden_layers})
        self.second.begin(tokens, {t: hidden[t] for t in self.second.hidden_layers})
        self.behind = []  # (new, hidden) of the rounds the second drafter has not caught up on

    def commit(self, n, new, hidden):
        self.first.catch_up(new, {t: hidden[t] for t in self.first.hidden_layers})
        self.behind.append((new, {t: hidden[t] for t in self.second.hidden_layers}))

    def second_catches_up(self):
        """The rounds since the second drafter last drafted, in one catch_up: one pass over them
        all, not one a round (a round where the first is sure then costs the second nothing)."""
        if self.behind:
            new = torch.cat([n for n, _ in self.behind])
            hidden = {t: torch.cat([h[t] for _, h in self.behind], 1)
                      for t in self.second.hidden_layers}
            self.second.catch_up(new, hidden)
            self.behind = []

    def sure_of_itself(self):
        j = self.first.match()
        return j is not None and self.first.match_length(j) >= self.sure

    def propose_tree(self, depth, nodes, sampler):
        chains = [self.first.propose(min(depth, self.k_first), sampler)[0].tolist()]
        if not self.sure_of_itself():
            self.drafted += 1
            self.second_catches_up()
            chains.append(self.second.propose(min(depth, self.k_second), sampler)[0].tolist())
        tokens, parents = trie(chains)
        return tokens[:nodes], parents[:nodes]
