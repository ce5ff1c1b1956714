"""
draft_mtp.py -- multi-token prediction (MTP) as a built-in drafter
(DeepSeek-V3, arXiv 2412.19437, §2.2).

draft_small.py drafted with an independent small GPT that reads only tokens. An MTP module
instead reads the target's own last hidden state: to predict the token after next it takes
h_i (what the target 'thinks' at position i) and the embedding of t_{i+1} (the token the
target just chose), mixes them with one linear map, runs ONE transformer layer and reads
the answer off the target's own LM head:

    h'_i = M · [RMSNorm(h_i) ; RMSNorm(Emb(t_{i+1}))]      M: 2d -> d, no bias
    h''_i = Layer(h'_0 .. h'_i)                             causal, its own KV cache
    p(t_{i+2}) = softmax(lm_head(ln_f(h''_i)))              the target's ln_f + lm_head

Embedding and LM head are the target's (frozen at draft time), so the module is tiny: one
layer plus M. D modules chain as in DeepSeek-V3 (module m reads module m-1's output and
t_{i+m}, predicts t_{i+m+1}); drafts deeper than D reuse the last module recursively,
feeding back its own output and its own drafted token (as vLLM/SGLang do).

Position: no position embedding is added. h_i already carries position (the target added
wpe at its input and every causal layer has mixed it in), and the layer's causal attention
sees the module's own history. The module is thereby free of absolute positions.

It trains two ways (train.py --mtp-mode). `joint` adds λ·L_mtp to the target's own loss while
the target trains (DeepSeek-V3, λ = 0.3) and writes out/mtp.pt with the target. `posthoc` (the
default) trains the module alone on the frozen target, on text the target wrote itself: half
distillation of the target's own distribution of the token after next (KL + TV), half
cross-entropy on that text's own token after next, which on the greedy three quarters of the
set is the target's own choice. A drafter is judged by agreeing with the target, not the data;
the hard half puts weight on the one token greedy decoding accepts (docs/experiments.md: MTP:
posthoc vs joint; MTP: distillation + text).

Post hoc, the module also learns the recursion it drafts with (FastMTP, Cai et al., Tencent
2025, arXiv 2509.18362): trained on h_i alone, it would meet its own outputs for the first time
at inference, from draft 2 on. So training unrolls it over --mtp-unroll draft steps with shared
weights, each fed its own previous output, with the attention it has at inference, the step
losses weighted beta^(j-1) (see "learning its own recursion"). EAGLE-3 calls the same thing its
training-time test (draft_eagle.py).

    python train.py --only mtp && python sample.py --method mtp --k 2
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

import ragged
from gpt import Layer, GPTConfig, attention
from draft_small import total_variation
from speculative import Drafter

# -----------------------------------------------------------------------------
# config


@dataclass
class MTPConfig:
    n_embd: int = 256     # must equal the target's width: h_i and its embedding go in as they are
    n_head: int = 8       # attention heads: the target's (its layer is one more of the target's)
    n_modules: int = 1    # D: chained modules (DeepSeek-V3: 1); deeper drafts reuse the last one
    sequence_len: int = 256  # the target's context window: size of the module's KV cache
    bias: bool = True     # like the target's Linears and LayerNorms (M itself never has a bias)
    label = "MTP"  # what a refusal calls it (not a field)

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        return cls(**d)

    @classmethod
    def for_target(cls, gpt_config, n_modules=1):
        c = gpt_config
        return cls(n_embd=c.n_embd, n_head=c.n_head, n_modules=n_modules,
                   sequence_len=c.sequence_len, bias=c.bias)

    def layer_config(self):
        return GPTConfig(sequence_len=self.sequence_len, n_layer=1, n_head=self.n_head,
                         n_embd=self.n_embd, bias=self.bias)

    def fitted(self, target_config):
        """This config, checked to fit the target whose states it reads and whose embedding and
        head it shares (width, heads, context): a checkpoint made for another target is refused."""
        c = target_config
        if (self.n_embd, self.n_head, self.sequence_len) != (c.n_embd, c.n_head, c.sequence_len):
            raise RuntimeError(f"{self.label} config {self} does not fit the target {c}")
        return self


# -----------------------------------------------------------------------------
# the module


class MTPModule(nn.Module):
    """One depth: (h_i, Emb(t_{i+m})) -> h''_i, from which the target's LM head predicts
    t_{i+m+1}."""

    def __init__(self, config):
        super().__init__()
        d = config.n_embd
        # h comes off the residual stream un-normalised, Emb is ~N(0, 0.02): normalising both
        # puts them on one scale before M mixes them
        self.norm_h = nn.RMSNorm(d)
        self.norm_e = nn.RMSNorm(d)
        self.proj = nn.Linear(2 * d, d, bias=False)  # M
        self.layer = Layer(config.layer_config())

    def mix(self, h, e):
        """M · [RMSNorm(h) ; RMSNorm(e)]: the layer's input, (B, T, d)."""
        return self.proj(torch.cat([self.norm_h(h), self.norm_e(e)], dim=-1))

    def forward(self, h, e):
        """Training's pass: plain causal attention over the T entries (drafting runs mix() and
        its layer over a ragged cache: MTPDrafter.step)."""
        return self.layer(self.mix(h, e))


