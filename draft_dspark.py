"""
draft_dspark.py -- DSpark: DFlash's one-pass backbone + a cheap semi-autoregressive Markov head
+ confidence-scheduled verification.

Paper: DSpark (Peking University + DeepSeek-AI, 2026; open code in DeepSpec, MIT).

draft_dflash.py drafts every block slot independently: slot 5 never learns what slot 4 chose,
so two plausible continuations can get mixed ("the the"). DSpark keeps the parallel backbone
for the expensive part and adds two cheap pieces on top:

1. A Markov head. The backbone (DFlash's network, unchanged) gives base logits U_k for every
   slot in one pass. Then, left to right, draft k is sampled from softmax(U_k + W1[x_{k-1}] W2):
   a rank-r bias that depends on the token just drafted. Drafting works the bias out for every
   previous token once, a (V x V) table (where it fits in memory), so the sequential part costs
   a row lookup and an add per token, small next to the backbone. Every q is an exact softmax,
   so rejection sampling stays lossless.
2. A confidence head c_k = sigmoid(w . [h_k; W1[x_{k-1}]]): the chance draft k survives given
   that its prefix did. Prefix survival a_j = prod_{i<=j} c_i (the code calls the list of them
   `survival`). A scheduler, with the target's verify latency profiled once at load, verifies
   only the prefix that maximises expected tokens per second,
   (1 + sum_{j<=l} a_j) / (t_draft + t_verify(l + 1)), where t_draft is the rest of a round
   (draft, commit, loop): profiled at load, then measured as the rounds run. Scoring the drafts
   costs time too, so the scheduler watches itself: when the cuts it makes save less than its
   scoring costs (at batch 1 on a CPU its rule keeps every draft: a longer verify costs little
   next to a round; docs/experiments.md: DSpark: scheduler at batch 1), it verifies whole
   blocks unscored and scores one round in SCORE_EVERY to keep watching.

The paper lets the anchor slot predict too (anchor + B-1 masks -> B drafts); here the backbone
is exactly DFlash's (the masks predict, B-1 drafts), so DSpark starts from the trained DFlash
network and what it adds is measured against it on equal footing: its training (the end of
this file) starts from DFlash's own training dspark_iters steps before its end (where DFlash is
still at its narrow block, the network is widened first), so the two take the same number of
optimizer steps.

    python train.py --only dspark && python speculative.py --method dspark
"""

import copy
import dataclasses
import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

from gpt import cpu_state_dict, load_checkpoint, number, setting, synchronize
from draft_small import total_variation
import draft_dflash
from batched import (CostTable, admit_batch, best_single_k, fill_budget, interpolate,
                     plan_budget)
from draft_dflash import (BatchDFlash, DFlash, DFlashConfig, DFlashDrafter, anchored, block_states,
                          network_config, position_weights, soft_labels)

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
        self.config = cfg
        self.backbone = DFlash(backbone_cfg, target)
        self.w1 = nn.Embedding(V, cfg.rank)              # W1[x]: the previous token's low-rank code
        # W2: code -> a bias over the vocabulary, (r, V) as in the paper's W1[x] W2: drafting
        # multiplies by it one row at a time, fastest with its rows contiguous
        # (docs/experiments.md: DSpark: Markov table)
        self.w2 = nn.Parameter(torch.zeros(cfg.rank, V))
        # w of the confidence head: torch's own Linear, because at one output column gpt.Linear's
        # packed product is the slower one (docs/experiments.md: DSpark: confidence head)
        self.conf = nn.Linear(d + cfg.rank, 1)
        nn.init.normal_(self.w1.weight, std=0.02)
        # w2 starts at zero: DSpark starts as plain DFlash and the bias grows from 0
        nn.init.zeros_(self.conf.weight)
        nn.init.zeros_(self.conf.bias)
        # per-position temperature for the confidence logits, fitted on held-out text
        # (calibrate()): one per draft position
        n_positions = backbone_cfg.block - 1 + backbone_cfg.shift
        self.register_buffer("conf_temp", torch.ones(n_positions))

    def markov(self, prev):
        """B(x_{k-1}, .) = W1[x_{k-1}] W2: prev (...) token ids -> (..., V)."""
        return self.w1(prev) @ self.w2

    @torch.no_grad()
    def markov_table(self):
        """B(x, .) for every token x at once: the (V, V) table W1 W2. A drafted token then costs
        one row lookup, where W1[x] W2 reads all of W2 (r x V) for every token."""
        return self.w1.weight @ self.w2

    def confidence_logit(self, h, prev):
        """w . [h_k; W1[x_{k-1}]] (before the sigmoid): h (..., d), prev (...) -> (...)."""
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
# DFlash's own loss, drafted better (tau 4.46 vs 4.33, 1,500 steps from the 5,500-step DFlash)


def dspark_terms(net, x, hidden, t_logits, anchors, block=None):
    """Teacher-forced block predictions on text x. Returns per-prediction (B, A, P) tensors:
    the cross-entropy against p_target, TV(p_draft, p_target), the confidence logit, and whether
    the greedy draft equals the target's argmax (what calibration fits). block: as in
    draft_dflash.block_states."""
    h, tpos = block_states(net.backbone, x, hidden, anchors, block)  # (B, A, P, d), (B, A, P)
    b = torch.arange(x.size(0), device=x.device)[:, None, None]
    prev = x[b, tpos - 1]  # x_{k-1}: the anchor for the first slot, then the text's own tokens
    logp = F.log_softmax((net.backbone.head(h) + net.markov(prev)).float(), dim=-1)  # (B, A, P, V)
    p_t = soft_labels(t_logits, tpos)
    tv = total_variation(logp, p_t)
    ce = -(p_t * logp).sum(-1)
    # the confidence head is a probe on the backbone: its BCE does not pull the drafting features
    z = net.confidence_logit(h.detach(), prev)
    hit = (logp.argmax(-1) == p_t.argmax(-1)).float()
    return ce, tv, z, hit


def dspark_loss(net, x, hidden, t_logits, anchors, gamma, block=None):
    ce, tv, z, _ = dspark_terms(net, x, hidden, t_logits, anchors, block)
    # soft label 1 - TV: the chance that a draft sampled from p_draft survives rejection
    # sampling against p_target
    bce = F.binary_cross_entropy_with_logits(z.float(), (1 - tv).detach(), reduction="none")
    w = position_weights(ce.size(-1), gamma, ce.device)
    return (((ce + tv + bce) * w).sum(-1).mean() / w.sum())


