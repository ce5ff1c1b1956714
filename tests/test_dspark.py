"""DSpark: the scheduler picks the throughput formula's optimum and stops at the first drop, a
round verifies only what it picked and measures what the rest of a round costs, the Markov
head's draft probabilities are exact softmaxes, and calibration lowers the ECE. The shared
equivalence tests (tests/test_speculative.py) run over drafter_for() below: Markov head and
scheduler on, configured as train.py ships it (shift 0); shift 1 gets its own check here."""

import copy
from dataclasses import fields

import pytest
import torch

import train
from benchmark.ablations import variants
from draft_dspark import (SCORE_EVERY, DSparkDrafter, admit, calibrate, ece,
                          expected_saving, host_greedy_chain, markov_chain)
from runtime.cpu_speed import speed_up
from sampler import Sampler
from speculative import generate_plain, generate_speculative
from test_dflash import drafter_for as make_dflash
from test_dflash import fit_block_drafter


def drafter_for(target, shift=0, arch="gpt2"):
    """The shared tests' DSpark, with its Markov head and the throughput scheduler on. At load it
    profiles the real device (runtime/profiling.profile_dspark); here it gets a fixed latency
    table instead (an m-token verify costs 1 + 0.5·m draft times: dear enough that it verifies ~4
    of 8 drafts), so which prefix it verifies -- and with it every test over it -- is
    deterministic. On a CPU greedy drafting takes the chain on the host (host_greedy_chain)."""
    net = fit_block_drafter(target, "dspark", shift=shift, arch=arch)
    d = speed_up(DSparkDrafter(net, schedule="auto"))
    d.t_draft, d.t_verify = 1.0, [0.0] + [1.0 + 0.5 * m for m in range(1, d.max_k + 2)]
    return d


# the shared tests run the papers' layers too, as "dspark-qwen3"
VARIANTS = {"qwen3": lambda target: drafter_for(target, arch="qwen3")}


make_dspark = drafter_for


def schedule_length(survival, t_draft, t_verify):
    """How many of the drafts with prefix survivals a_1..a_K the scheduler verifies, one request."""
    return admit([survival], 1, t_draft, lambda n: t_verify[n])[0]


def throughput(a, t_draft, t_verify, l):
    return (1 + sum(a[:l])) / (t_draft + t_verify[l + 1])


def test_scheduler_picks_the_formula_optimum():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        K = int(torch.randint(2, 16, (1,), generator=g))
        a = torch.cumprod(torch.rand(K, generator=g) * 0.3 + 0.7, 0).tolist()  # prefix survival
        # a concave-ish latency table (flat, then linear): throughput is unimodal in l
        knee = float(torch.rand(1, generator=g)) * K
        t_verify = [0.0] + [1.0 + 0.2 * max(0.0, m - knee) for m in range(1, K + 2)]
        t_draft = 0.3
        l = schedule_length(a, t_draft, t_verify)
        best = max(range(K + 1), key=lambda j: throughput(a, t_draft, t_verify, j))
        assert throughput(a, t_draft, t_verify, l) == throughput(a, t_draft, t_verify, best)


def test_scheduler_stops_at_the_first_drop():
    a = [0.95, 0.9, 0.9, 0.9, 0.9, 0.9]
    t_verify = [0, 1.0, 1.0, 1.5, 1.5, 1.5, 1.5, 1.5]  # a 3-token verify costs a step, then no more
    # the first drop...
    assert throughput(a, 0.0, t_verify, 2) < throughput(a, 0.0, t_verify, 1)
    # ...though later ones would pay
    assert throughput(a, 0.0, t_verify, 6) > throughput(a, 0.0, t_verify, 1)
    assert schedule_length(a, 0.0, t_verify) == 1
    # a flat table: everything is worth verifying
    assert schedule_length(a, 0.0, [0] + [1.0] * 7) == 6
    # no draft at all where even the first does not pay: the round is a plain step
    assert schedule_length([0.01, 0.001], 1.0, [0, 1.0, 1.1, 3.0]) == 0


