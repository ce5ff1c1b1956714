"""
draft_hybrid.py -- one drafter that copies when the text repeats and drafts when it does not.

draft_lookup.py drafts for free, and only as well as the text repeats itself; draft_dspark.py
(or any learned drafter) drafts well everywhere, for a forward a round. Each loses where the
other wins: greedy code that loops favours the copy, sampling favours the network. Serving
systems pick one per round (Arctic Inference: the suffix draft when its score reaches the
speculator's length; SAM-Decoding: by match length; vLLM: n-gram, then EAGLE). This file adds
that choice, made each round before anything is drafted, from what is known for free:

  m       how many tokens at the end of the text match where the lookup copies from (0: no
          match at all); a long match is a repeat in progress.
  record  per bucket of m and per draft position, how often each drafter's draft survived
          there. The lookup's record grows every round, also when it did not draft: its draft
          costs nothing to make, and the target's own tokens show what it would have kept.
  costs   what each drafter's round costs besides its verify (drafting, committing, the loop)
          and the verify by length, both timed as the loop runs (Costs).

The rule: for each drafter and each length k, the round's expected tokens less what its
seconds are worth at the speed decoding already runs (θ, the recent tokens per second),
1 + a_1 + ... + a_k − θ · (round + verify(k + 1)), with a_j the recorded prefix survival;
verify the best pair. A draft grows while its next token pays for the verify time it adds, and
the learned drafter drafts where its round is worth more than a copy or a plain step at that
speed. (DSpark's own rule, the round's tokens per second, drafted too long here: a long draft
lifts a poor round and costs the run; docs/experiments.md: Hybrid: the rule.) It picks the
lookup's length too, which a fixed k cannot. With sampling the lookup's record falls, and the
rule stays with the learned drafter.

The learned drafter stays in sync on rounds it does not draft: the target's states of those
rounds are kept and handed over in one catch_up before it drafts again (DSpark projects them
into its context in one product), and that cost is in its round's measured cost.

    python bench.py --methods ar,lookup,dspark,hybrid    # the rule beside fixed choices
"""

import time

import numpy as np
import torch

from draft_lookup import LookupDrafter
from speculative import Drafter, k_for
from tree import agreed

# -----------------------------------------------------------------------------
# the record: how each drafter's drafts fared, by the lookup's match length

# the buckets of the match length m: 0 (no match), 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16 and more
EDGES = (1, 2, 3, 4, 6, 8, 12, 16)
MATCH_CAP = EDGES[-1]  # match lengths are counted up to here
# the longest lookup draft the rule may verify: a repeat in progress keeps on repeating, and the
# lookup's fixed k = 10 cut most of them short (docs/experiments.md: Hybrid: the rule)
LOOKUP_MAX = 32
PRIOR = 4.0  # pseudo-rounds: a bucket starts at the pooled estimate, the pooled one at `start`
FORGET = 0.98  # the verify fit's memory, per round: it follows a machine whose speed drifts
RATE = 0.1     # how fast a round's measured overhead moves its drafter's running average
# the learned drafter's record grows only on rounds it drafts, so one unlucky start could keep it
# out of a bucket for good: after EXPLORE rounds there without it, it drafts once regardless, and
# then ever more rarely as its record there fills (one in EXPLORE times its rounds there over
# PRIOR): exploring every 16th round for good cost the greedy run where the lookup was the right
# choice (docs/experiments.md: Hybrid: the rule)
EXPLORE = 16


def bucket(m):
    return BUCKET_OF[min(m, MATCH_CAP)]


BUCKET_OF = [int(np.searchsorted(EDGES, m, side="right")) for m in range(MATCH_CAP + 1)]