@torch.no_grad()
def calibrate(net, batches):
    """Per-position temperature scaling of the confidence logits (Guo et al. 2017): for each
    slot k pick T_k minimising the log loss of sigmoid(z / T_k) against whether the greedy draft
    matched the target, teacher-forced on the target's own text, over the blocks whose drafts
    1..k-1 all matched. c_k is the chance that draft k survives GIVEN its prefix survived, and
    only those blocks say what that is: fitted on every block, the temperatures made late
    positions look far worse than they are in the loop, where a round reaches them only through
    an easy stretch of text, and the scheduler cut blocks that paid (docs/experiments.md:
    DSpark: calibration on live blocks).
    batches: an iterable of (x, hidden, t_logits, anchors), read once, so a generator streams them
    (only the confidences are kept). Returns the ECE (expected calibration error, see ece()) over
    those blocks before and after."""
    zs, hits = [], []
    for x, hid, t_logits, anchors in batches:
        _, _, z, hit = dspark_terms(net, x, hid, t_logits, anchors)
        zs.append(z.flatten(0, 1))
        hits.append(hit.flatten(0, 1))
    z, hit = torch.cat(zs).float(), torch.cat(hits)  # (N, P)
    # (N, P): whether each draft's prefix survived (the first draft's always has)
    alive = torch.cat([torch.ones_like(hit[:, :1]), hit.cumprod(1)[:, :-1]], 1).bool()

    def live_ece():  # at the current temperatures
        return ece(torch.sigmoid(z / net.conf_temp.float())[alive], hit[alive])
    before = live_ece()
    net.conf_temp.copy_(fit_temperatures(z, hit, alive))
    return before, live_ece()


def fit_temperatures(z, hit, alive, min_blocks=20):
    """z, hit, alive (N, P): confidence logits, greedy matches, whether the prefix matched. ->
    (P,) temperatures, each from a grid, minimising the log loss over the blocks alive there; 1
    where fewer than min_blocks got that far."""
    grid = torch.logspace(-1.5, 1.5, 61, device=z.device)
    temps = torch.ones(z.size(1), device=z.device)
    for k in range(z.size(1)):
        zk, hk = z[alive[:, k], k], hit[alive[:, k], k]
        if hk.numel() >= min_blocks:
            losses = [F.binary_cross_entropy_with_logits(zk / t, hk).item() for t in grid]
            temps[k] = grid[min(range(len(grid)), key=losses.__getitem__)]
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


class Throughput:
    """The scheduler's rule, fed the prefix survivals a_1, a_2, ... in order: admit position l
    while the expected throughput (1 + sum_{j<=l} a_j) / (t_draft + t_verify[l+1]) does not drop;
    refuse (and stay refused) at the first drop. t_verify[m]: seconds for an m-token target
    forward. The first position is always admitted: a round verifies at least one draft.
    l: positions admitted so far; expected: 1 + their summed survival (expected tokens per
    round); theta: the throughput at l."""

    def __init__(self, t_draft, t_verify):
        self.t_draft, self.t_verify = t_draft, t_verify
        self.l, self.expected, self.theta = 0, 1.0, 0.0

    def admit(self, survival):
        expected = self.expected + survival
        theta = expected / (self.t_draft + self.t_verify[self.l + 2])
        if self.l >= 1 and theta < self.theta:
            return False
        self.l, self.expected, self.theta = self.l + 1, expected, theta
        return True


class Threshold:
    """The static rule, for comparison: admit while a_l >= threshold (and always the first)."""

    def __init__(self, threshold):
        self.threshold, self.l = threshold, 0

    def admit(self, survival):
        if self.l >= 1 and survival < self.threshold:
            return False
        self.l += 1
        return True


def expected_saving(survival, length, t_draft, t_verify):
    """Seconds per round that verifying only `length` of the k drafts is expected to save against
    verifying all k: (seconds per token at k - at length) x the tokens such a round yields."""
    def per_token(m):
        return (t_draft + t_verify[m + 1]) / (1 + sum(survival[:m]))
    return (per_token(len(survival)) - per_token(length)) * (1 + sum(survival[:length]))


def admitted(rule, survival):
    """How many of the drafts with prefix survivals a_1..a_K `rule` verifies: it is fed them in
    order until its first refusal, and verifies nothing past it."""
    for s in survival:
        if not rule.admit(s):
            break
    return rule.l


def schedule_length(survival, t_draft, t_verify):
    """How many of the drafts with prefix survivals a_1..a_K the throughput rule verifies."""
    return admitted(Throughput(t_draft, t_verify), survival)


def profile_verify(target, m_max, context=None, reps=9, between=None):
    """Seconds of one target forward over m = 1..m_max new tokens after a context of `context`
    tokens (default: half the window), on the target's own device and dtype. The fastest of
    `reps` tries: interference from other processes only ever adds time (a median was thrown
    off by a busy shared CPU). Made non-decreasing in m. Returns a list indexed by m (0 unused).
    between(): run, untimed, before each try: the drafter's own forward, so the target runs as it
    does in the loop. Why: where the two models' weights do not fit in the cache together, a
    verify right after a draft costs more, and grows less with its length, than the same forward
    timed back to back; the back-to-back slope made the scheduler cut blocks that paid
    (docs/experiments.md: DSpark: scheduler at batch 1)."""
    dev = target.lm_head.weight.device
    n_ctx = context if context is not None else target.config.block_size // 2
    n_ctx = min(n_ctx, target.config.block_size - m_max)
    cache = target.new_cache()
    x = torch.zeros(1, n_ctx + m_max, dtype=torch.long, device=dev)
    with torch.inference_mode():
        target(x[:, :n_ctx], cache=cache)
        t = [0.0]
        for m in range(1, m_max + 1):
            ts = []
            for _ in range(reps):
                if between is not None:
                    between()
                cache.rollback(n_ctx)
                synchronize(dev)
                t0 = time.perf_counter()
                target(x[:, n_ctx:n_ctx + m], cache=cache)
                synchronize(dev)
                ts.append(time.perf_counter() - t0)
            t.append(max(min(ts), t[-1]))
    return t


