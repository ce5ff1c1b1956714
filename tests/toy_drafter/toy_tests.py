"""The toy drafter's own test (tests/test_toy.py once added): head j from h_i is written out by
hand; drafter_for builds it for the shared tests, which run it with every other drafter."""

import torch

from draft_toy import ToyConfig, ToyDrafter, ToyHeads


def drafter_for(target):
    """The shared tests' toy: random heads, scaled so that they disagree with the target often."""
    torch.manual_seed(6)
    net = ToyHeads(ToyConfig(n_embd=target.config.n_embd), target).double()
    with torch.no_grad():
        net.w.normal_(std=0.3)
    return ToyDrafter(net.eval(), target)


def test_a_head_is_its_formula(target):
    d = drafter_for(target)
    h = torch.randn(target.config.n_embd, dtype=torch.float64)
    with torch.no_grad():
        want = target.lm_head(target.transformer.ln_f(h + d.net.w[1] @ h))
        assert torch.allclose(d.net(h)[1], want, atol=1e-12)
