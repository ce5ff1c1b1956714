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
draft_small.py (an independent small GPT), draft_mtp.py, draft_dflash.py, draft_dspark.py and
draft_lookup.py each add one. How well a drafter does is measured by τ (tau): tokens per
target forward, the target's own token included -- plain decoding has τ = 1.

    python speculative.py --prompt "def parse(" --method small   # watch it draft and verify
"""

import copy
import importlib
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpt import (CheckpointError, load_checkpoint, load_target, number, path_arg,
                 pick_device, ArgumentParser, synchronize)

# -----------------------------------------------------------------------------
# sampling: one object decides how tokens are picked, drafted and verified


def sampling_dtype(device):
    """The float type sampling computes in: float64 where the device has it (CPU, CUDA), float32
    on MPS, which has no float64. Why not float32 everywhere: it would be exact too (below), but
    float64 is what the published results were sampled in (docs/results.md), so a seed keeps
    giving the same text, and
    it costs nothing that shows: V values per token, next to a whole forward pass. What makes
    coupled sampling token-identical is that plain and speculative decoding compute the same
    function of (logits, seed, position) -- true in either dtype, as long as both use the same."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def consecutive(positions, who):
    """(first position, count) of `positions`, which must be consecutive: a range with step 1,
    or a list like [S + j]. Else a ValueError naming `who`."""
    start, n = positions[0], len(positions)
    if isinstance(positions, range):
        ok = positions.step == 1
    else:
        ok = list(positions) == list(range(start, start + n))
    if not ok:
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


NOISE_CHUNK = 32  # positions whose keyed noise one keyed_gumbel call makes (see Sampler.noise)


