"""
train.py -- trains the target GPT, then every drafter for it, with one training loop.

    python train.py                      # everything, with the preset for this device
    python train.py --preset quick       # every drafter, far fewer steps: the lesson in minutes
    python train.py --only small --force # retrain one stage even though its checkpoint exists
    python train.py --init-from DIR      # drafters for your own model (docs/your_model.md)
    torchrun --standalone --nproc_per_node=N train.py   # the same run on N processes

How a drafter learns, read in two places: its own file (draft_*.py) holds its network and its
loss, and this file holds the loop every stage runs, nanoGPT's: set the learning rate from the
schedule, forward to the loss, loss.backward(), clip the gradient norm, optimizer.step(). The
target trains first, on the corpus; then each drafter, on text the target wrote itself and the
target's own logits and hidden states on it (training/distill.py), the target frozen.

What wraps the loop is plumbing, applied from outside: which network each stage builds and with
which settings (training/stages.py and one stage file per drafter), the resume files and the NaN
stop (training.trainer.Phase), the split of a step's batch over processes under torchrun
(training/ddp.py), the settings and presets (runtime/settings.py).
"""

import math
import os
import sys
import time

import torch

from runtime import command, cpu_speed
from runtime.checkpoint import CheckpointError
from runtime.devices import allow_tf32
from training import data as datamod
from training import ddp
from training.stages import STAGES, is_current
from training.trainer import (Phase, Trainer, TrainingError, check_out_dir, kept, plan,
                              resolve_args)

# -----------------------------------------------------------------------------
# the loop


def lr_at(step, iters, peak, warmup):
    """Linear warmup, then cosine decay to a tenth of the peak (nanoGPT)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    ratio = (step - warmup) / max(1, iters - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, ratio))))


def make_optimizer(module, lr):
    """AdamW over the trainable parameters, nanoGPT's way: weight decay on matrices only."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return params, torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def fit(tr, name, module, loss_fn, eval_fn, steps, lr, fingerprint, tokens_per_step,
        after_step=None, keep_resume=False):
    """The one training loop, every stage's: `steps` AdamW steps of loss_fn(step), the loss of
    step's batch, on module's trainable parameters -> (final val loss, optimizer state).
    tr: the Trainer (training/trainer.py); after_step(n), if given, runs after the n-th step;
    keep_resume: keep the resume file of a finished phase (a rerun then skips it)."""
    a, world = tr.args, tr.world
    cpu_speed.speed_up(module)  # its no-grad passes (validation, calibration) as bench's
    params, optimizer = make_optimizer(module, lr)
    phase = Phase(tr, name, module, optimizer, fingerprint, steps, eval_fn, tokens_per_step)
    forward = ddp.wrap(world, module, loss_fn)  # loss_fn itself in one process
    module.train()
    for step in range(phase.start, steps):  # phase.start > 0: an interrupted run resumes
        lr_now = lr_at(step, steps, lr, a.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        # the step's batch in --grad-accum micro-steps, and under torchrun a shard of each per
        # process: the gradients add up to the whole batch's (DDP averages them over processes)
        loss_val = 0.0
        for micro in range(a.grad_accum):
            tr.set_rows(ddp.shard(world, a.grad_accum, a.batch_size, micro))
            with ddp.sync_if_last(forward, micro, a.grad_accum), tr.autocast():
                loss = forward(step)
            if a.grad_accum > 1:
                loss = loss / a.grad_accum
            loss_val += loss.item()
            loss.backward()
        tr.set_rows(None)
        loss_val = ddp.mean(world, loss_val)  # the whole batch's loss, the same in every process
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        phase.check(step, loss_val, grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(step + 1)
        phase.after(step + 1, loss_val, lr_now)  # progress, validation, the resume file
    return phase.finish(keep_resume), optimizer.state_dict()


# -----------------------------------------------------------------------------
# the stages in order


def run_stages(tr, args):
    """Every stage in order (or just --only), skipping those whose checkpoint is current."""
    for stage, (fn, phases, _) in STAGES.items():
        if args.only and stage != args.only:
            continue
        names = [n for n, _ in phases(args)]
        if not args.force and is_current(tr, stage):
            print(f"{stage}: {tr.path(stage)} exists, skipping (--force to retrain)")
            tr.clock.finish(*names)
            continue
        tr.start(stage)
        val = fn(tr)
        ddp.barrier(args.world)  # every rank reads what rank 0 wrote only after it is written
        for name in names if args.world.main else ():
            resume_file = os.path.join(args.out_dir, f"{name}.resume.pt")
            if os.path.exists(resume_file):
                os.remove(resume_file)
        print(f"{stage}: done in {time.time() - tr.stage_t0:.0f}s, val loss {val:.4f}, "
              f"wrote {tr.path(stage)}")
        if stage == "target":
            tr.forget_target()  # the drafters must see the freshly trained target


def main(argv=None):
    args = resolve_args(argv)
    cpu_speed.enable()
    check_out_dir(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    world, stdout = args.world, sys.stdout
    args.device_resolved = ddp.start(world, args.device_resolved)  # cuda:LOCAL_RANK per rank
    if not world.main:  # rank 0 alone prints (errors still reach stderr)
        sys.stdout = open(os.devnull, "w")
    tf32 = allow_tf32(args.device_resolved)
    t0 = time.time()
    try:
        tr = Trainer(args, plan(args), loop=fit)
        precision = "bfloat16 autocast" if args.use_bf16 else "float32"
        procs = f", {world.size} processes (torchrun)" if world.size > 1 else ""
        print(f"device {tr.device}, torch {torch.__version__}, {torch.get_num_threads()} threads"
              f"{procs}, preset {args.preset}, training in {precision}"
              + (", TF32 matmuls" if tf32 else ""))
        run_stages(tr, args)
        print(f"train.py finished in {(time.time() - t0) / 60:.1f} minutes")
    finally:  # TF32 is for training only: float32 inference in the same process stays float32
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
        if sys.stdout is not stdout:
            sys.stdout.close()
            sys.stdout = stdout
        ddp.stop(world)


ERRORS = (CheckpointError, TrainingError, datamod.DataError, ValueError)  # a flag can fix them


def cli(argv=None):
    """main() with every error a flag can fix as one `error:` line and exit status 1, and Ctrl-C
    or SIGTERM as one line saying what was kept (runtime/command.py); under torchrun any error at
    all, as one line naming its rank (ddp.fail: torchrun then stops the other ranks)."""
    world = ddp.world_of_env()
    if world.size == 1:
        return command.run(lambda: main(argv), ERRORS, interrupted=kept)
    command.sigterm_as_interrupt()
    try:
        main(argv)
    except ERRORS as e:
        ddp.fail(world, e, shared=True)
    except Exception as e:
        ddp.fail(world, e, shared=False)
    except KeyboardInterrupt as e:  # Ctrl-C reaches every rank: one line, from rank 0
        if world.main:
            print(f"interrupted: {kept()}", file=sys.stderr)
        raise SystemExit(command.status(e)) from None


if __name__ == "__main__":
    cli()
