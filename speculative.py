"""
speculative.py -- plain decoding (the baseline) and the generic draft-then-verify loop.

gpt.py gave us a target with a KV cache that rolls back. This file adds the one idea the
whole repo teaches (Leviathan et al. 2023, Chen et al. 2023): let a cheap drafter guess k
tokens, check all of them with ONE target forward over [last, d1..dk], keep the longest
prefix the target agrees with plus one token of the target's own, roll both caches back to
exactly that, repeat. The output is unchanged; only the number of target forwards drops.
How a draft is drawn and which of it survives is sampler.py's Sampler (greedy, coupled or
rejection sampling).

Every drafter implements one interface, `Drafter`, and the loop never asks which one it runs:
each draft_*.py file adds one. The loop decodes a batch of requests, each row at its own
length (ragged.py), one request being a batch of one: a server's many requests and a single
user's one run the same lines. How well a drafter does is measured by τ (tau): tokens per
target forward, the target's own token included -- plain decoding has τ = 1.

    python sample.py --prompt "def parse(" --method small   # watch it draft and verify
"""

import contextlib
import copy
import time
from dataclasses import dataclass, field

import torch

import ragged

# -----------------------------------------------------------------------------
# plain decoding: the baseline every speedup is measured against


def tokens_allowed(model, prompt_len, max_new_tokens):
    """How many tokens we may generate: the sequence never outgrows the context window."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if prompt_len >= model.config.sequence_len:
        raise ValueError(f"the prompt has {prompt_len} tokens but the context window is "
                         f"{model.config.sequence_len}: shorten it to at most "
                         f"{model.config.sequence_len - 1}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive (got {max_new_tokens})")
    return min(max_new_tokens, model.config.sequence_len - prompt_len)


def as_prompt(prompt, device):
    return torch.as_tensor(prompt, dtype=torch.long, device=device).view(1, -1)


def check_prompts(model, prompts, max_new_tokens):
    """How many tokens each row may generate (tokens_allowed per row): one clear ValueError naming
    the row for an empty or over-long prompt, or an empty batch."""
    if len(prompts) == 0:
        raise ValueError("the batch is empty: give at least one prompt")
    allowed = []
    for r, p in enumerate(prompts):
        try:
            n = p.numel() if isinstance(p, torch.Tensor) else len(p)
            allowed.append(tokens_allowed(model, n, max_new_tokens))
        except ValueError as e:
            raise ValueError(f"prompt {r} of the batch: {e}" if len(prompts) > 1 else str(e)) \
                from None
    return allowed


def padded(prompts, device):
    """Prompts (token lists or tensors) -> ((B, width) long tensor on the device, zeros after each
    row's end; each row's length). One request goes as it is (a prompt already on the device is
    not copied)."""
    if len(prompts) == 1:
        x = as_prompt(prompts[0], device)
        return x, [x.size(1)]
    rows = [torch.as_tensor(p, dtype=torch.long).view(-1) for p in prompts]
    x = torch.zeros(len(rows), max(r.numel() for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        x[i, :r.numel()] = r
    return x.to(device), [r.numel() for r in rows]


@torch.inference_mode()
def generate_plain_batch(model, prompts, max_new_tokens, sampler, cache=None, stats=None,
                         stop=()):
    """Token-by-token decoding of B prompts at once, each row at its own length: one prefill,
    then one (B, 1) forward a step over a ragged.RaggedCache; a row that has all its tokens gets
    zero tokens (its slot is padding, packed away). No host sync until the end, in every
    sampling mode: the chosen tokens stay on the device and are fed straight back in. stop:
    token ids that end a row's text (a chat model's end of turn), kept as its last token;
    watching for them reads each step's tokens back (on a CPU, free). Returns a token list a
    row. stats: a Stats to count the steps in, and their seconds (verify_time; not the
    prefill)."""
    allowed = check_prompts(model, prompts, max_new_tokens)
    x, P = padded(prompts, model.lm_head.weight.device)
    cache = cache or ragged.new_cache(model, len(prompts))
    cache.reset()
    out = torch.empty(len(P), max(allowed), dtype=torch.long, device=x.device)
    logits = ragged.forward(model, x, cache, P, last_only=True)[0]  # (B, 1, V)
    out[:, :1] = sampler.first_token(logits, P)
    t0 = time.perf_counter()
    for i in range(1, max(allowed)):
        if stop:  # a row whose token i - 1 is a stop token has all its tokens
            ended = out[:, i - 1].tolist()
            allowed = [i if i - 1 < a and t in stop else a for t, a in zip(ended, allowed)]
        counts = [int(i < a) for a in allowed]
        if not any(counts):
            break
        logits = ragged.forward(model, out[:, i - 1:i], cache, counts)[0]  # (B, 1, V)
        out[:, i:i + 1] = sampler.pick(logits, [p + i for p in P])
        if stats is not None:
            stats.record_plain(sum(counts))
    rows = out.tolist()  # host sync (the only one, without stop tokens)
    if stats is not None:
        stats.verify_time += time.perf_counter() - t0
        stats.tokens += sum(allowed)
    return [row[:a] for row, a in zip(rows, allowed)]


def generate_plain(model, prompt, max_new_tokens, sampler, cache=None, stop=()):
    """One request: generate_plain_batch's batch of one -> its tokens. cache: a
    ragged.RaggedCache of one row."""
    return generate_plain_batch(model, [prompt], max_new_tokens, sampler, cache, stop=stop)[0]


# -----------------------------------------------------------------------------
# the drafter interface: what the loop needs from any drafter


class NoLayers(tuple):
    """A drafter's hidden_layers until it lists its own: none, and reading one is an error that
    says what to set (a drafter that reads the target's states must ask for them)."""

    def __getitem__(self, i):
        raise DrafterError("a drafter reads the target's hidden states but lists no "
                           "hidden_layers: set self.hidden_layers = (layer, ...) in its __init__, "
                           "the layers its network reads (0: the embedding, n_layer: the last "
                           "block's output)")


class Drafter:
    """What the loop needs from any drafter. The loop keeps this invariant: the confirmed
    sequence is `tokens`, and the target has hidden states for every confirmed token but the
    last (that one is the first input of the next verify pass).

    begin(tokens, hidden)       a new sequence. tokens (1, n); hidden {layer: (1, n-1, d)}.
    propose(k, sampler)         draft up to k tokens after the confirmed sequence (also again
                                before a commit, each call as if the first: a profile does) ->
                                (tokens (k',), q (k', V) or None), 0 <= k' <= k: fewer where a
                                scheduler verifies fewer or the drafter has nothing to offer.
    commit(n, new, hidden)      n of the k drafts survived; `new` (n+1,) = those n plus the target's
                                own token; hidden {layer: (1, n+1, d)} = the target's states at the
                                n+1 positions that just became 'all but the last'.
    catch_up(new, hidden)       the sequence grew by `new` (m,) on rounds another drafter drafted
                                (draft_hybrid.py); hidden (1, m, d) as in commit. By default a
                                commit: every drafter here reads n only as len(new) - 1.

    Many requests at once (the loop, generate_batch), B rows each at its own length:
    begin_batch(seqs, hidden)   seqs: B token tensors (n_r,); hidden (B, P, d), row r's first n_r-1
    propose_batch(ks, sampler)  up to ks[r] for row r -> (drafts (B, K), counts, q (B, K, V) / None)
    commit_batch(kept, new, hidden)  row r keeps new[r, :kept[r]] (0: it has finished)
    The loop calls these. A drafter that drafts every row in one pass (draft_small.py's) writes
    them, its one-request calls being a batch of one; any other writes the one-request calls, and
    a batch runs a copy a row (fresh()), a batch of one the drafter itself.
    """
    name = "drafter"
    hidden_layers = NoLayers()  # which target hidden states this drafter reads
    max_k = None        # most tokens it can draft in one round (None: no limit)
    default_k = 4       # the k it drafts unless told (greedy)
    sampled_k = None    # the same when sampling (None: default_k); see k_for

    def begin(self, tokens, hidden):
        self.begin_batch([tokens.view(-1)], hidden)

    def propose(self, k, sampler):
        drafts, counts, q = self.propose_batch([k], sampler)
        return drafts[0, :counts[0]], None if q is None else q[0, :counts[0]]

    def commit(self, n, new, hidden):
        self.commit_batch([n + 1], new.view(1, -1), hidden)

    def catch_up(self, new, hidden):
        self.commit(new.numel() - 1, new, hidden)

    def fresh(self):
        """A copy with state of its own and the same weights (a shallow copy: begin() makes its
        state anew; a drafter whose buffers outlive begin() makes new ones)."""
        return copy.copy(self)

    # a batch, one copy a row: the default of a drafter that writes only the one-request calls
    def begin_batch(self, seqs, hidden):
        if type(self).begin is Drafter.begin:
            raise DrafterError(f"the {self.name} drafter writes neither begin() nor begin_batch()")
        self.copies = None  # or each copy would carry the copies of the batch before
        # one request: the drafter itself, so that what it learns of a request stays with it
        self.copies = [self] if len(seqs) == 1 else [self.fresh() for _ in seqs]
        self.device = seqs[0].device
        for r, (d, s) in enumerate(zip(self.copies, seqs)):
            d.begin(s.view(1, -1), {k: h[r:r + 1, :s.numel() - 1] for k, h in hidden.items()})

    def propose_batch(self, ks, sampler):
        got = []
        for r, (d, k) in enumerate(zip(self.copies, ks)):
            got.append(d.propose(k, sampler.row(r)) if k > 0 else (None, None))
            why = k > 0 and broken(got[-1], k)
            if why:
                raise DrafterError(f"the {d.name} drafter broke the loop's contract: {why} "
                                   "(speculative.Drafter.propose)")
        counts = [0 if t is None else t.numel() for t, _ in got]
        real = [(r, t, q) for r, ((t, q), c) in enumerate(zip(got, counts)) if c]
        drafts = torch.zeros(len(ks), max(counts), dtype=torch.long, device=self.device)
        q = None if sampler.mode != "rejection" or not real else real[0][2].new_zeros(
            len(ks), max(counts), real[0][2].size(-1))
        for r, t, qr in real:
            drafts[r, :t.numel()] = t
            if q is not None:
                q[r, :t.numel()] = qr
        return drafts, counts, q

    def commit_batch(self, kept, new, hidden):
        for r, (d, m) in enumerate(zip(self.copies, kept)):
            if m:
                d.commit(m - 1, new[r, :m], {k: h[r:r + 1, :m] for k, h in hidden.items()})


class DrafterError(Exception):
    """A drafter broke the loop's contract, or failed inside its own code: a bug in the drafter,
    not in what the user asked for. The message names the drafter; the commands show the
    drafter's own traceback under it (runtime/command.py)."""


@contextlib.contextmanager
def drafter_code(drafter, method):
    """The loop calling drafter.<method>(): whatever goes wrong in there is the drafter's."""
    try:
        yield
    except (DrafterError, MemoryError):
        raise
    except Exception as e:
        raise DrafterError(f"the {drafter.name} drafter failed inside its {method}(): "
                           f"{type(e).__name__}: {e}") from e


def proposals(drafter, ks, sampler, vocab_size):
    """drafter.propose_batch(ks, sampler), checked at the boundary once a round: what the loop
    verifies must be what a drafter promises (Drafter) -> (drafts (B, K), counts, q), K the most
    any row drafted. Cheap: no host sync but the ids' range on a CPU (on a GPU a bad id fails in
    the verify's embedding)."""
    with drafter_code(drafter, "propose"):
        got = drafter.propose_batch(ks, sampler)
    why = broken_batch(got, ks, vocab_size)
    if why:
        raise DrafterError(f"the {drafter.name} drafter broke the loop's contract: {why} "
                           "(speculative.Drafter.propose_batch)")
    drafts, counts, q = got
    K = max(counts)  # a row's slots past its count are not drafts: never verified
    return drafts[:, :K], list(counts), None if q is None else q[:, :K]


def broken(got, k):
    """Which promise one request's proposal (Drafter.propose) breaks, or None."""
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"propose() returned a {type(got).__name__}, not (tokens, q)"
    draft, q = got
    if not isinstance(draft, torch.Tensor) or draft.dim() != 1 or draft.is_floating_point():
        return f"its tokens are a {type(draft).__name__}, not a 1-D tensor of token ids"
    if draft.numel() > k:
        return f"it drafted {draft.numel()} tokens where at most k={k} were asked"
    if q is not None and (not isinstance(q, torch.Tensor) or q.size(0) != draft.numel()):
        return f"its q is not one row of probabilities per drafted token ({draft.numel()})"
    return None


def broken_batch(got, ks, vocab_size):
    """Which promise a batch's proposal (Drafter.propose_batch) breaks, or None."""
    if not (isinstance(got, tuple) and len(got) == 3):
        return f"propose_batch() returned a {type(got).__name__}, not (drafts, counts, q)"
    drafts, counts, q = got
    B = len(ks)
    if (not isinstance(drafts, torch.Tensor) or drafts.dim() != 2 or drafts.size(0) != B
            or drafts.is_floating_point()):
        return f"its drafts are not a ({B}, K) tensor of token ids"
    if len(counts) != B:
        return f"it gave {len(counts)} counts for {B} rows"
    for r, (c, k) in enumerate(zip(counts, ks)):
        if not 0 <= c <= min(k, drafts.size(1)):
            return f"it drafted {c} tokens where at most k={k} were asked" + (
                f" (row {r})" if B > 1 else "")
    if q is not None and (not isinstance(q, torch.Tensor) or q.shape[:2] != drafts.shape):
        return "its q is not one row of probabilities per drafted token"
    if drafts.device.type == "cpu" and drafts.numel():
        K = max(counts)  # rows of one count (always one request's) checked at once
        rows = [drafts[:, :K]] if min(counts) == K else [d[:c] for d, c in zip(drafts, counts)]
        bad = torch.cat([r[(r < 0) | (r >= vocab_size)] for r in rows])
        if bad.numel():
            return (f"it drafted token id {int(bad[0])}, outside the target's vocabulary "
                    f"0..{vocab_size - 1}")
    return None


def k_for(drafter, mode):
    """The k a drafter drafts unless told, greedy or sampling: sampling lowers acceptance, so long
    drafts stop paying (each drafter's k: docs/experiments.md)."""
    k = drafter.sampled_k if mode != "greedy" and drafter.sampled_k else drafter.default_k
    if not isinstance(k, int) or k < 1:
        raise DrafterError(f"the {drafter.name} drafter's default_k (or sampled_k) is {k!r}: a "
                           "drafter drafts 1 token a round or more; set it in its class")
    return k


# -----------------------------------------------------------------------------
# the loop


@dataclass
class Stats:
    """What a run of the loop measured, over every row of its batch. tau (τ) counts tokens per
    target forward, bonus included; a forward of B rows counts as B (each row's own), so τ reads
    as at batch 1."""
    tokens: int = 0
    target_forwards: int = 0
    rounds: int = 0
    drafted_at: list = field(default_factory=list)   # rounds that drafted position i
    accepted_at: list = field(default_factory=list)  # rounds in which position i survived
    draft_time: float = 0.0
    verify_time: float = 0.0
    batches: int = 0        # forwards of the whole batch after its prefill
    verify_tokens: int = 0  # the real tokens those forwards ran (a row's drafts + 1)
    slots: int = 0          # what their padded attention ran: each row as wide as the widest
    given: list = field(default_factory=list)  # given[l]: rows verified with l drafts

    @classmethod
    def of(cls, k, rows=1):
        """Zero counts for drafts of up to k tokens, each row's prefill counted."""
        return cls(target_forwards=rows, drafted_at=[0] * k, accepted_at=[0] * k,
                   given=[0] * (k + 1))

    @property
    def tau(self):
        return self.tokens / max(1, self.target_forwards)

    @property
    def padding(self):
        """The share of the attention's slots that were padding."""
        return 1 - self.verify_tokens / max(1, self.slots)

    def acceptance(self):
        """Per draft position i, the share of ALL rounds in which position i survived: every
        target forward is a round here, the prefill included, and a round that drafted fewer
        than i tokens counts as one where position i did not survive. Why all rounds: then
        tau = 1 + sum(acceptance) exactly (each forward keeps a token of its own plus the
        drafts that survived), and a drafter that seldom drafts deep cannot look good there."""
        return [a / max(1, self.target_forwards) for a in self.accepted_at]

    def record(self, n_drafted, n_accepted, width=None):
        """One row's round: one target forward; positions 1..n_drafted were drafted, the first
        n_accepted of them survived. width: the slots its forward gave it (n_drafted + 1
        unless a wider row padded it)."""
        self.target_forwards += 1
        self.rounds += 1
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted
        self.verify_tokens += n_drafted + 1
        self.slots += width or n_drafted + 1
        self.given[n_drafted] += 1

    def record_plain(self, rows):
        """One plain step of `rows` rows: what record() counts for each, nothing drafted, in O(1)
        (a plain batch records one a step, and a loop over its rows cost it measurably:
        docs/experiments.md, "Batched: ragged cache and packed verify")."""
        self.batches += 1
        self.target_forwards, self.rounds = self.target_forwards + rows, self.rounds + rows
        self.verify_tokens, self.slots = self.verify_tokens + rows, self.slots + rows
        self.given[0] += rows


def check_k(drafter, k, window):
    """k, the tokens drafted per round, must be one this drafter can draft and a round of the
    target's window (k + 1 tokens verified) can hold."""
    if not 1 <= k < window:
        raise ValueError(f"k (tokens drafted per round) must be 1 to {window - 1}, what a round "
                         f"of the target's {window}-token window verifies (got {k})")
    if drafter.max_k is not None and k > drafter.max_k:
        raise ValueError(f"the {drafter.name} drafter can draft at most {drafter.max_k} tokens "
                         f"per round (asked for k={k})")


def until_stop(new_ids, stop):
    """How many of a round's new tokens the text keeps: all of them, or up to and with the first
    stop token (an end of turn inside the accepted drafts ends the text there)."""
    return next((i + 1 for i, t in enumerate(new_ids) if t in stop), len(new_ids))


def prefill(target, drafter, prompts, max_new_tokens, sampler, cache):
    """The prompts through the target, the drafter begun -> (each row's last confirmed token (B,),
    its tokens so far [[first token]], tokens allowed a row, cache). The LM head on each row's last
    token only, as in generate_plain (over every row it may round float32 otherwise); the drafter
    gets every row's states. One host sync."""
    dev, B = target.lm_head.weight.device, len(prompts)
    allowed = check_prompts(target, prompts, max_new_tokens)
    cache = cache or ragged.new_cache(target, B)
    if len(cache.lengths) != B:
        raise ValueError(f"a cache for {len(cache.lengths)} rows cannot decode {B} prompts")
    cache.reset()
    x, P = padded(prompts, dev)
    logits, _, hid = ragged.forward(target, x, cache, P, hidden_layers=drafter.hidden_layers,
                                    last_only=True)
    last = sampler.first_token(logits, P)[:, 0]  # (B,)
    out = [[t] for t in last.tolist()]  # host sync (once, after the prefill)
    with drafter_code(drafter, "begin"):
        drafter.begin_batch([torch.cat([x[r, :p], last[r:r + 1]]) for r, p in enumerate(P)], hid)
    return last, out, allowed, cache


@torch.inference_mode()
def generate_batch(target, drafter, prompts, max_new_tokens, k, sampler, cache=None, trace=None,
                   sync=None, stop=()):
    """Draft up to k, verify in one target forward, keep the agreed prefix + the target's token:
    for B prompts at once, each row at its own length (one request: a batch of one). Every row
    drafts up to k (fewer near its end; the drafter may give it fewer, or none), one forward
    verifies every row's [last, drafts], and each row keeps its own survivors and rolls back
    alone. A row that has all its tokens, or wrote a stop token (a chat model's end of turn,
    kept as its last, as generate_plain's), gets zero tokens in every forward after.
    Returns (a token list a row, Stats). trace: None or a list a row, to which each round
    appends (accepted drafts, the target's own token, whether that token was a bonus; None
    when the row drafted nothing).

    Host syncs: one after the prefill, then exactly one per round (in verify), plus whatever a
    drafter takes itself (DSpark's scheduler reads its confidences). sync: called between draft
    and verify, so that Stats' draft/verify split is true on a GPU (one more wait a round: None
    when timing throughput; a CPU runs nothing asynchronously)."""
    check_k(drafter, k, target.config.sequence_len)
    last, out, allowed, cache = prefill(target, drafter, prompts, max_new_tokens, sampler, cache)
    allowed = [1 if o[0] in stop else a for o, a in zip(out, allowed)]  # ended at its first
    B, stats = len(out), Stats.of(k, len(out))
    while True:
        active = [len(o) < a for o, a in zip(out, allowed)]
        if not any(active):
            break
        # never past max_new_tokens or the context window
        ks = [min(k, a - len(o) - 1) if on else 0 for o, a, on in zip(out, allowed, active)]
        t0 = time.perf_counter()
        if any(ks):
            drafts, counts, q = proposals(drafter, ks, sampler, target.config.vocab_size)
        else:
            drafts, counts, q = last.new_zeros(B, 0), [0] * B, None
        if sync is not None:
            sync()  # only so that the draft/verify split is honest on a GPU
        t1 = time.perf_counter()
        starts = list(cache.lengths)  # row r: its confirmed tokens but the last, not cached yet
        logits, _, hid = ragged.forward(target, torch.cat([last[:, None], drafts], 1), cache,
                                        [c + 1 if on else 0 for c, on in zip(counts, active)],
                                        hidden_layers=drafter.hidden_layers)
        # the round's one host sync is inside verify: n and the new tokens come back as host ints,
        # and `new` stays on the device, so nothing is uploaded or read back again this round
        n, ids, new = sampler.verify(logits, drafts, counts, q, [s + 1 for s in starts])
        kept = [until_stop(i, stop) if on else 0 for i, on in zip(ids, active)]  # n + 1, or fewer
        cache.rollback([s + m for s, m in zip(starts, kept)])  # keep [last, d1..dn]; t* uncached
        with drafter_code(drafter, "commit"):
            drafter.commit_batch(kept, new, hid)
        last = new.gather(1, ragged.offsets([max(m - 1, 0) for m in kept], 1, new.device))[:, 0]
        stats.draft_time += t1 - t0
        stats.verify_time += time.perf_counter() - t1
        stats.batches += 1
        for r in (r for r in range(B) if active[r]):
            out[r].extend(ids[r][:kept[r]])
            allowed[r] = len(out[r]) if out[r][-1] in stop else allowed[r]
            stats.record(counts[r], kept[r] - 1, drafts.size(1) + 1)
            if trace is not None:
                bonus = None if counts[r] == 0 else kept[r] - 1 == counts[r]
                trace[r].append((ids[r][:kept[r] - 1], ids[r][kept[r] - 1], bonus))
    stats.tokens = sum(len(o) for o in out)
    return out, stats


def generate_speculative(target, drafter, prompt, max_new_tokens, k, sampler, cache=None,
                         trace=None, sync=None, stop=()):
    """One request: generate_batch's batch of one -> (generated tokens, Stats). trace: a list
    to which each round appends (accepted drafts, the target's own token, whether it was a
    bonus; None when the round drafted nothing). cache: a ragged.RaggedCache of one row."""
    outs, stats = generate_batch(target, drafter, [prompt], max_new_tokens, k, sampler, cache,
                                 None if trace is None else [trace], sync, stop)
    return outs[0], stats
