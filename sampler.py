"""
sampler.py -- how a token is chosen, drafted and verified: one object, three modes.

speculative.py's loop asks two things of the Sampler every round: draw the drafter's tokens
(draft) and decide which of them the target keeps (verify). Three ways to accept a draft:
  greedy     accept while draft == target argmax; token-identical to plain greedy decoding.
  coupled    Gumbel-max with noise keyed on (seed, absolute position), shared by drafter and
             target; accept iff equal. Token-identical to plain sampling with the same seed
             (Daliri, Musco & Suresh 2024).
  rejection  accept d ~ q with prob min(1, p(d)/q(d)), else resample from norm(max(0, p - q)).
             Same *distribution* as plain sampling, not the same tokens.
Plain decoding (speculative.generate_plain) picks its tokens with the same object, so the
baseline and the loop compute the same function of (logits, seed, position).
"""

import torch
import torch.nn.functional as F



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
    so that each row samples exactly what its own batch-1 run samples (speculative.generate_batch)."""

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
        """Row r as a one-request Sampler sharing its generator (a drafter run row by row); row 0
        under one seed for every row is this sampler itself (one request: its noise made once)."""
        if r == 0 and not isinstance(self.seed, (list, tuple)):
            return self
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
        ids[r] the same as a host list. Exactly one host sync (a .tolist()). The rule: greedy
        and coupled, a draft survives where it is the token the target itself picks at its
        position (pick: the same keyed noise), up to the first that is not, and the target's
        pick follows; rejection, verify_rejection's min(1, p/q)."""
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