def profile_propose(drafter, target, k, reps=9):
    """Seconds for one propose(k) of `drafter` (a greedy pick) after begin() on a dummy context of
    half the target's window, the fastest of `reps` (as profile_verify: interference only adds).
    Leaves that dummy context begun."""
    from speculative import Sampler
    tcfg, w = target.config, target.lm_head.weight
    n_ctx = tcfg.block_size // 2
    hid = {t: torch.zeros(1, n_ctx, tcfg.n_embd, device=w.device, dtype=w.dtype)
           for t in drafter.hidden_layers}
    drafter.begin(torch.zeros(1, n_ctx + 1, dtype=torch.long, device=w.device), hid)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        drafter.propose(k, Sampler("greedy"))
        synchronize(w.device)
        ts.append(time.perf_counter() - t0)
    return min(ts)


# -----------------------------------------------------------------------------
# the Drafter


# drafting keeps DSpark.markov_table when it takes no more memory than this (ours, V = 4096 in
# float32: 64 MiB; GPT-2's 50,257 would need 10 GB), and multiplies by W2 per token otherwise.
# Why: a row lookup is far cheaper than re-reading W2, which the target's forward pushes out of
# the cache between rounds (docs/experiments.md: DSpark: Markov table)
MARKOV_TABLE_BYTES = 256 * 2**20
# the batched budget rule (BatchDSpark) probes with this many drafts a row when it has no estimate
# (and every SCORE_EVERY-th round while it drafts nothing): enough to see whether drafting pays
PROBE_WIDTH = 2
MAX_WAIT = 256
# after OFF_AFTER batches in a row at one batch size skipped the draft in OFF_SHARE of their
# rounds, its batches are decoded plainly from the start (the drafter off), except one in
# OFF_EVERY, which looks again
OFF_AFTER, OFF_SHARE, OFF_EVERY, OFF_COST = 2, 0.9, 16, 2.0
# the budget rule drafts only where its tables promise more than this much over a round without a
# draft: below it, the tables' own error decides, and the rounds it drafted lost
# (docs/experiments.md: Batched: the budget rule's margin)
PLAN_MARGIN = 0.25
CALIBRATION_PRIOR = 5.0  # pseudo-rounds at the confidence head's own estimate (recalibrate)
# while scoring does not pay (DSparkDrafter.closed), one round in this many is still scored, so a
# change (a longer context, a busier device) is seen
SCORE_EVERY = 16