@torch.inference_mode()
def test_a_round_verifies_only_the_scheduled_prefix(target):
    d = make_dspark(target)
    hid = target(torch.tensor([[1, 2]]), hidden_layers=d.hidden_layers)[2]
    d.begin(torch.tensor([[1, 2, 3]]), hid)
    # verifying is dear
    d.t_draft, d.t_verify = 0.0, [0.0] + [1.0 + 10.0 * m for m in range(1, d.max_k + 2)]
    draft, _ = d.propose(8, Sampler("greedy"))
    assert draft.numel() < 8
    d.schedule = "full"
    assert d.propose(8, Sampler("greedy"))[0].numel() == 8
    d.schedule, d.threshold = "threshold", 2.0  # nothing reaches it: one draft
    assert d.propose(8, Sampler("greedy"))[0].numel() == 1
    assert d.mean_verify_len == (draft.numel() + 8 + 1) / 3


def test_expected_saving_of_a_cut():
    a = [0.9, 0.5, 0.1]
    t_verify = [0, 1.0, 1.0, 2.0, 3.0]
    cost = t_verify.__getitem__
    assert expected_saving([a], [3], 1, 1.0, cost) == 0.0  # no cut, no saving
    # verify 1 of 3: 2 s for 1.9 tokens against 4 s for 2.5 tokens, over 1.9 tokens
    assert abs(expected_saving([a], [1], 1, 1.0, cost) - (4.0 / 2.5 - 2.0 / 1.9) * 1.9) < 1e-12
    # two requests, one verify: both cut to 1 of 3 (N = 4 tokens), against all (N = 8)
    cost = [0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 5.0].__getitem__
    assert abs(expected_saving([a, a], [1, 1], 2, 1.0, cost)
               - (6.0 / 5.0 - 3.0 / 3.8) * 3.8) < 1e-12


@torch.inference_mode()
def test_the_scheduler_scores_only_while_its_cuts_pay(target):
    """A flat latency table: no cut saves anything, so after one scored round the drafter verifies
    whole blocks unscored, scoring one round in SCORE_EVERY; a dear one: the cuts pay again, and
    it scores (and cuts) every round; a dear scoring: whole blocks again, and the rounds that watch
    cut nothing."""
    d = make_dspark(target)
    hid = target(torch.tensor([[1, 2]]), hidden_layers=d.hidden_layers)[2]
    d.begin(torch.tensor([[1, 2, 3]]), hid)
    scored, watch = [], d.watch
    d.watch = lambda saved, spent: (scored.append(saved), watch(saved, spent))
    dear = d.t_verify
    d.t_verify = [0.0] + [1.0] * (d.max_k + 1)
    lengths = [d.propose(8, Sampler("greedy"))[0].numel() for _ in range(2 * SCORE_EVERY)]
    assert lengths == [8] * (2 * SCORE_EVERY)
    assert scored == [0.0] * 3  # rounds 1, SCORE_EVERY and 2 * SCORE_EVERY
    d.t_verify = dear
    lengths = [d.propose(8, Sampler("greedy"))[0].numel() for _ in range(2 * SCORE_EVERY)]
    assert d.saved > d.t_score and len(scored) > 3 + SCORE_EVERY
    assert max(lengths[-SCORE_EVERY:]) < 8
    # scoring made dear: the same cuts no longer pay for it, and the watch rounds cut nothing
    d.t_score, n_scored = 1e9, len(scored)
    lengths = [d.propose(8, Sampler("greedy"))[0].numel() for _ in range(2 * SCORE_EVERY)]
    assert lengths == [8] * (2 * SCORE_EVERY)
    assert len(scored) == n_scored + 2 and min(scored[-2:]) > 0  # each would have cut
    # bench's ablation rows, copies of this drafter, keep their own account from scratch
    assert all(v.saved is None and v.rounds == 0 for v in variants(d).values())


@torch.inference_mode()
def test_rounds_measure_what_a_round_costs_besides_its_verify(target, monkeypatch):
    import draft_dspark
    d = make_dspark(target)
    hid = target(torch.tensor([[1, 2]]), hidden_layers=d.hidden_layers)[2]
    d.begin(torch.tensor([[1, 2, 3]]), hid)
    clock = iter([10.0, 10.0 + d.t_verify[d.max_k + 1] + 3.0])
    monkeypatch.setattr(draft_dspark.time, "perf_counter", lambda: next(clock))
    d.schedule, d.measured, d.t_draft = "full", True, 1.0
    d.propose(d.max_k, Sampler("greedy"))  # the first round has nothing to measure
    assert d.t_draft == 1.0
    d.propose(d.max_k, Sampler("greedy"))  # 3 s besides its verify: 10% of the way from 1 to 3
    assert abs(d.t_draft - 1.2) < 1e-12
    d.begin(torch.tensor([[1, 2, 3]]), hid)  # a new text: its first round measures nothing
    assert d._last is None


