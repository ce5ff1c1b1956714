"""
training/stages.py -- the stages of train.py, in order: which network each trains and with which
settings, its resume fingerprint, its checkpoint, and whether the one in out/ is still current.
The target's and the small drafter's stages are here; each other drafter's is in its own file
(training/stages_mtp.py, _eagle, _dflash, _dspark).

Each draft_*.py file holds its network, how it drafts and its loss: the idea of how it learns. A
stage is the plumbing around that loss: train.py calls train_<name>(trainer) for stage <name>,
and <name>_phases(args) first, to check the settings (runtime/settings.py) and plan the steps. A
stage gets everything from the Trainer (training/trainer.py): the target, the distillation set,
fit() (train.py's loop, with resume) and save().
"""

import hashlib
import os

import torch

from draft_mtp import mtp_loss
from draft_small import small_loss
from gpt import GPT, GPTConfig
from runtime import cpu_speed
from runtime.checkpoint import (CheckpointError, cpu_state_dict, cpu_tree, load_checkpoint,
                                save_checkpoint, state_hash)
from runtime.settings import (DFLASH, DISTILL, DSPARK, EAGLE, MTP as MTP_SETTINGS, SHARED,
                              SMALL, TARGET)
from training import data as datamod
from training import ddp, pretrained
from training.stages_dflash import dflash_phases, train_dflash
from training.stages_dspark import dspark_phases, train_dspark
from training.stages_eagle import eagle_phases, train_eagle
from training.stages_mtp import mtp_phases, new_mtp, save_mtp, train_mtp

# -----------------------------------------------------------------------------
# the target's stage (with --mtp-mode joint, the MTP head trains alongside it; with --init-from
# it is a pretrained model's, read from its folder instead)


def train_target(tr):
    """The target GPT on the corpus (with the MTP head in joint mode) -> out/target.pt."""
    a = tr.args
    if a.init_from:
        return import_target(tr)
    cfg = GPTConfig(sequence_len=a.block_size, vocab_size=tr.info["vocab_size"], n_layer=a.n_layer,
                    n_head=a.n_head, n_embd=a.n_embd)
    torch.manual_seed(a.seed)
    model = GPT(cfg).to(tr.device)
    print(f"target: {model.num_params() / 1e6:.2f}M parameters, {cfg}")
    mtp = new_mtp(tr, cfg) if a.mtp_mode == "joint" else None
    taps = (cfg.n_layer,) if mtp is not None else ()  # the last block's states, for the head

    def loss_fn(step):
        x, y = tr.data.get("train", step, tr.device)
        _, loss, hid = model(x, y, hidden_layers=taps)
        if mtp is not None:  # DeepSeek-V3: L_main + lambda L_mtp, into the whole target
            loss = loss + a.mtp_lambda * mtp_loss(mtp, model, hid[cfg.n_layer], x, y)
        return loss

    fingerprint = {"stage": "target", "config": cfg.to_dict(),
                   "tokenizer": tr.info["tokenizer_hash"],
                   "iters": a.target_iters, "lr": a.target_lr, "batch": a.batch_size,
                   "seed": a.seed, "mtp": None if mtp is None else (a.mtp_modules, a.mtp_lambda)}
    module = model if mtp is None else torch.nn.ModuleDict({"gpt": model, "mtp": mtp})
    val, opt_state = tr.fit("target", module, loss_fn,
                            lambda: tr.val_loss(lambda x, y: model(x, y)[1]),  # L_main only
                            steps=a.target_iters, lr=a.target_lr, fingerprint=fingerprint,
                            tokens_per_step=a.batch_size * a.block_size)
    sd = cpu_state_dict(model)
    save_checkpoint({"kind": "target", "config": cfg.to_dict(), "state_dict": sd,
                     "model_hash": state_hash(sd), "tokenizer_hash": tr.info["tokenizer_hash"],
                     "data": tr.info["recipe"], "step": a.target_iters,
                     "optimizer": cpu_tree(opt_state), "val_loss": val,
                     "tokens_seen": a.target_iters * a.batch_size * a.block_size,
                     "settings": stage_settings(a, "target")},
                    tr.path("target"))
    if mtp is not None:  # the head belongs to exactly this target: the mtp stage is now current
        ddp.barrier(tr.world)  # every rank reads the target.pt rank 0 just wrote
        tr.forget_target()
        save_mtp(tr, mtp, "joint")
    return val


def import_target(tr):
    """out/target.pt from the --init-from folder (training/pretrained.py): the weights as they are,
    the context window cut to --block-size; its loss on the corpus's validation windows printed."""
    a = tr.args
    # the token files are the folder's tokenizer's: prepare() rebuilds them when it changes
    model = cpu_speed.speed_up(pretrained.load_folder(a.init_from, a.block_size)[0].to(tr.device))
    print(f"target: {model.num_params() / 1e6:.2f}M parameters from {a.init_from}, "
          f"{model.config}")
    val = tr.val_loss(lambda x, y: model(x, y)[1])
    sd = cpu_state_dict(model)
    save_checkpoint({"kind": "target", "config": model.config.to_dict(), "state_dict": sd,
                     "model_hash": state_hash(sd), "tokenizer_hash": tr.info["tokenizer_hash"],
                     "data": tr.info["recipe"], "step": 0, "val_loss": val, "tokens_seen": 0,
                     "init_from": a.init_from,
                     "settings": stage_settings(a, "target")},
                    tr.path("target"))
    return val