class Sampler:
    """mode: 'greedy', 'coupled' or 'rejection'. Plain decoding uses pick() for every token but
    the first in all three modes (keyed Gumbel-max is exact sampling from softmax(logits / T));
    first_token() draws the token after the prefill, from the sampler's own generator in
    rejection mode.
    dtype: what sampling computes in (default: sampling_dtype of the logits' device).

    No method reads a value back to the host except verify(), once: the loop's one sync a round."""

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
        self.seed, self.dtype = seed, dtype
        self.gen = torch.Generator(device=device).manual_seed(seed)  # rejection mode only
        self._noise = {}  # coupled mode: (chunk, V, device, dtype) -> (NOISE_CHUNK, V) noise rows

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

    def sample(self, p):
        """One token per row of probabilities p (..., V) from this sampler's generator: the
        exponential race, argmax p / E with E ~ Exp(1). It is exactly what torch.multinomial does
        for one draw (same generator, same tokens), minus multinomial's two checks of its input,
        each an .item(): a host sync per sampled token on a GPU."""
        return (p / torch.empty_like(p).exponential_(generator=self.gen)).argmax(-1)

    def pick(self, logits, positions):
        """(T, V) logits for tokens at absolute `positions` -> (T,) tokens. Deterministic."""
        if self.mode == "greedy":
            return logits.argmax(-1)
        noise = self.noise(positions, logits.size(-1), logits.device)
        return (self.scaled(logits) + noise).argmax(-1)

    def noise(self, positions, vocab_size, device):
        """keyed_gumbel's rows for these consecutive positions, made NOISE_CHUNK positions at a
        time and kept until the positions move past them. Why: a round's drafter and its verify
        pass want the same positions (drafts at S..S+k-1, the target's picks at S..S+k), and one
        call for 32 rows costs far less than 32 one-row calls (docs/experiments.md: Coupled
        sampling: noise in chunks). Chunks start at multiples of NOISE_CHUNK, and plain decoding
        reads the same chunks: both see the very same numbers, however they ask."""
        dtype = self.float_dtype(device)
        start, n = consecutive(positions, "noise")
        first, last = start // NOISE_CHUNK, (start + n - 1) // NOISE_CHUNK
        rows = []
        for c in range(first, last + 1):
            key = (c, vocab_size, str(device), dtype)
            if key not in self._noise:
                span = range(c * NOISE_CHUNK, (c + 1) * NOISE_CHUNK)
                self._noise[key] = keyed_gumbel(self.seed, span, vocab_size, device, dtype)
            rows.append(self._noise[key])
        # positions only move forward within a generation: forget the chunks behind this one
        self._noise = {key: v for key, v in self._noise.items() if first <= key[0] <= last}
        offset = start - first * NOISE_CHUNK
        block = rows[0] if len(rows) == 1 else torch.cat(rows)
        return block[offset:offset + n]

    def draft(self, logits, positions):
        """The drafter's choice: (tokens, q) where q is the distribution it sampled from
        (rejection mode needs the real q; the other modes compare tokens only)."""
        if self.mode != "rejection":
            return self.pick(logits, positions), None
        q = self.probs(logits)
        return self.sample(q), q

    def first_token(self, logits, position):
        """The target's token after the prefill (rejection mode draws from p with its own RNG)."""
        if self.mode != "rejection":
            return self.pick(logits, [position])
        return self.sample(self.probs(logits))

    def verify(self, logits, draft, q, positions):
        """logits (k+1, V) of the target over [last, d1..dk]; draft (k,). Returns (n accepted,
        new_ids, new): the n surviving drafts and the target's own token after them, as host
        ints (a list of n+1) and as a device tensor (n+1,). Exactly one host sync (a .tolist())."""
        k = draft.numel()
        if self.mode == "rejection":
            return self.verify_rejection(logits, draft, q)
        t = self.pick(logits, positions)  # (k+1,) what the target itself would emit
        both = torch.cat([t, draft]).tolist()  # host sync
        t_ids, d = both[:k + 1], both[k + 1:]
        n = 0
        while n < k and d[n] == t_ids[n]:
            n += 1
        # the surviving drafts equal the target's picks, so `t` serves as both: no upload
        return n, t_ids[:n + 1], t[:n + 1]

    def verify_rejection(self, logits, draft, q):
        """Accept d_i ~ q with probability min(1, p(d_i)/q(d_i)); at the first rejection n draw
        the token from norm(max(0, p_n - q_n)), exactly what makes the output distribution p; if
        all k survive, a free bonus token from p_k. Every step on the device; one read back."""
        k, dev = draft.numel(), logits.device
        p = self.probs(logits)  # (k+1, V)
        n, rows = torch.full((1,), k, device=dev), p[k:]
        if k > 0:
            idx = torch.arange(k, device=dev)
            ratio = p[idx, draft] / q[idx, draft]
            r = torch.rand(k, generator=self.gen, device=dev, dtype=ratio.dtype)
            rejected = r >= ratio
            # n: the survivors before the first rejection
            n = torch.where(rejected.any(), rejected.int().argmax(), k).view(1)
            resid = (p[:k] - q).clamp_min(0)
            # mass is 0 only if rounding made p <= q everywhere: then take p itself
            mass = resid.sum(-1, keepdim=True)
            rows = torch.cat([torch.where(mass > 0, resid / mass, p[:k]), p[k:]]).index_select(0, n)
        tok = self.sample(rows)  # (1,)
        vals = torch.cat([n, tok, draft]).tolist()  # host sync
        m = vals[0]
        return m, vals[2:2 + m] + [vals[1]], torch.cat([draft[:m], tok])


# -----------------------------------------------------------------------------
# plain decoding: the baseline every speedup is measured against


