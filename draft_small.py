"""
draft_small.py -- classic speculative decoding: an independent small GPT drafts for the target.

Papers: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding",
ICML 2023, arXiv 2211.17192; Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling", 2023, arXiv 2302.01318.

speculative.py made the loop and the `Drafter` interface; this file adds the first drafter
anyone tries: a second, much smaller GPT (gpt.py's own class, 1 layer x 128 on the CPU preset)
with its own KV cache, drafting k tokens one forward at a time. Its cost grows linearly with
k, which is what the later drafters (draft_mtp.py, draft_dflash.py) attack.

How it learns: by distillation. It trains on text the target wrote itself (train.py's
distillation set) against the target's own distributions, KL + total variation. The total
variation term, shared by every drafter's loss, lives here where it first appears
(total_variation: why).

    python train.py --only small && python speculative.py --method small
"""

import torch
import torch.nn.functional as F

from gpt import GPT, GPTConfig, number, setting
from batched import BatchDrafter, Confirmed
from speculative import Drafter

# -----------------------------------------------------------------------------
# the drafter


class DraftModel(Drafter):
    """An independent small GPT with its own KV cache.

    Cache bookkeeping: after drafting k tokens the cache holds the confirmed tokens plus
    d1..d_{k-1} (d_k was predicted, never fed). On commit with n < k it is cut back to the
    confirmed prefix plus d1..dn; with n == k it keeps d1..d_{k-1} and d_k is fed, together
    with the target's token, at the start of the next propose."""
    name = "small"
    # k: the best of a bench sweep on the CPU preset (docs/experiments.md: Small model: k)
    default_k = 5
    sampled_k = 1  # under sampling its acceptance falls fastest: one draft a round pays best

    def __init__(self, model):
        self.model = model
        self.cache = model.new_cache()

    def begin(self, tokens, hidden):
        self.cache.reset()
        self.seq = tokens.view(-1).clone()

    @torch.inference_mode()
    def propose(self, k, sampler):
        S = self.seq.numel()
        # the confirmed tokens not yet in the cache (at least one)
        pending = self.seq[self.cache.length:].view(1, -1)
        drafts, qs = [], []
        for j in range(k):
            logits = self.model(pending, cache=self.cache, last_only=True)[0][0]  # (1, V)
            tok, q = sampler.draft(logits, [S + j])
            drafts.append(tok)
            qs.append(q)
            if j + 1 < k:
                pending = tok.view(1, 1)
        return torch.cat(drafts), (torch.cat(qs) if qs[0] is not None else None)

    def fresh(self):
        return DraftModel(self.model)

    def batched(self):
        return BatchSmall(self)

    def commit(self, n, new, hidden):
        S = self.seq.numel()
        k_minus_1 = self.cache.length - S  # how many drafts were fed
        self.cache.rollback(S + min(n, k_minus_1))
        self.seq = torch.cat([self.seq, new.to(self.seq.device)])


def load_small(ckpt, target, device, dtype):
    model = GPT(GPTConfig.from_dict(ckpt["config"]))
    model.load_state_dict(ckpt["state_dict"])
    return DraftModel(model.to(device=device, dtype=dtype).eval())


# -----------------------------------------------------------------------------
# many requests at once (batched.py): the same drafter over a ragged batch


