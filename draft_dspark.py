"""
draft_dspark.py -- DSpark: DFlash's one-pass backbone + a cheap semi-autoregressive Markov head
+ confidence-scheduled verification.

Paper: DSpark (Peking University + DeepSeek-AI, 2026; open code in DeepSpec, MIT).

draft_dflash.py drafts every block slot independently: slot 5 never learns what slot 4 chose,
so two plausible continuations can get mixed ("the the"). DSpark keeps the parallel backbone
for the expensive part and adds two cheap pieces on top:

1. A Markov head. The backbone (DFlash's network, unchanged) gives base logits U_j for every
   slot in one pass. Then, left to right, draft j is sampled from softmax(U_j + W1[x_{j-1}] W2):
   a rank-r bias that depends on the token just drafted. Drafting works the bias out for every
   previous token once, a (V x V) table (where it fits in memory), so the sequential part costs
   a row lookup and an add per token, small next to the backbone. Every q is an exact softmax,
   so rejection sampling stays lossless.
2. A confidence head c_j = sigmoid(w . [h_j; W1[x_{j-1}]]): the chance draft j survives given
   that its prefix did. Prefix survival a_j = prod_{i<=j} c_i (the code calls the list of them
   `survival`). A scheduler, with the target's verify latency profiled once at load, verifies
   only the prefix that maximises expected tokens per second,
   (1 + sum_{j<=l} a_j) / (t_draft + t_verify(l + 1)), where t_draft is the rest of a round
   (draft, commit, loop): profiled at load, then measured as the rounds run. Over a batch of
   requests the same rule (the paper's Algorithm 1, admit) spends one verify over every row.
   Scoring the drafts costs time too, so the scheduler watches itself: when the cuts it makes
   save less than its scoring costs (at batch 1 on a CPU its rule keeps every draft: a longer
   verify costs little next to a round; docs/experiments.md: DSpark: scheduler at batch 1), it
   verifies whole blocks unscored and scores one round in SCORE_EVERY to keep watching.

How it learns (dspark_loss, calibrate). The paper lets the anchor slot predict too; here the
backbone is exactly DFlash's (the masks predict, B-1 drafts), so DSpark starts from DFlash's own
training and what it adds is measured against it on equal footing. DSpark's stage branches off
DFlash's training dspark_iters steps before its end (DFlash saves its state there), widens the
network if DFlash was still at its narrow block, and trains its own steps from it, so the two
drafters take the same number of optimizer steps:

    spark = DSpark(cfg, DSparkConfig(), target)
    widen(spark.backbone, dflash_state_at_the_branch)   # draft_dflash.widen; Markov head at 0
    ...train dspark_loss in the trainer's loop...
    calibrate(spark, held_out_batches)                  # the confidences' temperatures

(training/stages_dspark.py runs it, with a copy tuned on sampled text for sampling.)

    python train.py --only dspark && python sample.py --method dspark
"""

import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from draft_small import total_variation
from draft_dflash import (DFlash, DFlashConfig, DFlashDrafter, position_weights, soft_labels,
                          training_states)
from tree import pays

# -----------------------------------------------------------------------------
# the network: a DFlash backbone + Markov head + confidence head


@dataclass
class DSparkConfig:
    # Markov head rank r (the paper's 256; its vocabulary is 100k+, ours 4096). A higher rank
    # drafted better at equal steps, and drafting from the (V x V) table costs the same at any
    # rank: only training pays for it (docs/experiments.md: DSpark: Markov rank)
    rank: int = 256

    def to_dict(self):
        return asdict(self)


