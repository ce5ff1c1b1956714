"""
speculative.py -- plain decoding (the baseline) and the generic draft-then-verify loop.

gpt.py gave us a target with a KV cache that rolls back. This file adds the one idea the
whole repo teaches (Leviathan et al. 2023, Chen et al. 2023): let a cheap drafter guess k
tokens, check all of them with ONE target forward over [last, d1..dk], keep the longest
prefix the target agrees with plus one token of the target's own, roll both caches back to
exactly that, repeat. The output is unchanged; only the number of target forwards drops.

Three ways to accept a draft (the `Sampler`):
  greedy     accept while draft == target argmax; token-identical to plain greedy decoding.
  coupled    Gumbel-max with noise keyed on (seed, absolute position), shared by drafter and
             target; accept iff equal. Token-identical to plain sampling with the same seed
             (Daliri, Musco & Suresh 2024).
  rejection  accept d ~ q with prob min(1, p(d)/q(d)), else resample from norm(max(0, p - q)).
             Same *distribution* as plain sampling, not the same tokens.

Every drafter implements one interface, `Drafter`, and the loop never asks which one it runs:
each draft_*.py file adds one. How well a drafter does is measured by τ (tau): tokens per
target forward, the target's own token included -- plain decoding has τ = 1.

    python sample.py --prompt "def parse(" --method small   # watch it draft and verify
"""

import contextlib
import copy
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# sampling: one object decides how tokens are picked, drafted and verified


def sampling_dtype(device):
    """The float type sampling computes in: float64 where the device has it, float32 on MPS (no
    float64). float32 would be exact too: plain and speculative decoding compute the same function
    of (logits, seed, position) in either dtype. float64 keeps a seed giving the text published
    results were sampled with, and costs V values a token, nothing next to a forward pass."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def consecutive(positions, who):
    """(first position, count) of `positions`, which must be consecutive (a range with step 1, or
    a list like [S + j]); else a ValueError naming `who`."""
    start, n = positions[0], len(positions)
    if not (positions.step == 1 if isinstance(positions, range)
            else list(positions) == list(range(start, start + n))):
        raise ValueError(f"{who} needs consecutive positions (got {list(positions)})")
    return start, n


def keyed_gumbel(seed, positions, vocab_size, device, dtype=torch.float64):
    """Gumbel(0,1) noise of shape (len(positions), V), a pure function of (seed, position,
    token id): a counter-based integer hash, so the baseline and the speculative loop see the
    same noise at the same absolute position, in any chunking.

    positions: consecutive absolute positions (a range, or a list like [S + j]). They are made
    on the device by arange, never copied from the host: a copy per sampled token would be a host
    sync on a GPU. dtype float64: u from all 32 hash bits; float32 (MPS): u from the top 23, as
    (m + 0.5) / 2^23, which float32's 24-bit significand holds exactly: u is never rounded to 0
    or 1, and the noise stays finite."""
    M = 0xFFFFFFFF
    start, n = consecutive(positions, "keyed_gumbel")
    pos = torch.arange(start, start + n, device=device, dtype=torch.int64).view(-1, 1)
    v = torch.arange(vocab_size, device=device, dtype=torch.int64).view(1, -1)
    # every term < 2^63: exact in int64
    x = (v + pos * 0x9E3779B1 + (((seed & M) * 0x85EBCA77) & M)) & M
    # xorshift-multiply rounds: a 32-bit x times a constant < 2^31 stays exact in int64
    for _ in range(3):
        x = ((x ^ (x >> 16)) * 0x045D9F3B) & M
    x = x ^ (x >> 16)
    if dtype == torch.float64:
        u = (x.to(torch.float64) + 0.5) / 2.0 ** 32  # in (0, 1), never 0 or 1
    else:
        u = ((x >> 9).to(dtype) + 0.5) / 2.0 ** 23  # exact in float32, in (0, 1)
    return -torch.log(-torch.log(u))


def counts_on(counts, K, device):
    """Each row's number of drafts, (B,) on the device (one request: nothing uploaded)."""
    if all(c == K for c in counts):
        return torch.full((len(counts),), K, device=device)
    return torch.tensor(counts, device=device)


