"""The loop's promises, checked for every registered drafter (conftest.drafter_names):
greedy and coupled sampling are token-identical to plain decoding (float64), rejection
sampling has the target's distribution, caches after a rejection equal a fresh prefill,
and generation stops exactly where it should."""

import copy
import math

import pytest
import torch

import ragged

from conftest import make, tiny_gpt, within
from registry import drafters as registry
from runtime.profiling import add_stats
from sampler import NOISE_CHUNK, Sampler, keyed_gumbel
from speculative import Drafter, DrafterError, Stats, generate_plain, generate_speculative, k_for


def prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 20, (1,), generator=g))
        out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    return out


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_is_token_identical(target, drafter_name, k):
    drafter = make(drafter_name, target)
    rounds = 0
    for i, p in enumerate(prompts(12, target.config.vocab_size)):
        ref = generate_plain(target, p, 40, Sampler("greedy"))
        out, stats = generate_speculative(target, drafter, p, 40, within(drafter, k),
                                          Sampler("greedy"))
        assert out == ref, (f"prompt {i}: diverged at "
                            f"{next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)}")
        rounds += stats.rounds
    assert rounds > 0


class ProposeTwice:
    """A drafter whose every round proposes twice before the commit, as a start-up profile does
    (profiling.profile_propose): the second call must draft as if it were the first."""

    def __init__(self, drafter):
        self.drafter = drafter

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, k, sampler):
        self.drafter.propose(k, sampler)
        return self.drafter.propose(k, sampler)


def test_propose_again_before_a_commit_keeps_greedy_exact(target, drafter_name):
    drafter = ProposeTwice(make(drafter_name, target))
    for i, p in enumerate(prompts(6, target.config.vocab_size)):
        ref = generate_plain(target, p, 40, Sampler("greedy"))
        out, _ = generate_speculative(target, drafter, p, 40, within(drafter, 4),
                                      Sampler("greedy"))
        assert out == ref, f"prompt {i}"


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_coupled_is_token_identical_to_plain_sampling(target, drafter_name, temperature):
    drafter = make(drafter_name, target)
    for seed, p in enumerate(prompts(10, target.config.vocab_size, seed=1)):
        ref = generate_plain(target, p, 40, Sampler("coupled", temperature, None, seed))
        out, _ = generate_speculative(target, drafter, p, 40, within(drafter, 4),
                                      Sampler("coupled", temperature, None, seed))
        assert out == ref
    # and the seed matters: a different seed gives different text (the test can fail)
    other = generate_plain(target, p, 40, Sampler("coupled", temperature, None, seed + 1))
    assert other != ref


def test_every_drafter_drafts_on_text_it_should_match(target, drafter_name):
    """The target's own greedy text, said twice: every drafter offers tokens there (a drafter that
    never drafts passes every exactness test above unseen: its loop is plain decoding)."""
    text = generate_plain(target, [5, 6, 7], 24, Sampler("greedy"))
    drafter = make(drafter_name, target)
    _, stats = generate_speculative(target, drafter, [5, 6, 7, *text, 5, 6, 7], 24,
                                    within(drafter, 4), Sampler("greedy"))
    assert stats.drafted_at[0] > 0, f"{drafter_name} drafted nothing in {stats.rounds} rounds"


def test_no_state_leaks_from_one_request_to_the_next(target, drafter_name):
    """A drafter that served one request drafts for the next exactly as a fresh copy does, round
    for round. What moves with the clock describes the machine, not the request, and carries over
    by design: DSpark's timed scheduler is set to its fixed threshold here; the hybrid, which picks
    its half by the clock, is left out."""
    if drafter_name.startswith("hybrid"):
        pytest.skip("the hybrid picks its half each round by measured times")
    drafter = make(drafter_name, target)
    if getattr(drafter, "schedule", None) == "auto":
        drafter.schedule, drafter.measured = "threshold", False
    fresh = copy.deepcopy(drafter)
    first, second = prompts(2, target.config.vocab_size, seed=5)
    k = within(drafter, 4)
    generate_speculative(target, drafter, first, 30, k, Sampler("greedy"))
    after, alone = [], []
    generate_speculative(target, drafter, second, 30, k, Sampler("greedy"), trace=after)
    generate_speculative(target, fresh, second, 30, k, Sampler("greedy"), trace=alone)
    assert after == alone


