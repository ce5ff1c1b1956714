"""The small drafter (draft_small.py): its cache holds exactly what its docstring says after every
commit. The shared equivalence tests run the drafter drafter_for() builds, and the target drafting
for itself ("small-self"), whose every draft survives."""

import torch

from conftest import tiny_gpt
from draft_small import DraftModel
from sampler import Sampler


def drafter_for(target):
    """The shared tests' small drafter, with random weights: it disagrees with the target often
    (tests/test_speculative.py checks that it does, so that the rejection path is exercised)."""
    return DraftModel(tiny_gpt(1, n_layer=1, n_embd=16, vocab=target.config.vocab_size,
                               sequence_len=target.config.sequence_len))


VARIANTS = {"self": DraftModel}  # the target drafting for itself: every draft must survive


def test_small_drafter_cache_bookkeeping(target):
    """After each commit the drafter's cache equals a fresh prefill of the tokens it holds, and
    it holds the confirmed prefix plus min(n, k-1) of the surviving drafts."""
    drafter = drafter_for(target)
    sampler = Sampler("greedy")
    seq = torch.tensor([[5, 6, 7, 8]])
    drafter.begin(seq, {})
    saw_full, saw_reject = False, False
    for rnd in range(20):
        (S,) = drafter.rows.lengths  # one request: one row
        draft, _ = drafter.propose(4, sampler)
        assert drafter.cache.lengths == [S + 3]
        n = [4, 0, 2, 1][rnd % 4]  # pretend verdicts: full acceptance and rejections
        new = torch.cat([draft[:n], torch.tensor([rnd % target.config.vocab_size])])
        drafter.commit(n, new, {})
        assert drafter.cache.lengths == [S + min(n, 3)]
        saw_full |= n == 4
        saw_reject |= n < 4
        (n_cached,) = drafter.cache.lengths
        fresh = drafter.model.new_cache()
        with torch.no_grad():
            drafter.model(drafter.rows.toks[:, :n_cached], cache=fresh)
        cached = drafter.cache.k[:, :, :, :n_cached]
        assert torch.allclose(cached, fresh.k[:, :, :, :n_cached], atol=1e-10, rtol=0)
    assert saw_full and saw_reject
