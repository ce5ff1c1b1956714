"""
draft_small.py -- classic speculative decoding: an independent small GPT drafts for the target.

Papers: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding",
ICML 2023, arXiv 2211.17192; Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling", 2023, arXiv 2302.01318.

speculative.py made the loop and the `Drafter` interface; this file adds the first drafter
anyone tries: a second, much smaller GPT (gpt.py's own class, 1 layer x 128 on the CPU preset)
with its own KV cache, drafting k tokens one forward at a time. Its cost grows linearly with
k, which is what the later drafters (draft_mtp.py, draft_dflash.py) attack.

How it learns (small_loss): by distillation. It trains on text the target wrote itself
(training/distill.py) against the target's own distributions, KL + total variation, in
the trainer's loop (training/trainer.py). The total variation term, shared by every drafter's loss, lives here where it
first appears (total_variation: why).

    python train.py --only small && python sample.py --method small
"""

import torch
import torch.nn.functional as F

import ragged
from gpt import GPT, GPTConfig
from speculative import Drafter

# -----------------------------------------------------------------------------
# the drafter


class DraftModel(Drafter):
    """An independent small GPT with its own KV cache.

    Cache bookkeeping: after drafting k tokens the cache holds the confirmed tokens plus
    d1..d_{k-1} (d_k was predicted, never fed). On commit with n < k it is cut back to the
    confirmed prefix plus d1..dn; with n == k it keeps d1..d_{k-1} and d_k is fed, together
    with the target's token, at the start of the next propose.

    A round on its own, run as written (tests/test_layout.py runs every example of the lesson):
    a tiny random target, in float64 as the tests prove exactness, and a tinier drafter.

        >>> import torch
        >>> from gpt import GPT, GPTConfig
        >>> from sampler import Sampler
        >>> from speculative import generate_plain, generate_speculative
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> small = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=1, n_head=2, n_embd=16))
        >>> drafter = DraftModel(small.double().eval())
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_speculative(target, drafter, prompt, 12, 4, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    name = "small"
    # k: the best of a bench sweep on the CPU preset (docs/experiments.md: Small model: k)
    default_k = 5
    sampled_k = 1  # under sampling its acceptance falls fastest: one draft a round pays best

    def __init__(self, model):
        self.model = model

    def begin_batch(self, seqs, hidden):
        # every row's K/V at its own length (a request: one row), and its confirmed tokens
        self.cache = ragged.new_cache(self.model, len(seqs))
        self.rows = ragged.Confirmed(seqs, self.model.config.sequence_len + self.cache.slack)

    @torch.inference_mode()
    def propose_batch(self, ks, sampler):
        S = self.rows.lengths
        # a propose before this one: undo it (the cache keeps the confirmed tokens but the last)
        self.cache.rollback([min(n, s - 1) for n, s in zip(self.cache.lengths, S)])
        pending = [s - n for s, n in zip(S, self.cache.lengths)]  # not yet in the cache (>= 1)
        x = self.rows.at(self.cache.lengths, max(pending))  # (B, max pending)
        counts = [p if k > 0 else 0 for p, k in zip(pending, ks)]  # a row drafting nothing: none
        drafts, qs = [], []
        for j in range(max(ks)):
            logits = ragged.forward(self.model, x, self.cache, counts, last_only=True)[0]  # (B,1,V)
            x, q = sampler.draft(logits, [s + j for s in S], [int(k > j) for k in ks])  # (B, 1)
            drafts.append(x)
            qs.append(q)
            counts = [1 if k > j + 1 else 0 for k in ks]  # the last draft is never fed
        q = torch.cat(qs, 1) if qs[0] is not None else None
        return torch.cat(drafts, 1), list(ks), q

    def commit_batch(self, kept, new, hidden):
        S = self.rows.lengths
        # row r keeps its confirmed prefix plus the surviving drafts it was fed (cache.lengths[r]
        # - S[r] of them); a row that has finished keeps what it has
        self.cache.rollback([min(n, s + m - 1) if m else n
                             for n, s, m in zip(self.cache.lengths, S, kept)])
        self.rows.extend(new, kept)

    def fresh(self):
        return DraftModel(self.model)  # a cache of its own


# -----------------------------------------------------------------------------
# how it learns: distillation, and the term every drafter's loss shares


def small_loss(model, w, t_logits, distill=1.0):
    """w (B, T) windows of the target's own text: inputs w[:, :-1], labels w[:, 1:]; t_logits
    (B, T, V) the target's logits on w (causal, so [:, :-1] are its distributions for the labels).
    -> (1 - distill)·CE(labels) + distill·(KL(target || drafter) + TV): a drafter is judged by
    agreeing with the target, so the target's whole distribution is the label, not only the
    token its text happened to take."""
    logits, ce, _ = model(w[:, :-1], w[:, 1:])
    if distill == 0:
        return ce
    teacher = F.log_softmax(t_logits[:, :-1], -1)
    logq = F.log_softmax(logits, -1)
    kl = F.kl_div(logq, teacher, log_target=True, reduction="batchmean") / logits.size(1)
    kl = kl + total_variation(logq, teacher.exp()).mean()
    return distill * kl + (1 - distill) * ce



def total_variation(logq, p):
    """TV(q, p) = 1/2 sum_v |q_v - p_v| over the last axis: logq the drafter's log-probabilities,
    p the target's probabilities -> one distance per row. Every drafter trains on the target's
    soft labels (cross-entropy, or KL: the same gradient) plus this. Why: a draft survives about
    as often as the two distributions overlap (exactly 1 - TV under rejection sampling), and TV,
    unlike cross-entropy, spends nothing on tokens neither model would pick. It raised every
    drafter's tau (docs/experiments.md: Loss: CE + TV)."""
    return 0.5 * (logq.float().exp() - p.float()).abs().sum(-1)


# -----------------------------------------------------------------------------
# declared once: what the house reads of this file (registry/drafters.py lists it; how it learns
# in train.py, its stage, is training/stages_small.py)

DRAFTER = dict(
    name="small",
    network=lambda config, target: GPT(GPTConfig.from_dict(config)),  # a GPT of its own
    drafter=lambda model, target: DraftModel(model),
    pairs=True,
)