def test_a_drafter_that_breaks_its_contract_is_named_with_the_rule(target):
    """Proposals the loop cannot verify, and a bug inside a drafter: a DrafterError naming the
    drafter and the rule (the command prints it, then the drafter's traceback), not a traceback
    deep in the verify."""
    class Bad(Drafter):
        name = "bad"

        def __init__(self, give):
            self.give = give

        def begin(self, tokens, hidden):
            pass

        def propose(self, k, sampler):
            return self.give(k)

        def commit(self, n, new, hidden):
            pass
    V = target.config.vocab_size
    for give, needle in [(lambda k: ([1, 2], None), "its tokens are a list"),
                         (lambda k: torch.tensor([1] * (k + 1)), "not (tokens, q)"),
                         (lambda k: (torch.tensor([1] * (k + 1)), None), "5 tokens where at most"),
                         (lambda k: (torch.tensor([V]), None), f"token id {V}, outside"),
                         (lambda k: {}["key"], "failed inside its propose(): KeyError")]:
        with pytest.raises(DrafterError, match="the bad drafter") as e:
            generate_speculative(target, Bad(give), [1, 2, 3], 10, 4, Sampler("greedy"))
        assert needle in str(e.value)
    Bad.default_k = 0
    with pytest.raises(DrafterError, match="the bad drafter's default_k"):
        k_for(Bad(None), "greedy")


def test_random_drafter_is_rejected_often(target):
    """The random drafter must exercise the rejection path, or the tests above prove little."""
    small = make("small", target)
    _, stats = generate_speculative(target, small, [1, 2, 3], 60, 4, Sampler("greedy"))
    assert stats.acceptance()[0] < 0.9
    self_drafter = make("small-self", target)
    _, stats = generate_speculative(target, self_drafter, [1, 2, 3], 60, 4, Sampler("greedy"))
    assert stats.accepted_at == stats.drafted_at and stats.tau > 4  # every draft survives


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_tau_is_one_plus_the_summed_acceptance(target, drafter_name, mode):
    """Acceptance at position i is the share of all rounds (target forwards) in which position i
    survived, so tau = 1 + its sum, per prompt and summed over prompts -- also for drafters that
    draft fewer than k tokens in some rounds (DSpark's scheduler, prompt lookup), where dividing
    by the rounds that drafted position i would not add up."""
    drafter = make(drafter_name, target)
    total = Stats()
    for seed, p in enumerate(prompts(6, target.config.vocab_size, seed=2)):
        _, stats = generate_speculative(target, drafter, p, 40, within(drafter, 4),
                                        Sampler(mode, 0.8, None, seed))
        assert stats.tau == pytest.approx(1 + sum(stats.acceptance()), rel=1e-12, abs=0)
        add_stats(total, stats)
    assert total.tau == pytest.approx(1 + sum(total.acceptance()), rel=1e-12, abs=0)
    assert all(0 <= a <= 1 for a in total.acceptance())
    if drafter_name in ("dspark", "lookup"):  # the case the metric is about: short rounds
        assert total.drafted_at[-1] < total.rounds


# -----------------------------------------------------------------------------
# rejection sampling: same distribution as the target, checked against the exact one

def exact_pair_distribution(model, prompt, temperature):
    """P(t2, t3) of plain sampling, summed over t1: V*V cells, computed exactly."""
    V = model.config.vocab_size
    with torch.no_grad():
        def dist(seq):
            return torch.softmax(model(torch.tensor([seq]))[0][0, -1] / temperature, -1)
        p1 = dist(prompt)
        joint = torch.zeros(V, V, dtype=torch.float64)
        for t1 in range(V):
            p2 = dist(prompt + [t1])
            for t2 in range(V):
                joint[t2] += p1[t1] * p2[t2] * dist(prompt + [t1, t2])
    return joint


def chi_square(counts, expected):
    """Pearson's statistic over cells, pooling cells with expected count < 5; returns (stat,
    dof)."""
    small = expected < 5
    c = torch.cat([counts[~small], counts[small].sum().view(1)])
    e = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = e > 0
    return (((c - e) ** 2)[keep] / e[keep]).sum().item(), int(keep.sum()) - 1


def chi2_critical(dof, z=3.719):  # Wilson-Hilferty: the upper 1e-4 quantile of chi-square(dof)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


class AlwaysAccept(Sampler):
    """A wrong rule (keeps every draft): the statistical test must catch it."""

    def verify(self, logits, drafts, counts, q, start):
        k = counts[0]
        new = torch.cat([drafts[0, :k], self.sample(self.probs(logits[0, k:k + 1]))])
        return [k], [new.tolist()], new[None]


@pytest.fixture(scope="module")
def target8():
    return tiny_gpt(3, vocab=8, scale=3.0)


def empirical_pairs(target, drafter, prompt, n, sampler_cls=Sampler):
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for seed in range(n):
        out, _ = generate_speculative(target, drafter, prompt, 4, within(drafter, 2),
                                      sampler_cls("rejection", 1.0, None, seed))
        counts[out[1], out[2]] += 1
    return counts


