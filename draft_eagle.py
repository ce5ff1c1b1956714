"""
draft_eagle.py -- EAGLE-3: an autoregressive drafter at the feature level that reads three
target layers and learns, in training, from its own drafts (the "training-time test").

Paper: Li, Wei, Zhang, Zhang, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test", 2025, arXiv 2503.01840. It is the learned drafter most serving
systems ship, and the baseline every DFlash and DSpark claim is measured against.

What it adds over draft_mtp.py. The MTP module reads ONE target state, the last layer's h_i,
next to the embedding of t_{i+1}, runs one layer and predicts t_{i+2}; drafts 2..k feed it its own
output. EAGLE-3 is that same chain with two changes:

  1. Its input is a fusion of three target layers, low, middle and high, concatenated and
     projected 3d -> d (g_i = FC([h_low; h_mid; h_high])): the last layer alone has already
     thrown away much of what the middle ones knew about the tokens after next.
  2. It learns its recursion. Trained on the target's states only, a drafter sees at test time
     inputs it never saw in training (its own outputs, from draft 2 on), and acceptance falls
     fast with depth. EAGLE-3 unrolls the drafter in training over several steps on its own
     outputs, with the attention each step has at inference: the training-time test. Here that
     is draft_mtp.unrolled, which MTP now uses too (FastMTP): the one idea, met twice.

Like EAGLE-3 it predicts tokens directly (no regression onto the target's features, which
EAGLE-1/2 had), and the embedding and LM head are the target's, frozen. Like EAGLE-1 it mixes
[g; Emb(t)] with one linear 2d -> d before a standard layer (EAGLE-3 moved that linear into the
attention's input projection; one linear map either way), and like this project's MTP it adds
no position encoding: the target's states carry position. It drafts a chain (EAGLE-2/3 draft a
dynamic tree; a chain is the simple case).

Drafting is MTP's, unchanged: one KV cache fed the fused state of every confirmed position,
then the recursion on its own outputs (draft_mtp.MTPDrafter: the bookkeeping). What DFlash
(draft_dflash.py) then changes: it drafts the whole block in ONE forward instead of one forward
per token, and injects its context into every draft layer as keys and values instead of feeding
it in at the input.

    python train.py --only eagle && python sample.py --method eagle
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from draft_mtp import MTPConfig, MTPDrafter, MTPModule, gpt2_init, recursion_loss

# -----------------------------------------------------------------------------
# config and network


def default_taps(n_layer):
    """Low, middle and high: the layers at a third and two thirds of the depth, and the last
    (2, 4, 6 for the CPU preset's 6 layers). EAGLE-3 reads three such layers."""
    return [max(1, math.ceil(n_layer / 3)), max(1, math.ceil(2 * n_layer / 3)), n_layer]


@dataclass
class EagleConfig(MTPConfig):
    """MTP's config (the one module's width, attention heads, context) plus the target layers
    it fuses."""
    taps: list = field(default_factory=lambda: [2, 4, 6])  # low, middle, high
    label = "EAGLE"

    @classmethod
    def for_target(cls, gpt_config, taps=None):
        c = gpt_config
        return cls(n_embd=c.n_embd, n_head=c.n_head, n_modules=1, sequence_len=c.sequence_len,
                   bias=c.bias, taps=list(taps or default_taps(c.n_layer)))

    def fitted(self, target_config):
        """MTP's check, and the layers it fuses must be the target's."""
        if not all(1 <= t <= target_config.n_layer for t in self.taps):
            raise RuntimeError(f"{self.label} config {self} does not fit the target "
                               f"{target_config}")
        return super().fitted(target_config)


class Eagle(nn.Module):
    """The fusion FC (3d -> d) and one MTP module (draft_mtp.MTPModule: RMSNorms, the 2d -> d
    mix, one layer). Only these train and go in out/eagle.pt; the target is passed in."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        d = config.n_embd
        self.fuse = nn.Linear(len(config.taps) * d, d, bias=False)
        self.mods = nn.ModuleList([MTPModule(config)])  # MTPDrafter drafts with mods[0]
        gpt2_init(self)

    def features(self, hidden):
        """g_i = FC([h_low; h_mid; h_high]) from the target's states {layer: (B, T, d)}."""
        return self.fuse(torch.cat([hidden[t] for t in self.config.taps], dim=-1))  # (B, T, d)


# -----------------------------------------------------------------------------
# drafting: MTP's chain, fed the fused state


class EagleDrafter(MTPDrafter):
    """MTPDrafter over the fused features: the same cache, recursion and commit.

    A round on its own, run as written (tests/test_layout.py runs every example of the lesson),
    on a tiny random target in float64 whose two layers it fuses (1, 2, 2):

        >>> from gpt import GPT, GPTConfig
        >>> from sampler import Sampler
        >>> from speculative import generate_plain, generate_speculative
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> net = Eagle(EagleConfig.for_target(target.config)).double().eval()
        >>> drafter = EagleDrafter(net, target)
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_speculative(target, drafter, prompt, 12, 4, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    name = "eagle"
    # the best of a bench sweep over k (docs/experiments.md: EAGLE-3: k), greedy and coupled
    default_k = 6
    sampled_k = 3

    def __init__(self, net, target):
        super().__init__(net, target)
        self.hidden_layers = tuple(sorted(set(net.config.taps)))

    def features(self, hidden):
        return self.mtp.features(hidden)


# -----------------------------------------------------------------------------
# how it learns: MTP's loss (distillation + the text's tokens, draft_mtp.step_loss) over the
# unrolled steps, each weighted beta^(j-1); with one step it is plain teacher forcing, the ablation
# (training/stages_eagle.py runs it in the trainer's loop, training/trainer.py)


UNROLL = 4     # draft steps unrolled on its own outputs in training (1: teacher forcing only)
BETA = 0.8     # step j's loss weighs beta^(j-1) (EAGLE-3's code: 0.8)
DISTILL = 0.5  # the weight of the KL to the target's distribution (1: it alone; 0: the tokens')


def eagle_loss(net, target, w, t_logits, hid, anchors, steps=UNROLL, beta=BETA, distill=DISTILL):
    """w (B, T+1) windows of the target's text; t_logits (B, T+1, V) and hid {layer: (B, T+1, d)}
    the target's logits and states on them. Step 1 reads the fused states at positions 0..T-1 of
    every window; steps 2..`steps` unroll at anchors (B, A) (draft_mtp.unroll_anchors draws
    them)."""
    taps = net.config.taps
    # under autocast the fusion comes out in bfloat16; the norms after it want the states' dtype
    h = net.features({t: hid[t][:, :-1] for t in taps}).to(hid[taps[0]].dtype)  # (B, T, d)
    return recursion_loss(net.mods[0], target, h, w, t_logits[:, :-1], distill, steps, beta,
                          anchors)


# -----------------------------------------------------------------------------
# declared once: what the house reads of this file (registry/drafters.py lists it; how it learns
# in train.py, its stage, is training/stages_eagle.py)

DRAFTER = dict(
    name="eagle",
    network=lambda config, target: Eagle(EagleConfig.from_dict(config).fitted(target.config)),
    drafter=EagleDrafter,
    pairs=True,
)
