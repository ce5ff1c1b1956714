"""The hybrid drafter (draft_hybrid.py): rounds that switch between prompt lookup and a learned
drafter stay exact for every learned drafter, the learned one stays in sync on the rounds it
misses, the oracle is a ceiling, and the rule's parts do what their docstrings say. The shared
equivalence tests (greedy, coupled, rejection's distribution, rollback, stops) run over the
hybrid too: drafter_for() below, under the rule, and VARIANTS' "hybrid-switch", under a fixed
switching script. Its partners are every drafter the registry says pairs with it."""

import pytest
import torch

from benchmark.ablations import oracle_stats
from conftest import make
from draft_hybrid import (Costs, EDGES, HybridDrafter, LOOKUP_MAX, Record, best_round, bucket,
                          outcome)
from registry import drafters as registry
from runtime.profiling import profile_hybrid
from sampler import Sampler
from speculative import generate_plain, generate_speculative

LEARNED = registry.partners()  # every drafter the hybrid can pair with
SWITCH = ["lookup", "learned", "learned", "lookup", "lookup", "learned"]
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 5, 9, 5], [7, 3, 11, 30, 2, 7, 3]]



def make_hybrid(target, learned=None, script=None):
    """Prompt lookup and a learned drafter (DFlash unless given) under the hybrid's rule, with a
    fixed cost model instead of the profile and the timed rounds (a verify of m tokens costs
    1 + 0.05 m, a learned draft 0.5, a lookup 0.01), so its choices are deterministic. script:
    a cycle of choices instead of the rule (ScriptedHybrid), so that rounds switch drafters for
    certain."""
    learned = learned or make("dflash", target)
    d = ScriptedHybrid(learned, target, script) if script else HybridDrafter(learned, target)
    d.t_verify = [0.0] + [1.0 + 0.05 * m for m in range(1, LOOKUP_MAX + 2)]
    d.start_cost = {"lookup": 0.01, "learned": 0.5}
    d.reset_record()
    return d


class ScriptedHybrid(HybridDrafter):
    """The hybrid with a fixed cycle of choices ('lookup' / 'learned', one round each) instead
    of its rule."""

    def __init__(self, learned, target, script):
        super().__init__(learned, target)
        self.script, self.turn = script, 0

    def choose(self, m, copied, k_learned, sampler):
        who = self.script[self.turn % len(self.script)]
        self.turn += 1
        return who, (len(copied) if who == "lookup" else k_learned)


drafter_for = make_hybrid  # the shared tests' hybrid: under its rule, DFlash as the learned half
VARIANTS = {"switch": lambda target: make_hybrid(
    target, script=["lookup", "learned", "learned", "lookup", "lookup"])}

# -----------------------------------------------------------------------------
# exact whoever drafts


@pytest.mark.parametrize("learned", LEARNED)
@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_rounds_that_switch_drafters_are_token_identical(target, learned, mode):
    h = make_hybrid(target, make(learned, target), script=SWITCH)
    for p in PROMPTS:
        want = generate_plain(target, p, 40, Sampler(mode, 0.9, None, 4))
        got, stats = generate_speculative(target, h, p, 40, 8, Sampler(mode, 0.9, None, 4))
        assert got == want
        assert stats.tau == pytest.approx(1 + sum(stats.acceptance()), rel=1e-12)
    assert h.rounds["lookup"] > 5 and h.rounds["learned"] > 5


@pytest.mark.parametrize("learned", LEARNED)
def test_the_start_up_profile_runs_with_every_learned_partner(target, learned):
    """The registry's loader profiles the hybrid's partner (several proposes after one begin, no
    commit); with small, MTP or EAGLE-3 that once crashed at start-up. Then it drafts exactly."""
    profiled = profile_hybrid(HybridDrafter(make(learned, target), target), reps=2)
    assert len(profiled.t_verify) == LOOKUP_MAX + 2 and profiled.start_cost["learned"] > 0
    assert profiled.measure
    h = make_hybrid(target, profiled.learned)  # profiled: begun on a dummy context, then reused
    for p in PROMPTS[:3]:
        want = generate_plain(target, p, 30, Sampler("greedy"))
        assert generate_speculative(target, h, p, 30, 8, Sampler("greedy"))[0] == want


@pytest.mark.parametrize("learned", LEARNED)
def test_the_learned_drafter_catches_up_on_the_rounds_it_missed(target, learned):
    """After lookup rounds, the learned drafter drafts what a fresh copy of it begun on the same
    text drafts: catch_up handed it every token and target state it missed."""
    h = make_hybrid(target, make(learned, target), script=SWITCH)
    seen, real = [], h.learned.propose

    def propose(k, sampler):
        draft = real(k, sampler)
        seen.append((list(h.lookup.seq), k, draft[0].tolist()))
        return draft
    h.learned.propose = propose
    generate_speculative(target, h, PROMPTS[2], 48, 8, Sampler())
    assert len(seen) > 5
    layers = h.hidden_layers
    for seq, k, draft in seen:
        fresh = make(learned, target)
        x = torch.tensor([seq])
        with torch.no_grad():
            _, _, hid = target(x[:, :-1], hidden_layers=layers)
        fresh.begin(x, {t: hid[t] for t in layers})
        again = fresh.propose(k, Sampler())[0].tolist()
        n = min(len(draft), len(again))  # DSpark's scheduler may cut a block differently
        assert n >= 1 and again[:n] == draft[:n]