# every registered drafter; not their variants (dflash-qwen3), whose drafts reach the rule by
# the same code as their drafter's, and whose 3,000 samples would cost the suite seconds each
@pytest.mark.parametrize("name", registry.names())
def test_rejection_sampling_matches_target_distribution(target8, name):
    prompt, n = [1, 5, 2], 3000
    expected = exact_pair_distribution(target8, prompt, 1.0) * n
    counts = empirical_pairs(target8, make(name, target8), prompt, n)
    stat, dof = chi_square(counts.view(-1), expected.view(-1))
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} over {dof} dof"


def test_statistical_test_catches_a_biased_rule(target8):
    prompt, n = [1, 5, 2], 3000
    expected = exact_pair_distribution(target8, prompt, 1.0) * n
    counts = empirical_pairs(target8, make("small", target8), prompt, n, AlwaysAccept)
    stat, dof = chi_square(counts.view(-1), expected.view(-1))
    assert stat > chi2_critical(dof)


# -----------------------------------------------------------------------------
# bookkeeping

def test_target_cache_after_rejections_equals_fresh_prefill(target, drafter_name):
    drafter = make(drafter_name, target)
    cache = ragged.new_cache(target, 1)
    prompt = [3, 1, 4, 1, 5]
    out, _ = generate_speculative(target, drafter, prompt, 30, within(drafter, 4),
                                  Sampler("greedy"), cache=cache)
    assert_cache_is_a_fresh_prefill(target, cache, prompt + out)


def assert_cache_is_a_fresh_prefill(target, cache, seq):
    """After a generation of seq: the cache holds the K/V of every token but the last (it has
    none yet), as one prefill of them computes. cache: a gpt.KVCache or a one-row
    ragged.RaggedCache (the same layout)."""
    n = cache.lengths[0] if isinstance(cache, ragged.RaggedCache) else cache.length
    assert n == len(seq) - 1
    fresh = target.new_cache()
    with torch.no_grad():
        target(torch.tensor([seq[:-1]]), cache=fresh)
    assert torch.allclose(cache.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-10, rtol=0)
    assert torch.allclose(cache.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-10, rtol=0)


@pytest.mark.parametrize("n", [1, 7, 33])
def test_stops_exactly_at_max_new_tokens(target, drafter_name, n):
    drafter = make(drafter_name, target)
    out, stats = generate_speculative(target, drafter, [1, 2, 3], n, within(drafter, 8),
                                      Sampler("greedy"))
    assert len(out) == n == stats.tokens
    assert len(generate_plain(target, [1, 2, 3], n, Sampler("greedy"))) == n


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_a_stop_token_ends_the_text_where_plain_decoding_ends_it(target, drafter_name, mode):
    """An end-of-turn token (stop) ends the text at its first appearance, kept as its last
    token, in plain decoding and in the loop alike, wherever in a round it falls: among the
    accepted drafts, or as the target's own token."""
    drafter = make(drafter_name, target)
    ends = 0
    for seed, p in enumerate(prompts(8, target.config.vocab_size, seed=3)):
        whole = generate_plain(target, p, 40, Sampler(mode, 0.8, None, seed))
        stop = {whole[5 + seed * 3 % 30]}  # a token it writes somewhere past the start
        ref = generate_plain(target, p, 40, Sampler(mode, 0.8, None, seed), stop=stop)
        assert ref == whole[:next(i for i, t in enumerate(whole) if t in stop) + 1]
        out, stats = generate_speculative(target, drafter, p, 40, within(drafter, 6),
                                          Sampler(mode, 0.8, None, seed), stop=stop)
        assert out == ref and stats.tokens == len(out), f"prompt {seed}"
        assert stats.tau == pytest.approx(1 + sum(stats.acceptance()), rel=1e-12)
        ends += len(ref) < 40
    assert ends > 0


def test_stops_at_the_context_limit(target, drafter_name):
    drafter = make(drafter_name, target)
    T = target.config.sequence_len
    prompt = list(range(10)) * 8  # 80 tokens
    out, _ = generate_speculative(target, drafter, prompt, 1000, within(drafter, 8),
                                  Sampler("greedy"))
    assert len(prompt) + len(out) == T
    assert out == generate_plain(target, prompt, 1000, Sampler("greedy"))


def test_keyed_noise_depends_only_on_seed_and_position():
    a = keyed_gumbel(7, [3, 4, 5], 100, "cpu")
    b = keyed_gumbel(7, [5], 100, "cpu")
    assert torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(keyed_gumbel(8, [5], 100, "cpu"), b)
    # Gumbel(0,1): mean is the Euler-Mascheroni constant, variance pi^2/6
    g = keyed_gumbel(1, list(range(200)), 1000, "cpu")
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi ** 2 / 6) < 0.03