@pytest.mark.parametrize("table", [True, False], ids=["table", "product"])
@torch.inference_mode()
def test_markov_head_probabilities_are_exact_softmaxes(target, table):
    """Both ways of drafting the bias: the (V, V) table (a small vocabulary) and W1[x] W2."""
    d = make_dspark(target)
    net = d.spark
    assert net.w2.abs().sum() > 0  # the head is not a no-op after fitting
    assert d.markov_table is not None  # the test vocabulary is small
    if not table:
        d = copy.copy(d)
        d.markov_table = None
    d.schedule = "full"
    seq = torch.tensor([[4, 9, 16, 25]])
    d.begin(seq, target(seq[:, :-1], hidden_layers=d.hidden_layers)[2])
    sampler = Sampler("rejection", 1.0, None, 7)
    draft, q = d.propose(6, sampler)
    assert torch.allclose(q.sum(-1), torch.ones(6, dtype=q.dtype), atol=1e-12, rtol=0)
    base_logits = net.backbone.logits(d.draft_states([6])[0])  # (6, V) base logits
    prev = torch.cat([seq[0, -1:], draft[:-1]])
    assert torch.allclose(q, torch.softmax(base_logits + net.markov(prev), -1), atol=1e-12, rtol=0)
    # the bias really depends on the previous token
    assert not torch.allclose(q, torch.softmax(base_logits, -1))


@torch.inference_mode()
def test_greedy_drafting_on_the_host_picks_what_the_torch_chain_picks(target):
    """draft_dspark.host_greedy_chain (numpy over the Markov table) against its markov_chain, on
    many contexts, and the path greedy propose() takes on a CPU (the drafter's greedy_chain, which
    its constructor sets where the table is on the CPU)."""
    d = make_dspark(target)
    assert d.greedy_chain is not None
    host = host_greedy_chain(d.markov_table)
    d.schedule = "full"
    g = torch.Generator().manual_seed(3)
    sampler = Sampler("greedy")
    for _ in range(20):
        seq = torch.randint(0, target.config.vocab_size, (1, 12), generator=g)
        d.begin(seq, target(seq[:, :-1], hidden_layers=d.hidden_layers)[2])
        base_logits = d.net.logits(d.draft_states([d.max_k])[0])
        S = d.seq.numel()
        chain, _ = markov_chain(d.spark, base_logits[None], d.seq[-1:],
                                lambda logits, j: sampler.draft(logits, S + j),
                                d.markov_table, d.markov)
        chain = chain[0]
        assert torch.equal(host(base_logits, int(d.seq[-1])), chain)
        assert torch.equal(d.propose(d.max_k, Sampler("greedy"))[0], chain)
    # the Markov bias changes the picks: the test compares two paths that have work to do
    assert not torch.equal(chain, base_logits.argmax(-1))


def test_threshold_schedule_stays_token_identical(target):
    d = make_dspark(target)
    d.schedule, d.threshold = "threshold", 0.5
    for p in ([3, 1, 4], [2, 7, 1, 8]):
        out, stats = generate_speculative(target, d, p, 40, 8, Sampler("greedy"))
        assert out == generate_plain(target, p, 40, Sampler("greedy"))
    assert 1 <= d.mean_verify_len < 8


def test_calibration_lowers_the_ece(target):
    net = fit_block_drafter(target, "dspark")
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, target.config.vocab_size, (8, 30), generator=g)
    with torch.no_grad():
        logits, _, hid = target(x, hidden_layers=net.backbone.config.taps)
    cfg = net.backbone.config
    anchors = torch.arange(1, 30 - cfg.block - cfg.shift + 1, 2).expand(8, -1)
    saved = net.conf_temp.clone()
    try:
        before, after = calibrate(net, [(x, hid, logits, anchors)])
        assert after <= before
    finally:
        net.conf_temp.copy_(saved)  # the fitted net is shared with other tests
    assert ece(torch.tensor([0.9, 0.9, 0.1, 0.1]), torch.tensor([1, 1, 0, 0])) < 0.11


