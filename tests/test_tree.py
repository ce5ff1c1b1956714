"""tree.py's promises, in float64 on the tiny target: every tree drafter is token-identical to
plain decoding, greedy and coupled, including rounds whose accepted path is not the first branch
and rounds where no branch survives; the cache after a round equals a fresh prefill of what was
kept; rejection sampling is refused."""

import pytest
import torch

from conftest import make
from runtime.profiling import chain_as_tree
from sampler import Sampler
from speculative import generate_plain
from test_speculative import assert_cache_is_a_fresh_prefill, prompts
from tree import (BlockTree, Branches, Calibration, TreeDrafter, accept, depths, generate_tree,
                  pays, same_cost, tree_mask, trie)


class Scripted(TreeDrafter):
    """A tree built from plain decoding's own continuation (the answer key): the right token is
    put in the `right`-th branch of each node, among wrong siblings, `deep` levels deep; `wrong`
    rounds offer no right token at all."""

    def __init__(self, answer, right=1, width=3, deep=3, wrong=()):
        self.answer, self.right, self.width = answer, right, width
        self.deep, self.wrong = deep, wrong
        self.max_k, self.nodes, self.hidden_layers, self.name = deep, 64, (), "scripted"
        self.rounds = 0

    def begin(self, tokens, hidden):
        self.n = tokens.numel()

    def commit(self, n, new, hidden):
        self.n += new.numel()

    def propose_tree(self, depth, nodes, sampler):
        self.rounds += 1
        good = self.answer[self.n:self.n + depth]
        tokens, parents, node = [], [], 0
        for t in good:
            siblings = [(t + 1 + i) % 64 for i in range(self.width)]
            if self.rounds not in self.wrong:
                siblings[self.right] = t
            for s in siblings:
                tokens.append(s)
                parents.append(node)
            node = len(tokens) - self.width + self.right  # go on under the right one
        return tokens[:nodes], parents[:nodes]


def test_the_mask_shows_each_node_its_ancestors_only():
    parents = [0, 0, 1, 1, 3]  # root -> 1, 2; 1 -> 3, 4; 3 -> 5
    m = tree_mask(parents, 2, "cpu")
    assert m.shape == (6, 8) and m[:, :2].all()
    assert m[5, 2:].tolist() == [True, True, False, True, False, True]
    assert m[2, 2:].tolist() == [True, False, True, False, False, False]
    assert depths(parents) == [0, 1, 1, 2, 2, 3]
    assert trie([[5, 6, 7], [5, 6, 9], [8]]) == ([5, 6, 7, 9, 8], [0, 1, 2, 2, 0])


@pytest.mark.parametrize("m,start", [(1, 0), (1, 5), (4, 3), (9, 0)])
def test_the_profiles_chain_is_the_tree_a_chain_makes(m, start):
    """runtime/profiling.py times a tree's kernels on a chain it builds itself: the very depths and
    mask tree.py gives a chain of m tokens."""
    parents = list(range(m - 1))
    got_depths, got_mask = chain_as_tree(m, start, "cpu")
    assert got_depths.tolist() == depths(parents)
    assert torch.equal(got_mask, tree_mask(parents, start, "cpu"))


def test_acceptance_follows_the_targets_choice_down_any_branch():
    tokens, parents = [4, 5, 6, 7], [0, 0, 2, 2]  # root -> 4, 5; 5 -> 6, 7
    choices = [5, 0, 7, 0, 9]  # the target's token after node 0..4
    assert accept(choices, tokens, parents) == ([0, 2, 4], [5, 7, 9])
    assert accept([1, 0, 0, 0, 0], tokens, parents) == ([0], [1])  # no branch survives


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
@pytest.mark.parametrize("right", [0, 2])
def test_a_scripted_tree_is_exact_on_any_branch_and_after_a_miss(target, mode, right):
    for seed, p in enumerate(prompts(4, target.config.vocab_size)):
        sampler = lambda: Sampler(mode, 0.8, None, seed)  # noqa: E731
        ref = generate_plain(target, p, 30, sampler())
        d = Scripted(p + ref, right=right, wrong={2, 3})
        out, stats = generate_tree(target, d, p, 30, sampler())
        assert out == ref
        assert stats.target_forwards < 20  # the right branches were taken: ~3 tokens a round


class Dear:
    """A cost model where width is dear: each node costs `per_node`, a branched tree `fork` more,
    a round 1; it hears every round (as runtime/profiling.TreeCost does), and its learned
    branch (`second`) costs `second`."""

    def __init__(self, per_node, fork=0.0, second=0.0):
        self.per_node, self.fork, self.second, self.branched = per_node, fork, second, []

    def __call__(self, n, branched=True):
        return 1.0 + self.per_node * n + (self.fork if branched and n > 1 else 0.0)

    def observe(self, n, drafting, verifying, branched):
        self.branched.append(branched)

    def observe_rest(self, seconds):
        pass