NOISE_CHUNK = 32  # positions whose keyed noise one keyed_gumbel call makes (see Sampler.noise)


class Sampler:
    """mode: 'greedy', 'coupled' or 'rejection'. Plain decoding uses pick() for every token but
    the first in all three modes (keyed Gumbel-max is exact sampling from softmax(logits / T));
    first_token() draws the token after the prefill, from the sampler's own generator in
    rejection mode. dtype: what sampling computes in (default: sampling_dtype of the logits'
    device). No method reads a value back to the host but verify(), once: the round's one sync.

    One request or a batch, one object: logits (T, V) with `start`, the absolute position of
    their first row, are one request; logits (B, T, V) with `start` a list of B positions are B
    requests, row r with its own seed (seed: one for every row, or a list) and its own generator,
    so that each row samples exactly what its own batch-1 run samples (serving/batched.py)."""

    def __init__(self, mode="greedy", temperature=1.0, top_k=None, seed=0, device="cpu",
                 dtype=None):
        if mode not in ("greedy", "coupled", "rejection"):
            raise ValueError(f"unknown sampling mode {mode!r}: use greedy, coupled or rejection")
        if mode != "greedy" and not temperature > 0:
            raise ValueError(f"temperature must be > 0 for {mode} sampling (got {temperature}); "
                             "use --sampling greedy for temperature 0")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top-k must be a positive number of tokens (got {top_k})")
        self.mode, self.temperature, self.top_k = mode, temperature, top_k
        self.seed, self.device, self.dtype = seed, device, dtype
        self.gens = {}  # row -> its torch.Generator (rejection mode only), made when first used
        self.rows = {}  # row -> that row as a one-request Sampler (row())
        self._noise = {}  # coupled mode: (row, chunk, V, device, dtype) -> (NOISE_CHUNK, V) rows

    def seed_of(self, r):
        if not isinstance(self.seed, (list, tuple)):
            return self.seed
        if r >= len(self.seed):  # a seed a row
            raise ValueError(f"{len(self.seed)} seeds for a batch of more rows: give one a row")
        return self.seed[r]

    def gen(self, r=0):
        """Row r's random generator (rejection sampling), seeded with its seed."""
        if r not in self.gens:
            self.gens[r] = torch.Generator(device=self.device).manual_seed(self.seed_of(r))
        return self.gens[r]

    def row(self, r):
        """Row r as a one-request Sampler sharing its generator (a drafter run row by row)."""
        if r not in self.rows:
            self.rows[r] = Sampler(self.mode, self.temperature, self.top_k, self.seed_of(r),
                                   self.device, self.dtype)
            self.rows[r].gens = {0: self.gen(r)}
        return self.rows[r]

    def float_dtype(self, device):
        return self.dtype or sampling_dtype(device)

    def scaled(self, logits):
        """Logits after temperature and top-k: we sample from the softmax of these."""
        logits = logits.to(self.float_dtype(logits.device)) / self.temperature
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return logits

    def probs(self, logits):
        return F.softmax(self.scaled(logits), dim=-1)

    def sample(self, p, r=0):
        """One token per row of probabilities p (..., V) from row r's generator: argmax p / E,
        E ~ Exp(1), exactly torch.multinomial's one draw (same generator, same tokens) without
        its two checks of its input, each an .item(): a host sync per sampled token on a GPU."""
        return (p / torch.empty_like(p).exponential_(generator=self.gen(r))).argmax(-1)

    def pick(self, logits, start):
        """Logits (T, V) from position `start` on -> (T,) tokens; or (B, T, V) -> (B, T), row r
        from start[r]. Deterministic."""
        if self.mode == "greedy":
            return logits.argmax(-1)
        noise = self.noise(start, logits.size(-2), logits.size(-1), logits.device)
        return (self.scaled(logits) + noise).argmax(-1)

    def noise(self, start, T, vocab_size, device):
        """keyed_gumbel's (T, V) rows for positions start .. start + T - 1 (a list of starts: (B,
        T, V), row r's by its own seed), made NOISE_CHUNK positions at a time and kept until the
        positions move past them. Why: a round's drafter and its verify want the same positions,
        and one call for 32 rows costs far less than 32 one-row calls (docs/experiments.md:
        Coupled sampling: noise in chunks). The noise is a pure function of the seed and the
        position: plain decoding sees the very same numbers, however it asks."""
        if isinstance(start, (list, tuple)):
            return torch.stack([self.noise_of(r, s, T, vocab_size, device)
                                for r, s in enumerate(start)])
        return self.noise_of(0, start, T, vocab_size, device)

    def noise_of(self, r, start, T, vocab_size, device):
        """Row r's noise at positions start .. start + T - 1."""
        dtype, seed = self.float_dtype(device), self.seed_of(r)
        first, last = start // NOISE_CHUNK, (start + T - 1) // NOISE_CHUNK
        rows = []
        for c in range(first, last + 1):
            key = (r, c, vocab_size, str(device), dtype)
            if key not in self._noise:
                span = range(c * NOISE_CHUNK, (c + 1) * NOISE_CHUNK)
                self._noise[key] = keyed_gumbel(seed, span, vocab_size, device, dtype)
            rows.append(self._noise[key])
        # a row's positions only move forward: forget the chunks behind this one (rows of a
        # batch keep their own: each row's chunks sit near its own position)
        self._noise = {key: v for key, v in self._noise.items()
                       if key[0] != r or first <= key[1] <= last}
        offset = start - first * NOISE_CHUNK
        noise = rows[0] if len(rows) == 1 else torch.cat(rows)
        return noise[offset:offset + T]

    def draft(self, logits, start, ks=None):
        """The drafter's choice: (tokens, q) where q is the distribution it sampled from
        (rejection mode needs the real q; the other modes compare tokens only). A batch: ks[r],
        row r drafts only its first ks[r] slots (rejection mode draws nothing for the others, so
        each row's generator moves as in its batch-1 run); None: every slot."""
        if self.mode != "rejection":
            return self.pick(logits, start), None
        q = self.probs(logits)
        if q.dim() == 2:
            return self.sample(q), q
        ks = ks if ks is not None else [q.size(1)] * q.size(0)
        # row r from its own generator, its first ks[r] slots in one draw
        toks = torch.zeros(q.shape[:2], dtype=torch.long, device=q.device)
        for r, k in enumerate(ks):
            toks[r, :k] = self.sample(q[r, :k], r)
        return toks, q

    def first_token(self, logits, start):
        """The target's token after the prefill: logits (1, V) -> (1,), or (B, 1, V) -> (B, 1)
        (rejection mode draws from p with each row's own generator)."""
        if self.mode != "rejection":
            return self.pick(logits, start)
        p = self.probs(logits)
        if p.dim() == 2:
            return self.sample(p)
        return torch.stack([self.sample(p[r], r) for r in range(p.size(0))])

    def verify(self, logits, drafts, counts, q, start):
        """logits (B, T, V) of the target over each row's [last, d1..d_counts[r]]; drafts (B, K),
        row r's first counts[r] real; start[r]: the absolute position of row r's first logits.
        Returns (n, ids, new): n[r] drafts of row r survived (host ints); new (B, T) holds, in
        row r's first n[r] + 1 slots, those drafts and the target's own token after them, and
        ids[r] the same as a host list. Exactly one host sync (a .tolist())."""
        if self.mode == "rejection":
            return self.verify_rejection(logits, drafts, counts, q)
        t = self.pick(logits, start)  # (B, T) what the target itself would emit
        K = drafts.size(1)
        live = torch.arange(K, device=t.device) < counts_on(counts, K, t.device)[:, None]
        # n[r]: row r's drafts that match the target's picks before the first that does not
        n = ((drafts == t[:, :K]) & live).int().cumprod(1).sum(1)
        # the surviving drafts equal the target's picks, so `t` serves as both: no upload
        return self.read(n, t)

    def verify_rejection(self, logits, drafts, counts, q):
        """Accept d_i ~ q with probability min(1, p(d_i)/q(d_i)); at the first rejection n draw
        the token from norm(max(0, p_n - q_n)), exactly what makes the output distribution p; if
        all of a row's drafts survive, a free bonus token from p. Every step on the device, one
        read back. Row r draws from its own generator, in its batch-1 order (its rand for its
        own drafts, then its token)."""
        p = self.probs(logits)  # (B, T, V)
        (B, T, V), K, dev = p.shape, drafts.size(1), p.device
        c = n = counts_on(counts, K, dev)
        rows = p.gather(1, n.view(B, 1, 1).expand(B, 1, V))[:, 0]  # (B, V): p after every draft
        if K > 0:
            pd = p[:, :K].gather(2, drafts[..., None])[..., 0]  # (B, K) p(d_i)
            qd = q.gather(2, drafts[..., None])[..., 0]
            u = torch.ones(B, K, device=dev, dtype=pd.dtype)  # padding: never accepted
            for r, m in enumerate(counts):
                if m:
                    u[r, :m] = torch.rand(m, generator=self.gen(r), device=dev, dtype=pd.dtype)
            rejected = (u >= pd / qd) | (torch.arange(K, device=dev) >= c[:, None])
            # n: each row's survivors before its first rejection
            n = torch.where(rejected.any(1), rejected.int().argmax(1), K).minimum(c)
            p_n = p.gather(1, n.view(B, 1, 1).expand(B, 1, V))[:, 0]  # (B, V)
            q_n = q.gather(1, n.clamp_max(K - 1).view(B, 1, 1).expand(B, 1, V))[:, 0]
            resid = (p_n - q_n).clamp_min(0)
            # mass is 0 only if rounding made p <= q everywhere: then take p itself
            mass = resid.sum(-1, keepdim=True)
            fixed = torch.where(mass > 0, resid / mass.clamp_min(1e-300), p_n)
            rows = torch.where((n < c)[:, None], fixed, p_n)
        tok = torch.stack([self.sample(rows[r], r) for r in range(B)])  # (B,)
        new = drafts.new_zeros(B, K + 1)
        new[:, :K] = drafts
        new.scatter_(1, n.view(B, 1), tok.view(B, 1))
        return self.read(n, new)

    @staticmethod
    def read(n, new):
        """-> (n as host ints, each row's n[r] + 1 new tokens as host lists, new on the device):
        the round's one host sync."""
        vals = torch.cat([n.view(-1, 1).to(new.dtype), new], 1).tolist()
        ns = [v[0] for v in vals]
        return ns, [v[1:2 + m] for v, m in zip(vals, ns)], new


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