class DSpark(nn.Module):

    def __init__(self, backbone_cfg, cfg, target):
        super().__init__()
        V, d = target.config.vocab_size, backbone_cfg.n_embd
        if backbone_cfg.draft_vocab:
            raise ValueError("DSpark drafts over the target's whole vocabulary (its Markov head "
                             "biases every token): train its backbone with --dflash-vocab 0")
        self.config = cfg
        self.backbone = DFlash(backbone_cfg, target)
        self.w1 = nn.Embedding(V, cfg.rank)              # W1[x]: the previous token's low-rank code
        # W2: code -> a bias over the vocabulary, (r, V) as in the paper's W1[x] W2: drafting
        # multiplies by it one row at a time, fastest with its rows contiguous
        # (docs/experiments.md: DSpark: Markov table)
        self.w2 = nn.Parameter(torch.zeros(cfg.rank, V))
        self.conf = nn.Linear(d + cfg.rank, 1)  # w (and b) of the confidence head
        nn.init.normal_(self.w1.weight, std=0.02)
        # w2 starts at zero: DSpark starts as plain DFlash and the bias grows from 0
        nn.init.zeros_(self.conf.weight)
        nn.init.zeros_(self.conf.bias)
        # per-position temperature for the confidence logits, fitted on held-out text
        # (calibrate()): one per draft position
        n_positions = backbone_cfg.block - 1 + backbone_cfg.shift
        self.register_buffer("conf_temp", torch.ones(n_positions))

    def markov(self, prev):
        """B(x_{j-1}, .) = W1[x_{j-1}] W2: prev (...) token ids -> (..., V)."""
        return self.w1(prev) @ self.w2

    @torch.no_grad()
    def markov_table(self):
        """B(x, .) for every token x at once: the (V, V) table W1 W2. A drafted token then costs
        one row lookup, where W1[x] W2 reads all of W2 (r x V) for every token."""
        return self.w1.weight @ self.w2

    def features(self, h):
        """The backbone state the confidence head reads (its layer family's choice)."""
        return self.backbone.family.features(self.backbone, h)

    def confidence_logit(self, h, prev):
        """w . [h_j; W1[x_{j-1}]] (before the sigmoid): h (..., d) the features, prev (...) ->
        (...)."""
        return self.conf(torch.cat([h, self.w1(prev)], dim=-1)).squeeze(-1)

    @torch.no_grad()
    def confidence_table(self):
        """The same logit split the way drafting uses it: w . [h; W1[x]] + b = h . w_h + c[x],
        with c = W1 w_code + b worked out once for every token x. Returns (w_h (d,), c (V,)): a
        round then scores its k drafts with one (k, d) x (d,) product and one lookup."""
        d = self.backbone.config.n_embd
        w = self.conf.weight[0]
        return w[:d].clone(), self.w1.weight @ w[d:] + self.conf.bias


# -----------------------------------------------------------------------------
# training: CE + TV + BCE, all position-weighted: CE the cross-entropy against the target's
# distribution, TV the total variation distance to it, BCE the binary cross-entropy of the
# confidence head. The paper weighs 0.1 CE (against the text's token) + 0.9 TV; here CE + TV,
# DFlash's own loss, drafted better (docs/experiments.md: DSpark: loss)


def dspark_terms(spark, x, hidden, t_logits, anchors, block=None):
    """Teacher-forced block predictions on text x. Returns per-prediction (B, A, P) tensors:
    the cross-entropy against p_target, TV(p_draft, p_target), the confidence logit, and whether
    the greedy draft equals the target's argmax (what calibration fits). block: as in
    draft_dflash.training_states."""
    h, tpos = training_states(spark.backbone, x, hidden, anchors, block)  # (B, A, P, d), (B, A, P)
    b = torch.arange(x.size(0), device=x.device)[:, None, None]
    prev = x[b, tpos - 1]  # x_{j-1}: the anchor for the first slot, then the text's own tokens
    logits = spark.backbone.logits(h) + spark.markov(prev)
    logp = F.log_softmax(logits.float(), dim=-1)  # (B, A, P, V)
    p_t = soft_labels(t_logits, tpos)
    tv = total_variation(logp, p_t)
    ce = -(p_t * logp).sum(-1)
    # the confidence head is a probe on the backbone: its BCE does not pull the drafting features
    z = spark.confidence_logit(spark.features(h).detach(), prev)
    hit = (logp.argmax(-1) == p_t.argmax(-1)).float()
    return ce, tv, z, hit


