"""
training/stages_target.py -- the target's stage of train.py, the first: trained here on the corpus,
or read from a model someone else trained (--init-from: a Hugging Face folder or a GGUF file).

gpt.py is the model; this file trains it with the one training loop, tr.fit (a Stage, as every
drafter's: training/stage.py). With --mtp-mode joint the MTP head trains inside this stage, its loss added
to the target's (DeepSeek-V3: L_main + lambda L_mtp), and out/mtp.pt is written with the target.
With --init-from the weights are a pretrained model's (formats/pretrained.py reads a folder or a
GGUF), nothing trains, and the context window is cut to --block-size; a chat model's chat format
is kept with it (sample.py --chat, bench.py's chat prompts). Every drafter stage then reads the
target back (runtime/target.py), frozen.
"""

import hashlib
import math
import os
from dataclasses import dataclass

import torch

from draft_mtp import mtp_loss
from gpt import GPT, GPTConfig
from runtime import cpu_speed
from runtime.checkpoint import (CheckpointError, cpu_state_dict, cpu_tree, save_checkpoint,
                                state_hash)
from runtime.settings import setting, settings_of, values_of
from formats import pretrained
from training import ddp
from training.stage import SharedSettings, Stage
from training.stages_mtp import new_mtp, save_mtp
from training.trainer import TrainingError


@dataclass
class TargetSettings:
    """The target's settings (train.py's flags --n-layer, ..., --target-lr). Its context window is
    --block-size, every stage's; with --init-from its shape is the folder's."""
    n_layer: int = setting(6, "target: transformer blocks", cuda=8, tiny=2)
    n_head: int = setting(8, "target: attention heads per block", tiny=2)
    n_embd: int = setting(256, "target: model width", cuda=512, tiny=32)
    target_iters: int = setting(1300, "target: optimizer steps", cuda=4000, quick=120, tiny=30)
    target_lr: float = setting(2e-3, "target: peak learning rate", cuda=1e-3, tiny=3e-3)


# -----------------------------------------------------------------------------
# the stage


def phases(settings, run):
    """The target stage's phases: (name, steps); none when it is read from a folder. Checks its
    settings too."""
    mtp = run.settings.get("mtp")
    joint = mtp is not None and mtp.mode == "joint"
    if run.init_from:
        if joint:
            raise ValueError("--mtp-mode joint trains the MTP head inside the target's training, "
                             "and with --init-from the target is not trained: use --mtp-mode "
                             "posthoc")
        return []
    if settings.n_embd % settings.n_head:
        raise ValueError(f"--n-embd ({settings.n_embd}) must be a multiple of --n-head "
                         f"({settings.n_head})")
    return [("target", settings.target_iters)]


def train(tr, settings):
    """The target GPT on the corpus (with the MTP head in joint mode) -> out/target.pt."""
    run = tr.run
    if run.init_from:
        return import_target(tr)
    cfg = GPTConfig(sequence_len=run.block_size, vocab_size=tr.info["vocab_size"],
                    n_layer=settings.n_layer, n_head=settings.n_head, n_embd=settings.n_embd)
    torch.manual_seed(run.seed)
    model = GPT(cfg).to(tr.device)
    print(f"target: {model.num_params() / 1e6:.2f}M parameters, {cfg}")
    joint = run.settings.get("mtp")
    joint = joint if joint is not None and joint.mode == "joint" else None
    mtp = new_mtp(tr, joint, cfg) if joint else None
    taps = (cfg.n_layer,) if mtp is not None else ()  # the last block's states, for the head

    def loss_fn(step):
        x, y = tr.data.get("train", step, tr.device)
        _, loss, hid = model(x, y, hidden_layers=taps)
        if mtp is not None:  # DeepSeek-V3: L_main + lambda L_mtp, into the whole target
            loss = loss + joint.lambda_ * mtp_loss(mtp, model, hid[cfg.n_layer], x, y)
        return loss

    fingerprint = {"stage": "target", "config": cfg.to_dict(),
                   "tokenizer": tr.info["tokenizer_hash"],
                   "iters": settings.target_iters, "lr": settings.target_lr,
                   "batch": run.batch_size,
                   "seed": run.seed, "mtp": None if mtp is None else (joint.modules, joint.lambda_)}
    module = model if mtp is None else torch.nn.ModuleDict({"gpt": model, "mtp": mtp})
    val, opt_state = tr.fit("target", module, loss_fn,
                            lambda: tr.val_loss(lambda x, y: model(x, y)[1]),  # L_main only
                            steps=settings.target_iters, lr=settings.target_lr,
                            fingerprint=fingerprint,
                            tokens_per_step=run.batch_size * run.block_size)
    sd = cpu_state_dict(model)
    save_checkpoint({"kind": "target", "config": cfg.to_dict(), "state_dict": sd,
                     "model_hash": state_hash(sd), "tokenizer_hash": tr.info["tokenizer_hash"],
                     "data": tr.info["recipe"], "step": settings.target_iters,
                     "optimizer": cpu_tree(opt_state), "val_loss": val,
                     "tokens_seen": settings.target_iters * run.batch_size * run.block_size,
                     "settings": tr.recorded("target")},
                    tr.path("target"))
    if mtp is not None:  # the head belongs to exactly this target: the mtp stage is now current
        ddp.barrier(tr.world)  # every rank reads the target.pt rank 0 just wrote
        tr.forget_target()
        save_mtp(tr, mtp, "joint", steps=settings.target_iters)
    return val