def tokens_allowed(model, prompt_len, max_new_tokens):
    """How many tokens we may generate: the sequence never outgrows the context window."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if prompt_len >= model.config.block_size:
        raise ValueError(f"the prompt has {prompt_len} tokens but the context window is "
                         f"{model.config.block_size}: shorten it to at most "
                         f"{model.config.block_size - 1}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive (got {max_new_tokens})")
    return min(max_new_tokens, model.config.block_size - prompt_len)


def as_prompt(prompt, device):
    return torch.as_tensor(prompt, dtype=torch.long, device=device).view(1, -1)


@torch.inference_mode()
def generate_plain(model, prompt, max_new_tokens, sampler, cache=None):
    """Token-by-token decoding with the KV cache. No host sync until the end, in every sampling
    mode: the chosen token stays on the device and is fed straight back in (only the prompt is
    uploaded, before any work is queued)."""
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
        logits = model(out[i - 1:i].view(1, 1), cache=cache)[0][0]
        out[i:i + 1] = sampler.pick(logits, [P + i])
    return out.tolist()  # host sync (the only one)


# -----------------------------------------------------------------------------
# the drafter interface: what the loop needs from any drafter


class Drafter:
    """What the loop needs from any drafter. The loop keeps this invariant: the confirmed
    sequence is `tokens`, and the target has hidden states for every confirmed token but the
    last (that one is the first input of the next verify pass).

    begin(tokens, hidden)       a new sequence. tokens (1, n); hidden {layer: (1, n-1, d)}.
    propose(k, sampler)         draft up to k tokens after the confirmed sequence ->
                                (tokens (k',), q (k', V) or None), 0 <= k' <= k: a scheduler
                                may choose to verify fewer, and a drafter with nothing to offer
                                drafts none (the round is a plain step).
    commit(n, new, hidden)      n of the k drafts survived; `new` (n+1,) = those n plus the target's
                                own token; hidden {layer: (1, n+1, d)} = the target's states at the
                                n+1 positions that just became 'all but the last'.
    catch_up(new, hidden)       the sequence grew by `new` (m,) on rounds another drafter drafted
                                (draft_hybrid.py); hidden (1, m, d) as in commit. By default a
                                commit that kept none of its own drafts: every drafter here reads
                                n in commit only as len(new) - 1 past the drafts it was fed.
    """
    name = "drafter"
    hidden_layers = ()  # which target hidden states this drafter reads
    max_k = None        # most tokens it can draft in one round (None: no limit)
    default_k = 4       # what bench.py and speculative.py use unless told otherwise (greedy)
    sampled_k = None    # the same when sampling (None: default_k); see k_for
    budget = []         # its training: [{steps, seconds}], a warm start's first (load_drafter)
    sweeps = True       # whether bench's k sweep runs it (not the hybrid: its k is only a cap)

    def begin(self, tokens, hidden):
        raise NotImplementedError

    def propose(self, k, sampler):
        raise NotImplementedError

    def commit(self, n, new, hidden):
        raise NotImplementedError

    def catch_up(self, new, hidden):
        self.commit(new.numel() - 1, new, hidden)

    def batched(self):
        """This drafter over a batch of rows (batched.BatchDrafter). The default asks one fresh
        copy of it per row (batched.PerRow); drafters with a network override it with a native
        batched twin, which drafts every row in one pass."""
        from batched import PerRow
        return PerRow(self)

    def fresh(self):
        """A copy with state of its own (caches, sequence) and the same weights: one per row
        when batched.PerRow batches a drafter. Drafters with buffers override it."""
        return copy.copy(self)


def k_for(drafter, mode):
    """The k a drafter drafts unless told: its best in a bench sweep on the CPU preset, greedy or
    sampled (coupled, temperature 0.8; each drafter's k in docs/experiments.md). Sampling lowers
    acceptance, so long drafts stop paying."""
    return drafter.sampled_k if mode != "greedy" and drafter.sampled_k else drafter.default_k


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

    def add(self, other):
        self.tokens += other.tokens
        self.target_forwards += other.target_forwards
        self.rounds += other.rounds
        for name in ("drafted_at", "accepted_at"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.draft_time += other.draft_time
        self.verify_time += other.verify_time


def check_k(drafter, k):
    """k, the tokens drafted per round, must be one this drafter can draft."""
    if k <= 0:
        raise ValueError(f"k (tokens drafted per round) must be at least 1 (got {k})")
    if drafter.max_k is not None and k > drafter.max_k:
        raise ValueError(f"the {drafter.name} drafter can draft at most {drafter.max_k} tokens "
                         f"per round (asked for k={k})")


@torch.inference_mode()
def generate_speculative(target, drafter, prompt, max_new_tokens, k, sampler, cache=None,
                         trace=None, split_timing=False):
    """Draft k, verify in one target forward, keep the agreed prefix + the target's token.
    Returns (generated tokens, Stats). If `trace` is a list, each round appends
    (accepted draft tokens, the target's own token, whether that token was a bonus; None when
    the round drafted nothing).

    Host syncs: one after the prefill, then exactly one per round (in verify), plus whatever a
    drafter takes itself (DSpark's scheduler reads its confidences once a round). split_timing:
    also wait for the drafter's work before the verify, so Stats' draft/verify split is true on
    a GPU -- a second wait per round, so leave it off when timing throughput. On a CPU the
    split is true either way (nothing runs asynchronously)."""
    check_k(drafter, k)
    dev = target.lm_head.weight.device
    x = as_prompt(prompt, dev)
    P = x.size(1)
    n_total = tokens_allowed(target, P, max_new_tokens)
    layers = drafter.hidden_layers
    cache = cache or target.new_cache()
    cache.reset()
    stats = Stats(drafted_at=[0] * k, accepted_at=[0] * k)

    # the LM head on the last row only, as in generate_plain: the same computation, so the same
    # first token even in float32 (a head over every row may round differently). The drafter
    # still gets the hidden states of every prompt row
    logits, _, hid = target(x, cache=cache, hidden_layers=layers, last_only=True)
    first = sampler.first_token(logits[0], P)
    seq = torch.cat([x[0], first])  # confirmed tokens
    drafter.begin(seq.view(1, -1), hid)
    stats.target_forwards, out = 1, [first.item()]  # host sync (once, after the prefill)

    while len(out) < n_total:
        cache_len = cache.length  # == len(seq) - 1: the last confirmed token is not cached yet
        k_round = min(k, n_total - len(out) - 1)  # never past max_new_tokens or the context window
        t0 = time.perf_counter()
        if k_round > 0:
            draft, q = drafter.propose(k_round, sampler)
        else:
            draft, q = seq[:0], None
        n_drafted = draft.numel()  # a scheduling drafter may offer fewer than asked
        if split_timing:
            synchronize(dev)  # only so that the draft/verify split is honest on a GPU
        t1 = time.perf_counter()
        logits, _, hid = target(torch.cat([seq[-1:], draft]).view(1, -1), cache=cache,
                                hidden_layers=layers)
        # the round's one host sync is inside verify: n and the new tokens come back as host ints,
        # and `new` stays on the device, so nothing is uploaded or read back again this round
        positions = range(cache_len + 1, cache_len + n_drafted + 2)
        n, new_ids, new = sampler.verify(logits[0], draft, q, positions)
        cache.rollback(cache_len + n + 1)  # keep K/V for [last, d1..dn]; t* has none yet
        seq = torch.cat([seq, new])
        drafter.commit(n, new, {layer: h[:, :n + 1] for layer, h in hid.items()})
        stats.verify_time += time.perf_counter() - t1
        stats.draft_time += t1 - t0
        stats.record(n_drafted, n)
        out.extend(new_ids)
        if trace is not None:
            trace.append((new_ids[:n], new_ids[n], None if n_drafted == 0 else n == n_drafted))
    stats.tokens = len(out)
    return out, stats


# -----------------------------------------------------------------------------
# loading drafters by name: the one place that knows which file makes which

DRAFTERS = {  # name -> (module, checkpoint file in out/, train.py stage that makes it)
    "small": ("draft_small", "small.pt", "small"),
    "mtp": ("draft_mtp", "mtp.pt", "mtp"),
    "eagle": ("draft_eagle", "eagle.pt", "eagle"),
    "dflash": ("draft_dflash", "dflash.pt", "dflash"),
    "dspark": ("draft_dspark", "dspark.pt", "dspark"),
    "lookup": ("draft_lookup", None, None),  # prompt lookup: nothing to train, nothing to load
    # prompt lookup and a learned drafter (HYBRID_WITH unless told), chosen round by round: no
    # weights of its own, the learned one's checkpoint
    "hybrid": ("draft_hybrid", None, None),
}
HYBRID_WITH = "dspark"  # the learned drafter the hybrid pairs with the lookup: the strongest one


def load_drafter(name, out_dir, target, target_ckpt, device="cpu", dtype=torch.float32,
                 sampling="greedy", hybrid_with=HYBRID_WITH):
    """Load a drafter: a trained one is checked to belong to this very target and tokenizer;
    one without weights (prompt lookup) is simply built for this target. sampling: the mode it
    will draft in; a checkpoint with sampling weights (DSpark's 'sampled' entry, see
    draft_dspark.sampling_weights) loads those for coupled and rejection sampling.
    hybrid_with: the learned drafter the hybrid pairs with prompt lookup."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: choose from {', '.join(DRAFTERS)}")
    if name == "hybrid":
        if hybrid_with in ("lookup", "hybrid"):
            raise ValueError(f"the hybrid pairs prompt lookup with a learned drafter, not "
                             f"{hybrid_with!r}: choose from "
                             f"{', '.join(n for n in DRAFTERS if n not in ('lookup', 'hybrid'))}")
        from draft_hybrid import HybridDrafter
        learned = load_drafter(hybrid_with, out_dir, target, target_ckpt, device, dtype, sampling)
        return HybridDrafter(learned, target)
    module, fname, stage = DRAFTERS[name]
    if fname is None:  # a drafter with no weights works for any target as it is
        return getattr(importlib.import_module(module), f"load_{name}")(None, target, device, dtype)
    path = os.path.join(out_dir, fname)
    ckpt = load_checkpoint(path, name, stage=stage)
    for what, key, want in (("target", "target_hash", target_ckpt["model_hash"]),
                            ("tokenizer", "tokenizer_hash", target_ckpt["tokenizer_hash"])):
        if ckpt.get(key) != want:
            raise CheckpointError(f"{path} was trained against {what} {str(ckpt.get(key))[:16]} "
                                  f"but the current {what} is {str(want)[:16]}: "
                                  f"run `python train.py --only {stage} --force` to retrain it")
    tuned = ckpt.get("sampled") if sampling != "greedy" else None
    if tuned:
        ckpt = {**ckpt, "state_dict": tuned["state_dict"]}
    try:
        load = getattr(importlib.import_module(module), f"load_{name}")
        drafter = load(ckpt, target, device, dtype)
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not fit its config ({str(e).splitlines()[0][:120]}); "
                              f"run `python train.py --only {stage} --force`") from None
    # what its training cost
    drafter.budget = [b for b in (ckpt.get("init_budget"), ckpt.get("budget"),
                                  tuned and tuned["budget"]) if b]
    return drafter