def dspark_loss(spark, x, hidden, t_logits, anchors, gamma, block=None):
    ce, tv, z, _ = dspark_terms(spark, x, hidden, t_logits, anchors, block)
    # soft label 1 - TV: the chance that a draft sampled from p_draft survives rejection
    # sampling against p_target
    bce = F.binary_cross_entropy_with_logits(z.float(), (1 - tv).detach(), reduction="none")
    w = position_weights(ce.size(-1), gamma, ce.device)
    return (((ce + tv + bce) * w).sum(-1).mean() / w.sum())


@torch.no_grad()
def calibrate(spark, batches):
    """Per-position temperature scaling of the confidence logits (Guo et al. 2017): for each
    slot j pick T_j minimising the log loss of sigmoid(z / T_j) against whether the greedy draft
    matched the target, teacher-forced on the target's own text, over the blocks whose drafts
    1..j-1 all matched. c_j is the chance that draft j survives GIVEN its prefix survived, and
    only those blocks say what that is: fitted on every block, the temperatures made late
    positions look far worse than they are in the loop, where a round reaches them only through
    an easy stretch of text, and the scheduler cut blocks that paid (docs/experiments.md:
    DSpark: calibration on live blocks).
    batches: an iterable of (x, hidden, t_logits, anchors), read once, so a generator streams them
    (only the confidences are kept). Returns the ECE (expected calibration error, see ece()) over
    those blocks before and after."""
    zs, hits = [], []
    for x, hid, t_logits, anchors in batches:
        _, _, z, hit = dspark_terms(spark, x, hid, t_logits, anchors)
        zs.append(z.flatten(0, 1))
        hits.append(hit.flatten(0, 1))
    z, hit = torch.cat(zs).float(), torch.cat(hits)  # (N, P)
    # (N, P): whether each draft's prefix survived (the first draft's always has)
    alive = torch.cat([torch.ones_like(hit[:, :1]), hit.cumprod(1)[:, :-1]], 1).bool()

    def live_ece():  # at the current temperatures
        return ece(torch.sigmoid(z / spark.conf_temp.float())[alive], hit[alive])
    before = live_ece()
    spark.conf_temp.copy_(fit_temperatures(z, hit, alive))
    return before, live_ece()


def fit_temperatures(z, hit, alive, min_blocks=20):
    """z, hit, alive (N, P): confidence logits, greedy matches, whether the prefix matched. ->
    (P,) temperatures, each from a grid, minimising the log loss over the blocks alive there; 1
    where fewer than min_blocks got that far."""
    grid = torch.logspace(-1.5, 1.5, 61, device=z.device)
    temps = torch.ones(z.size(1), device=z.device)
    for j in range(z.size(1)):
        zj, hj = z[alive[:, j], j], hit[alive[:, j], j]
        if hj.numel() >= min_blocks:
            losses = [F.binary_cross_entropy_with_logits(zj / t, hj).item() for t in grid]
            temps[j] = grid[min(range(len(grid)), key=losses.__getitem__)]
    return temps


def ece(prob, outcome, bins=10):
    """Expected calibration error: |mean confidence - frequency| per equal-width bin, weighted."""
    idx = (prob * bins).long().clamp(max=bins - 1)
    err = 0.0
    for i in range(bins):
        m = idx == i
        if m.any():
            gap = abs(prob[m].mean().item() - outcome[m].float().mean().item())
            err += m.float().mean().item() * gap
    return err


# -----------------------------------------------------------------------------
# the scheduler: how many drafts to verify this round