def import_target(tr):
    """out/target.pt from the --init-from folder or GGUF (formats/pretrained.py): the weights as
    they are, the context window cut to --block-size, its chat format where it has one; its loss
    on the corpus's validation windows printed."""
    run = tr.run
    # the token files are the model's tokenizer's: prepare() rebuilds them when it changes
    model = pretrained.load(run.source, run.block_size)
    try:
        chat = pretrained.chat_of(run.source)
    except CheckpointError as e:  # the model still reads text: imported, without a chat format
        print(f"target: {e}; imported without a chat format (sample.py --chat and bench.py's "
              "chat prompts need one)")
        chat = None
    model = cpu_speed.speed_up(model.to(tr.device))
    print(f"target: {model.num_params() / 1e6:.2f}M parameters from {run.init_from}, "
          f"{model.config}")
    # a check that it computes, not a measurement: a few windows (a real model's full validation
    # is slow on a CPU)
    val = tr.val_loss(lambda x, y: model(x, y)[1], n=2, rows=4)
    if not math.isfinite(val):  # a target that computes nan is not imported as done
        raise TrainingError(f"target: the model in {run.init_from} computes a validation loss "
                            f"of {val} on this corpus: its weights or its config.json make it "
                            "diverge; nothing was written")
    sd = cpu_state_dict(model)
    save_checkpoint({"kind": "target", "config": model.config.to_dict(), "state_dict": sd,
                     "model_hash": state_hash(sd), "tokenizer_hash": tr.info["tokenizer_hash"],
                     "data": tr.info["recipe"], "step": 0, "val_loss": val, "tokens_seen": 0,
                     "init_from": os.path.abspath(run.init_from),
                     "source": pretrained.served_as(run.source),
                     "settings": tr.recorded("target"),
                     "chat": chat.to_dict() if chat else None},
                    tr.path("target"))
    return val


def weights_id(source):
    """Which model a folder or GGUF holds, for the target stage's record of its settings: the
    sha256 of its config.json and weights, or of the GGUF (a pretrained target is re-read when
    any of them changes)."""
    h = hashlib.sha256()
    paths = pretrained.source_files(source)
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return f"{' + '.join(os.path.basename(p) for p in paths)} {h.hexdigest()[:16]}"


def records(run):
    """What out/target.pt records of the settings (one that records others is not current): read
    from a folder, which folder, which weights and what context; trained here, the seed, the
    shared settings, its own, and the MTP head's where it trains inside (--mtp-mode joint)."""
    if run.init_from:
        return {"init_from": os.path.abspath(run.init_from), "weights": weights_id(run.init_from),
                "block_size": run.block_size}
    values = {n: getattr(run, n) for n, _ in settings_of(SharedSettings)}
    values.update(values_of(run.settings["target"]))
    mtp = run.settings.get("mtp")
    if mtp is not None:
        values["mtp_mode"] = mtp.mode
        if mtp.mode == "joint":
            values.update(mtp_modules=mtp.modules, mtp_lambda=mtp.lambda_)
    return {"seed": run.seed, **values}


# one step costs 1: the unit of the run's time estimate
STAGE = Stage(settings=TargetSettings, phases=phases, train=train, step_cost={"target": 1.0},
              reads=("mtp",), records=records)