# -----------------------------------------------------------------------------
# watch it work


def show(enc, prompt_ids, trace, color):
    """Prompt, then each round: accepted drafts (green), the target's own token (red if it
    corrected a draft, blue if it was a free bonus after full acceptance, plain if nothing was
    drafted that round: `full` is None)."""
    if color:
        G, R, B, Z = "\033[32m", "\033[31;1m", "\033[34;1m", "\033[0m"
    else:
        G, R, B, Z = "", "[", "{", ""
    parts = [enc.decode(prompt_ids)]
    for acc, tok, full in trace:
        if acc:
            parts.append(G + enc.decode(acc) + Z)
        if full is None:  # a round with no draft (prompt lookup found no match): a plain step
            parts.append(enc.decode([tok]))
            continue
        close = (Z if color else ("}" if full else "]"))
        parts.append((B if full else R) + enc.decode([tok]) + close)
    return "".join(parts)


DEFAULT_TEMPERATURE = 1.0  # the flag's default is None, so that parse_args can tell "not given"


def add_sampling_flags(p):
    """--sampling, --temperature, --top-k, --seed: the same four flags here and in bench.py."""
    p.add_argument("--sampling", default="greedy", choices=["greedy", "coupled", "rejection"],
                   help="acceptance rule (default: %(default)s)")
    p.add_argument("--temperature", type=number(float, above=0), default=None,
                   help=f"sampling temperature (coupled/rejection; default: {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-k", type=number(int, 1), default=None,
                   help="sample only among the k most likely tokens (default: all of them)")
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0,
                   help="sampling seed (default: %(default)s)")