class Record:
    """Per bucket b and draft position j: the rounds in which j was tried (every draft before it
    survived and j's fate is known) and those in which it survived too. survival(b, k) is the
    estimated prefix survival a_1..a_k: each position's share kept, shrunk towards that position
    over all buckets (PRIOR pseudo-rounds), which is shrunk towards `start`. Plain lists: these
    run every round on a few dozen numbers, where numpy's per-call cost was most of the time."""

    def __init__(self, depth, start):
        # row b per bucket, the last row pooled over all of them
        self.tried = [[0.0] * depth for _ in range(len(EDGES) + 2)]
        self.kept = [[0.0] * depth for _ in range(len(EDGES) + 2)]
        self.start = start

    def observe(self, b, kept, tried):
        for row in (b, -1):
            t, k = self.tried[row], self.kept[row]
            for j in range(tried):
                t[j] += 1.0
            for j in range(kept):
                k[j] += 1.0

    def survival(self, b, k):
        out, a = [], 1.0
        kp, tp, kb, tb = self.kept[-1], self.tried[-1], self.kept[b], self.tried[b]
        start = self.start
        for j in range(k):
            pooled = (kp[j] + PRIOR * start) / (tp[j] + PRIOR)
            a *= (kb[j] + PRIOR * pooled) / (tb[j] + PRIOR)
            out.append(a)
        return out


def outcome(draft, ids):
    """(kept, tried) for a draft against the tokens the round confirmed: kept = how many of its
    first tokens equal them; tried = kept + 1 where the next one is known to differ, else kept."""
    kept = agreed(draft, ids)
    return kept, kept + (kept < min(len(draft), len(ids)))


class Costs:
    """What a round costs: c[who] + verify(m) for a verify of m tokens. verify(m) = alpha + beta*m,
    fitted by least squares to the verifies as they run in the loop (from the draft's return to
    its commit), the data forgotten at FORGET a round and held by a pseudo-round at each end of
    the start-up profile. Why not the profile itself: timed alone, on a machine whose speed
    drifts, a forward's cost by length came out too flat or too steep from one run to the next;
    inside the loop it was a line (docs/experiments.md: Hybrid: costs). c[who]: the rest of that
    drafter's rounds (drafting, commits, the loop), a running average."""

    def __init__(self, t_verify, start):
        m_max = len(t_verify) - 1
        # the normal equations of the line through (m, seconds), as sums of 1, m, m^2, seconds,
        # m * seconds: one pseudo-round at each end of the profile, enough to hold the line before
        # the loop has timed two lengths, little against the ~50 rounds FORGET keeps
        self.prior = [2.0, 1.0 + m_max, 1.0 + m_max ** 2, t_verify[1] + t_verify[m_max],
                      t_verify[1] + m_max * t_verify[m_max]]
        self.data = [0.0] * 5
        self.fit()
        self.c = dict(start)
        self.tokens, self.seconds = 0.0, 0.0

    def fit(self):
        n, sm, smm, st, smt = (p + d for p, d in zip(self.prior, self.data))
        det = n * smm - sm * sm
        self.alpha, self.beta = (smm * st - sm * smt) / det, (n * smt - sm * st) / det

    def observe_verify(self, m, seconds):
        self.data = [FORGET * d + x for d, x in zip(self.data, (1.0, m, m * m, seconds,
                                                               m * seconds))]
        self.fit()

    def observe_round(self, who, seconds, verify_seconds, tokens):
        self.c[who] += RATE * (max(0.0, seconds - verify_seconds) - self.c[who])
        self.tokens = FORGET * self.tokens + tokens
        self.seconds = FORGET * self.seconds + seconds

    def rate(self):
        """Tokens per second over the recent rounds (0 before any: then a draft is as long as
        it is expected to pay in tokens alone)."""
        return self.tokens / self.seconds if self.seconds else 0.0

    def fixed(self, who):
        return self.c[who]

    def verify(self, m):
        return self.alpha + self.beta * m


def best_round(survival, fixed, cost, rate, least=0):
    """(value, k): the k >= least that maximises a round's expected tokens less what its seconds
    are worth at `rate` (tokens per second), and that value. A draft grows while its next token
    is expected to pay for the verify time it adds at the speed decoding already runs.
    (Maximising the round's own tokens per second instead drafted too long, and chose the
    learned drafter where its round beat a plain step but cost the run: docs/experiments.md:
    Hybrid: the rule.) survival: a_1..a_K; cost: Costs (fixed + cost.verify(k + 1) seconds)."""
    best, tokens = None, 1.0
    for k in range(len(survival) + 1):
        if k:
            tokens += survival[k - 1]
        if k >= least:
            value = tokens - rate * (fixed + cost.verify(k + 1))
            if best is None or value > best[0]:
                best = (value, k)
    return best


