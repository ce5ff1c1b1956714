"""
training/stages_toy.py -- the toy drafter's stage of train.py (draft_toy.py): its heads trained on
the frozen target's own text, out/toy.pt.
"""

from dataclasses import dataclass

import torch

from draft_toy import ToyConfig, ToyHeads, toy_loss
from runtime.settings import setting
from training.stage import Stage


@dataclass
class ToySettings:
    """The toy's settings: train.py's flags --toy-<field>."""
    heads: int = setting(ToyConfig.heads, "toy: heads, tokens drafted a round at most")
    iters: int = setting(300, "toy: optimizer steps", quick=60, tiny=6)
    lr: float = setting(2e-3, "toy: peak learning rate")


def phases(settings, run):
    return [("toy", settings.iters)]


def train(tr, settings):
    """The heads on the frozen target, on the distillation set -> out/toy.pt."""
    run = tr.run
    target, target_ckpt = tr.target()
    torch.manual_seed(run.seed + 6)
    cfg = ToyConfig(n_embd=target.config.n_embd, heads=settings.heads)
    net = ToyHeads(cfg, target).to(tr.device)
    batches, last = tr.distill.batches("gen"), target.config.n_layer
    fingerprint = {"stage": "toy", "config": net.config.to_dict(), "iters": settings.iters,
                   "lr": settings.lr, "target": target_ckpt["model_hash"], "seed": run.seed,
                   "gen": tr.distill.key("gen")}
    val = tr.fit("toy", net, lambda s: toy_loss(net, *batches(s), last),
                 lambda: tr.val_loss(lambda x, y: toy_loss(net, x, *tr.distill.features(x), last)),
                 steps=settings.iters, lr=settings.lr, fingerprint=fingerprint,
                 tokens_per_step=run.batch_size * run.block_size).val_loss
    tr.save(net.config.to_dict(), net, {"val_loss": val})
    return val


STAGE = Stage(settings=ToySettings, phases=phases, train=train, step_cost={"toy": 0.2})
