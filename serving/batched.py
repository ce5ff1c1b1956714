"""
serving/batched.py -- many requests at once: plain decoding and the draft-then-verify loop over a
batch.

speculative.py decoded one sequence; this file adds what serving needs: B prompts of different
lengths decoded together, every target forward shared by all of them. Each row keeps its own
length in one static cache (ragged.RaggedCache), its own positions, its own accepted count every
round and its own O(1) rollback; the mask is built from positions, so padding and stale K/V of
a row always sit past every valid query of that row (ragged.Ragged). A verify runs its Linears and
MLP on the real tokens only, packed, and pads only the attention: its cost follows the total
number of tokens, which is what a serving engine budgets.

What changes with load: at batch 1 a 16-token verify costs little more than a 1-token step, so
drafting long always pays. At batch 32 the same verify is a 512-token forward and costs several
times a plain batched step: a fixed draft length turns into a slowdown. DSpark's scheduler
(serving.dflash.BatchDSpark, with serving/rules.py) spends one verify budget over the whole batch
instead. A drafter drafts a batch itself (speculative.Drafter's batch calls), or through a
twin (serving/dflash.py).

Rows are exact one by one: greedy and coupled sampling give each row the tokens its own batch-1
decoding gives (the coupled noise is keyed on the row's own seed and absolute positions);
rejection sampling gives each row the target's distribution, from the row's own generator.

    python bench.py --batch-size 1,4,16,32     # the serving sweep: every method, batched
"""

import time

import torch

import ragged
from speculative import (Stats, check_k, generate_plain, generate_speculative,
                         tokens_allowed, until_stop)

# -----------------------------------------------------------------------------
# plain batched decoding: the baseline at batch B


def check_prompts(model, prompts, max_new_tokens):
    """How many tokens each row may generate (speculative.tokens_allowed per row): one clear
    ValueError naming the row for an empty or over-long prompt, or an empty batch."""
    if len(prompts) == 0:
        raise ValueError("the batch is empty: give at least one prompt")
    allowed = []
    for r, p in enumerate(prompts):
        try:
            allowed.append(tokens_allowed(model, len(p), max_new_tokens))
        except ValueError as e:
            raise ValueError(f"prompt {r} of the batch: {e}") from None
    return allowed


