"""Shared fixtures: a tiny float64 target and a factory for every drafter, so that each
equivalence test runs over all of them (add a new drafter to DRAFTER_FACTORIES)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpt import GPT, GPTConfig  # noqa: E402
from speculative import DraftModel  # noqa: E402

VOCAB = 64


def peaked(model, scale):
    """Scale random weights up so distributions are peaked (near-uniform logits would make
    every drafter 'agree' under shared noise, and rejections rare)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return model


def tiny_gpt(seed, n_layer=2, n_embd=32, n_head=2, vocab=VOCAB, block_size=96, scale=8.0):
    torch.manual_seed(seed)
    cfg = GPTConfig(block_size=block_size, vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    return peaked(GPT(cfg), scale).double().eval()


@pytest.fixture(scope="session")
def target():
    return tiny_gpt(0)


def make_small(target):
    """The classic drafter with random weights: it disagrees with the target often."""
    return DraftModel(tiny_gpt(1, n_layer=1, n_embd=16, vocab=target.config.vocab_size,
                               block_size=target.config.block_size))


def make_self(target):
    """The target drafting for itself: every draft must be accepted (greedy)."""
    return DraftModel(target)


DRAFTER_FACTORIES = {"small": make_small, "self": make_self}


@pytest.fixture(params=sorted(DRAFTER_FACTORIES))
def drafter_name(request):
    return request.param