def test_the_oracle_is_exact_and_beats_either_drafter_alone(target):
    h = make_hybrid(target)
    refs = [generate_plain(target, p, 40, Sampler()) for p in PROMPTS]
    oracle = oracle_stats(h, target, PROMPTS, refs, 8, Sampler, 40)
    taus = {}
    for who in ("lookup", "learned"):
        one = make_hybrid(target, script=[who])
        tokens = forwards = 0
        for p, ref in zip(PROMPTS, refs):
            out, stats = generate_speculative(target, one, p, 40, 8, Sampler())
            assert out == ref
            tokens, forwards = tokens + stats.tokens, forwards + stats.target_forwards
        taus[who] = tokens / forwards
    assert oracle["tau"] >= max(taus.values())
    assert 0 < oracle["lookup_share"] < 1


# -----------------------------------------------------------------------------
# the rule's parts


def test_outcome_counts_what_survived_and_what_is_known():
    assert outcome([4, 5, 6], [4, 5, 9]) == (2, 3)     # position 3 tried and failed
    assert outcome([4, 5, 6], [4, 5]) == (2, 2)        # position 3 not known yet: not tried
    assert outcome([4, 5], [4, 5, 6, 7]) == (2, 2)     # the draft ended
    assert outcome([], [1]) == (0, 0)


def test_the_record_shrinks_a_thin_bucket_towards_the_pooled_one():
    r = Record(3, start=0.5)
    for _ in range(40):
        r.observe(1, 3, 3)  # bucket 1: every draft survives
    a = r.survival(1, 3)
    assert a[0] > 0.9 and a[2] < a[1] < a[0]
    thin = r.survival(2, 1)[0]  # nothing seen in bucket 2: the pooled estimate, near 1 by now
    assert 0.5 < thin < a[0]
    assert [bucket(m) for m in (0, 1, 3, 5, 16, 40)] == [0, 1, 3, 4, len(EDGES), len(EDGES)]


class Line:
    def __init__(self, alpha, beta):
        self.alpha, self.beta = alpha, beta

    def verify(self, m):
        return self.alpha + self.beta * m


def test_a_draft_grows_while_its_next_token_pays_for_its_verify_time():
    # each token costs 0.1 s of verify; at 5 tokens/s it must survive with p > 0.5 to pay
    survival = [0.9, 0.8, 0.6, 0.45, 0.3]
    value, k = best_round(survival, 0.0, Line(1.0, 0.1), rate=5.0)
    assert k == 3 and value == pytest.approx(1 + 0.9 + 0.8 + 0.6 - 5.0 * (1.0 + 0.4))
    assert best_round(survival, 0.0, Line(1.0, 0.1), rate=0.0)[1] == 5  # time free: all of it
    assert best_round([0.1], 0.0, Line(1.0, 0.1), rate=5.0, least=1)[1] == 1


def test_the_cost_fit_finds_the_loop_s_line_and_each_drafter_s_overhead():
    # the profile timed alone: 30% faster than the loop runs it, as on a busy machine
    costs = Costs([0.0] + [0.7 * (2.0 + 0.25 * m) for m in range(1, 34)],
                  {"lookup": 0.0, "learned": 0.0})
    for i in range(300):
        m = 1 + (7 * i) % 33
        costs.observe_verify(m, 2.0 + 0.25 * m)
        costs.observe_round("learned" if i % 3 else "lookup", 2.0 + 0.25 * m + (1.5 if i % 3 else
                                                                              0.1),
                            2.0 + 0.25 * m, tokens=4)
    # one pseudo-round at each end of the profile against ~50 remembered rounds
    assert costs.alpha == pytest.approx(2.0, rel=0.05)
    assert costs.beta == pytest.approx(0.25, rel=0.05)
    assert costs.fixed("learned") == pytest.approx(1.5, abs=1e-3)
    assert costs.fixed("lookup") == pytest.approx(0.1, abs=1e-3)
    assert costs.rate() == pytest.approx(4 / (2.0 + 0.25 * 17 + 1.0), rel=0.1)


def test_the_rule_copies_a_repeat_in_progress_and_drafts_where_nothing_matches(target):
    h = make_hybrid(target)
    long_match = bucket(20)
    for _ in range(50):  # the lookup's copies of long repeats survive; with no match it has none
        h.record["lookup"].observe(long_match, 20, 20)
        h.record["learned"].observe(long_match, 3, 4)
        h.record["learned"].observe(0, 3, 4)
    h.since = [0] * len(h.since)
    h.now = {"bucket": long_match}
    who, k = h.choose(20, list(range(32)), 8, Sampler())
    assert who == "lookup" and k >= 20
    h.now = {"bucket": 0}
    assert h.choose(0, [], 8, Sampler()) == ("learned", 8)
