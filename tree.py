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
import math
import time

import torch

from speculative import Drafter, Stats, as_prompt, drafter_code, tokens_allowed, until_stop

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


def branched(parents):
    """Does the tree branch anywhere? (One that does not is a chain: node i's parent is i - 1.)"""
    return parents != list(range(len(parents)))


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
    noise = sampler.noise(start + 1, 1 + max(depth), logits.size(-1), logits.device)
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
    and at most `depth` deep, node i's parent before it.

    A tree sized by what its rounds cost (`cost`, see pays below) times them on its own clock:
    started() as propose_tree begins, proposed(parents) as it returns its nodes, verified() as
    commit begins. Where the cost has observe(n, seconds growing the tree or None, seconds
    verifying, branched?) and observe_rest (seconds from a verify to the next round's start:
    commit, the loop), it hears each round."""
    cost = None

    def propose_tree(self, depth, nodes, sampler):
        raise NotImplementedError

    def started(self):
        self.clock = [time.perf_counter()]
        if getattr(self, "done", None) is not None and hasattr(self.cost, "observe_rest"):
            self.cost.observe_rest(self.clock[0] - self.done)
        self.done = None

    def proposed(self, parents, grown=True):
        """grown=False: this round's draft is not the tree's growing (a chain drafter's own round),
        so its seconds tell nothing of what growing costs."""
        self.clock += [time.perf_counter(), parents, grown]

    def verified(self):
        if hasattr(self.cost, "observe") and len(getattr(self, "clock", ())) == 4:
            start, proposed, parents, grown = self.clock
            self.done = time.perf_counter()
            self.cost.observe(len(parents), proposed - start if grown else None,
                              self.done - proposed, branched(parents))
        self.clock = ()


def prefill(target, drafter, prompt, max_new_tokens, sampler, cache):
    """The prompt through the target (a gpt.KVCache: a tree's round writes its nodes and compacts
    the path it keeps), the drafter begun -> (confirmed tokens, [first token], tokens allowed,
    cache). The LM head on the last row only, as in generate_plain. One host sync."""
    x = as_prompt(prompt, target.lm_head.weight.device)
    n_total = tokens_allowed(target, x.size(1), max_new_tokens)
    cache = cache or target.new_cache()
    cache.reset()
    logits, _, hid = target(x, cache=cache, hidden_layers=drafter.hidden_layers, last_only=True)
    seq = torch.cat([x[0], sampler.first_token(logits[0], x.size(1))])  # confirmed tokens
    with drafter_code(drafter, "begin"):
        drafter.begin(seq.view(1, -1), hid)
    return seq, [seq[-1].item()], n_total, cache


@torch.inference_mode()
def generate_tree(target, drafter, prompt, max_new_tokens, sampler, cache=None, trace=None,
                  stop=()):
    """generate_speculative's loop with a tree in place of the chain -> (tokens, Stats). The
    drafter's own `max_k` bounds the depth and `nodes` the size of each round's tree; stop, as
    there, ends the text at the first stop token."""
    if sampler.mode == "rejection":
        raise ValueError("tree verification keeps greedy and coupled sampling exact; rejection "
                         "sampling over a tree needs a multi-candidate rule that is not built: "
                         "use --sampling greedy or coupled")
    dev, layers = target.lm_head.weight.device, drafter.hidden_layers
    seq, out, n_total, cache = prefill(target, drafter, prompt, max_new_tokens, sampler, cache)
    k = drafter.max_k
    stats = Stats.of(k)
    while len(out) < n_total and out[-1] not in stop:
        start = cache.length  # == len(seq) - 1
        depth = min(drafter.max_k, n_total - len(out) - 1)  # never past the tokens asked for
        nodes = min(drafter.nodes, target.config.sequence_len - start - 1)  # nor the cache
        t0 = time.perf_counter()
        tokens, parents = drafter.propose_tree(depth, nodes, sampler) if depth > 0 else ([], [])
        t1 = time.perf_counter()
        d = depths(parents)
        idx = torch.tensor(tokens, dtype=torch.long, device=dev)
        # a tree of one branch is a chain: verified as one, through the causal mask's kernels
        shape = ((torch.tensor(d, device=dev), tree_mask(parents, start, dev))
                 if branched(parents) else None)
        logits, _, hid = target(torch.cat([seq[-1:], idx]).view(1, -1), cache=cache,
                                hidden_layers=layers, tree=shape)
        choices = target_choices(sampler, logits[0], d, start).tolist()  # the round's host sync
        path, new_ids = accept(choices, tokens, parents)
        keep = until_stop(new_ids, stop)
        path, new_ids = path[:keep], new_ids[:keep]
        compact(cache, start, path)
        new = torch.tensor(new_ids, dtype=torch.long, device=dev)
        seq = torch.cat([seq, new])
        kept = (slice(0, len(path)) if path[-1] == len(path) - 1 else path)  # a prefix: a view
        drafter.commit(len(path) - 1, new, {layer: h[:, kept] for layer, h in hid.items()})
        stats.verify_time += time.perf_counter() - t1
        stats.draft_time += t1 - t0
        stats.record(max(d), len(path) - 1)
        out.extend(new_ids)
        if trace is not None:  # as generate_speculative's: was the target's token a bonus?
            trace.append((new_ids[:-1], new_ids[-1], path[-1] not in parents if tokens else None))
    stats.tokens = len(out)
    return out, stats


# -----------------------------------------------------------------------------
# how big a tree: what each node is expected to keep, against what it costs here


def pays(expected, p, seconds, more_seconds):
    """Does one more node pay for itself? Without it a round is expected to keep `expected`
    tokens in `seconds`; with it, `expected + p` in `more_seconds` (p: the chance the node is
    kept). It pays where tokens per second do not drop. Grown best-first, each next node's p is at
    most the last one's (a node is kept only if its parent is), so the first node that does not
    pay ends the tree: more width would only cost more. A tree's shape and the drafts a request
    or a batch of them verifies (DSpark's scheduler, draft_dspark.admit) are this one question."""
    return (expected + p) * seconds >= expected * more_seconds


class Calibration:
    """The chance that a candidate is kept once its parent is, from the drafter's own probability
    q of it, as verification has counted it: per tenth of q, and apart for a node's best
    candidate and its runner-ups (a drafter is confident in a different way about the two).
    A bin nobody has counted yet says q itself (PRIOR pseudo-rounds of it)."""
    BINS, PRIOR = 10, 2.0

    def __init__(self):
        self.reached = [[0.0] * self.BINS for _ in range(2)]  # [best?][bin]: parent was kept
        self.kept = [[0.0] * self.BINS for _ in range(2)]     # ... and so was it

    def cell(self, q, rank):
        """(best candidate or runner-up, tenth of q): where a candidate is counted."""
        return min(rank, 1), min(int(q * self.BINS), self.BINS - 1)

    def __call__(self, q, rank):
        r, b = self.cell(q, rank)
        return (self.kept[r][b] + self.PRIOR * q) / (self.reached[r][b] + self.PRIOR)

    def observe(self, q, rank, kept):
        r, b = self.cell(q, rank)
        self.reached[r][b] += 1
        self.kept[r][b] += kept


def same_cost(n, branched=True):
    """The cost model of no measurement: every round costs the same, so every node pays and a
    tree grows to its cap. runtime/profiling.py measures a device's (TreeCost): a round of n
    nodes costs more branched than as a chain, whose verify takes the causal mask's kernels."""
    return 1.0


# -----------------------------------------------------------------------------
# trees from drafters


class BlockTree(TreeDrafter):
    """A DFlash-style drafter's tree: its drafter drafts every depth from one pass (draft_states);
    each node's candidates are its depth's logits, plus, with DSpark's Markov head, the bias of the
    node's own token, each node offering its `width` best.

    Sized (a `cost`: (n nodes, branched?) -> seconds of a round with such a tree): each round the tree
    grows best-first by each candidate's chance of being kept, P(parent kept) x the calibrated
    chance of it given its parent (Calibration, from the drafter's own probability), and stops at
    the first node that does not pay (pays) or at `nodes`. A chain is the tree that stops at one
    branch, and no tree at all (a plain step) is allowed. Where the tree comes out a chain, the
    next rounds are the drafter's own chain rounds, at the chain's cost (own_chain), until a
    watch round grows a tree again. Each round reports its timings to the cost (TreeDrafter's
    clock; runtime/profiling.TreeCost corrects its start-up profile by them).
    Without a cost, the fixed shape: `nodes` every round, the drafter's own chain first (each
    node's best candidate, from the root), so the tree keeps at least what the chain would; then
    best-first by cumulative log-probability (EAGLE-2). chain=False: best-first from the start.

    A tree's rounds on their own, run as written (tests/test_layout.py runs every example of the
    lesson): DFlash's tree on a tiny random target in float64, sized as if every node cost the
    same (same_cost).

        >>> from gpt import GPT, GPTConfig
        >>> from draft_dflash import DFlash, DFlashConfig, DFlashDrafter
        >>> from sampler import Sampler
        >>> from speculative import generate_plain
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> cfg = DFlashConfig(n_embd=32, n_head=2, taps=[1, 2], block=8)
        >>> chain = DFlashDrafter(DFlash(cfg, target).double().eval())
        >>> drafter = BlockTree(chain, nodes=12, cost=same_cost)
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_tree(target, drafter, prompt, 12, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    WATCH = 8

    def __init__(self, drafter, nodes=16, width=2, depth=None, chain=True, cost=None, k=None):
        self.drafter, self.nodes, self.width, self.chain = drafter, nodes, width, chain
        self.k = k or drafter.default_k  # the drafter's own chain's length (own_chain)
        self.name, self.max_k = f"{drafter.name}-tree", depth or drafter.max_k
        for deep in (self.max_k, self.k):
            if not 1 <= deep <= drafter.max_k:
                raise ValueError(f"a {drafter.name} tree is at most {drafter.max_k} deep (its "
                                 f"drafter's block holds), not {deep}")
        self.default_k = drafter.default_k
        self.hidden_layers = drafter.hidden_layers
        markov = getattr(drafter, "markov", False)
        self.bias = None if not markov else (
            (lambda prev: drafter.markov_table[prev]) if drafter.markov_table is not None
            else drafter.spark.markov)
        self.cost, self.calibration = cost, Calibration()
        self.grown = None  # the sized round in flight: its nodes' (q, rank)
        self.sizes = []  # nodes a round, of the rounds grown (sized trees)
        self.chained = 0  # rounds in a row drafted as a chain (sized trees)

    def begin(self, tokens, hidden):
        self.drafter.begin(tokens, hidden)
        self.grown, self.done = None, None

    def commit(self, n, new, hidden):
        self.verified()
        if self.grown is not None:
            self.count(new.tolist())
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
        if self.cost is not None and self.chained >= self.WATCH and self.chained % self.WATCH:
            return self.own_chain(depth, sampler)
        d = self.drafter
        self.started()
        # (depth, V): one pass drafts every depth (a request: a batch of one row)
        base = d.net.target_logits(d.draft_states([depth])[0])
        S, root = d.seq.numel(), int(d.seq[-1])
        noise = (sampler.noise(S, depth, base.size(-1), base.device)
                 if sampler.mode == "coupled" else None)  # every depth's row at once
        scores = lambda j, prev: self.node_scores(base, j, prev, sampler, noise)  # noqa: E731
        if self.cost is None:
            tokens, parents = self.fixed(scores, root, depth, nodes)
        else:
            rows = self.chain_rows(base, root, sampler, noise)
            tokens, parents = self.sized(scores, rows, depth, nodes)
            self.chained = 0 if branched(parents) else self.chained + 1
        self.proposed(parents)
        return tokens, parents

    def own_chain(self, depth, sampler):
        """A round of the drafter's own chain (k long), as it drafts one alone: a sized tree that
        came out a chain WATCH rounds in a row drafts this instead, and grows a tree one round in
        WATCH to see whether branching pays yet (growing one costs a little every round)."""
        self.started()
        self.chained += 1
        tokens = self.drafter.propose(min(depth, self.k), sampler)[0].tolist()
        parents = list(range(len(tokens)))
        self.proposed(parents, grown=False)
        return tokens, parents

    def chain_rows(self, base, root, sampler, noise):
        """Every depth's `width` best candidates after the drafter's own chain, from one product:
        [(log-probs, tokens)] by depth, row j's after the chain's node j (the root for j = 0).
        With the Markov head each row's bias is its chain token's, so the chain comes first."""
        logits = base
        if self.bias is not None:
            chain = getattr(self.drafter, "greedy_chain", None)
            if sampler.mode == "greedy" and chain is not None:
                picks = chain(base, root)
            else:  # one depth at a time: each pick is the next one's bias
                picks, prev = [], root
                for j in range(base.size(0)):
                    prev = int(self.node_scores(base, j, prev, sampler, noise).argmax())
                    picks.append(prev)
                picks = torch.tensor(picks, device=base.device)
            prevs = torch.cat([torch.tensor([root], device=base.device), picks[:-1]])
            logits = base + self.bias(prevs)
        if noise is not None:
            logits = sampler.scaled(logits) + noise[:base.size(0)]
        top = torch.log_softmax(logits.float(), -1).topk(self.width)
        return list(zip(top.values.tolist(), top.indices.tolist()))

    def fixed(self, scores, root, depth, nodes):
        """The fixed shape: `nodes` nodes, the chain first (with chain=True)."""
        tokens, parents, score = [], [], [0.0]
        # (off the chain?, -cumulative log-prob, tie-break, parent node, its depth, token): with
        # chain=True the drafter's own chain (each node's best child, from the root) comes first
        heap = []

        def offer(node, j, prev, on_chain):
            top = scores(j, prev).topk(self.width)
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

    def sized(self, scores, rows, depth, nodes):
        """Best-first by the chance of being kept, while the next node pays (pays, self.cost).
        rows: chain_rows, every candidate under the chain; scores(j, prev): under any node."""
        tokens, parents, kept_p, offered = [], [], [1.0], []  # offered: (node, token, q, rank)
        heap = []  # (-P(kept), tie-break, parent node, its depth, token, q, rank, on the chain?)

        def offer(node, j, top, on_chain):
            for rank, (lp, t) in enumerate(zip(*top)):
                q = math.exp(lp)
                p = kept_p[node] * self.calibration(q, rank)
                heapq.heappush(heap, (-p, len(heap), node, j, t, q, rank, on_chain and rank == 0))
                offered.append((node, t, q, rank))
        offer(0, 0, rows[0], True)
        expected, n, forked = 1.0, 0, False  # the target's own token, kept every round
        while heap and n < nodes:
            neg, _, parent, j, t, q, rank, on_chain = heap[0]
            more = forked or parent != n  # a chain stays one only under its last node
            if not pays(expected, -neg, self.cost(n, forked), self.cost(n + 1, more)):
                break
            heapq.heappop(heap)
            tokens.append(t)
            parents.append(parent)
            kept_p.append(-neg)
            expected, n, forked = expected - neg, n + 1, more
            if j + 1 < depth:  # under the chain its row is ready; elsewhere, scored now
                top = (rows[j + 1] if on_chain else
                       [x.tolist() for x in scores(j + 1, t).topk(self.width)])
                offer(n, j + 1, top, on_chain)
        self.grown = {"tokens": tokens, "parents": parents, "offered": offered}
        self.sizes.append(n)
        return tokens, parents

    def count(self, ids):
        """After a sized round's verify: every candidate offered under a node that was kept, in
        the tree or not, tells the calibration whether it would have been kept (the target's token
        after that node is known), so what was never verified is learned too. ids: the tokens the
        round confirmed."""
        g, self.grown = self.grown, None
        kids, path = children_of(g["parents"]), [0]
        for t in ids[:-1]:  # the kept nodes: each is its parent's child with the target's token
            path.append(next(c for c in kids[path[-1]] if g["tokens"][c - 1] == t))
        after = {node: ids[i] for i, node in enumerate(path)}  # the target's token after it
        for node, t, q, rank in g["offered"]:
            if node in after:
                self.calibration.observe(q, rank, t == after[node])


class Branches(TreeDrafter):
    """Two chains as two branches of one tree: prompt lookup's (`first`, draft_lookup.py) always,
    free; the learned drafter's (`second`) only where it is worth its drafting and its width.
    Sized (a `cost`, as BlockTree's, whose `second` is the seconds the learned drafter's draft
    takes): where the tokens the learned branch has added, over what the lookup alone kept, at
    this length of the lookup's match, pay for those seconds and the wider verify (pays). Its
    record starts hopeful (PRIOR rounds at half its chain kept), so it is tried, and stops being
    drafted where it keeps losing. Without a cost: where the lookup's match is shorter than `sure`
    tokens. A round where the learned drafter does not draft costs what the lookup's own round
    costs: it does not even catch up on it until it drafts again.

    A tree's rounds on their own, run as written (tests/test_layout.py runs every example of the
    lesson): the lookup's branch and an MTP head's, on a tiny random target in float64.

        >>> from gpt import GPT, GPTConfig
        >>> from draft_lookup import LookupDrafter
        >>> from draft_mtp import MTP, MTPConfig, MTPDrafter
        >>> from sampler import Sampler
        >>> from speculative import generate_plain
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> mtp = MTPDrafter(MTP(MTPConfig.for_target(target.config)).double().eval(), target)
        >>> drafter = Branches(LookupDrafter(target.config.vocab_size), mtp, 6, 3)
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_tree(target, drafter, prompt, 12, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    PRIOR, MATCHES = 1.0, 8  # the record's hopeful start; match lengths apart, 0..MATCHES

    def __init__(self, first, second, k_first, k_second, sure=8, nodes=32, cost=None):
        self.first, self.second, self.sure, self.nodes = first, second, sure, nodes
        self.k_first, self.k_second, self.cost = k_first, k_second, cost
        self.name, self.max_k = "two-branch", max(k_first, k_second)
        self.default_k = self.max_k
        self.hidden_layers = tuple(sorted({*first.hidden_layers, *second.hidden_layers}))
        self.drafted = 0  # rounds the second drafter drafted
        # per match length: [rounds, tokens the lookup kept]; [rounds the second drafted, tokens
        # it added over the lookup's]
        self.kept = [[0.0, 0.0] for _ in range(self.MATCHES + 1)]
        self.added = [[0.0, 0.0] for _ in range(self.MATCHES + 1)]

    def begin(self, tokens, hidden):
        self.first.begin(tokens, {t: hidden[t] for t in self.first.hidden_layers})
        self.second.begin(tokens, {t: hidden[t] for t in self.second.hidden_layers})
        self.behind = []  # (new, hidden) of the rounds the second drafter has not caught up on
        self.round, self.done = None, None

    def commit(self, n, new, hidden):
        self.verified()
        if self.round is not None:
            self.count(new.tolist())
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

    def match_length(self):
        j = self.first.match()
        return 0 if j is None else self.first.match_length(j)

    def worth_drafting(self, m, n_first, k_second):
        """Is the learned branch worth drafting, the lookup's match m tokens long?"""
        if self.cost is None:
            return m < self.sure
        b = min(m, self.MATCHES)
        rounds, kept = self.kept[b]
        expected = 1 + (kept + self.PRIOR * n_first / 2) / (rounds + self.PRIOR)
        drafted, added = self.added[b]
        gain = (added + self.PRIOR * k_second / 2) / (drafted + self.PRIOR)
        wider = self.cost(n_first + k_second, True) + self.cost.second
        return pays(expected, gain, self.cost(n_first, False), wider)

    def propose_tree(self, depth, nodes, sampler):
        self.started()
        chains = [self.first.propose(min(depth, self.k_first), sampler)[0].tolist()]
        m = self.match_length()
        k_second = min(depth, self.k_second)
        if self.worth_drafting(m, len(chains[0]), k_second):
            self.drafted += 1
            t0 = time.perf_counter()
            self.second_catches_up()
            chains.append(self.second.propose(k_second, sampler)[0].tolist())
            if hasattr(self.cost, "observe_second"):
                self.cost.observe_second(time.perf_counter() - t0)
        self.round = (min(m, self.MATCHES), chains)
        tokens, parents = trie(chains)
        self.proposed(parents[:nodes])
        return tokens[:nodes], parents[:nodes]

    def count(self, ids):
        """After the verify: what the lookup kept, and what the learned branch added to it."""
        (b, chains), self.round = self.round, None
        first = agreed(chains[0], ids)
        self.kept[b][0] += 1
        self.kept[b][1] += first
        if len(chains) > 1:
            self.added[b][0] += 1
            self.added[b][1] += max(0, agreed(chains[1], ids) - first)


def agreed(chain, ids):
    """How many of a chain's first tokens the round confirmed (ids: the tokens it kept)."""
    known = min(len(chain), len(ids))
    return next((j for j in range(known) if chain[j] != ids[j]), known)