class DSparkDrafter(DFlashDrafter):
    """schedule: 'auto' (the throughput scheduler), 'threshold' (verify while a_j >= threshold)
    or 'full' (always all k), so bench can ablate. markov=False drops the Markov bias (ablation).
    profile=False skips the start-up profile: set t_draft and t_verify before an 'auto' round
    (the tests do). mean_verify_len: average number of drafts actually sent to verification."""
    name = "dspark"

    def __init__(self, net, schedule="auto", threshold=0.5, markov=True, profile=True):
        super().__init__(net.backbone)
        # sampling: one slot more than DFlash. Its sampling weights (sampling_weights, below)
        # train the block's first slots, and k = 4 beat 3 in a coupled probe
        # (docs/experiments.md: DSpark: sampling k)
        self.sampled_k = min(4, self.max_k)
        if schedule not in ("auto", "threshold", "full"):
            raise ValueError(f"unknown schedule {schedule!r}: use auto, threshold or full")
        self.spark, self.schedule, self.threshold, self.markov = net, schedule, threshold, markov
        # set to a list to record (a_1..a_l, n survived) per round (calibration checks)
        self.log = None
        self.reset_account()
        self.t_draft = 0.0
        # t_draft: what a round costs besides its verify forward. The start-up profile of one
        # draft is the first guess; with profile on, the rounds then measure it (measure_round):
        # inside the loop a draft runs slower than alone (where the target and the drafter evict
        # each other from the cache), and the commit and the loop add to it
        self.measured, self._last = False, None  # not while profiling: no verify between drafts
        # the confidence head as a table (DSpark.confidence_table). Like the stacked ctx_kv, a copy
        # taken here: a drafter is built after training
        self.conf_h, self.conf_code = net.confidence_table()
        self.conf_temp = net.conf_temp.tolist()
        V = net.w2.size(1)
        fits = V * V * net.w2.element_size() <= MARKOV_TABLE_BYTES
        self.markov_table = net.markov_table() if fits else None  # (V, V) or None
        # the same table seen by numpy (no copy), for greedy_on_host: CPU, float32 or float64 only
        t = self.markov_table
        host = (t is not None and t.device.type == "cpu"
                and t.dtype in (torch.float32, torch.float64))
        self.markov_host = t.detach().numpy() if host else None
        self.t_verify = None
        if profile:
            self.t_draft = self.profile_draft()  # leaves a dummy context begun
            self.t_verify = profile_verify(net.backbone.target, self.max_k + 1,
                                           between=lambda: self.draft_forward(self.max_k))
        self.measured = profile

    def variants(self):
        """Ablation rows for bench.py: the same network with one part switched off. They share
        this drafter's buffers, which is fine because every generation starts with begin()."""
        rows = {"dspark-full": dict(schedule="full"),  # no scheduler: verify the whole block
                "dspark-threshold": dict(threshold=0.5, schedule="threshold"),  # static rule
                "dspark-nomarkov": dict(markov=False)}  # no Markov head: DFlash's parallel picks
        out = {}
        for name, changes in rows.items():
            v = copy.copy(self)
            v.__dict__.update(changes)
            v.reset_account()  # its own counts and its own account of scoring
            out[name] = v
        return out

    def reset_account(self):
        """Counts from zero: drafts verified, rounds, rounds whose drafts were scored (each one
        host sync); and the scheduler's own account (auto only): the seconds a round its cuts
        save and the seconds its scoring takes, running averages over scored rounds (None:
        nothing scored yet). For a new drafter, each of bench's ablation copies, and after the
        start-up profile."""
        self.verified, self.rounds, self.scored = 0, 0, 0
        self.saved, self.t_score = None, 0.0

    @property
    def mean_verify_len(self):
        return self.verified / max(1, self.rounds)

    def profile_draft(self, reps=9):
        """Seconds for one full-block propose() on a dummy context (a greedy pick); the fastest
        try."""
        saved = self.schedule, self.threshold
        # every position scored and admitted: the full cost
        self.schedule, self.threshold = "threshold", 0.0
        seconds = profile_propose(self, self.net.target, self.max_k, reps)
        self.schedule, self.threshold = saved
        self.reset_account()
        return seconds

    def batched(self, schedule="budget"):
        """The batched twin (BatchDSpark); its default rule is the one that pays in the serving
        sweep (docs/results.md: Many requests at once)."""
        return BatchDSpark(self, schedule)

    def begin(self, tokens, hidden):
        self._last = None  # (start time, verified drafts) of this generation's previous round
        super().begin(tokens, hidden)

    def measure_round(self):
        """Called as a round starts: the time since the previous one started, less the profiled
        verify forward of the length it chose, moves t_draft (a running average, 10% a round)."""
        now = time.perf_counter()
        if self.measured and self._last is not None:
            start, length = self._last
            fixed = max(0.0, now - start - self.t_verify[length + 1])
            self.t_draft += 0.1 * (fixed - self.t_draft)
        return now

    @torch.inference_mode()
    def propose(self, k, sampler):
        now = self.measure_round()
        self.check_k(k)
        h = self.draft_states(k)  # (k, d): the states that draft the next k tokens
        # (k, V) base logits, all slots in one product (row by row was slower)
        base_logits = self.net.head(h)
        if sampler.mode == "greedy" and self.markov and self.markov_host is not None:
            toks, qs = self.greedy_on_host(base_logits), None
        else:
            toks, qs = self.markov_chain(base_logits, sampler)
        length = self.schedule_round(h, toks)
        self.verified += length
        self.rounds += 1
        self._last = (now, length)
        return toks[:length], (qs[:length] if qs is not None else None)

    def markov_chain(self, base_logits, sampler):
        """The sequential part: draft j from U_j + B(x_{j-1}, .), left to right, each pick fed to
        the next. -> (k,) tokens and, in rejection mode, the (k, V) distributions they came
        from (else None)."""
        S = self.seq.numel()
        prev, toks, qs = self.seq[-1:], [], []
        w1, w2, table = self.spark.w1.weight, self.spark.w2, self.markov_table
        for j in range(base_logits.size(0)):
            logits = base_logits[j:j + 1]
            if self.markov and table is not None:
                logits = logits + table[prev]  # one (1, V) row
            elif self.markov:  # W1[x_{k-1}] W2 fused into one product: half the time of two ops
                logits = torch.addmm(logits, w1[prev], w2)
            prev, q = sampler.draft(logits, [S + j])
            toks.append(prev)
            qs.append(q)
        return torch.cat(toks), (torch.cat(qs) if qs[0] is not None else None)

    def greedy_on_host(self, base_logits):
        """markov_chain for greedy drafting on a CPU, in numpy over the same memory: the same
        float32 adds and the same first-maximum argmax, so the same tokens (tested), without four
        small torch ops a step (docs/experiments.md: DSpark: greedy chain on the host)."""
        base, table = base_logits.numpy(), self.markov_host
        prev, toks = int(self.seq[-1]), []
        for u in base:
            prev = int((u + table[prev]).argmax())
            toks.append(prev)
        return torch.tensor(toks, device=base_logits.device)

    def draft_forward(self, k):
        """The drafter's forward alone (block states and base logits), for profile_verify."""
        return self.net.head(self.draft_states(k))

    def schedule_round(self, h, toks):
        """How many of the k drafts to verify: every confidence c_j at once, the prefix survival
        a_j = prod c_i, then the rule on the host (one sync per scored round, not one per
        draft). While scoring does not pay (closed), a round scores nothing and verifies all k,
        and a watch round scores and verifies all k too: it only works out what its cut would
        have saved. Drafting all k first costs only the cheap Markov steps past the cut.
        toks (k,): the drafts."""
        k, auto = h.size(0), self.schedule == "auto"
        closed = auto and self.closed()
        watching = closed and (self.rounds + 1) % SCORE_EVERY == 0  # this is round rounds + 1
        if self.log is None and (self.schedule == "full" or (closed and not watching)):
            return k
        synchronize(h.device)  # on a GPU: the draft's queued work is not scoring's cost
        t0 = time.perf_counter()
        self.scored += 1
        prev = torch.cat([self.seq[-1:], toks[:-1]])  # x_{j-1}: the token before each draft
        z = (h @ self.conf_h + self.conf_code[prev]).tolist()  # (k,) logits: the host sync
        survival, a = [], 1.0
        for z_j, temp in zip(z, self.conf_temp):  # on the host: k tiny steps, not k more ops
            a *= 0.5 * (1 + math.tanh(0.5 * z_j / temp))  # sigmoid(z_j / T_j)
            survival.append(a)
        length = k
        if self.schedule != "full":
            length = admitted(Throughput(self.t_draft, self.t_verify) if auto
                              else Threshold(self.threshold), survival)
        if auto:
            self.watch(expected_saving(survival, length, self.t_draft, self.t_verify),
                       time.perf_counter() - t0)
        if watching and self.log is None:
            # a watch round cuts nothing: it only asks whether cuts pay yet. Cutting there gave up
            # drafts for a saving its own account put below what scoring cost
            # (docs/experiments.md: DSpark: scheduler at batch 1)
            length = k
        self._survival = survival[:length]
        return length

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

    @torch.inference_mode()
    def commit(self, n, new, hidden):
        if self.log is not None:
            self.log.append((self._survival, n))
        super().commit(n, new, hidden)

    def catch_up(self, new, hidden):
        # the rounds since its last were another drafter's: its next round starts the clock anew,
        # and the calibration log gets no entry for drafts it did not make
        self._last = None
        DFlashDrafter.commit(self, new.numel() - 1, new, hidden)


def load_dspark(ckpt, target, device, dtype):
    backbone_cfg = DFlashConfig.from_dict(ckpt["config"]["backbone"])
    net = DSpark(backbone_cfg, DSparkConfig(**ckpt["config"]["dspark"]), target)
    net.load_state_dict(ckpt["state_dict"])
    return DSparkDrafter(net.to(device=device, dtype=dtype).eval())


# -----------------------------------------------------------------------------
# many requests at once (batched.py): the scheduler as the paper defines it, over the batch

BATCH_SCHEDULES = ("auto", "goodput", "budget", "full")