def test_temperatures_are_fitted_on_blocks_whose_prefix_matched():
    """c_k means 'draft k survives, given drafts 1..k-1 did': a block whose draft 1 missed says
    nothing about position 2. Here position 2 always matches when position 1 did, and never
    otherwise; its fitted confidence must follow the first kind only, and whatever the blocks
    with a missed prefix hold must not move it."""
    from draft_dspark import fit_temperatures
    g = torch.Generator().manual_seed(0)
    N = 400
    z = torch.full((N, 2), 1.0)
    hit1 = (torch.rand(N, generator=g) < 0.5).float()
    hit = torch.stack([hit1, hit1], 1)  # position 2 matches exactly when position 1 did
    alive = torch.stack([torch.ones(N), hit1], 1).bool()
    temps = fit_temperatures(z, hit, alive)
    assert torch.sigmoid(1.0 / temps[1]) > 0.95  # all its live blocks matched: confident
    assert 0.4 < torch.sigmoid(1.0 / temps[0]) < 0.6  # half of all blocks matched at 1
    hit_dead = hit.clone()
    hit_dead[hit1 == 0, 1] = 1.0  # change only blocks whose prefix missed
    assert torch.equal(fit_temperatures(z, hit_dead, alive), temps)
    few = alive.clone()
    few[20:, 1] = False  # 19 live blocks left at position 2: too few, its temperature stays 1
    few[:1, 1] = False
    assert fit_temperatures(z, hit, few)[1] == 1.0


@torch.inference_mode()
def test_the_confidence_table_is_the_confidence_head(target):
    """Drafting scores with DSpark.confidence_table (h . w_h + c[x]); training with the head."""
    net = fit_block_drafter(target, "dspark")
    assert net.conf.weight.abs().sum() > 0 and net.w1.weight.abs().sum() > 0
    w_h, c = net.confidence_table()
    h = torch.randn(5, net.backbone.config.n_embd, dtype=torch.float64)
    x = torch.tensor([0, 3, 7, 1, 2])
    assert torch.allclose(h @ w_h + c[x], net.confidence_logit(h, x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("preset", ["tiny", "cpu", "cuda"])
def test_the_shared_block_drafters_are_built_as_train_py_builds_them(target, preset):
    """The equivalence tests run over the tests' DFlash and DSpark; they prove something about
    the shipped drafters only if those are configured as train.py configures them. Every
    DFlashConfig field that is a choice, not a size fitted to the tiny target, must match
    stages_dflash.network_config's, the one DFlash's and DSpark's training build (shift 0 above
    all: the tests once ran DSpark at shift 1 only)."""
    from training import stages_dflash
    run = train.resolve_args(["--preset", preset, "--device", "cpu"])
    shipped = stages_dflash.network_config(run.settings["dflash"], target.config)
    sizes = {"n_embd", "n_head", "n_layer", "taps", "block", "n_kv_head", "head_dim", "n_hidden"}
    for d in (make_dspark(target), make_dflash(target)):
        ours = d.net.config  # DSpark's drafter holds its backbone here
        for f in (f.name for f in fields(ours) if f.name not in sizes):
            assert getattr(ours, f) == getattr(shipped, f), (d.name, f)
        assert ours.shift == 0 and d.max_k == 8  # and the shared tests' k = 1..8 all allowed


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_shift_1_stays_token_identical(target, kind):
    """DFlashConfig's other option, shift 1 (the anchor slot drafts too, a block one shorter),
    is not what train.py ships, so the shared tests do not run it; this keeps it exact: greedy
    and coupled decoding stay token-identical to plain decoding, at the shortest and longest k."""
    d = (make_dspark if kind == "dspark" else make_dflash)(target, shift=1)
    assert d.net.config.shift == 1 and d.max_k == 8
    accepted = 0
    for seed, p in enumerate(([3, 1, 4], [2, 7, 1, 8, 2, 8], [9])):
        for k in (1, 8):
            out, stats = generate_speculative(target, d, p, 30, k, Sampler("greedy"))
            assert out == generate_plain(target, p, 30, Sampler("greedy"))
            accepted += sum(stats.accepted_at)
        sampled = Sampler("coupled", 0.8, None, seed)
        out, _ = generate_speculative(target, d, p, 30, 4, sampled)
        assert out == generate_plain(target, p, 30, Sampler("coupled", 0.8, None, seed))
    assert accepted > 0  # the drafts were used, not only rejected