def weights_id(folder):
    """Which model a folder holds, for the target stage's settings: the sha256 of its config.json
    and weights (a pretrained target is re-read when any of them changes)."""
    h = hashlib.sha256()
    names = pretrained.weight_files(folder)
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return f"{' + '.join(names)} {h.hexdigest()[:16]}"


def target_phases(a):
    """The target stage's train_loop phases: (name, steps). Checks its settings too."""
    if a.init_from:
        if a.mtp_mode == "joint":
            raise ValueError("--mtp-mode joint trains the MTP head inside the target's training, "
                             "and with --init-from the target is not trained: use --mtp-mode "
                             "posthoc")
        return []
    if a.n_embd % a.n_head:
        raise ValueError(f"--n-embd ({a.n_embd}) must be a multiple of --n-head ({a.n_head})")
    return [("target", a.target_iters)]


# -----------------------------------------------------------------------------
# the small GPT: train.py runs train_small(trainer) as its "small" stage



def small_phases(a):
    """The train_loop phases this stage runs: (name, steps). Checks the settings too."""
    if a.small_embd % a.small_heads:
        raise ValueError(f"--small-embd ({a.small_embd}) must be a multiple of --small-heads "
                         f"({a.small_heads})")
    return [("small", a.small_iters)]


def train_small(tr):
    """A 1-2 layer GPT, distilled from the target on its own text -> out/small.pt."""
    a = tr.args
    target, target_ckpt = tr.target()
    cfg = GPTConfig(sequence_len=a.block_size, vocab_size=target.config.vocab_size,
                    n_layer=a.small_layers, n_head=a.small_heads, n_embd=a.small_embd)
    torch.manual_seed(a.seed + 1)
    model = GPT(cfg).to(tr.device)
    print(f"small: {model.num_params() / 1e6:.2f}M parameters, {cfg}")

    fingerprint = {"stage": "small", "config": cfg.to_dict(), "target": target_ckpt["model_hash"],
                   "iters": a.small_iters, "lr": a.small_lr, "distill": a.small_distill,
                   "seed": a.seed, "text": tr.distill.key(a.small_text)}
    batches = tr.distill.batches(a.small_text)
    val, _ = tr.fit("small", model,
                    lambda s: small_loss(model, *batches(s)[:2], a.small_distill),
                    lambda: tr.val_loss(lambda x, y: model(x, y)[1]),
                    steps=a.small_iters, lr=a.small_lr, fingerprint=fingerprint,
                    tokens_per_step=a.batch_size * a.block_size)
    tr.save("small", cfg.to_dict(), model, {"val_loss": val})
    return val


STAGES = {  # stage -> (its function, its train_loop phases [(name, steps)], its settings)
    "target": (train_target, target_phases, TARGET),
    "small": (train_small, small_phases, SMALL),
    "mtp": (train_mtp, mtp_phases, MTP_SETTINGS),
    "eagle": (train_eagle, eagle_phases, EAGLE),
    "dflash": (train_dflash, dflash_phases, DFLASH),
    "dspark": (train_dspark, dspark_phases, {**DFLASH, **DSPARK}),  # DFlash's backbone
}


def stage_settings(args, stage):
    """The settings a stage's checkpoint records: one trained with other values is not current.
    The target's include the MTP head's in joint mode, where it trains inside the target stage."""
    if stage == "target" and args.init_from:  # read, not trained: which weights, what context
        return {"init_from": os.path.abspath(args.init_from),
                "weights": weights_id(args.init_from), "block_size": args.block_size}
    names = [*SHARED, *STAGES[stage][2]]
    if stage != "target":
        names += [*DISTILL]
    else:
        names += ["mtp_mode"] + (["mtp_modules", "mtp_lambda"] if args.mtp_mode == "joint" else [])
    return {"seed": args.seed, **{n: getattr(args, n) for n in names}}


def is_current(tr, stage):
    """Does out/<stage>.pt exist, belong to the current target and tokenizer, and record the
    settings of this run?"""
    path = tr.path(stage)
    if not os.path.exists(path):
        return False
    try:
        ckpt = load_checkpoint(path, stage)
    except CheckpointError:  # truncated, garbage, or another kind of checkpoint: it is remade
        print(f"{stage}: {path} is unreadable; retraining it")
        return False
    if stage == "target":  # a trained target is not thrown away without --force
        why = datamod.mismatch(ckpt, tr.info, tr.args.out_dir)
        if why:
            raise CheckpointError(f"{why}, or pass --force to retrain the target and every "
                                  "drafter on this build")
    elif ckpt.get("target_hash") != tr.target()[1]["model_hash"]:
        print(f"{stage}: {path} was trained against another target; retraining it")
        return False
    had = ckpt.get("settings")
    if not isinstance(had, dict):  # unknown, not "all of them changed": kept, as it is
        print(f"{stage}: {path} records no settings, so whether this run's are its own is "
              "unknown: kept (--force retrains it)")
        return True
    changed = [f"{k} {had.get(k)} -> {v}" for k, v in stage_settings(tr.args, stage).items()
               if had.get(k) != v]
    if changed:
        print(f"{stage}: {path} was trained with other settings ({', '.join(changed[:4])}"
              f"{', ...' if len(changed) > 4 else ''}); retraining it")
    return not changed