def build_parser():
    p = ArgumentParser(description="Generate text with speculative decoding and show what was "
                                   "drafted and kept.")
    p.add_argument("--prompt", default="def parse(", help="the text to continue")
    p.add_argument("--method", default="small",
                   help=f"drafter: {', '.join(DRAFTERS)} (default: small)")
    p.add_argument("--k", type=number(int, 1), default=None,
                   help="tokens drafted per round (default: the drafter's own)")
    p.add_argument("--hybrid-with", default=HYBRID_WITH,
                   help="with --method hybrid: the learned drafter it pairs with prompt lookup "
                   "(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=number(int, 1), default=96,
                   help="how many tokens to generate")
    add_sampling_flags(p)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--out-dir", type=path_arg("dir"), default="out",
                   help="where train.py put the checkpoints")
    p.add_argument("--no-color", action="store_true",
                   help="mark tokens with [correction] and {bonus} instead of colors")
    return p


def sampling_flag_problems(sampling, temperature_given, top_k_given):
    """The one-line warning for sampling flags the chosen mode does not use, or None. Greedy
    decoding takes the argmax, so --temperature and --top-k would be silently ignored. (Values
    no mode can use, like a temperature <= 0, are refused where they are parsed.)"""
    flags = (("--temperature", temperature_given), ("--top-k", top_k_given))
    unused = [f for f, given in flags if given]
    if sampling != "greedy" or not unused:
        return None
    return (f"warning: {' and '.join(unused)} unused: --sampling greedy takes the argmax "
            "(use coupled or rejection to sample)")


