"""
training/stages_small.py -- the small drafter's stage of train.py: a 1-2 layer GPT distilled from the
target on its own text (draft_small.py: small_loss), out/small.pt.
"""

from dataclasses import dataclass

import torch

from draft_small import small_loss
from gpt import GPT, GPTConfig
from runtime.settings import number, setting
from training.stage import Fit, Stage


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


def phases(cfg, run):
    """The phases this stage runs: (name, steps). Checks the settings too."""
    if cfg.embd % cfg.heads:
        raise ValueError(f"--small-embd ({cfg.embd}) must be a multiple of --small-heads "
                         f"({cfg.heads})")
    return [("small", cfg.iters)]


def train(tr, cfg):
    """A 1-2 layer GPT, distilled from the target on its own text -> out/small.pt."""
    run = tr.run
    target, target_ckpt = tr.target()
    gpt_cfg = GPTConfig(sequence_len=run.block_size, vocab_size=target.config.vocab_size,
                        n_layer=cfg.layers, n_head=cfg.heads, n_embd=cfg.embd)
    torch.manual_seed(run.seed + 1)
    model = GPT(gpt_cfg).to(tr.device)
    print(f"small: {model.num_params() / 1e6:.2f}M parameters, {gpt_cfg}")
    fingerprint = {"stage": "small", "config": gpt_cfg.to_dict(),
                   "target": target_ckpt["model_hash"], "iters": cfg.iters, "lr": cfg.lr,
                   "distill": cfg.distill, "seed": run.seed, "text": tr.distill.key(cfg.text)}
    batches = tr.distill.batches(cfg.text)
    val, _ = yield Fit("small", model, lambda s: small_loss(model, *batches(s)[:2], cfg.distill),
                       lambda: tr.val_loss(lambda x, y: model(x, y)[1]),
                       steps=cfg.iters, lr=cfg.lr, fingerprint=fingerprint,
                       tokens_per_step=run.batch_size * run.block_size)
    tr.save("small", gpt_cfg.to_dict(), model, {"val_loss": val})
    return val


STAGE = Stage(settings=SmallSettings, phases=phases, train=train, step_cost={"small": 0.43})