def admit(survival, base, t_fixed, cost):
    """DSpark's scheduler (paper §3.2.2, Algorithm 1): how many of its drafts each request
    verifies, over a batch of requests (one request: a batch of one).
    survival[r]: request r's prefix survivals a_{r,1}, a_{r,2}, ... (as many as it drafted);
    base: the requests verified this round, each with at least its last token; cost(N): seconds
    of one target forward over N tokens in all; t_fixed: the rest of a round's seconds. Start
    with every length 0 and admit (request, position) pairs most likely first, each adding a
    token to the forward and its survival to the expected tokens, while expected tokens per
    second does not drop (tree.pays); the first that does ends the search. Stopping there, not
    searching past it, is what keeps sampling lossless (paper, Appendix A). a_{r,j} falls with
    j, so each request's admitted drafts are a prefix of them. -> a length per request, 0 allowed."""
    pairs = sorted((-a, j, r) for r, row in enumerate(survival) for j, a in enumerate(row))
    lengths, expected, n = [0] * len(survival), float(base), base
    for neg_a, j, r in pairs:
        if not pays(expected, -neg_a, t_fixed + cost(n), t_fixed + cost(n + 1)):
            break
        lengths[r], expected, n = j + 1, expected - neg_a, n + 1
    return lengths


def above(survival, threshold):
    """The static rule, for comparison: the drafts while a_j >= threshold, and always the first."""
    return next((j for j in range(1, len(survival)) if survival[j] < threshold), len(survival))


def expected_saving(survival, lengths, base, t_draft, cost):
    """Seconds per round that verifying only lengths[r] of request r's drafts is expected to save
    against verifying them all: (seconds per token at all - at lengths) x the tokens such a
    round yields. survival, base, cost: as admit's."""
    def per_token(ls):
        tokens = base + sum(sum(a[:m]) for a, m in zip(survival, ls))
        return (t_draft + cost(base + sum(ls))) / tokens, tokens
    full, _ = per_token([len(a) for a in survival])
    cut, tokens = per_token(lengths)
    return (full - cut) * tokens


# -----------------------------------------------------------------------------
# the Drafter


# drafting keeps DSpark.markov_table when it takes no more memory than this (V * V numbers: ours
# fits, GPT-2's vocabulary does not), and multiplies by W2 per token otherwise.
# Why: a row lookup is far cheaper than re-reading W2, which the target's forward pushes out of
# the cache between rounds (docs/experiments.md: DSpark: Markov table)
MARKOV_TABLE_BYTES = 256 * 2**20
# while scoring does not pay (DSparkDrafter.closed), one round in this many is still scored, so a
# change (a longer context, a busier device) is seen
SCORE_EVERY = 16
# the fixed rule's bar (schedule="threshold"): verify the drafts while their predicted survival
# is at least this
THRESHOLD = 0.5


def markov_chain(spark, base, prev, draw, table=None, markov=True):
    """The sequential part, written once for one request and for a batch: draft j from
    U_j + B(x_{j-1}, .), left to right, each pick fed to the next. base (B, K, V) the backbone's
    logits U; prev (B,) the token before the first draft; draw(logits (B, V), j) -> (tokens (B,),
    q (B, V) or None), how a draft is picked; table: spark.markov_table() where it fits (a row
    lookup), else None (W1[x] W2 as one product); markov=False: no bias (the ablation).
    -> tokens (B, K), q (B, K, V) or None."""
    toks, qs = [], []
    for j in range(base.size(1)):
        if not markov:
            logits = base[:, j]
        elif table is not None:
            logits = base[:, j] + table[prev]  # one (B, V) row a request
        else:  # W1[x_{j-1}] W2 fused into one product: half the time of two ops
            logits = torch.addmm(base[:, j], spark.w1.weight[prev], spark.w2)
        prev, q = draw(logits, j)
        toks.append(prev)
        qs.append(q)
    return torch.stack(toks, 1), (torch.stack(qs, 1) if qs[0] is not None else None)