def parse_args(parser, argv=None):
    """parser.parse_args, warning (one line, on stderr) about sampling flags the mode ignores,
    then filling in the temperature's default."""
    a = parser.parse_args(argv)
    warning = sampling_flag_problems(a.sampling, a.temperature is not None, a.top_k is not None)
    if warning:
        print(warning, file=sys.stderr)
    if a.temperature is None:
        a.temperature = DEFAULT_TEMPERATURE
    return a


def main(argv=None):
    a = parse_args(build_parser(), argv)
    import data
    device = pick_device(a.device)
    target, target_ckpt = load_target(os.path.join(a.out_dir, "target.pt"), device)
    enc = data.encoding_of(data.load_build(a.out_dir))  # every data file checked
    drafter = load_drafter(a.method, a.out_dir, target, target_ckpt, device, sampling=a.sampling,
                           hybrid_with=a.hybrid_with)
    sampler = Sampler(a.sampling, a.temperature, a.top_k, a.seed, device)
    ids = data.encode(enc, a.prompt)
    trace = []
    a.k = a.k if a.k is not None else k_for(drafter, a.sampling)
    out, stats = generate_speculative(target, drafter, ids, a.max_new_tokens, a.k, sampler,
                                      trace=trace, split_timing=True)
    color = sys.stdout.isatty() and not a.no_color
    print(show(enc, ids, [([], out[0], False)] + trace, color))
    print()
    if len(out) < a.max_new_tokens:
        print(f"(stopped at the context limit: prompt + generated = {len(ids) + len(out)} tokens, "
              f"the target's context window)")
    print(f"method {a.method}, k={a.k}, {a.sampling}: {stats.tokens} tokens in "
          f"{stats.target_forwards} target forwards, tau = {stats.tau:.2f}")
    print("acceptance by draft position: " + " ".join(f"{x:.0%}" for x in stats.acceptance()))
    print(f"time: draft {stats.draft_time * 1000:.0f} ms, verify {stats.verify_time * 1000:.0f} ms")
    if color:
        legend = "green = accepted draft, red = target's correction, blue = target's bonus"
    else:
        legend = "plain = accepted draft, [x] = target's correction, {x} = target's bonus"
    print(legend)


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}")