def tree_drafters(target):
    dspark, dflash = make("dspark", target), make("dflash", target)
    return {"dspark-tree": BlockTree(dspark, nodes=12, width=2),
            "dspark-tree-shallow": BlockTree(make("dspark", target), nodes=8, width=3, depth=3),
            "dflash-tree": BlockTree(dflash, nodes=12, width=3),
            "two-branch": Branches(make("lookup", target), make("dspark", target), 10, 8, sure=4),
            "dspark-sized": BlockTree(make("dspark", target), nodes=16, cost=same_cost),
            "dflash-sized-dear": BlockTree(make("dflash", target), nodes=16, cost=Dear(0.05, 0.1)),
            "two-branch-sized": Branches(make("lookup", target), make("dspark", target), 10, 8,
                                         cost=Dear(0.02, 0.0, 0.3))}


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_every_tree_drafter_is_token_identical(target, mode):
    for name, d in tree_drafters(target).items():
        for seed, p in enumerate(prompts(8, target.config.vocab_size, seed=3)):
            ref = generate_plain(target, p, 40, Sampler(mode, 0.7, None, seed))
            out, _ = generate_tree(target, d, p, 40, Sampler(mode, 0.7, None, seed))
            assert out == ref, (name, seed)


def test_every_tree_ends_at_a_stop_token_as_plain_decoding_does(target):
    for name, d in tree_drafters(target).items():
        for seed, p in enumerate(prompts(4, target.config.vocab_size, seed=5)):
            whole = generate_plain(target, p, 40, Sampler("greedy"))
            stop = {whole[4 + 5 * seed]}
            ref = generate_plain(target, p, 40, Sampler("greedy"), stop=stop)
            out, stats = generate_tree(target, d, p, 40, Sampler("greedy"), stop=stop)
            assert out == ref and len(ref) < 40 and stats.tokens == len(ref), (name, seed)


def test_the_cache_after_tree_rounds_equals_a_fresh_prefill(target):
    for d in tree_drafters(target).values():
        cache, prompt = target.new_cache(), [3, 1, 4, 1, 5]
        out, stats = generate_tree(target, d, prompt, 30, Sampler("greedy"), cache=cache)
        assert stats.tokens == 30
        assert_cache_is_a_fresh_prefill(target, cache, prompt + out)


def test_a_tree_beats_its_chain_on_the_tiny_target(target):
    """Not speed (bench.py measures that): a tree's τ is at least its chain's, since the chain's
    own path is one of its branches more often than not."""
    from speculative import generate_speculative
    d = make("dspark", target)
    chain = tree = 0
    for p in prompts(8, target.config.vocab_size, seed=5):
        chain += generate_speculative(target, d, p, 40, d.max_k, Sampler("greedy"))[1].tau
        tree += generate_tree(target, BlockTree(d, nodes=24, width=2), p, 40,
                              Sampler("greedy"))[1].tau
    assert tree > chain


def test_the_tree_stops_at_the_context_window_and_refuses_rejection(target):
    d = BlockTree(make("dspark", target), nodes=40, width=3)
    p = list(range(1, 60))
    out, _ = generate_tree(target, d, p, 100, Sampler("greedy"))
    assert out == generate_plain(target, p, 100, Sampler("greedy"))
    assert len(out) == target.config.sequence_len - len(p)
    with pytest.raises(ValueError, match="rejection"):
        generate_tree(target, d, p, 10, Sampler("rejection"))


# -----------------------------------------------------------------------------
# sized trees: grown while the next node pays


def test_a_node_pays_where_tokens_per_second_do_not_drop():
    assert pays(2.0, 0.5, 1.0, 1.2)       # 2.5 tokens in 1.2 s beats 2 in 1 s
    assert not pays(2.0, 0.3, 1.0, 1.2)   # 2.3 in 1.2 s does not
    assert pays(1.0, 0.0, 1.0, 1.0)       # free and useless: it does no harm


def test_calibration_starts_at_the_drafters_own_probability_and_learns():
    c = Calibration()
    assert c(0.35, 0) == pytest.approx(0.35) and c(0.35, 1) == pytest.approx(0.35)
    for _ in range(50):
        c.observe(0.35, 1, False)  # runner-ups at q = 0.35 are never kept
    assert c(0.35, 1) < 0.02 and c(0.35, 0) == pytest.approx(0.35)  # the best: its own count


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_a_sized_tree_grows_where_width_is_cheap_and_stays_a_chain_or_nothing_where_it_is_dear(
        target, mode):
    """The same drafter, three cost models: every round the same (it grows to its cap), width
    dear (a chain, or no draft at all), a branched tree far dearer (never branched)."""
    sizes = {}
    for name, cost in [("free", same_cost), ("dear", Dear(0.3)), ("fork", Dear(0.01, 5.0))]:
        d = BlockTree(make("dspark", target), nodes=10, cost=cost)
        for seed, p in enumerate(prompts(4, target.config.vocab_size, seed=7)):
            ref = generate_plain(target, p, 30, Sampler(mode, 0.7, None, seed))
            assert generate_tree(target, d, p, 30, Sampler(mode, 0.7, None, seed))[0] == ref
        sizes[name] = d.sizes
    assert max(sizes["free"]) == 10
    assert max(sizes["dear"]) < 4 and max(sizes["dear"]) < sum(sizes["free"]) / len(sizes["free"])
    assert d.cost.branched and not any(d.cost.branched)  # each of its rounds a chain


def test_a_sized_two_branch_tree_stops_drafting_a_branch_that_does_not_pay(target):
    cheap = Branches(make("lookup", target), make("dspark", target), 10, 8, cost=Dear(0.0))
    dear = Branches(make("lookup", target), make("dspark", target), 10, 8, cost=Dear(0.0, 0.0, 50.0))
    for d in (cheap, dear):
        for p in prompts(4, target.config.vocab_size, seed=9):
            assert generate_tree(target, d, p, 30, Sampler("greedy"))[0] == generate_plain(
                target, p, 30, Sampler("greedy"))
    assert cheap.drafted > 4 * dear.drafted