def host_greedy_chain(table):
    """markov_chain's twin for greedy drafting on a CPU: the same float adds and the same
    first-maximum argmax, so the same tokens (tested), in numpy over the table's own memory (no
    copy), without four small torch ops a step (docs/experiments.md: DSpark: greedy chain on the
    host). table: the (V, V) Markov table -> chain(base_logits (k, V), prev token) -> (k,)
    tokens; None where the table is not a float table on the CPU (or there is none)."""
    if not (torch.is_tensor(table) and table.device.type == "cpu"
            and table.dtype in (torch.float32, torch.float64)):
        return None
    host = table.detach().numpy()

    def chain(base_logits, prev):
        toks = []
        for u in base_logits.numpy():
            prev = int((u + host[prev]).argmax())
            toks.append(prev)
        return torch.tensor(toks, device=base_logits.device)
    return chain


class DSparkDrafter(DFlashDrafter):
    """DFlash's drafter (self.net: the DFlash network, DSpark's backbone) plus the Markov head and
    the scheduler (self.spark: the whole DSpark network). It drafts a batch of requests in one
    pass, as DFlash does, and its scheduler spends one verify over all of them (Algorithm 1);
    one request is a batch of one.

    schedule        'auto' (the throughput scheduler), 'threshold' (verify while a_j >=
                    threshold) or 'full' (always all k); markov=False drops the Markov bias. The
                    last two are the paper's ablations.
    t_draft         seconds of the rest of a round (drafting, commit, the loop), and
    t_verify        t_verify[n], seconds of a verify forward of n tokens in all: what the
                    scheduler weighs, at the batch size in use. use_costs() passes them in, per
                    batch size (runtime/profiling.py measures them on the device in use). None:
                    no device measured, and every verify length costs the same (a large target
                    on a GPU, where a verify is bound by reading the weights), so the rule
                    verifies every draft. measured: whether the rounds keep measuring t_draft
                    (measure_round).
    greedy_chain    markov_chain's twin for greedy drafting of one request on a CPU
                    (host_greedy_chain), or None: the Markov table is not on the CPU, or does
                    not fit
    sync            waits for the device before scoring is timed (None: none; its start-up
                    profile sets it)
    mean_verify_len the drafts sent to verification, per round

    A round on its own, run as written (tests/test_layout.py runs every example of the lesson):
    a tiny random target in float64, DFlash's backbone at block 8, a rank-8 Markov head.

        >>> from gpt import GPT, GPTConfig
        >>> from draft_dflash import DFlashConfig
        >>> from sampler import Sampler
        >>> from speculative import generate_plain, generate_speculative
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> cfg = DFlashConfig(n_embd=32, n_head=2, taps=[1, 2], block=8)
        >>> drafter = DSparkDrafter(DSpark(cfg, DSparkConfig(rank=8), target).double().eval())
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_speculative(target, drafter, prompt, 12, 4, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    name = "dspark"

    def __init__(self, spark, schedule="auto", threshold=THRESHOLD, markov=True, t_draft=0.0,
                 t_verify=None):
        super().__init__(spark.backbone)
        # sampling: one slot more than DFlash: its sampling weights train the block's first slots,
        # and a coupled probe chose the longer draft (docs/experiments.md: DSpark: sampling k)
        self.sampled_k = min(4, self.max_k)
        if schedule not in ("auto", "threshold", "full"):
            raise ValueError(f"unknown schedule {schedule!r}: use auto, threshold or full")
        self.spark, self.schedule, self.threshold, self.markov = spark, schedule, threshold, markov
        self.reset_account()
        # t_draft: what a round costs besides its verify forward. The profile's guess first;
        # then, when measured, the rounds move it (inside the loop a draft runs slower than
        # alone, where the target and the drafter evict each other from the cache)
        if t_verify is None:  # no device measured: a verify of any length costs one unit
            t_verify = defaultdict(lambda: 1.0)
        self.t_draft, self.t_verify, self.measured, self._last = t_draft, t_verify, False, None
        self.costs, self.batch_size = None, None
        # the confidence head as a table (DSpark.confidence_table). Like the stacked ctx_kv, a copy
        # taken here: a drafter is built after training
        self.conf_h, self.conf_code = spark.confidence_table()
        self.conf_temp = spark.conf_temp.tolist()
        V = spark.w2.size(1)
        fits = V * V * spark.w2.element_size() <= MARKOV_TABLE_BYTES
        self.markov_table = spark.markov_table() if fits else None  # (V, V) or None
        # on a CPU a greedy draft runs the chain on the host: markov_chain's tokens, fewer ops
        self.greedy_chain = host_greedy_chain(self.markov_table)
        self.sync = None

    def use_costs(self, costs, sync=None):
        """The start-up profile's costs (runtime/profiling.profile_dspark): costs(B) -> (t_draft,
        t_verify) at batch size B, asked when a batch of a new size begins (t_draft then moves
        with the rounds); sync, a wait for the device before scoring is timed."""
        self.costs, self.sync, self.measured, self.batch_size = costs, sync, True, None

    def scoring_every_draft(self):
        """A copy with state of its own that scores every draft and verifies them all: what a
        round costs at most (the start-up profile times it)."""
        c = self.fresh()
        c.schedule, c.threshold = "threshold", 0.0
        return c

    def reset_account(self):
        """Counts from zero: drafts verified, rounds, rounds whose drafts were scored (each one
        host sync); and the scheduler's own account (auto only): the seconds a round its cuts
        save and the seconds its scoring takes, running averages over scored rounds (None:
        nothing scored yet)."""
        self.verified, self.rounds, self.scored = 0, 0, 0
        self.saved, self.t_score = None, 0.0

    @property
    def mean_verify_len(self):
        return self.verified / max(1, self.rounds)

    def begin_batch(self, seqs, hidden):
        self._last = None  # (start time, tokens verified) of this generation's previous round
        if self.costs is not None and len(seqs) != self.batch_size:  # a new batch size: its costs
            self.batch_size = len(seqs)
            self.t_draft, self.t_verify = self.costs(self.batch_size)
        DFlashDrafter.begin_batch(self, seqs, hidden)

    def measure_round(self):
        """Called as a round starts: the time since the previous one started, less the profiled
        verify forward of the tokens it verified, moves t_draft (a running average, 10% a round)."""
        now = time.perf_counter()
        if self.measured and self._last is not None:
            start, n = self._last
            fixed = max(0.0, now - start - self.t_verify[n])
            self.t_draft += 0.1 * (fixed - self.t_draft)
        return now

    @torch.inference_mode()
    def propose_batch(self, ks, sampler):
        now = self.measure_round()
        h = self.draft_states(ks)  # (B, K, d): the states that draft each row's next tokens
        toks, q = self.chain(h, ks, sampler)
        base = sum(k > 0 for k in ks)  # rows verified, each with its last token at least
        lengths = self.schedule_round(h, toks, ks, base)
        self.verified += sum(lengths)
        self.rounds += 1
        self._last = (now, base + sum(lengths))
        L = max(lengths)
        return toks[:, :L], lengths, (q[:, :L] if q is not None else None)

    def chain(self, h, ks, sampler):
        """The Markov chain over the backbone's logits (every row's slots in one product), left
        to right, every row at once -> (tokens (B, K), q (B, K, V) or None). One request drafting
        greedily on a CPU takes the chain on the host (host_greedy_chain)."""
        base = self.head(h, ks)  # (B, K, V)
        last = self.rows.last()  # (B,)
        if (len(ks) == 1 and sampler.mode == "greedy" and self.markov
                and self.greedy_chain is not None):
            return self.greedy_chain(base[0], int(last[0]))[None], None
        S = self.rows.lengths

        def draw(logits, j):  # logits (B, V): slot j of every row, from its own position
            tok, q = sampler.draft(logits[:, None], [s + j for s in S], [int(k > j) for k in ks])
            return tok[:, 0], (q[:, 0] if q is not None else None)
        return markov_chain(self.spark, base, last, draw, self.markov_table, self.markov)

    def schedule_round(self, h, toks, ks, base):
        """How many drafts each row verifies: every confidence c_j at once, the prefix survivals
        a_j = prod c_i, then the rule on the host (one sync per scored round, not one per draft).
        While scoring does not pay (closed), a round scores nothing and verifies all it drafted,
        and a watch round scores and verifies all too: it only works out what its cut would have
        saved. Drafting all k first costs only the cheap Markov steps past the cut.
        toks (B, K): the drafts; base: the rows verified (admit's)."""
        auto = self.schedule == "auto"
        closed = auto and self.closed()
        watching = closed and (self.rounds + 1) % SCORE_EVERY == 0  # this is round rounds + 1
        if self.schedule == "full" or (closed and not watching):
            return list(ks)
        if self.sync is not None:
            self.sync()  # on a GPU: the draft's queued work is not scoring's cost
        t0 = time.perf_counter()
        self.scored += 1
        survival = self.survival(h, toks, ks)
        if not auto:
            return [above(a, self.threshold) for a in survival]
        lengths = admit(survival, base, self.t_draft, self.verify_cost)
        self.watch(expected_saving(survival, lengths, base, self.t_draft, self.verify_cost),
                   time.perf_counter() - t0)
        # a watch round cuts nothing: it only asks whether cuts pay yet. Cutting there gave up
        # drafts for a saving its own account put below what scoring cost (docs/experiments.md:
        # DSpark: scheduler at batch 1)
        return list(ks) if watching else lengths

    def verify_cost(self, n):
        return self.t_verify[n]

    def survival(self, h, toks, ks):
        """Every row's prefix survivals a_{r,j} = prod_{i<=j} c_{r,i}, its first ks[r] -> a list a
        row (host floats). One product and one host read for the whole batch."""
        prev = torch.cat([self.rows.last()[:, None], toks[:, :-1]], 1)  # x_{j-1} before each draft
        f = self.spark.features(h)
        z = (f @ self.conf_h + self.conf_code[prev]).tolist()  # (B, K) logits: the host sync
        out = []
        for z_r, k in zip(z, ks):  # on the host: k tiny steps a row, not k more ops
            row, prefix = [], 1.0
            for z_j, temp in zip(z_r[:k], self.conf_temp):
                prefix *= 0.5 * (1 + math.tanh(0.5 * z_j / temp))  # sigmoid(z_j / T_j)
                row.append(prefix)
            out.append(row)
        return out

    def closed(self):
        """Whether scoring has cost more than the cuts it made would save (the running averages):
        then the drafter verifies whole blocks unscored, and one round in SCORE_EVERY watches (is
        scored, cuts nothing) so a change (a longer context, a busier device) is seen. The
        averages carry over from one generation to the next, like t_draft: they describe the
        machine, not the text."""
        return self.saved is not None and self.saved < self.t_score

    def watch(self, saved, spent):
        """After a scored round: the seconds its cut is expected to save and the seconds scoring
        took move the running averages (10% a round; the first round sets them)."""
        if self.saved is None:
            self.saved, self.t_score = saved, spent
        else:
            self.saved += 0.1 * (saved - self.saved)
            self.t_score += 0.1 * (spent - self.t_score)

    def catch_up(self, new, hidden):
        # the rounds since its last were another drafter's: its next round starts the clock anew
        self._last = None
        self.commit(new.numel() - 1, new, hidden)


# -----------------------------------------------------------------------------
# declared once: what the house reads of this file (registry/drafters.py lists it; how it learns
# in train.py, its stage, is training/stages_dspark.py)


def from_config(config, target):
    """The DSpark network for out/dspark.pt's config: its backbone's (DFlash's) and its own."""
    return DSpark(DFlashConfig.from_dict(config["backbone"]), DSparkConfig(**config["dspark"]),
                  target)


DRAFTER = dict(
    name="dspark",
    network=from_config,
    drafter=lambda spark, target: DSparkDrafter(spark),
    pairs=True,
    trees=True,
    syncs={"propose_batch": (1, 0)},  # its scheduler reads the confidences in a round it scores
)
