"""
training/stages_small.py -- the small drafter's stage of train.py: a 1-2 layer GPT distilled from
the target on its own text (draft_small.py: small_loss), out/small.pt.
"""

from dataclasses import dataclass

import torch

from draft_small import small_loss
from gpt import GPT, GPTConfig
from runtime.settings import number, setting
from training.stage import Stage


@dataclass
class SmallSettings:
    """The small drafter's settings: train.py's flags --small-<field>."""
    layers: int = setting(1, "small: number of blocks", cuda=2, gpt2=4)
    embd: int = setting(128, "small: width", cuda=256, gpt2=384, tiny=16)
    heads: int = setting(4, "small: attention heads", gpt2=6, tiny=2)
    iters: int = setting(500, "small: optimizer steps", cuda=2000, gpt2=6000, quick=60, tiny=10)
    lr: float = setting(3e-3, "small: peak learning rate", cuda=2e-3)
    distill: float = setting(1.0, "small: weight of the KL-to-target loss (1 = pure distillation, "
                             "0 = the text's own tokens only)", type=number(float, 0, 1))
    text: str = setting("gen", "small: training text, 'gen' (the distillation set the target "
                        "wrote) or 'data' (the corpus)", choices=["gen", "data"])


def phases(settings, run):
    """The phases this stage runs: (name, steps). Checks the settings too."""
    if settings.embd % settings.heads:
        raise ValueError(f"--small-embd ({settings.embd}) must be a multiple of --small-heads "
                         f"({settings.heads})")
    return [("small", settings.iters)]


def train(tr, settings):
    """A 1-2 layer GPT, distilled from the target on its own text -> out/small.pt."""
    run = tr.run
    target, target_ckpt = tr.target()
    cfg = GPTConfig(sequence_len=run.block_size, vocab_size=target.config.vocab_size,
                        n_layer=settings.layers, n_head=settings.heads, n_embd=settings.embd)
    torch.manual_seed(run.seed + 1)
    model = GPT(cfg).to(tr.device)
    print(f"small: {model.num_params() / 1e6:.2f}M parameters, {cfg}")
    fingerprint = {"stage": "small", "config": cfg.to_dict(),
                   "target": target_ckpt["model_hash"], "iters": settings.iters, "lr": settings.lr,
                   "distill": settings.distill, "seed": run.seed,
                   "text": tr.distill.key(settings.text)}
    batches = tr.distill.batches(settings.text)
    val = tr.fit("small", model, lambda s: small_loss(model, *batches(s)[:2], settings.distill),
                 lambda: tr.val_loss(lambda x, y: model(x, y)[1]),
                 steps=settings.iters, lr=settings.lr, fingerprint=fingerprint,
                 tokens_per_step=run.batch_size * run.block_size).val_loss
    tr.save(cfg.to_dict(), model, {"val_loss": val})
    return val


STAGE = Stage(settings=SmallSettings, phases=phases, train=train, step_cost={"small": 0.43})