def padded(rows, device, width=None):
    """A list of token lists -> (B, width) long tensor, zeros after each row's end."""
    width = width or max(len(r) for r in rows)
    x = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        x[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
    return x.to(device)


@torch.inference_mode()
def generate_plain_batched(model, prompts, max_new_tokens, sampler, cache=None, stats=None,
                           stop=()):
    """Token-by-token decoding of B prompts at once: one ragged prefill, then one (B, 1) forward
    a step. A row that has all its tokens gets zero tokens (its slot is padding, packed away).
    No host sync until the end (but a read of each step's tokens where `stop` ends a row, as in
    generate_plain). Returns one token list per row. stats: a BatchStats to count the steps in."""
    dev = model.lm_head.weight.device
    allowed = check_prompts(model, prompts, max_new_tokens)
    if len(prompts) == 1:  # one request: the batch-1 loop's own path (generate_batched's reason)
        out = generate_plain(model, prompts[0], max_new_tokens, sampler.row(0), stop=stop)
        if stats is not None:
            for _ in range(len(out) - 1):  # one plain step a token after the prefill's
                stats.record_plain(1)
        return [out]
    P = [len(p) for p in prompts]
    cache = cache or ragged.new_cache(model, len(prompts))
    cache.reset()
    logits = ragged.forward(model, padded(prompts, dev), cache, P, last_only=True)[0]  # (B, 1, V)
    first = sampler.first_token(logits, P)  # (B, 1)
    firsts = first[:, 0].tolist()
    allowed = [1 if t in stop else a for t, a in zip(firsts, allowed)]  # ended at its first
    rest = plain_steps(model, cache, first[:, 0], [1] * len(P), allowed, P, sampler, stats, stop)
    return [[t] + r for t, r in zip(firsts, rest)]


def plain_steps(model, cache, last, done, allowed, P, sampler, stats=None, stop=()):
    """Plain decoding of every row to its end: row r has done[r] of its allowed[r] tokens, the
    last of them, last[r], not yet in the cache; its next token sits at position P[r] + done[r].
    One (B, 1) forward a step, a row with all its tokens getting zero. No host sync until the
    end, unless `stop` ends rows: then each step's tokens are read back, and a row that wrote a
    stop token has all its tokens. Returns each row's new tokens. stats: a BatchStats to count
    the steps in (a round each, nothing drafted)."""
    B, steps, allowed = len(done), max(a - d for a, d in zip(allowed, done)), list(allowed)
    out = torch.empty(B, max(steps, 0), dtype=torch.long, device=last.device)
    x = last[:, None]
    for i in range(steps):
        counts = [1 if d + i < a else 0 for d, a in zip(done, allowed)]
        if not any(counts):  # every row stopped
            break
        logits = ragged.forward(model, x, cache, counts)[0]  # (B, 1, V)
        x = out[:, i:i + 1] = sampler.pick(logits, [p + d + i for p, d in zip(P, done)])
        if stats is not None:
            stats.record_plain(sum(counts))
        if stop:  # a host read a step
            for r, t in enumerate(x[:, 0].tolist()):
                if counts[r] and t in stop:
                    allowed[r] = done[r] + i + 1
    rows = out.tolist()  # host sync (the only one)
    return [row[:a - d] for row, a, d in zip(rows, allowed, done)]


# -----------------------------------------------------------------------------
# the batched drafter interface


class BatchDrafter:
    """A batched twin: a lesson drafter's batch calls (speculative.Drafter's begin_batch,
    propose_batch, commit_batch), written here until its lesson file drafts a batch itself, and
    what a serving rule adds:

    plain_batch(B)             asked before each batch of B rows: True decodes it on plain
                               decoding's own path, start to end (BatchDSpark's measured rule,
                               where no draft pays); the drafter then sees nothing of it but
                               timed_plain(B, steps, seconds), the plain steps' time.
    one_request()              the drafter that decodes a batch of one: the lesson's own.
    """
    name = "drafter"
    hidden_layers = ()
    max_k = None
    default_k = 4
    sampled_k = None
    budget = []

    def __init__(self, drafter):
        """The batched twin of the batch-1 `drafter`: it drafts what that one would, so it takes
        its name, the target layers it reads, its k and its training record."""
        for name in ("name", "hidden_layers", "max_k", "default_k", "sampled_k"):
            setattr(self, name, getattr(drafter, name))
        self.budget = getattr(drafter, "budget", [])
        self.single = drafter

    def one_request(self):
        return self.single

    def plain_batch(self, B):
        return False  # a drafter without a rule of its own drafts every batch

    def timed_plain(self, B, steps, seconds):
        pass


# -----------------------------------------------------------------------------
# the batched loop


@torch.inference_mode()
def generate_batched(target, drafter, prompts, max_new_tokens, k, sampler, cache=None, stop=()):
    """speculative.generate_speculative over B prompts: every row drafts up to k (fewer near its
    end; the drafter may give it fewer, or none), one target forward verifies every row's
    [last, drafts] packed, each row keeps its own survivors plus the target's token and rolls back
    alone. A row that has all its tokens, or has written a stop token, gets nothing more: zero
    tokens in every forward. Returns (token lists, BatchStats). Host syncs: one after the
    prefill, one a round (verify), plus what a drafter takes itself (DSpark's scheduler reads
    its confidences)."""
    check_k(drafter, k, target.config.sequence_len)
    dev = target.lm_head.weight.device
    allowed = check_prompts(target, prompts, max_new_tokens)
    twin = isinstance(drafter, BatchDrafter)
    if len(prompts) == 1:
        # one request: the batch-1 loop itself, with the drafter the twin was made from. The
        # ragged cache, the packing and the batch rule's bookkeeping only cost there (measured:
        # docs/experiments.md, "Batched: ragged cache and packed verify"); plain decoding too
        out, one = generate_speculative(target, drafter.one_request() if twin else drafter,
                                        prompts[0], max_new_tokens, k, sampler.row(0), stop=stop)
        return [out], BatchStats.of_one(one, k)
    B, P, layers = len(prompts), [len(p) for p in prompts], drafter.hidden_layers
    stats = BatchStats(B, k)
    plain = twin and drafter.plain_batch(B)  # the drafter's rule: no draft pays at this batch size
    cache = cache or ragged.new_cache(target, B)
    cache.reset()
    x = padded(prompts, dev)
    logits, _, hid = ragged.forward(target, x, cache, P, hidden_layers=() if plain else layers,
                                    last_only=True)
    last = sampler.first_token(logits, P)[:, 0]  # (B,) each row's last confirmed token
    out = [[t] for t in last.tolist()]  # host sync (once, after the prefill)
    allowed = [1 if o[0] in stop else a for o, a in zip(out, allowed)]  # ended at its first
    if plain:
        return plainly(target, drafter, cache, last, out, allowed, P, sampler, stats, stop)
    drafter.begin_batch([torch.cat([x[r, :p], last[r:r + 1]]) for r, p in enumerate(P)], hid)
    while True:
        active = [len(o) < a for o, a in zip(out, allowed)]
        if not any(active):
            break
        ks = [min(k, a - len(o) - 1) if on else 0 for o, a, on in zip(out, allowed, active)]
        t0 = time.perf_counter()
        if any(ks):
            drafts, counts, q = drafter.propose_batch(ks, sampler)
        else:
            drafts, counts, q = last.new_zeros(B, 0), [0] * B, None
        t1 = time.perf_counter()
        starts = list(cache.lengths)  # row r: len(seq) - 1, its last token not cached yet
        vcounts = [c + 1 if on else 0 for c, on in zip(counts, active)]
        logits, _, hid = ragged.forward(target, torch.cat([last[:, None], drafts], 1), cache,
                                        vcounts, hidden_layers=layers)
        n, ids, new = sampler.verify(logits, drafts, counts, q, [s + 1 for s in starts])
        kept = [until_stop(i, stop) if on else 0 for i, on in zip(ids, active)]  # n + 1, or fewer
        n = [max(m - 1, 0) for m in kept]
        cache.rollback([s + m for s, m in zip(starts, kept)])  # keep [last, d1..dn] per row
        drafter.commit_batch(kept, new, hid)
        # each row's last token (a finished row's is never read again)
        last = new.gather(1, torch.tensor([max(m - 1, 0) for m in kept], device=dev)[:, None])[:, 0]
        for r, on in enumerate(active):
            if on:
                out[r].extend(ids[r][:kept[r]])
                if out[r][-1] in stop:
                    allowed[r] = len(out[r])
        stats.record(counts, n, active, drafts.size(1) + 1, t1 - t0, time.perf_counter() - t1)
    stats.tokens = sum(len(o) for o in out)
    return out, stats


def plainly(target, drafter, cache, last, out, allowed, P, sampler, stats, stop=()):
    """A batch after its prefill on plain decoding's own path (plain_steps): every row from its
    first token to its end, no drafter, no taps, no host sync a step; timed for the drafter's
    rule (timed_plain). Returns (out, stats) with each row's tokens appended."""
    done = [len(o) for o in out]
    t0 = time.perf_counter()
    rest = plain_steps(target, cache, last, done, allowed, P, sampler, stats, stop)
    seconds = time.perf_counter() - t0
    # the steps it ran: each row's tokens, fewer than allowed where a stop token ended it
    drafter.timed_plain(len(out), max((len(r) for r in rest), default=0), seconds)
    stats.verify_time += seconds
    for o, r in zip(out, rest):
        o.extend(r)
    stats.tokens = sum(len(o) for o in out)
    return out, stats

class BatchStats(Stats):
    """speculative.Stats summed over rows (target_forwards counts (row, round) pairs, so tau is
    tokens per row per forward, 1 + sum of acceptance as at batch 1), plus what a batch spends:
    verify_tokens (real tokens in every verify), slots (what the padded attention ran: active
    rows x the round's widest row), and given[l]: rows verified with l drafts."""

    def __init__(self, batch_size, k):
        super().__init__(drafted_at=[0] * k, accepted_at=[0] * k)
        self.target_forwards = batch_size  # each row's prefill, as at batch 1
        self.batch_size, self.verify_tokens, self.slots, self.batches = batch_size, 0, 0, 0
        self.given = [0] * (k + 1)

    def record(self, counts, n, active, width, t_draft, t_verify):
        self.batches += 1
        self.draft_time += t_draft
        self.verify_time += t_verify
        for c, m, on in zip(counts, n, active):
            if on:
                super().record(c, m)
                self.verify_tokens += c + 1
                self.slots += width
                self.given[c] += 1

    @classmethod
    def of_one(cls, stats, k):
        """A batch-1 run's speculative.Stats as a batch of one's: the same counts, each round's
        verify as wide as its drafts + 1 (no padding), given[l] from the rounds that drafted l."""
        b = cls(1, k)
        for name in ("tokens", "target_forwards", "rounds", "draft_time", "verify_time"):
            setattr(b, name, getattr(stats, name))
        b.drafted_at, b.accepted_at = list(stats.drafted_at), list(stats.accepted_at)
        b.batches = stats.rounds
        b.verify_tokens = b.slots = sum(stats.drafted_at) + stats.rounds
        at = [stats.rounds, *stats.drafted_at, 0]  # rounds that drafted at least l
        b.given = [at[l] - at[l + 1] for l in range(k + 1)]
        return b

    def record_plain(self, rows):
        """One plain step of `rows` active rows: what record() counts for it, nothing drafted,
        in O(1): a plain batch records one a step, and a loop over its rows cost it measurably
        (docs/experiments.md, "Batched: ragged cache and packed verify")."""
        self.batches += 1
        self.target_forwards, self.rounds = self.target_forwards + rows, self.rounds + rows
        self.verify_tokens, self.slots = self.verify_tokens + rows, self.slots + rows
        self.given[0] += rows

    @property
    def padding(self):
        """The share of the attention's slots that were padding."""
        return 1 - self.verify_tokens / max(1, self.slots)