def test_sampler_noise_is_keyed_gumbel_in_any_chunking():
    """Sampler.noise serves rows from chunks of NOISE_CHUNK positions; whatever range is asked
    (inside a chunk, across two or three, forward or back), the rows are keyed_gumbel's, bit for
    bit, so plain decoding and the speculative loop see the same numbers."""
    sampler = Sampler("coupled", 0.8, None, 5)
    C = NOISE_CHUNK
    for start, n in [(0, 1), (3, 5), (C - 2, 4), (C - 1, 2 * C + 3), (1, 1), (5 * C, C), (7, 9)]:
        got = sampler.noise(start, n, 300, "cpu")
        assert torch.equal(got, keyed_gumbel(5, range(start, start + n), 300, "cpu"))
    # a batch: row r's own positions, keyed on its own seed
    rows = Sampler("coupled", 0.8, None, [5, 9]).noise([40, 3], 2, 300, "cpu")
    assert torch.equal(rows[0], keyed_gumbel(5, [40, 41], 300, "cpu"))
    assert torch.equal(rows[1], keyed_gumbel(9, [3, 4], 300, "cpu"))
    with pytest.raises(ValueError, match="consecutive"):
        keyed_gumbel(5, [1, 3], 300, "cpu")


def test_bad_arguments(target):
    d = make("small", target)
    with pytest.raises(ValueError, match="must be 1 to"):
        generate_speculative(target, d, [1], 5, 0, Sampler())
    with pytest.raises(ValueError, match="window verifies"):  # a round of k + 1 must fit
        generate_speculative(target, d, [1], 5, target.config.sequence_len, Sampler())
    with pytest.raises(ValueError, match="empty"):
        generate_plain(target, [], 5, Sampler())
    with pytest.raises(ValueError, match="context window"):
        generate_speculative(target, d, [1] * target.config.sequence_len, 5, 2, Sampler())
    with pytest.raises(ValueError, match="temperature"):
        Sampler("coupled", temperature=-1)
    with pytest.raises(ValueError, match="top-k"):
        Sampler("coupled", top_k=0)
    with pytest.raises(ValueError, match="unknown sampling"):
        Sampler("beam")


def test_k_for_uses_the_sampling_default_only_when_sampling():
    class Both(Drafter):
        default_k, sampled_k = 5, 2

    class GreedyOnly(Drafter):
        default_k = 4

    assert k_for(Both(), "greedy") == 5
    assert k_for(Both(), "coupled") == k_for(Both(), "rejection") == 2
    assert k_for(GreedyOnly(), "coupled") == 4


def test_the_prefill_computes_the_first_token_as_plain_decoding_does(monkeypatch):
    """The speculative prefill must draw its first token from the same computation as
    generate_plain's (the LM head on the last row only): in float32 a head over every prompt row
    may round differently and pick another token for no reason. The drafter still gets the
    hidden states of every prompt row."""
    target = tiny_gpt(0).float()
    forward, ragged_forward, calls, firsts = target.forward, ragged.forward, [], []

    def recording_forward(idx, **kw):
        calls.append((idx.tolist(), kw.get("last_only", False)))
        return forward(idx, **kw)

    def recording_ragged(model, idx, cache, counts=None, **kw):  # the loop's forward
        calls.append((idx.tolist(), kw.get("last_only", False)))
        return ragged_forward(model, idx, cache, counts, **kw)

    class RecordingSampler(Sampler):
        def first_token(self, logits, position):
            firsts.append(logits.clone())
            return super().first_token(logits, position)

    class Watcher(Drafter):
        hidden_layers = (1, 2)

        def begin(self, tokens, hidden):
            self.hidden = hidden

    monkeypatch.setattr(target, "forward", recording_forward)
    monkeypatch.setattr(ragged, "forward", recording_ragged)
    prompt, watcher = [5, 3, 9, 1, 4, 4, 2, 8, 6, 7, 0], Watcher()
    plain = generate_plain(target, prompt, 1, RecordingSampler("greedy"))
    spec, _ = generate_speculative(target, watcher, prompt, 1, 4, RecordingSampler("greedy"))
    assert calls == [([prompt], True)] * 2  # one prefill each, the head on the last row only
    assert firsts[0].shape == (1, 1, target.config.vocab_size)
    assert torch.equal(firsts[0], firsts[1]) and spec == plain  # bit for bit, in float32
    assert all(h.shape == (1, len(prompt), 32) for h in watcher.hidden.values())