def gpt2_init(module):
    """GPT-2's init over a drafter's own weights: N(0, 0.02), residual projections scaled down,
    biases zero (draft_eagle.py's network starts the same way)."""
    for pn, p in module.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2) if pn.endswith("c_proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        elif pn.endswith("bias"):
            nn.init.zeros_(p)


def lm_logits(target, h):
    """The target's own output head (ln_f + lm_head): shared, never copied into the checkpoint."""
    return target.lm_head(target.transformer.ln_f(h))


class MTP(nn.Module):
    """D chained MTP modules. Only these weights train in posthoc mode and go in out/mtp.pt;
    the target (embedding, LM head, hidden states) is passed in, never registered as a submodule."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.mods = nn.ModuleList([MTPModule(config) for _ in range(config.n_modules)])
        gpt2_init(self)

    def forward(self, target, hidden, idx, next_tok):
        """Training forward over whole sequences.

        hidden (B, T, d): the target's last layer's output at positions 0..T-1 of idx (B, T);
        next_tok (B, 1): the token after idx (so t_0..t_T are all known).
        Module m (1-based) runs over indices i = 0..T-1-m: input (h^{m-1}_i, t_{i+m}), predicting
        t_{i+m+1}. Returns ([logits (B, T-m, V) for each m], [targets (B, T-m) for each m])."""
        T = idx.size(1)
        full = torch.cat([idx, next_tok], dim=1)  # (B, T+1): t_0 .. t_T
        wte = target.transformer.wte
        h, logits, targets = hidden, [], []
        for m, mod in enumerate(self.mods, start=1):
            h = mod(h[:, :T - m], wte(full[:, m:T]))  # (B, T-m, d): plain causal attention from 0
            logits.append(lm_logits(target, h))
            targets.append(full[:, m + 1:T + 1])
        return logits, targets


def mtp_loss(mtp, target, hidden, x, y, target_logits=None, distill=0.0, steps=1, beta=0.6,
             anchors=None):
    """Mean over the D modules of step_loss: (1 - distill)·CE(data) + distill·(KL(target ||
    module) + TV), with CE the cross-entropy against the text's own next tokens, KL the
    Kullback-Leibler divergence and TV the total variation distance
    (draft_small.total_variation). The distillation teacher for module m at index i is the
    target's own distribution at position i+m (given the true prefix), which is exactly what
    greedy acceptance compares to. steps > 1 (one module): its own recursion unrolled over that
    many draft steps at `anchors` instead (recursion_loss, below)."""
    if steps > 1:
        full = torch.cat([x, y[:, -1:]], dim=1)  # (B, T+1): t_0 .. t_T
        return recursion_loss(mtp.mods[0], target, hidden, full, target_logits, distill, steps,
                              beta, anchors)
    logits, targets = mtp(target, hidden, x, y[:, -1:])
    total = 0.0
    for m, (lg, tg) in enumerate(zip(logits, targets), start=1):
        teacher = target_logits[:, m:] if distill > 0 else None
        total = total + step_loss(lg, tg, teacher, distill)
    return total / len(logits)


# -----------------------------------------------------------------------------
# learning its own recursion: the draft steps unrolled in training (FastMTP, arXiv 2509.18362;
# the same idea is EAGLE-3's "training-time test", draft_eagle.py)
#
# Trained as above, the module only ever reads the target's state h_i. At inference, drafts 2..k
# feed it its OWN previous output instead (MTPDrafter.propose), an input it never saw in
# training; what that costs depends on how far its output lies from the states it was trained
# on (little for MTP here, much for EAGLE-3's fused input: docs/experiments.md, "MTP: its own
# recursion (FastMTP)" and "EAGLE-3: training-time test"). The fix is to train what inference
# runs: the module is unrolled over `steps` draft steps with shared weights, step j reading
# step j-1's output and predicting one token further, with exactly the attention it has at
# inference. There the module's cache holds one exact entry per confirmed position, fed by the
# target, and then the round's own recursive entries: a step-j query at index i sees the step-1
# entries 0..i and its own chain's entries of steps 2..j at i, nothing else. So step 1 runs
# teacher-forced over the whole window (plain causal attention), and steps 2.. run at a sample
# of anchors i, each attending to step 1's keys 0..i plus its chain's own keys. The tokens fed
# in are the text's (t_{i+j}): a draft that differs from them would be rejected at inference
# anyway.


def qkv(layer, x):
    """q, k, v of a gpt.Layer's attention on its input x (B, T, C): each (B, nh, T, hs)."""
    B, T, C = x.shape
    nh = layer.attn.n_head
    return [t.view(B, T, nh, C // nh).transpose(1, 2)
            for t in layer.attn.c_attn(layer.ln_1(x)).split(C, dim=2)]


def layer_rest(layer, x, y):
    """The rest of gpt.Layer.forward after the attention: y (B, nh, T, hs) its attention heads'
    output."""
    B, nh, T, hs = y.shape
    x = x + layer.attn.resid_dropout(layer.attn.c_proj(y.transpose(1, 2).reshape(B, T, nh * hs)))
    return x + layer.mlp(layer.ln_2(x))


def chain_attention(q, k1, v1, visible, chain):
    """A step-j query at anchor i over step 1's keys k1, v1 (B, nh, T, hs) where visible (B, A, T)
    (index <= i) and over its own chain's keys [(k, v) (B, nh, A, hs)], steps 2..j at i."""
    scale = q.size(-1) ** -0.5
    s1 = (q @ k1.transpose(-1, -2) * scale).masked_fill(~visible[:, None], float("-inf"))
    ks = torch.stack([k for k, _ in chain], -2)  # (B, nh, A, j-1, hs)
    vs = torch.stack([v for _, v in chain], -2)
    s = torch.cat([s1, (q[..., None, :] * ks).sum(-1) * scale], -1).softmax(-1)  # (B, nh, A, T+j-1)
    T = k1.size(2)
    return s[..., :T].to(v1.dtype) @ v1 + (s[..., T:, None] * vs).sum(-2).to(v1.dtype)


def unrolled(mod, target, h, full, steps, anchors=None):
    """One module's training forward over `steps` draft steps with shared weights.

    h (B, T, d): what step 1 reads at positions 0..T-1 (MTP: the target's last states; EAGLE-3:
    its fused taps); full (B, T+1): tokens t_0..t_T; anchors (B, A): the indices at which steps
    2.. unroll (each <= T-1-steps). Step j at index i reads (its step j-1 output at i, t_{i+j})
    and predicts t_{i+j+1}; step 1 reads (h_i, t_{i+1}) at every i = 0..T-2.
    Returns [(outputs (B, n, d), the positions of the tokens they predict (B, n))], one per step:
    step 1 over every index, later steps at the anchors."""
    B, T, _ = h.shape
    wte, layer = target.transformer.wte, mod.layer
    x = mod.mix(h[:, :T - 1], wte(full[:, 1:T]))  # (B, T-1, d)
    q, k1, v1 = qkv(layer, x)
    o = layer_rest(layer, x, attention(q, k1, v1, is_causal=True))  # (B, T-1, d): plain causal
    idx = torch.arange(T - 1, device=h.device)
    out = [(o, (idx + 2).expand(B, -1))]
    if steps == 1:
        return out
    o = o.gather(1, anchors[..., None].expand(-1, -1, o.size(-1)))  # (B, A, d)
    visible = idx[None, None, :] <= anchors[..., None]  # (B, A, T-1): step 1's entries 0..i
    chain = []
    for j in range(2, steps + 1):
        # (B, A, d): (o^{j-1}_i, t_{i+j}); o in h's dtype, as an autocast Linear left it bf16
        x = mod.mix(o.to(h.dtype), wte(full.gather(1, anchors + j)))
        q, k, v = qkv(layer, x)
        chain.append((k, v))
        o = layer_rest(layer, x, chain_attention(q, k1, v1, visible, chain))
        out.append((o, anchors + j + 1))
    return out


def unroll_anchors(B, T, steps, n, gen=None, device="cpu"):
    """(B, n) distinct indices per row at which to unroll `steps` steps in a window of T
    inputs: every step's label must lie in the window (i + steps <= T - 1); all of them if n
    is larger."""
    hi = T - steps  # indices 0 .. T-1-steps
    if hi < 1:
        raise ValueError(f"a window of {T} tokens cannot unroll {steps} draft steps")
    return torch.rand(B, hi, generator=gen).argsort(dim=1)[:, :n].to(device)


def step_loss(logits, labels, teacher, distill):
    """(1 - distill)·CE(labels) + distill·(KL(teacher || drafter) + TV), mean over rows:
    logits (..., V) the drafter's, labels (...) the text's tokens, teacher (..., V) the target's
    logits for the same tokens (used only with distill > 0)."""
    logq = F.log_softmax(logits, dim=-1)  # once for both terms: the largest tensor
    loss = F.nll_loss(logq.flatten(0, -2), labels.flatten()) if distill < 1 else 0.0
    if distill > 0:
        p_log = F.log_softmax(teacher.detach(), dim=-1)
        p = p_log.exp()
        kl = (p * (p_log - logq)).sum(-1) + total_variation(logq, p)
        loss = (1 - distill) * loss + distill * kl.mean()
    return loss


def recursion_loss(mod, target, h, full, t_logits, distill, steps, beta, anchors):
    """sum_j beta^(j-1) L_j / sum_j beta^(j-1) over the unrolled steps (FastMTP: beta = 0.6),
    L_j = step_loss of step j; t_logits (B, T, V) the target's logits at positions 0..T-1, the
    teacher of the token at position p being t_logits[:, p-1]."""
    total, weights = 0.0, 0.0
    b = torch.arange(h.size(0), device=h.device)[:, None]
    for j, (o, pos) in enumerate(unrolled(mod, target, h, full, steps, anchors)):
        teacher = t_logits[b, pos - 1] if distill > 0 else None
        total = total + beta ** j * step_loss(lm_logits(target, o), full[b, pos], teacher, distill)
        weights += beta ** j
    return total / weights


# -----------------------------------------------------------------------------
# drafting


class MTPDrafter(Drafter):
    """Drafts with the MTP modules, each keeping its own KV cache indexed by i (the position of
    the target hidden state at the root of that entry).

    Bookkeeping. The confirmed sequence is t_0..t_{S-1}; the target has h_0..h_{S-2}.
      - Entry i of module m reads (h^{m-1}_i, t_{i+m}) and predicts t_{i+m+1}. It is EXACT
        (a pure function of confirmed data) when i <= S-1-m. Module 1's exact entries are
        0..S-2: all of them, since h_i is the target's own.
      - propose: module m (m <= D) first catches up on a chunk of indices [cache length, S-2]
        in one forward (for m = 1 these are the target states that commit handed over, the
        last one being step 1 = (h_{S-2}, t*)); the output at S-2 drafts token S+m-1. Module
        m >= 2 reads the drafts d_1..d_{m-1} at its tail, so its last m-1 entries are
        speculative. Steps past D reuse module D at indices S-1, S, ...: input = its own
        previous output (standing in for a target state it does not have) + its own last
        draft. Those RECURSIVE entries are always speculative.
      - commit: every cache is cut back to its exact entries (module m: indices < S-m, with
        S the length before the commit), and the target's states of the n+1 positions that
        just became 'all but the last' go into H[0], to be eaten by the next propose.
    H[m, r, i] keeps module m's output at index i of row r (H[0] = the target's states): module
    m+1 reads it. Every row of a batch keeps its own caches' lengths (ragged.py); one request is
    a batch of one row.

    A round on its own, run as written (tests/test_layout.py runs every example of the lesson):
    two chained modules, so that k = 4 drafts with both and then recursively, on a tiny random
    target in float64.

        >>> from gpt import GPT
        >>> from sampler import Sampler
        >>> from speculative import generate_plain, generate_speculative
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> mtp = MTP(MTPConfig.for_target(target.config, n_modules=2)).double().eval()
        >>> drafter = MTPDrafter(mtp, target)
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_speculative(target, drafter, prompt, 12, 4, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    name = "mtp"
    # trained on the target's own text, the module's acceptance decays slowly by position, so deep
    # drafts pay; under sampling the later drafts rarely survive (each the best of a sweep,
    # docs/experiments.md: MTP: k)
    default_k = 5
    sampled_k = 3
    max_k = None

    def __init__(self, mtp, target):
        self.mtp, self.target = mtp, target
        self.hidden_layers = (target.config.n_layer,)

    def features(self, hidden):
        """What step 1 reads at each position, from the target's returned states: (B, T, d).
        For MTP the last layer's output h_i (draft_eagle.py fuses three layers instead)."""
        return hidden[self.hidden_layers[0]]

    def begin_batch(self, seqs, hidden):
        cfg, p, B, D = self.mtp.config, self.target.lm_head.weight, len(seqs), self.mtp.config.n_modules
        # one cache per module (module m's is caches[m-1]): the modules' exact extents differ;
        # every row at its own length (a request: one row)
        self.caches = [ragged.RaggedCache(cfg.layer_config(), B, p.device, p.dtype)
                       for _ in range(D)]
        width = cfg.sequence_len + self.caches[0].slack
        self.rows = ragged.Confirmed(seqs, width)  # its drafts go after each row's end
        self.H = torch.zeros(D + 1, B, width, cfg.n_embd, device=p.device, dtype=p.dtype)
        h = self.features(hidden)  # (B, P, d): row r's first S_r - 1 valid
        self.H[0, :, :h.size(1)] = h

    def step(self, m, h, toks, counts):
        """Module m over row r's counts[r] entries (h (B, T, d), toks (B, T)) at its next indices,
        all rows in one forward (ragged.py) -> its outputs (B, T, d) and where they are."""
        cache = self.caches[m - 1]
        rag = ragged.Ragged(cache.lengths, counts, h.size(1), h.device)
        mod = self.mtp.mods[m - 1]
        x = mod.mix(rag.pack(h), rag.pack(self.target.transformer.wte(toks)))
        out = ragged.layer(mod.layer, x, (cache.k[0], cache.v[0]), rag)
        cache.lengths = [n + c for n, c in zip(cache.lengths, counts)]
        return rag.unpack(out), rag

    @torch.inference_mode()
    def propose_batch(self, ks, sampler):
        S, D, B = self.rows.lengths, self.mtp.config.n_modules, len(ks)
        drafts, qs = [], []
        # a propose before this one (no commit between): back to the exact entries, and each
        # module re-runs at least index S-2, whose output drafts (after a commit: no change)
        for j, c in enumerate(self.caches, start=1):
            c.rollback([max(0, min(n, s - max(j, 2))) for n, s in zip(c.lengths, S)])

        def draft(h, j):  # h (B, 1, d) -> draft j (B, 1) at position S + j - 1, written after
            live = [int(k >= j) for k in ks]  # each row's confirmed tokens (module j + 1 reads it)
            tok, q = sampler.draft(lm_logits(self.target, h), [s + j - 1 for s in S], live)
            at = ragged.offsets([s + j - 1 for s in S], 1, tok.device)
            self.rows.toks.scatter_(1, at.clamp_max(self.rows.toks.size(1) - 1), tok)
            drafts.append(tok)
            qs.append(q)
            return tok

        # chained modules: module j over indices [cache length, S-2]; output at S-2 drafts S+j-1
        for j in range(1, min(max(ks), D) + 1):
            first = self.caches[j - 1].lengths  # the first index module j has not seen yet
            chunk = [s - 1 - f if k >= j else 0 for s, f, k in zip(S, first, ks)]
            T = max(max(chunk), 1)
            pos = ragged.offsets(first, T, self.H.device).clamp_max(self.H.size(2) - 1)  # (B, T)
            rows = torch.arange(B, device=pos.device)[:, None]
            out, rag = self.step(j, self.H[j - 1, rows, pos], self.rows.at(
                [f + j for f in first], T), chunk)  # (B, T, d)
            self.H[j, rows, pos] = out  # module j + 1 reads it (padding slots: stale, past S-2)
            h_last = rag.last(out)
            draft(h_last, j)
        # recursion: module D again at index S-2+(j-D), fed its own last output and last draft
        for j in range(D + 1, max(ks) + 1):
            h_last, _ = self.step(D, h_last, drafts[-1], [int(k >= j) for k in ks])
            draft(h_last, j)
        q = torch.cat(qs, 1) if qs[0] is not None else None
        return torch.cat(drafts, 1), list(ks), q

    def commit_batch(self, kept, new, hidden):
        S = self.rows.lengths
        for m, c in enumerate(self.caches, start=1):  # keep exact entries 0..S-1-m, drop the rest
            c.rollback([max(0, min(n, s - m)) if kk else n
                        for n, s, kk in zip(c.lengths, S, kept)])
        h = self.features(hidden)  # (B, T, d): h_{S-1} .. of every row
        pos = ragged.offsets([s - 1 for s in S], h.size(1), h.device)
        self.H[0, torch.arange(h.size(0), device=h.device)[:, None], pos] = h
        self.rows.extend(new, kept)

    def fresh(self):
        return type(self)(self.mtp, self.target)  # caches and states of its own


# -----------------------------------------------------------------------------
# declared once: what the house reads of this file (registry/drafters.py lists it; how it learns
# in train.py, its stage, is training/stages_mtp.py)

DRAFTER = dict(
    name="mtp",
    network=lambda config, target: MTP(MTPConfig.from_dict(config).fitted(target.config)),
    drafter=MTPDrafter,
    pairs=True,
)