# -----------------------------------------------------------------------------
# the drafter


class HybridDrafter(Drafter):
    """Prompt lookup and a learned drafter behind one interface, each round's drafter and length
    chosen by the rule above over `choices` (both drafters; bench's ablation weighs the lookup
    alone, to show how much of the gain the rule's length brings).
    Its costs: use_costs(t_verify, the learned drafter's round), as runtime/profiling.py measures
    them on the device in use; then the rounds fit them as they run. Until then no device was
    measured: every round costs the same and the rule weighs expected tokens alone (t_verify and
    start_cost may be set by hand, then reset_record(), as the tests do).

    A round on its own, run as written (tests/test_layout.py runs every example of the lesson):
    a tiny random target in float64, and DFlash as the learned half.

        >>> from gpt import GPT, GPTConfig
        >>> from draft_dflash import DFlash, DFlashConfig, DFlashDrafter
        >>> from sampler import Sampler
        >>> from speculative import generate_plain, generate_speculative
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> cfg = DFlashConfig(n_embd=32, n_head=2, taps=[1, 2], block=8)
        >>> drafter = HybridDrafter(DFlashDrafter(DFlash(cfg, target).double().eval()), target)
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_speculative(target, drafter, prompt, 12, 4, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    name = "hybrid"
    default_k = LOOKUP_MAX  # the most a round verifies; each drafter is capped at its own below
    choices = ("lookup", "learned")  # what the rule weighs

    def __init__(self, learned, target):
        self.lookup = LookupDrafter(target.config.vocab_size)
        self.learned, self.target = learned, target
        self.hidden_layers = learned.hidden_layers
        self.depth = learned.max_k or max(learned.default_k, LOOKUP_MAX)
        # no costs: a verify of any length costs 1, drafting nothing (no device measured)
        self.t_verify = [0.0] + [1.0] * (LOOKUP_MAX + 1)
        self.start_cost = {"lookup": 0.0, "learned": 0.0}
        self.measure = False  # fit the costs to the rounds as they run (use_costs())
        # the tokens and target states the learned drafter has not seen yet (miss), copied into
        # buffers made once: kept as views of each verify's output, they made every forward
        # allocate afresh, which cost more than the copy. Shared by bench's copies, which run
        # one after another, each from begin()
        tc, w = target.config, target.lm_head.weight
        self.missed = {t: torch.empty(1, tc.sequence_len, tc.n_embd, device=w.device, dtype=w.dtype)
                       for t in self.hidden_layers}
        self.missed_ids = torch.empty(tc.sequence_len, dtype=torch.long, device=w.device)
        self.reset_record()

    def use_costs(self, t_verify, t_learned):
        """Start from costs measured on the device in use (runtime/profiling.py): t_verify[m], the
        seconds of an m-token verify, and t_learned, the learned drafter's round; then fit them
        to the rounds as they run."""
        self.t_verify, self.start_cost["learned"] = t_verify, t_learned
        self.measure = True
        self.reset_record()

    def reset_record(self):
        """A fresh record and cost account (a new drafter, each of bench's copies).
        The lookup's record starts at even odds; the learned drafter's optimistic, so that it is
        tried before the record is trusted (its record grows only on rounds it drafts)."""
        self.record = {"lookup": Record(LOOKUP_MAX + 1, 0.5), "learned": Record(self.depth, 0.9)}
        self.cost = Costs(self.t_verify, self.start_cost)
        self.rounds = {"lookup": 0, "learned": 0}
        self.since = [0] * (len(EDGES) + 1)  # per bucket: rounds since the learned one drafted

    def begin(self, tokens, hidden):
        self.lookup.begin(tokens, hidden)
        self.learned.begin(tokens, hidden)
        self.last, self.n_missed = None, 0

    def miss(self, new, hidden):
        """Keep a round's tokens and states for the learned drafter, which did not draft it."""
        r, m = self.n_missed, new.numel()
        self.missed_ids[r:r + m] = new
        for t in self.hidden_layers:
            self.missed[t][:, r:r + m] = hidden[t]
        self.n_missed += m

    @torch.inference_mode()
    def propose(self, k, sampler):
        now = time.perf_counter()
        self.account(now)
        j = self.lookup.match()
        m = self.lookup.match_length(j, MATCH_CAP) if j is not None else 0
        copied = self.lookup.copy(j, min(k, LOOKUP_MAX)) if j is not None else []
        k_learned = min(k, k_for(self.learned, sampler.mode), self.depth)
        self.now = {"bucket": bucket(m), "copied": copied}
        who, n = self.choose(m, copied, k_learned, sampler)
        draft = self.make_draft(who, n, copied, sampler)
        self.now["who"] = who
        self.rounds[who] += 1
        self.last = {"start": now, "who": who, "drafted": draft[0].numel(),
                     "proposed": time.perf_counter()}
        return draft

    def choose(self, m, copied, k_learned, sampler):
        """(who drafts, how many) under the rule above."""
        b, rate = self.now["bucket"], self.cost.rate()
        longest = {"lookup": (len(copied), 0), "learned": (k_learned, 1)}  # (k at most, at least)
        options = {w: best_round(self.record[w].survival(b, longest[w][0]), self.cost.fixed(w),
                                 self.cost, rate, longest[w][1]) for w in self.choices}
        seen = self.record["learned"].tried[b][0]  # rounds it drafted in this bucket
        if "learned" in options and self.since[b] >= EXPLORE * max(1.0, seen / PRIOR):
            return "learned", options["learned"][1]
        who = max(options, key=lambda w: options[w][0])
        return who, options[who][1]

    def make_draft(self, who, n, copied, sampler):
        """The round's draft: n tokens of the lookup's copy, or of the learned drafter's."""
        if who == "lookup":
            return self.lookup.as_draft(copied[:n], sampler)
        return self.draft_learned(n, sampler)

    def draft_learned(self, k, sampler):
        """The learned drafter's draft, after it has caught up on the rounds it missed."""
        n = self.n_missed
        if n:  # the buffers are views: the drafter copies what it keeps, as from commit's
            self.learned.catch_up(self.missed_ids[:n],
                                  {t: h[:, :n] for t, h in self.missed.items()})
            self.n_missed = 0
        return self.learned.propose(k, sampler)

    def account(self, now):
        """As a round starts: the previous round's seconds (start to start), less its verify, go
        to its drafter's overhead."""
        last = self.last
        if last is not None and self.measure:
            self.cost.observe_round(last["who"], now - last["start"], last["verify"],
                                    last["tokens"])

    @torch.inference_mode()
    def commit(self, n, new, hidden):
        last = self.last
        last["verify"], last["tokens"] = time.perf_counter() - last["proposed"], n + 1
        if self.measure:  # the verify just ran: its seconds by its length
            self.cost.observe_verify(last["drafted"] + 1, last["verify"])
        ids, now = new.tolist(), self.now
        if now["copied"]:  # what the lookup kept or would have kept: known whoever drafted
            self.record["lookup"].observe(now["bucket"], *outcome(now["copied"], ids))
        b = now["bucket"]
        self.since[b] = 0 if now["who"] == "learned" else self.since[b] + 1
        if now["who"] == "learned":
            self.record["learned"].observe(b, n, min(last["drafted"], n + 1))
            self.learned.commit(n, new, hidden)
        else:
            self.miss(new, hidden)
        self.lookup.extend(ids)

    @property
    def lookup_share(self):
        """The share of rounds the lookup drafted."""
        return self.rounds["lookup"] / max(1, sum(self.rounds.values()))


# -----------------------------------------------------------------------------
# declared once: what the house reads of this file (registry/drafters.py lists it). No network of
# its own: it is built around a learned drafter, DSpark unless told (--hybrid-with), and loads
# that one's checkpoint.

DRAFTER = dict(name="hybrid", drafter=HybridDrafter, partner="dspark")