@torch.inference_mode()
def generate_plain(model, prompt, max_new_tokens, sampler, cache=None, stop=()):
    """Token-by-token decoding with the KV cache. No host sync until the end, in every sampling
    mode: the chosen token stays on the device and is fed straight back in (only the prompt is
    uploaded, before any work is queued). stop: token ids that end the text (a chat model's end
    of turn), kept as its last token; watching for them reads each token back, a host sync a
    token (on a CPU, free)."""
    dev = model.lm_head.weight.device
    x = as_prompt(prompt, dev)
    P = x.size(1)
    n = tokens_allowed(model, P, max_new_tokens)
    cache = cache or model.new_cache()
    cache.reset()
    out = torch.empty(n, dtype=torch.long, device=dev)
    logits = model(x, cache=cache, last_only=True)[0][0]  # (1, V)
    out[0:1] = sampler.first_token(logits, P)
    for i in range(1, n):
        if stop and out[i - 1].item() in stop:
            return out[:i].tolist()
        logits = model(out[i - 1:i].view(1, 1), cache=cache)[0][0]
        out[i:i + 1] = sampler.pick(logits, P + i)
    return out.tolist()  # host sync (the only one)


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

    Many requests at once (serving/batched.py's loop), B rows each at its own length:
    begin_batch(seqs, hidden)   seqs: B token tensors (n_r,); hidden (B, P, d), row r's first n_r-1
    propose_batch(ks, sampler)  up to ks[r] for row r -> (drafts (B, K), counts, q (B, K, V) / None)
    commit_batch(kept, new, hidden)  row r keeps new[r, :kept[r]] (0: it has finished)
    A drafter that drafts every row in one pass (draft_small.py's) writes these, a request being a
    batch of one; any other writes the one-request calls, and a batch runs a copy a row (fresh()).
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
        self.copies, self.device = [self.fresh() for _ in seqs], seqs[0].device
        for r, (d, s) in enumerate(zip(self.copies, seqs)):
            d.begin(s.view(1, -1), {k: h[r:r + 1, :s.numel() - 1] for k, h in hidden.items()})

    def propose_batch(self, ks, sampler):
        got = [d.propose(k, sampler.row(r)) if k > 0 else (None, None)
               for r, (d, k) in enumerate(zip(self.copies, ks))]
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


def proposal(drafter, k, sampler, vocab_size):
    """drafter.propose(k, sampler), checked at the boundary once a round: what the loop verifies
    must be what a drafter promises (Drafter.propose). Cheap: no host sync but the ids' range on
    a CPU (on a GPU a bad id fails in the verify's embedding)."""
    with drafter_code(drafter, "propose"):
        got = drafter.propose(k, sampler)
    why = broken(got, k, vocab_size)
    if why:
        raise DrafterError(f"the {drafter.name} drafter broke the loop's contract: {why} "
                           "(speculative.Drafter.propose)")
    return got


def broken(got, k, vocab_size):
    """Which promise a proposal breaks, or None."""
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"propose() returned a {type(got).__name__}, not (tokens, q)"
    draft, q = got
    if not isinstance(draft, torch.Tensor) or draft.dim() != 1 or draft.is_floating_point():
        return f"its tokens are a {type(draft).__name__}, not a 1-D tensor of token ids"
    if draft.numel() > k:
        return f"it drafted {draft.numel()} tokens where at most k={k} were asked"
    if q is not None and (not isinstance(q, torch.Tensor) or q.size(0) != draft.numel()):
        return f"its q is not one row of probabilities per drafted token ({draft.numel()})"
    if draft.numel() and draft.device.type == "cpu":
        bad = draft[(draft < 0) | (draft >= vocab_size)]
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
    """What a run of the loop measured. tau (τ) counts tokens per target forward, bonus
    included."""
    tokens: int = 0
    target_forwards: int = 0
    rounds: int = 0
    drafted_at: list = field(default_factory=list)   # rounds that drafted position i
    accepted_at: list = field(default_factory=list)  # rounds in which position i survived
    draft_time: float = 0.0
    verify_time: float = 0.0

    @property
    def tau(self):
        return self.tokens / max(1, self.target_forwards)

    def acceptance(self):
        """Per draft position i, the share of ALL rounds in which position i survived: every
        target forward is a round here, the prefill included, and a round that drafted fewer
        than i tokens counts as one where position i did not survive. Why all rounds: then
        tau = 1 + sum(acceptance) exactly (each forward keeps a token of its own plus the
        drafts that survived), and a drafter that seldom drafts deep cannot look good there."""
        return [a / max(1, self.target_forwards) for a in self.accepted_at]

    def record(self, n_drafted, n_accepted):
        """One round: one target forward; positions 1..n_drafted were drafted, the first
        n_accepted of them survived."""
        self.target_forwards += 1
        self.rounds += 1
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted


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


def prefill(target, drafter, prompt, max_new_tokens, sampler, cache):
    """The prompt through the target, the drafter begun -> (confirmed tokens, [first token],
    tokens allowed, cache). The LM head on the last row only, as in generate_plain (over every row
    it may round float32 otherwise); the drafter gets every row's states. One host sync."""
    x = as_prompt(prompt, target.lm_head.weight.device)
    n_total = tokens_allowed(target, x.size(1), max_new_tokens)
    cache = cache or target.new_cache()
    cache.reset()
    logits, _, hid = target(x, cache=cache, hidden_layers=drafter.hidden_layers, last_only=True)
    seq = torch.cat([x[0], sampler.first_token(logits[0], x.size(1))])  # confirmed tokens
    with drafter_code(drafter, "begin"):
        drafter.begin(seq.view(1, -1), hid)
    return seq, [seq[-1].item()], n_total, cache


@torch.inference_mode()
def generate_speculative(target, drafter, prompt, max_new_tokens, k, sampler, cache=None,
                         trace=None, sync=None, stop=()):
    """Draft k, verify in one target forward, keep the agreed prefix + the target's token.
    Returns (generated tokens, Stats). If `trace` is a list, each round appends
    (accepted draft tokens, the target's own token, whether that token was a bonus; None when
    the round drafted nothing). stop: as generate_plain's, the text ending where plain
    decoding's does.

    Host syncs: one after the prefill, then exactly one per round (in verify), plus whatever a
    drafter takes itself (DSpark's scheduler reads its confidences once a round). sync: called
    between draft and verify, so that Stats' draft/verify split is true on a GPU (one more wait
    a round: None when timing throughput; a CPU runs nothing asynchronously)."""
    check_k(drafter, k, target.config.sequence_len)
    seq, out, n_total, cache = prefill(target, drafter, prompt, max_new_tokens, sampler, cache)
    stats = Stats(drafted_at=[0] * k, accepted_at=[0] * k, target_forwards=1)
    layers = drafter.hidden_layers
    while len(out) < n_total and out[-1] not in stop:  # the prefill's token may end it
        cache_len = cache.length  # == len(seq) - 1: the last confirmed token is not cached yet
        k_round = min(k, n_total - len(out) - 1)  # never past max_new_tokens or the context window
        t0 = time.perf_counter()
        if k_round > 0:
            draft, q = proposal(drafter, k_round, sampler, target.config.vocab_size)
        else:
            draft, q = seq[:0], None
        n_drafted = draft.numel()  # a scheduling drafter may offer fewer than asked
        if sync is not None:
            sync()  # only so that the draft/verify split is honest on a GPU
        t1 = time.perf_counter()
        logits, _, hid = target(torch.cat([seq[-1:], draft]).view(1, -1), cache=cache,
                                hidden_layers=layers)
        # the round's one host sync is inside verify: n and the new tokens come back as host ints,
        # and `new` stays on the device, so nothing is uploaded or read back again this round
        n, new_ids, new = sampler.verify(logits, draft.view(1, -1), [n_drafted],
                                         None if q is None else q[None], [cache_len + 1])
        n, new_ids, new = n[0], new_ids[0], new[0, :n[0] + 1]  # a batch of one: its row
        keep = until_stop(new_ids, stop)  # n + 1, unless a stop token came earlier
        n, new_ids, new = keep - 1, new_ids[:keep], new[:keep]
        cache.rollback(cache_len + n + 1)  # keep K/V for [last, d1..dn]; t* has none yet
        seq = torch.cat([seq, new])
        with drafter_code(drafter, "commit"):
            drafter.commit(n, new, {layer: h[:, :n + 1] for layer, h in hid.items()})
        stats.verify_time += time.perf_counter() - t1
        stats.draft_time += t1 - t0
        stats.record(n_drafted, n)
        out.extend(new_ids)
        if trace is not None:
            trace.append((new_ids[:n], new_ids[n], None if n_drafted == 0 else n == n_drafted))
    stats.tokens = len(out)
    return out, stats