class BatchSmall(BatchDrafter):
    """DraftModel over B rows in one pass: one RaggedCache for the small GPT, each row at its own
    length. A round feeds every row its pending confirmed tokens (1 or 2) and then its drafts one
    step at a time, all rows together; a row that wants fewer drafts gets zero tokens in the
    later steps (packed away). The cache bookkeeping is DraftModel's, per row."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.model = drafter.model

    def begin(self, seqs, hidden):
        self.cache = self.model.new_cache(len(seqs), ragged=True)
        self.rows = Confirmed(seqs, self.model.config.block_size + self.cache.slack)

    @torch.inference_mode()
    def propose(self, ks, sampler):
        S, B, K = self.rows.lengths, len(ks), max(ks)
        pending = [s - n for s, n in zip(S, self.cache.lengths)]  # not yet in the cache (>= 1)
        x = self.rows.at(self.cache.lengths, max(pending))
        counts = [p if k > 0 else 0 for p, k in zip(pending, ks)]
        drafts, qs = [], []
        for j in range(K):
            logits = self.model(x, cache=self.cache, counts=counts, last_only=True)[0]  # (B, 1, V)
            x, q = sampler.draft(logits, [s + j for s in S], [int(k > j) for k in ks])  # (B, 1)
            drafts.append(x)
            qs.append(q)
            counts = [1 if k > j + 1 else 0 for k in ks]  # the last draft is never fed
        q = torch.cat(qs, 1) if qs[0] is not None else None
        return torch.cat(drafts, 1), list(ks), q

    def commit(self, kept, new, hidden):
        S = self.rows.lengths
        # row r keeps its confirmed prefix plus the surviving drafts it was fed
        self.cache.rollback([min(n, s + max(m - 1, 0)) if m else n
                             for n, s, m in zip(self.cache.lengths, S, kept)])
        self.rows.extend(new, kept)


# -----------------------------------------------------------------------------
# the distillation term every drafter's loss shares


def total_variation(logq, p):
    """TV(q, p) = 1/2 sum_v |q_v - p_v| over the last axis: logq the drafter's log-probabilities,
    p the target's probabilities -> one distance per row. Every drafter trains on the target's
    soft labels (cross-entropy, or KL: the same gradient) plus this. Why: a draft survives about
    as often as the two distributions overlap (exactly 1 - TV under rejection sampling), and TV,
    unlike cross-entropy, spends nothing on tokens neither model would pick. It raised every
    drafter's tau (docs/experiments.md: Loss: CE + TV)."""
    return 0.5 * (logq.float().exp() - p.float()).abs().sum(-1)


# -----------------------------------------------------------------------------
# how it learns: train.py runs train_small(trainer) as its "small" stage

SETTINGS = {
    "small_layers": setting(1, "small: number of blocks", cuda=2, gpt2=4),
    "small_embd": setting(128, "small: width", cuda=256, gpt2=384, tiny=16),
    "small_heads": setting(4, "small: attention heads", gpt2=6, tiny=2),
    "small_iters": setting(500, "small: optimizer steps", cuda=2000, gpt2=6000, quick=100,
                           tiny=10),
    "small_lr": setting(3e-3, "small: peak learning rate", cuda=2e-3),
    "small_distill": setting(1.0, "small: weight of the KL-to-target loss (1 = pure "
                             "distillation, 0 = the text's own tokens only)",
                             type=number(float, 0, 1)),
    "small_text": setting("gen", "small: training text, 'gen' (the distillation set the "
                          "target wrote) or 'data' (the corpus)", choices=["gen", "data"]),
}


def phases(a):
    """The train_loop phases this stage runs: (name, steps). Checks the settings too."""
    if a.small_embd % a.small_heads:
        raise ValueError(f"--small-embd ({a.small_embd}) must be a multiple of --small-heads "
                         f"({a.small_heads})")
    return [("small", a.small_iters)]


def train_small(tr):
    """A 1-2 layer GPT, distilled from the target on its own text -> out/small.pt."""
    a = tr.args
    target, target_ckpt = tr.target()
    cfg = GPTConfig(block_size=a.block_size, vocab_size=target.config.vocab_size,
                    n_layer=a.small_layers, n_head=a.small_heads, n_embd=a.small_embd)
    torch.manual_seed(a.seed + 1)
    model = GPT(cfg).to(tr.device)
    print(f"small: {model.num_params() / 1e6:.2f}M parameters, {cfg}")

    def loss_of(w, p_logits, hid=None):
        """w (B, T): inputs w[:, :-1], labels w[:, 1:]; p_logits: the target's on w (causal, so
        [:, :-1] are its distributions for the labels)."""
        logits, ce, _ = model(w[:, :-1], w[:, 1:])
        if a.small_distill == 0:
            return ce
        teacher = F.log_softmax(p_logits[:, :-1], -1)
        logq = F.log_softmax(logits, -1)
        kl = F.kl_div(logq, teacher, log_target=True, reduction="batchmean") / logits.size(1)
        kl = kl + total_variation(logq, teacher.exp()).mean()
        return a.small_distill * kl + (1 - a.small_distill) * ce

    fingerprint = {"stage": "small", "config": cfg.to_dict(), "target": target_ckpt["model_hash"],
                   "iters": a.small_iters, "lr": a.small_lr, "distill": a.small_distill,
                   "seed": a.seed, "text": tr.distill.key(a.small_text)}
    batches = tr.distill.batches(a.small_text)
    val, _ = tr.fit("small", model, lambda s: loss_of(*batches(s)),
                    lambda: tr.val_loss(lambda x, y: model(x, y)[1]),
                    steps=a.small_iters, lr=a.small_lr, fingerprint=fingerprint,
                    tokens_per_step=a.batch_size * a.block_size)
    tr.save("small", cfg.to_dict(), model, {"val_loss": val})
    return val
