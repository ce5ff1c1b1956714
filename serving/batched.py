"""
serving/batched.py -- what serving adds to the loop: plain decoding of a batch (the baseline at
batch B) and a drafter's batch rule.

speculative.generate_batch decodes B prompts of different lengths together, every target
forward shared by all of them (ragged.py). What changes with load: at batch 1 a 16-token verify
costs little more than a 1-token step, so drafting long always pays. At batch 32 the same verify
is a 512-token forward and costs several times a plain batched step: a fixed draft length turns
into a slowdown. DSpark's scheduler (draft_dspark.py) spends one verify over the whole batch
instead; its measured rule (serving/rules.py) sets each round's width by what the rounds
measured, and may decode a batch plainly where no draft pays (serve()).

Rows are exact one by one: greedy and coupled sampling give each row the tokens its own batch-1
decoding gives (the coupled noise is keyed on the row's own seed and absolute positions);
rejection sampling gives each row the target's distribution, from the row's own generator.

    python bench.py --batch-size 1,4,16,32     # the serving sweep: every method, batched
"""

import time

import torch

import ragged
from speculative import Stats, check_prompts, generate_batch, padded

# -----------------------------------------------------------------------------
# plain batched decoding: the baseline at batch B


@torch.inference_mode()
def generate_plain_batched(model, prompts, max_new_tokens, sampler, cache=None, stats=None,
                           stop=()):
    """Token-by-token decoding of B prompts at once: one ragged prefill, then one (B, 1) forward
    a step. A row that has all its tokens gets zero tokens (its slot is padding, packed away).
    No host sync until the end (but a read of each step's tokens where `stop` ends a row, as in
    generate_plain). Returns one token list per row. stats: a speculative.Stats to count the
    steps in, and their seconds (verify_time, the prefill not counted)."""
    allowed = check_prompts(model, prompts, max_new_tokens)
    x, P = padded(prompts, model.lm_head.weight.device)
    cache = cache or ragged.new_cache(model, len(prompts))
    cache.reset()
    logits = ragged.forward(model, x, cache, P, last_only=True)[0]  # (B, 1, V)
    first = sampler.first_token(logits, P)  # (B, 1)
    firsts = first[:, 0].tolist()
    allowed = [1 if t in stop else a for t, a in zip(firsts, allowed)]  # ended at its first
    t0 = time.perf_counter()
    rest = plain_steps(model, cache, first[:, 0], [1] * len(P), allowed, P, sampler, stats, stop)
    if stats is not None:
        stats.verify_time += time.perf_counter() - t0
        stats.tokens += sum(1 + len(r) for r in rest)
    return [[t] + r for t, r in zip(firsts, rest)]


def plain_steps(model, cache, last, done, allowed, P, sampler, stats=None, stop=()):
    """Plain decoding of every row to its end: row r has done[r] of its allowed[r] tokens, the
    last of them, last[r], not yet in the cache; its next token sits at position P[r] + done[r].
    One (B, 1) forward a step, a row with all its tokens getting zero. No host sync until the
    end, unless `stop` ends rows: then each step's tokens are read back, and a row that wrote a
    stop token has all its tokens. Returns each row's new tokens. stats: a speculative.Stats to count
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
    """A serving rule around a lesson drafter (serving/rules.Measured): the drafter's batch calls
    (speculative.Drafter's begin_batch, propose_batch, commit_batch), with what the rule adds:

    plain_batch(B)             asked before each batch of B rows: True decodes it on plain
                               decoding's own path, start to end (where no draft pays); the
                               drafter then sees nothing of it but timed_plain(B, steps,
                               seconds), the plain steps' time.
    one_request()              the drafter that decodes a batch of one: the lesson's own.
    """
    name = "drafter"
    hidden_layers = ()
    max_k = None
    default_k = 4
    sampled_k = None
    budget = []

    def __init__(self, drafter):
        """The rule around `drafter`: it drafts what that one would, so it takes its name, the
        target layers it reads, its k and its training record."""
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
# a batch as a server decodes it


def serve(target, drafter, prompts, max_new_tokens, k, sampler, cache=None, stop=()):
    """speculative.generate_batch, with what a serving rule decides (BatchDrafter): a batch of
    one runs the lesson's own drafter (its own scheduler), and a batch where no draft pays is
    decoded plainly, start to end, the drafter told the plain steps' time. -> (token lists,
    Stats)."""
    if isinstance(drafter, BatchDrafter):
        if len(prompts) == 1:
            drafter = drafter.one_request()
        elif drafter.plain_batch(len(prompts)):
            stats = Stats.of(k, len(prompts))
            out = generate_plain_batched(target, prompts, max_new_tokens, sampler, cache, stats,
                                         stop)
            drafter.timed_plain(len(out), max(len(o) for o in out) - 1, stats.verify_time)
            return out, stats
    return generate_batch(target, drafter, prompts, max_new_tokens, k, sampler, cache, stop=stop)