class BatchDSpark(BatchDFlash):
    """DSparkDrafter over B rows: the batched DFlash block, then the Markov chain for every row at
    once, then every row's confidences in one product and ONE host read, then one choice of how
    many drafts each row verifies:
      auto     DSpark's Algorithm 1 over the whole batch (batched.admit_batch): (row, position)
               pairs admitted in order of survival until expected throughput stops rising;
      goodput  one length for every row, the best for the batch (batched.best_single_k), the rule
               a serving engine without per-request lengths uses;
      budget   the production variant: the budget is set before drafting from the previous
               round's survivals (batched.plan_budget), so a round the cost table says will not
               pay skips the draft itself; fresh confidences then fill it (batched.fill_budget);
      full     every row verifies all it drafted (a fixed k).
    The cost table (batched.CostTable) and the draft's cost by width (time_draft) are profiled
    once per batch size, at the first begin(); what they miss is measured as the rounds run
    (measure)."""

    def __init__(self, drafter, schedule="auto"):
        if schedule not in BATCH_SCHEDULES:
            raise ValueError(f"unknown batch schedule {schedule!r}: use {', '.join(BATCH_SCHEDULES)}")
        super().__init__(drafter)
        self.spark, self.schedule = drafter.spark, schedule
        self.markov_table = drafter.markov_table
        self.conf_h, self.conf_code = drafter.conf_h, drafter.conf_code
        self.conf_temp = drafter.spark.conf_temp.to(self.conf_h.dtype)
        self.costs = {}  # batch size -> (CostTable, t_draft)
        self.flush_cost = {}  # batch size -> seconds per pending target state a flush takes
        self.new_account()

    def new_account(self):
        """What it learns as it runs, from nothing: per batch size the measured corrections to its
        tables (adapt) and the batches begun; its rounds and skipped rounds; the recalibration
        sums (per draft position: survivals seen, survivals predicted); this batch's state."""
        self.adapt, self.batches, self.rounds, self.skipped = {}, {}, 0, 0
        self.calibration = np.zeros((2, self.max_k))
        self._scored, self.on, self.batch_rounds, self.skipped_in_batch = None, True, 0, 0
        self.estimate = None

    def variants(self):
        """The same drafter under each other rule, for bench_batched.py ("auto" is named "cut"):
        copies that share its start-up profiles and its buffers, each with an account of its own."""
        out = {}
        for s in BATCH_SCHEDULES:
            if s != self.schedule:
                v = copy.copy(self)
                v.schedule = s
                v.new_account()
                out["dspark-" + ("cut" if s == "auto" else s)] = v
        return out

    @torch.inference_mode()
    def begin(self, seqs, hidden):
        super().begin(seqs, hidden)
        B = len(seqs)
        if self.schedule != "full" and B not in self.costs:
            table = CostTable.profile(self.net.target, B, self.max_k + 1)
            t_draft, per_state = self.time_draft(B)
            self.costs[B] = (table, t_draft)
            self.flush_cost[B] = per_state
        ad = self.adapt.setdefault(B, {"scale": 1.0, "rest": [0.0, 0.0], "wait": SCORE_EVERY,
                                       "failed": 0, "width": PROBE_WIDTH})
        if self.on and self.batch_rounds:  # the batch before this one: did it draft at all?
            done = self.skipped_in_batch >= OFF_SHARE * self.batch_rounds
            ad["failed"] = ad["failed"] + 1 if done else 0
        # new requests: no estimate of their own yet (the first round probes), and the head's
        # confidences taken at their word again
        self.estimate, self._last, self.idle, self._plan = None, None, 0, None
        self.calibration = np.zeros((2, self.max_k))
        self.batches[B] = self.batches.get(B, 0) + 1
        self.batch_rounds, self.skipped_in_batch = 0, 0
        # where OFF_AFTER batches in a row at this batch size found that no draft pays, a batch is
        # decoded plainly from its start (no drafter to keep in sync: that costs a few percent a
        # round, docs/results.md); one batch in OFF_EVERY stays on and looks again
        # (only where the widest verify costs OFF_COST times a plain step or more: below that a
        # wrong "off" loses most of what speculation makes, a wrong "on" only the bookkeeping)
        table = self.costs.get(B, (None,))[0]
        dear = table is not None and table.seconds[-1] >= OFF_COST * table.seconds[0]
        self.on = not (self.schedule == "budget" and dear and ad["failed"] >= OFF_AFTER
                       and self.batches[B] % OFF_EVERY)

    def time_draft(self, B, reps=5):
        """Seconds of one draft of all B rows, w drafts each, at a few w (fastest of reps) ->
        t_draft(slots), slots = B * (w + 1) block slots in all, linear in between (the draft's
        Linears run on real slots only, so its cost follows their total); and the seconds per
        target state a flush takes (a draft after skipped rounds first projects their context).
        Each try follows a target forward, as a draft does in the loop: timed back to back, the
        drafter's weights stay in the cache and a draft looks several times cheaper than it is.
        Proposing writes only past every row's context, so it runs on the state begin() made."""
        target, dev = self.net.target, self.k_cache.device
        scratch = target.new_cache(B, ragged=True)
        x = torch.zeros(B, 1, dtype=torch.long, device=dev)

        def timed(fn):
            best = float("inf")
            for _ in range(reps):
                scratch.reset()
                target(x, cache=scratch)  # the target's weights back in the cache
                synchronize(dev)
                t0 = time.perf_counter()
                fn()
                synchronize(dev)
                best = min(best, time.perf_counter() - t0)
            return best
        points = {B * (w + 1): timed(lambda: self.draft([w] * B, None))
                  for w in sorted({1, 2, 4, 8, self.max_k}) if w <= self.max_k}
        n = min(16, self.net.target.config.block_size // 4)

        def flush():
            self.n_ctx = [max(0, c - n) for c in self.n_ctx]  # re-project the last n states
            self.flush()
        per_state = timed(flush) / (n * B)
        return interpolate(points), per_state

    def draft(self, ks, sampler):
        """The block for every row, then the Markov chain left to right, every row at once ->
        (tokens (B, K), q or None, block states (B, K, d)). sampler None: greedy (profiling)."""
        h = self.block_states(ks)  # (B, K, d)
        base = self.head(h, ks)  # (B, K, V)
        prev, S = self.rows.last(), self.rows.lengths
        toks, qs = [], []
        w1, w2, table = self.spark.w1.weight, self.spark.w2, self.markov_table
        for j in range(h.size(1)):
            logits = base[:, j] + table[prev] if table is not None else torch.addmm(
                base[:, j], w1[prev], w2)  # (B, V)
            if sampler is None:
                tok, q = logits.argmax(-1, keepdim=True), None
            else:
                tok, q = sampler.draft(logits[:, None], [s + j for s in S], [int(k > j) for k in ks])
            prev = tok[:, 0]
            toks.append(tok)
            qs.append(q)
        q = torch.cat(qs, 1) if qs[0] is not None else None
        return torch.cat(toks, 1), q, h

    def survival(self, h, toks, ks):
        """Every row's prefix survivals a_{r,j} = prod_{i<=j} c_{r,i}, capped at ks[r]: one
        product and one host read for the whole batch (as the head gives them: choose() scales
        them by what verification has shown, recalibrate)."""
        prev = torch.cat([self.rows.last()[:, None], toks[:, :-1]], 1)
        z = h @ self.conf_h + self.conf_code[prev]  # (B, K) confidence logits
        a = torch.sigmoid(z / self.conf_temp[:z.size(1)]).cumprod(1)
        return a.to("cpu", torch.float64).numpy(), np.array(ks)  # host sync

    def recalibrate(self, row):
        """row: survivals (A, L) as survival() gives them -> the same, recalibrated."""
        """a_j times the ratio of survivals seen to survivals predicted at position j, so far
        (kept non-increasing in j, at most 1). Why: the confidence head is calibrated on held-out
        training windows, and on other text it can be far off (on short prompts it predicted
        a_5 = 0.39 where 0.16 survived, docs/experiments.md: Batched: online recalibration),
        and every rule here spends the budget by these numbers. The ratio comes from earlier
        rounds only, so a round's choice never depends on its own outcome."""
        A, L = row
        seen, said = self.calibration[:, :A.shape[1]]
        # a prior of CALIBRATION_PRIOR rounds at the head's own word: thin evidence moves the
        # estimate little
        ratio = (seen + CALIBRATION_PRIOR) / (said + CALIBRATION_PRIOR)
        return np.minimum.accumulate(np.minimum(A * ratio, 1.0), axis=1), L

    def observe(self, lengths, a, kept, decay=0.98):
        """After a verify: which verified drafts survived (row r kept kept[r] - 1 of its
        lengths[r]), against the survivals a it was predicted (before recalibration)."""
        A, _ = a
        j = np.arange(A.shape[1])[None, :]
        verified = j < np.asarray(lengths)[:, None]
        survived = verified & (j < np.asarray(kept)[:, None] - 1)
        cal = self.calibration[:, :A.shape[1]]
        cal *= decay
        cal[0] += survived.sum(0)
        cal[1] += (A * verified).sum(0)

    @torch.inference_mode()
    def propose(self, ks, sampler):
        now, B = time.perf_counter(), len(ks)
        base = sum(k > 0 for k in ks)
        cost, t_draft = self.costs.get(B, (None, None))
        self.measure(now, cost, t_draft, B)
        if self.schedule == "budget" and self.estimate is not None:
            ks = self.planned(ks, base, cost, t_draft, B)
            self.batch_rounds += 1
            if not any(ks):  # the cost table says no draft pays: a plain step, not even drafted
                self.rounds, self.skipped = self.rounds + 1, self.skipped + 1
                self.skipped_in_batch += 1
                self._last = (now, time.perf_counter() - now, 0, base)
                return self.rows.toks[:, :0], [0] * B, None
        elif self.schedule == "budget":  # no estimate yet: a probe, cut by Algorithm 1, as wide as
            # the last plan at this batch size (new requests, but the same cost table)
            ks = [min(k, max(PROBE_WIDTH, self.adapt[B]["width"])) for k in ks]
        toks, q, h = self.draft(ks, sampler)
        lengths = list(ks) if self.schedule == "full" else self.choose(h, toks, ks, base, cost,
                                                                        t_draft, B)
        L = max(lengths)
        self.rounds += 1
        self._last = (now, time.perf_counter() - now, sum(k + 1 for k in ks if k),
                      base + sum(lengths))
        return toks[:, :L], lengths, (q[:, :L] if q is not None else None)

    def choose(self, h, toks, ks, base, cost, t_draft, B):
        """After drafting: every row's survivals (one host read), then the rule -> lengths."""
        raw = self.survival(h, toks, ks)
        a = self.recalibrate(raw)
        # the draft is spent already: t_fixed only scales theta
        t_fixed = self.adapt[B]["scale"] * float(t_draft(sum(k + 1 for k in ks if k)))
        t_fixed += self.adapt[B]["rest"][1]
        if self.schedule == "auto" or (self.schedule == "budget" and self.estimate is None):
            lengths = admit_batch(a, base, t_fixed, cost)
        elif self.schedule == "goodput":
            lengths = best_single_k(a, base, t_fixed, cost)
        else:
            lengths = fill_budget(a, self.budget_k)
        # a row that drafted nothing this round keeps its last estimate
        A, L = a
        A = np.pad(A, ((0, 0), (0, self.max_k - A.shape[1])))
        if self.estimate is not None:
            A = np.where(L[:, None] > 0, A, self.estimate[0])
            L = np.where(L > 0, L, self.estimate[1])
        self.estimate = (A, L)
        self._scored = (raw, lengths)  # observe() compares them with what survives
        return lengths

    @torch.inference_mode()
    def commit(self, kept, new, hidden):
        if self._scored is not None:
            self.observe(self._scored[1], self._scored[0], kept)
            self._scored = None
        super().commit(kept, new, hidden)

    def planned(self, ks, base, cost, t_draft, B):
        """budget: this round's K from last round's survivals (plan_budget) -> what each row
        drafts (the plan's width, or 0). A row's estimate is its last scored one. While K stays
        0, every SCORE_EVERY-th round drafts every row anyway (scored by Algorithm 1), so the
        estimates stay fresh."""
        ad = self.adapt[B]
        pending = sum(s - n for s, n in zip(self.n_states, self.n_ctx))  # a draft flushes these
        key = (id(self.estimate), base, tuple(ks), pending // (8 * B))
        if self._plan is None or self._plan[0] != key or self._plan[1][0]:
            A, L = self.estimate
            est = (A, np.minimum(L, ks))
            flush = pending * self.flush_cost.get(B, 0.0)
            # (a plan of no draft is kept while nothing it depends on moves: a skipped round
            # changes no estimate, so the same search would give the same answer)
            self._plan = (key, plan_budget(est, base, lambda n: ad["scale"] * t_draft(n) + flush,
                                           ad["rest"], cost, sum(ks), PLAN_MARGIN))
        self.budget_k, width, rows = self._plan[1]
        if self.budget_k == 0:
            self.idle += 1
            if self.idle < ad["wait"]:
                return [0] * len(ks)
            # a probe round, scored by Algorithm 1; while probes keep finding that drafting does
            # not pay, each waits twice as long as the last (a probe costs a draft and the
            # context of every skipped round)
            self.estimate, self.idle, ad["wait"] = None, 0, min(2 * ad["wait"], MAX_WAIT)
            return [min(k, PROBE_WIDTH) for k in ks]
        self.idle, ad["wait"], ad["width"] = 0, SCORE_EVERY, width
        # one slot past the plan: the fresh confidences pick which K tokens fill the budget, and
        # the plan can grow a position a round where it pays
        return [min(k, width + 1) if on else 0 for k, on in zip(ks, rows)]

    def measure(self, now, cost, t_draft, B, rate=0.3):
        """What the tables miss, measured as the rounds run (running averages, per batch size:
        they describe the machine, not the text). scale: a draft in the loop over the profiled
        t_draft (inside the loop the target's forward evicts the drafter's weights from the
        cache, and scoring and choosing add to it). rest[0] / rest[1]: the rest of a round
        without / with a draft, apart from its propose and its verify as the table prices it
        (commit, the loop; a round without a draft also its planning)."""
        if cost is None:
            return
        ad = self.adapt[B]
        if self._last is not None:
            start, spent, slots, n = self._last
            if slots:
                ad["scale"] += rate * (spent / float(t_draft(slots)) - ad["scale"])
                rest = now - start - float(cost(n)) - spent
            else:
                rest = now - start - float(cost(n))
            ad["rest"][int(slots > 0)] += rate * (max(0.0, rest) - ad["rest"][int(slots > 0)])


# -----------------------------------------------------------------------------
# how it learns (2): train.py runs train_dspark(trainer) as its "dspark" stage. The backbone
# takes DFlash's shape and text (the --dflash-* settings) and, by default, starts from DFlash's
# own training where it branched (draft_dflash.branch_step); then DSpark's own steps, the
# calibration of its confidences, and its weights for sampling.

SETTINGS = {
    "dspark_rank": setting(256, "dspark: rank r of the Markov head W1[x] W2 (the paper's 256)",
                           tiny=8),
    "dspark_iters": setting(1000, "dspark: optimizer steps of its own", cuda=2000, gpt2=4000,
                            quick=150, tiny=8),
    "dspark_lr": setting(2e-3, "dspark: peak learning rate", cuda=1e-3, tiny=3e-3),
    "dspark_init": setting("dflash", "dspark: 'dflash' (the backbone starts from DFlash's own "
                           "training dspark_iters steps before its end, so both drafters get "
                           "the same number of steps) or 'scratch'", choices=["dflash", "scratch"]),
    "dspark_calib_seqs": setting(32, "dspark: held-out target continuations for the confidence "
                                 "calibration (0: none)", type=number(int, 0),
                                 cuda=256, quick=16, tiny=4),
    "dspark_sampled_iters": setting(400, "dspark: steps of its sampling weights, a copy "
                                    "fine-tuned on the sampled share of the distillation set, "
                                    "which bench.py and speculative.py draft with when sampling "
                                    "(0: none)", type=number(int, 0), cuda=800, quick=50, tiny=4),
    "dspark_sampled_block": setting(5, "dspark: the block those steps train, anchor included "
                                    "(what a sampled round drafts is its first slots)",
                                    type=number(int, 2), tiny=3),
    "dspark_sampled_anchors": setting(16, "dspark: anchors per sequence in those steps",
                                      cuda=32, tiny=4),
}


def phases(a):
    """The train_loop phases this stage runs: (name, steps). Checks the settings too."""
    if a.dspark_sampled_iters and a.dspark_sampled_block > a.dflash_block:
        raise ValueError(f"--dspark-sampled-block ({a.dspark_sampled_block}) must be at most "
                         f"--dflash-block ({a.dflash_block})")
    draft_dflash.check_anchors(a, a.dflash_block, a.dflash_anchors, "--dflash-anchors")
    if a.dspark_sampled_iters:
        draft_dflash.check_anchors(a, a.dspark_sampled_block, a.dspark_sampled_anchors,
                                   "--dspark-sampled-anchors")
    out = [("dspark", a.dspark_iters)]
    return out + ([("dspark-sampled", a.dspark_sampled_iters)] if a.dspark_sampled_iters else [])


def train_dspark(tr):
    """The backbone (from DFlash's branch), the Markov and confidence heads, then calibration and
    the sampling weights -> out/dspark.pt."""
    a = tr.args
    target, target_ckpt = tr.target()
    backbone_cfg = network_config(a, target.config)
    cfg = DSparkConfig(rank=a.dspark_rank)
    torch.manual_seed(a.seed + 4)
    net = DSpark(backbone_cfg, cfg, target).to(tr.device)
    n_params = sum(p.numel() for p in net.parameters())
    print(f"dspark: {n_params / 1e6:.2f}M trainable parameters, {backbone_cfg}, {cfg}")
    init_budget = None
    if a.dspark_init == "dflash":  # warm start: DFlash's network is exactly DSpark's backbone
        state, init_budget = start_from_dflash(tr, backbone_cfg)
        net.backbone.load_narrower(state)  # a branch from the narrow phase: widened
    batches = tr.distill.batches(a.dflash_text)

    def loss_of(x, t_logits, hid, step):
        batch = anchored(tr, x, t_logits, hid, step, backbone_cfg, a.dflash_anchors)
        return dspark_loss(net, *batch, a.dflash_gamma)

    fingerprint = {"stage": "dspark", "backbone": backbone_cfg.to_dict(), "config": cfg.to_dict(),
                   "target": target_ckpt["model_hash"], "init": a.dspark_init,
                   "iters": a.dspark_iters, "lr": a.dspark_lr, "text": a.dflash_text,
                   "gen": tr.distill.key(a.dflash_text),
                   "anchors": a.dflash_anchors, "gamma": a.dflash_gamma, "seed": a.seed,
                   "init_budget": init_budget}
    tune = sampling_weights_wanted(tr)
    # keep_resume: a run stopped in the sampling steps that follow does not redo these
    val, _ = tr.fit("dspark", net, lambda s: loss_of(*batches(s), s),
                    lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                    steps=a.dspark_iters, lr=a.dspark_lr, fingerprint=fingerprint,
                    tokens_per_step=a.batch_size * a.dflash_anchors * backbone_cfg.block,
                    keep_resume=tune)
    extra = {"val_loss": val, "text": a.dflash_text, "init_budget": init_budget}
    if a.dspark_calib_seqs > 0:
        extra["ece_before"], extra["ece_after"] = calibrate_on_held_out(tr, net, backbone_cfg)
    budget = tr.budget()  # DSpark's own: it ends here, before the sampling weights
    if tune:
        extra["sampled"] = sampling_weights(tr, net, fingerprint)
    config = {"backbone": backbone_cfg.to_dict(), "dspark": cfg.to_dict()}
    tr.save("dspark", config, net, extra, budget=budget)
    return val


def start_from_dflash(tr, backbone_cfg):
    """--dspark-init dflash: DSpark's backbone weights and the budget they cost, from DFlash's
    branch (out/dflash.branch.pt, see draft_dflash.branch_step) or, without one, its final
    out/dflash.pt."""
    a = tr.args
    dfl = load_checkpoint(tr.path("dflash"), "dflash")
    same_target = dfl.get("target_hash") == tr.target()[1]["model_hash"]
    if not same_target or dfl["config"] != backbone_cfg.to_dict():
        raise ValueError(f"--dspark-init dflash needs {tr.path('dflash')} trained on this "
                         "target with the same --dflash-* shape: run "
                         "`python train.py --only dflash` first, or use --dspark-init scratch")
    branch = (dfl.get("fingerprint") or {}).get("branch")
    if branch is None:
        print(f"dspark: backbone initialised from {tr.path('dflash')} (its final weights)")
        return dfl["state_dict"], dfl.get("budget")
    br = load_checkpoint(tr.path("dflash.branch"), "dflash-branch", "dflash")
    if br.get("fingerprint") != dfl["fingerprint"]:
        raise ValueError(f"{tr.path('dflash.branch')} is not from the run that wrote "
                         f"{tr.path('dflash')}: run `python train.py --only dflash --force`")
    if branch != draft_dflash.branch_step(a):
        print(f"dspark: note: DFlash branched at step {branch}, not at DFlash's steps - "
              f"--dspark-iters = {draft_dflash.total_steps(a) - a.dspark_iters}: the budgets "
              "differ (retrain dflash to match them)")
    print(f"dspark: backbone initialised from DFlash's state at step {branch} "
          f"({tr.path('dflash.branch')})")
    return br["state_dict"], br["budget"]


def calibrate_on_held_out(tr, net, backbone_cfg):
    """calibrate() on held-out text: the target's own greedy continuations of validation
    prompts, with 4x the training anchors a sequence (the late positions are fitted only on
    blocks that got that far). -> ECE before, after."""
    a = tr.args
    held = tr.distill.write(a.dspark_calib_seqs, 0, "val")
    n_anchors = min(4 * a.dflash_anchors, held.size(1) - backbone_cfg.block - backbone_cfg.shift)
    held = [held[i:i + a.batch_size] for i in range(0, len(held), a.batch_size)]
    # a generator, not a list: one batch's target logits at a time (they are large at scale)
    batches = (anchored(tr, x, *tr.distill.features(x), -1 - i, backbone_cfg, n_anchors)
               for i, x in enumerate(held))
    before, after = calibrate(net, batches)
    print(f"dspark: confidence ECE (teacher-forced, held-out, drafts whose prefix matched) "
          f"{before:.3f} before calibration, {after:.3f} after; per-position temperatures "
          f"{[round(t, 2) for t in net.conf_temp.tolist()]}")
    return before, after


def sampling_weights_wanted(tr):
    """Whether DSpark gets sampling weights: --dspark-sampled-iters, and sampled text to learn."""
    a = tr.args
    if not a.dspark_sampled_iters:
        return False
    if a.dflash_text != "gen" or tr.distill.settings()["sampled"] == 0:
        print("dspark: no sampling weights (they learn from the sampled share of the distillation "
              "set: --dflash-text gen and --gen-sampled > 0)")
        return False
    return True


def sampling_weights(tr, net, fingerprint):
    """DSpark's weights for sampling: a copy of the trained network, fine-tuned on the sampled
    share of the distillation set only, and only on a block's first slots (the anchor and
    --dspark-sampled-block - 1 masks), what a sampled round drafts. Why a copy: DSpark's own
    steps learn from the set as it is (mostly greedy text), and more sampled text there trades
    greedy tau for sampled tau; a copy serves each mode (docs/experiments.md: DSpark:
    sampling weights). The later slots keep their weights, so any k still drafts. -> the 'sampled' entry
    of out/dspark.pt (speculative.load_drafter reads it)."""
    a = tr.args
    t0 = time.time()
    tuned = DSpark(net.backbone.config, net.config, tr.target()[0]).to(tr.device)
    tuned.load_state_dict(net.state_dict())  # the calibrated confidence temperatures too
    narrow = dataclasses.replace(net.backbone.config, block=a.dspark_sampled_block)
    batches = tr.distill.batches("gen", sampled_only=True)

    def loss_of(x, t_logits, hid, step):
        batch = anchored(tr, x, t_logits, hid, step, narrow, a.dspark_sampled_anchors)
        return dspark_loss(tuned, *batch, a.dflash_gamma, block=narrow.block)

    fingerprint = {**fingerprint, "sampled": [a.dspark_sampled_iters, a.dspark_sampled_block,
                                              a.dspark_sampled_anchors]}
    val, _ = tr.fit("dspark-sampled", tuned, lambda s: loss_of(*batches(s), s),
                    lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                    steps=a.dspark_sampled_iters, lr=a.dspark_lr, fingerprint=fingerprint,
                    tokens_per_step=a.batch_size * a.dspark_sampled_anchors * narrow.block)
    return {"state_dict": cpu_state_dict(tuned), "val_loss": val, "block": narrow.block,
            "budget": {"steps": a.dspark_sampled_iters, "seconds": round(time.time() - t0)}}
