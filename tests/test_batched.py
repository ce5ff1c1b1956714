"""Many requests at once (serving/batched.py), for every registered drafter: in float64 every row
of a ragged batch equals its own batch-1 plain decoding (greedy and coupled), also with rows
that finish early and rows that start at the edge of the context window; native batched drafters
equal the per-row reference; rejection sampling gives every row the target's distribution;
DSpark's batch rules cut, skip and stay exact; bad batches are one clear error."""

import math
import time

import numpy as np
import pytest
import torch

import ragged
from draft_dspark import admit
from runtime.profiling import CostTable
from serving.batched import Measured, Widths, interpolate, serve
from conftest import make, within
from draft_dspark import DSparkDrafter
from draft_mtp import MTPDrafter
from registry import drafters as registry
from registry.drafters import batched as batched_twin
from ragged import RaggedCache
from sampler import Sampler
from speculative import (Drafter, Stats, generate_plain, generate_plain_batch,
                         generate_speculative, padded)
from test_mtp import fit_mtp


def ragged_prompts(n, vocab, seed=0, window=None):
    """n prompts of 1..19 tokens; with `window`, the last one ends 6 tokens before the window's
    end, so its row finishes long before the others (the context limit)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 20, (1,), generator=g))
        out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    if window:
        out[-1] = torch.randint(0, vocab, (window - 6,), generator=g).tolist()
    return out


def fixed_costs(drafter, B):
    """Deterministic costs at batch size B (the real ones are profiled): a verify of N tokens over
    B rows costs 1 + N/B units, a draft half a unit (a tenth more a slot a row), a plain step two:
    the measured rule's prior, or the costs DSpark's own scheduler weighs."""
    K = drafter.max_k
    verify = CostTable(B, [1.0 + m for m in range(1, K + 2)])
    draft = interpolate({B: 0.5, B * (K + 1): 0.5 + 0.1 * K})
    if isinstance(drafter, Measured):
        drafter.priors[B] = {w: float(verify(B * (w + 1)) + draft(B * (w + 1)))
                             for w in range(1, K + 1)}
        drafter.priors[B][0] = 2.0
        drafter.widths.timed(B, 0, 2.0, drafter.priors[B])  # a plain step timed already: it drafts
    else:
        drafter.use_costs(lambda b: (0.5, verify(np.arange(b * (K + 1) + 1)).tolist()))
        drafter.measured = False  # the clock never moves its costs: the same lengths every run
    return drafter


def batches(name):
    """Whether the registered drafter `name` (or a variant of it) has a batched form."""
    return registry.entry(name.split("-")[0]).batched


def batched_drafter(name, target, B):
    one = make(name, target)
    if not batches(name):
        with pytest.raises(NotImplementedError, match="one request at a time"):
            batched_twin(one)
        pytest.skip(f"{name} drafts one request at a time (its registry line says so)")
    # DSpark under the rule that pays in the serving sweep (benchmark/serving_sweep.py)
    d = batched_twin(one)
    return fixed_costs(d, B) if isinstance(d, Measured) else d


# -----------------------------------------------------------------------------
# the ragged target


def test_a_ragged_forward_equals_each_row_alone(target):
    prompts = ragged_prompts(4, target.config.vocab_size, seed=3)
    P = [len(p) for p in prompts]
    cache = ragged.new_cache(target, 4)
    with torch.no_grad():
        logits = ragged.forward(target, padded(prompts, "cpu")[0], cache, P)[0]
        for r, p in enumerate(prompts):
            ref = target(torch.tensor([p]))[0][0]
            assert torch.allclose(logits[r, :len(p)], ref, atol=1e-12)
        # a ragged second chunk: rows of 3, 0, 5 and 1 new tokens, at their own positions
        new = [[1, 2, 3], [], [4, 5, 6, 7, 8], [9]]
        x = torch.tensor([n + [0] * (5 - len(n)) for n in new])  # (4, 5), zeros after each row
        logits = ragged.forward(target, x, cache, [len(n) for n in new])[0]
        for r, (p, n) in enumerate(zip(prompts, new)):
            if n:
                ref = target(torch.tensor([p + n]))[0][0][len(p):]
                assert torch.allclose(logits[r, :len(n)], ref, atol=1e-12)
    assert cache.lengths == [p + len(n) for p, n in zip(P, new)]
    cache.rollback([1, P[1], 2, 0])
    with pytest.raises(ValueError, match="roll back"):
        cache.rollback([100, 0, 0, 0])


def test_a_ragged_forward_refuses_to_pass_the_window(target):
    cache = ragged.new_cache(target, 2)
    window = target.config.sequence_len
    with torch.no_grad(), pytest.raises(ValueError, match="context window"):
        ragged.forward(target, torch.zeros(2, window + 1, dtype=torch.long), cache, [1, window + 1])
    assert isinstance(cache, RaggedCache) and cache.lengths == [0, 0]


# -----------------------------------------------------------------------------
# every row equals its own batch-1 decoding


def test_plain_batched_equals_batch_one(target):
    window = target.config.sequence_len
    prompts = ragged_prompts(5, target.config.vocab_size, window=window)
    for mode in ("greedy", "coupled"):
        ref = [generate_plain(target, p, 30, Sampler(mode, 0.8, None, 7)) for p in prompts]
        out = generate_plain_batch(target, prompts, 30, Sampler(mode, 0.8, None, 7))
        assert out == ref
    assert len(out[-1]) == 6  # the long prompt's row stopped at the window


def test_a_plain_step_is_counted_as_a_round_that_drafted_nothing():
    """Stats.record_plain (one call a plain step, O(1)) counts what record() counts for a round
    where no row drafted, row by row."""
    each, at_once = Stats.of(6, 4), Stats.of(6, 4)
    for active in ([1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 1, 0]):
        each.batches += 1
        for _ in range(sum(active)):
            each.record(0, 0, 1)
        at_once.record_plain(sum(active))
    assert vars(each) == vars(at_once) and at_once.rounds == 8


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
@pytest.mark.parametrize("k", [1, 4])
def test_every_drafter_batched_is_token_identical(target, drafter_name, mode, k):
    window = target.config.sequence_len
    prompts = ragged_prompts(5, target.config.vocab_size, seed=k, window=window)
    ref = [generate_plain(target, p, 30, Sampler(mode, 0.9, None, 11)) for p in prompts]
    d = batched_drafter(drafter_name, target, len(prompts))
    out, stats = serve(target, d, prompts, 30, within(d, k),
                                  Sampler(mode, 0.9, None, 11))
    for r, (o, want) in enumerate(zip(out, ref)):
        assert o == want, f"row {r} diverged"
    assert stats.tokens == sum(len(o) for o in out)
    assert stats.tau == pytest.approx(1 + sum(stats.acceptance()), rel=1e-12)


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_rows_end_at_their_stop_token_as_at_batch_one(target, drafter_name, mode):
    """A stop token ends its row where that row's batch-1 plain decoding ends (the other rows
    go on), batched plain decoding and every drafter alike."""
    prompts = ragged_prompts(5, target.config.vocab_size, seed=5, window=target.config.sequence_len)
    whole = [generate_plain(target, p, 30, Sampler(mode, 0.9, None, 11)) for p in prompts]
    stop = {whole[0][6], whole[2][12]}
    ref = [generate_plain(target, p, 30, Sampler(mode, 0.9, None, 11), stop=stop) for p in prompts]
    assert any(len(r) < 30 for r in ref)
    plain = generate_plain_batch(target, prompts, 30, Sampler(mode, 0.9, None, 11), stop=stop)
    d = batched_drafter(drafter_name, target, len(prompts))
    out, stats = serve(target, d, prompts, 30, within(d, 4),
                                  Sampler(mode, 0.9, None, 11), stop=stop)
    assert plain == ref and out == ref
    assert stats.tokens == sum(len(o) for o in out)


class PerRow(Drafter):
    """The reference a batch drafted in one pass is checked against: one batch-1 copy of `one` a
    row, asked in turn (speculative.Drafter's own batch calls)."""

    def __init__(self, one):
        self.one, self.name, self.hidden_layers = one, one.name, one.hidden_layers

    def fresh(self):
        return self.one.fresh()

    def begin(self, tokens, hidden):
        raise AssertionError("only its copies draft")


def natively_batched(target):
    """(name, batch-1 drafter) of every registered drafter that drafts a batch in one pass, itself
    (its batch calls its own) or through its line's twin, as the shared tests build it (DSpark
    verifying its whole block, the rule its batch-1 self shares with its twin), and a one-module
    MTP head (the shared tests' has two)."""
    for e in registry.drafters():
        if not e.batched:
            continue
        one = make(e.name, target)
        if isinstance(one, DSparkDrafter):
            one.schedule = "full"
        if type(one).propose_batch is not Drafter.propose_batch:
            yield e.name, one
    yield "mtp1", MTPDrafter(fit_mtp(target, n_modules=1), target)


@pytest.mark.parametrize("mode", ["greedy", "coupled", "rejection"])
def test_native_batched_drafters_equal_the_per_row_reference(target, mode):
    """A batch drafted in one pass drafts exactly what one batch-1 copy per row drafts: same tokens, same
    draft lengths, in rejection mode too (each row's generator moves as in its own run)."""
    prompts = ragged_prompts(4, target.config.vocab_size, seed=5)
    for name, one in natively_batched(target):
        runs = [serve(target, d, prompts, 24, 3, Sampler(mode, 0.9, None, 2))
                for d in (one, PerRow(one))]
        assert runs[0][0] == runs[1][0], name
        assert runs[0][1].given == runs[1][1].given, name


def test_rows_that_finish_cost_nothing_and_keep_their_tokens(target):
    """A row at its last token gets zero tokens in every later forward: the batch goes on
    without it, and its output has exactly its allowed length."""
    prompts = ragged_prompts(3, target.config.vocab_size, seed=9, window=target.config.sequence_len)
    d = batched_drafter("dflash", target, 3)
    out, stats = serve(target, d, prompts, 40, 4, Sampler("greedy"))
    assert [len(o) for o in out] == [40, 40, 6]
    assert stats.slots > stats.verify_tokens  # ragged rounds: the attention padded some slots


# -----------------------------------------------------------------------------
# rejection sampling: the target's distribution per row


def exact_marginals(target, prompt, temperature):
    """The target's distribution of the first and the second generated token (V and V x V)."""
    s = Sampler("rejection", temperature)
    with torch.no_grad():
        p1 = s.probs(target(torch.tensor([prompt]))[0][0, -1])  # (V,)
        V = p1.numel()
        seqs = torch.tensor([prompt + [t] for t in range(V)])
        p2 = s.probs(target(seqs)[0][:, -1])  # (V, V): row t = p(. | first token t)
    return p1, p1 @ p2


@pytest.mark.parametrize("name", ["small", "dspark", "lookup"])
def test_rejection_sampling_per_row_has_the_targets_distribution(target, name):
    prompt, rows, T = [3, 1, 4, 1, 5], 2000, 1.0
    p1, p2 = exact_marginals(target, prompt, T)
    d = batched_drafter(name, target, rows)
    sampler = Sampler("rejection", T, None, seed=list(range(rows)))
    out, stats = serve(target, d, [prompt] * rows, 3, 2, sampler)
    assert sum(stats.drafted_at) > 0 and stats.accepted_at[0] < stats.drafted_at[0]  # both paths
    for pos, p in ((0, p1), (1, p2)):
        counts = torch.bincount(torch.tensor([o[pos] for o in out]), minlength=p.numel())
        tv = 0.5 * (counts / rows - p).abs().sum().item()
        # 2,000 draws of plain sampling land about 0.06 from these distributions in TV; a sampler
        # that kept the drafter's q (or ignored rejections) lands far further off
        assert tv < 0.1, (name, pos, tv)


# -----------------------------------------------------------------------------
# DSpark's rules over the batch


def test_algorithm_1_admits_by_survival_and_stops_at_the_first_drop():
    cost = CostTable(2, [1.0, 1.2, 1.6, 2.4])  # N = 2, 4, 6, 8 tokens
    survival = [[0.9, 0.8, 0.1], [0.5, 0.05]]
    lengths = admit(survival, 2, 0.5, cost)
    assert lengths == [2, 1]  # 0.9, 0.8, 0.5 pay; 0.1 does not, and the search stops there
    # a flat cost admits everything that survives at all
    assert admit(survival, 2, 0.5, CostTable(2, [1.0] * 4)) == [3, 2]
    # a steep one admits nothing: a row may verify no draft at all
    assert admit(survival, 2, 0.0, CostTable(2, [1.0, 3.0, 9.0, 27.0])) == [0, 0]


def test_the_measured_rule_compares_every_width_on_the_same_rounds():
    """One verify at width 8 tells what every narrower width would have kept; the choice is the
    width with the most tokens per second."""
    w = Widths(8)
    assert w.widths == [1, 2, 4, 8]
    for _ in range(50):  # rows keep 3 drafts of 8, every round
        w.verified(2, 8, [8, 8], [3, 3], 0.0)
    S = w.survivals()
    assert min(S[:3]) > 0.9 and max(S[3:]) < 0.1  # what width 8 showed about every width
    flat = {0: 1.0, 1: 1.0, 2: 1.0, 4: 1.0, 8: 1.05}
    assert w.choose(1, flat) == 4  # 4 keeps all 3 drafts and their bonus token, as 8 does
    steep = {0: 1.0, 1: 1.5, 2: 1.9, 4: 3.9, 8: 7.9}
    assert w.choose(1, steep) == 2  # 1 + S1 + S2 = 3 tokens for 1.9: the most a second
    # measured seconds replace the prior; an untimed width is priced by the timed ones
    w = Widths(8)
    w.timed(1, 2, 3.8, steep)  # twice what the profile said
    assert w.estimate(1, 2, steep) == 3.8 and w.estimate(1, 4, steep) == 7.8
    assert w.estimate(2, 4, steep) == 7.8  # another batch size: the ratio measured anywhere
    assert w.estimate(1, 0, steep) == 1.0  # a plain step is priced by plain steps only


def test_the_measured_rule_goes_plain_on_evidence_and_looks_again():
    """Before a batch: plain where the batches drafted at this batch size made fewer tokens a
    second than plain decoding, even with the benefit of the doubt. One batch timed whole at 0.8
    of plain decoding's rate turns drafting off at batch 32, where a batch averages many prompts,
    not at batch 2, where one prompt moves it; as plain batches go by without a look the doubt
    grows until the rule drafts one again, and what that look shows decides."""
    w = Widths(8)
    flat = {x: 1.0 for x in (0, 1, 2, 4, 8)}
    for B in (2, 32):
        assert not w.plain(B, flat)  # no batch drafted at this batch size yet
        w.timed(B, 0, 0.1, flat)  # a plain step: 10 tokens a row a second
        w.started(B, 100.0)
        w.verified(B, 8, [8] * B, [0] * B, 100.5)  # a token a row, ...
        w.verified(B, 8, [8] * B, [6] * B, 101.0)  # ... then 7: 8 a row in 1 s
    assert not w.plain(2, flat)  # at batch 2 one batch proves too little ...
    assert w.drafted[2] == [pytest.approx(0.8)]
    assert w.plain(32, flat) and w.plain(32, flat)  # ... at batch 32 it is enough
    w.drafted[32] = [0.9]  # closer to plain decoding: the doubt reaches it sooner
    looks = [not w.plain(32, flat) for _ in range(30)]
    assert not any(looks[:3]) and any(looks), looks
    w.drafted[32] += [1.1] * 3  # the looks show drafting pays after all
    assert not w.plain(32, flat)


@pytest.mark.parametrize("schedule", ["measured", "auto", "full"])
@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_every_batch_rule_is_exact(target, schedule, mode):
    """The measured rule, DSpark's own scheduler over the batch (which cuts some rows' drafts
    here) and its whole block: every row exact."""
    prompts = ragged_prompts(4, target.config.vocab_size, seed=2, window=target.config.sequence_len)
    ref = [generate_plain(target, p, 30, Sampler(mode, 0.8, None, 5)) for p in prompts]
    one = make("dspark", target)
    if schedule != "measured":
        one.schedule = schedule
    d = fixed_costs(Measured(one) if schedule == "measured" else one, 4)
    out, stats = serve(target, d, prompts, 30, 6, Sampler(mode, 0.8, None, 5))
    assert out == ref
    if schedule == "full":
        assert sum(stats.given[1:6]) <= 4 * 3  # only near the end does a row get fewer than 6
    if schedule == "auto":  # it scored every round, and cut
        assert d.scored == d.rounds and sum(stats.given[:6]) > 4 * 3, stats.given


def test_the_measured_rule_decodes_plainly_where_no_draft_pays(target):
    """Where every drafted round costs far more than a plain step (here each propose also waits
    20 ms, against a plain step of a millisecond or two), the measured rule times plain decoding's
    own step on one batch, drafts one for evidence, then decodes whole batches on plain
    decoding's own path (the drafter sees none of their rounds); the tokens stay exact
    throughout. (Left to the tiny drafter's own speed the verdict hung on the host's timings: a
    drafted batch made about a third of plain decoding's rate on a quiet host, and once, on a
    busy one, the rule drafted a batch again.)"""
    prompts = ragged_prompts(4, target.config.vocab_size, seed=4)
    d = Measured(make("dspark", target))
    d.priors[4] = {w: 2.0 for w in range(1, d.max_k + 1)}  # a verify and a draft a unit each
    d.priors[4][0] = 1e-9
    propose = d.propose_batch

    def slow_propose(ks, sampler):
        time.sleep(0.02)
        return propose(ks, sampler)
    d.propose_batch = slow_propose
    ref = [generate_plain(target, p, 40, Sampler("greedy")) for p in prompts]
    drafted = []
    for _ in range(6):
        before = d.rounds
        out, stats = serve(target, d, prompts, 40, 6, Sampler("greedy"))
        assert out == ref
        drafted.append(d.rounds > before)
        assert drafted[-1] or stats.given[0] == stats.rounds  # plain steps only
    assert drafted == [False, True, False, False, False, False], drafted


# -----------------------------------------------------------------------------
# bad batches


def test_bad_batches_are_one_clear_error(target):
    window = target.config.sequence_len
    s = Sampler("greedy")
    with pytest.raises(ValueError, match="batch is empty"):
        generate_plain_batch(target, [], 4, Sampler("greedy"))
    with pytest.raises(ValueError, match="prompt 1 of the batch: the prompt is empty"):
        generate_plain_batch(target, [[1, 2], []], 4, s)
    with pytest.raises(ValueError, match="prompt 0 of the batch: the prompt has"):
        generate_plain_batch(target, [[1] * window, [1]], 4, s)
    with pytest.raises(ValueError, match="seeds for a batch"):
        Sampler("coupled", seed=[1, 2]).pick(torch.zeros(3, 1, 5), [0, 0, 0])
    d = batched_twin(make("dflash", target))
    with pytest.raises(ValueError, match="prompt 1 of the batch"):
        serve(target, d, [[1, 2], []], 4, 2, s)
    assert math.isfinite(serve(target, d, [[1, 2], [3]], 4, 2, s)[1].tau)


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_a_batch_of_one_is_the_one_request_loop(target, mode):
    """A batch of one is one request: served with the drafter itself or the one its twin was made
    from, it gives generate_speculative's tokens and rounds, and the batch's counts of them (and
    plain decoding of a batch of one, plain decoding's tokens)."""
    p = ragged_prompts(1, target.config.vocab_size, seed=4)[0]
    ref = generate_plain(target, p, 30, Sampler(mode, 0.9, None, 3))
    assert generate_plain_batch(target, [p], 30, Sampler(mode, 0.9, None, 3)) == [ref]
    for name in (n for n in registry.names() if batches(n)):
        d = batched_drafter(name, target, 1)
        k = within(d, 4)
        out, st = serve(target, d, [p], 30, k, Sampler(mode, 0.9, None, 3))
        single = d.single if isinstance(d, Measured) else d
        _, one = generate_speculative(target, single, p, 30, k, Sampler(mode, 0.9, None, 3))
        assert out == [ref], name
        assert (st.rounds, st.tau, st.accepted_at) == (one.rounds, one.tau, one.accepted_at)
        assert sum(st.given) == st.rounds == st.batches and st.padding == 0.0


def test_one_copy_a_row_keeps_nothing_of_the_batch_before(target):
    """speculative.Drafter's default batch calls make a copy a row per batch; a copy must not hold
    the copies of an earlier batch (a server runs batch after batch: memory would grow)."""
    d = make("lookup", target)
    prompts = ragged_prompts(3, target.config.vocab_size, seed=2)
    for _ in range(3):
        serve(target, d, prompts, 8, 3, Sampler("greedy"))
    assert all(c.__dict__.get("copies") is None for c in d.copies)


def test_a_drafter_that_writes_neither_set_of_calls_is_one_clear_error():
    """A Drafter writes its one-request calls or its batch calls; neither is an error naming it,
    not an endless loop between the two defaults."""
    from speculative import DrafterError

    class Nothing(Drafter):
        name = "nothing"
    with pytest.raises(DrafterError, match="nothing drafter writes neither begin"):
        Nothing().begin(torch.tensor([[1, 2]]), {})
