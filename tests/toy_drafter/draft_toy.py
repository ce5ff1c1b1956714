"""
draft_toy.py -- a drafter added as the README's "Adding a drafter of your own" says: a few heads on
the target's last hidden state, each guessing one token further ahead (Medusa's idea, Cai et al.
2024, arXiv 2401.10774, without its tree).

tests/test_adding_a_drafter.py copies the project, adds this file at its root, its stage
(stages_toy.py) in training/, one registry line and its own test, then trains, benches and samples
it and runs the shared tests over it.

Head j (1..K) reads the target's state h_i at position i and predicts the token at i + 1 + j:
logits_j = lm_head(ln_f(h_i + W_j h_i)), the target's own ln_f and LM head. A round drafts from
the last state the target has, h_{S-2} (the confirmed token at S - 1 has none yet): head j drafts
position S - 1 + j. Every head drafts from that one state, so a round is one small product.
"""

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from speculative import Drafter


@dataclass
class ToyConfig:
    n_embd: int = 256   # the target's width
    heads: int = 3      # K: tokens it drafts a round at most

    def to_dict(self):
        return asdict(self)


class ToyHeads(nn.Module):
    """K residual heads on the target's last state; the target is passed in, never registered."""

    def __init__(self, config, target):
        super().__init__()
        self.config = config
        self.__dict__["target"] = target
        self.w = nn.Parameter(torch.zeros(config.heads, config.n_embd, config.n_embd))

    def forward(self, h):
        """h (..., d) -> (..., K, V): every head's logits."""
        hs = h[..., None, :] + torch.einsum("kde,...e->...kd", self.w, h)  # (..., K, d)
        return self.target.lm_head(self.target.transformer.ln_f(hs))


class ToyDrafter(Drafter):
    """Drafts up to K tokens from the target's last state.

    A round on its own, run as written (the project's tests run every example of the lesson):

        >>> from gpt import GPT, GPTConfig
        >>> from sampler import Sampler
        >>> from speculative import generate_plain, generate_speculative
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> drafter = ToyDrafter(ToyHeads(ToyConfig(n_embd=32), target).double(), target)
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_speculative(target, drafter, prompt, 12, 3, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    name = "toy"

    def __init__(self, net, target):
        self.net, self.target = net, target
        self.hidden_layers = (target.config.n_layer,)
        self.max_k = self.default_k = net.config.heads

    def begin(self, tokens, hidden):
        self.length = tokens.size(1)
        h = hidden[self.hidden_layers[0]][0]  # (n - 1, d): none for a one-token prompt
        self.h = h[-1] if h.size(0) else None

    @torch.inference_mode()
    def propose(self, k, sampler):
        if self.h is None:  # no state yet: nothing to draft, a plain step
            return torch.empty(0, dtype=torch.long, device=self.net.w.device), None
        logits = self.net(self.h)[:k]  # (k, V)
        return sampler.draft(logits, self.length)

    def commit(self, n, new, hidden):
        self.length += new.numel()
        self.h = hidden[self.hidden_layers[0]][0, -1]


def toy_loss(net, x, t_logits, hidden, layer):
    """Each head against the target's own distribution of the token it drafts: head j at position
    i, the target's logits at i + j (its prediction of the token at i + 1 + j)."""
    h = hidden[layer]  # (B, T, d)
    logits = net(h)  # (B, T, K, V)
    loss = 0.0
    for j in range(1, net.config.heads + 1):
        mine = F.log_softmax(logits[:, :-j, j - 1].float(), -1)
        teacher = F.softmax(t_logits[:, j:].float(), -1)
        loss = loss - (teacher * mine).sum(-1).mean()
    return loss / net.config.heads


DRAFTER = dict(
    name="toy",
    network=lambda config, target: ToyHeads(ToyConfig(**config), target),
    drafter=ToyDrafter,
    pairs=True,
)
