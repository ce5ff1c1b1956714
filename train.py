"""
train.py -- trains the target GPT, then every drafter for it, with one training loop.

    python train.py                      # everything, with the preset for this device
    python train.py --preset quick       # every drafter, far fewer steps: the lesson in minutes
    python train.py --only small --force # retrain one stage even though its checkpoint exists
    python train.py --init-from DIR      # drafters for your own model (docs/your_model.md)
    torchrun --standalone --nproc_per_node=N train.py   # the same run on N processes

How a drafter learns, read in two places: its own file (draft_*.py) holds its network and its
loss, and this file holds the loop every stage runs, nanoGPT's: set the learning rate from the
schedule, forward to the loss, loss.backward(), clip the gradient norm, optimizer.step(). Between
the two, its stage (training/stages_<name>.py) says what trains: it yields each phase, a Fit (the
network, its loss on a step's batch, the steps, the learning rate), and this file trains it. The
target trains first, on the corpus (training/stages_target.py); then each drafter, in the registry's
order (registry/drafters.py), on text the target wrote itself and the target's own logits and
hidden states on it (training/distill.py), the target frozen.

What wraps the loop is plumbing, applied from outside: the resume files and the NaN stop
(training.trainer.Phase), the split of a step's batch over processes under torchrun
(training/ddp.py), the flags and presets (training/flags.py, from each stage's settings).
"""

import math
import os
import sys
import time

import torch

from registry import drafters as registry
from runtime import command, cpu_speed
from runtime.checkpoint import CheckpointError
from runtime.devices import allow_tf32
from training import data as datamod
from training import ddp, flags
from training.trainer import Phase, Trainer, TrainingError, is_current, kept

STAGES = registry.stages()  # {name: training.stage.Stage}: the target's, then every drafter's

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


def fit(tr, phase):
    """The one training loop, every stage's: phase.steps AdamW steps of phase.loss(step), the loss
    of that step's batch, on phase.module's trainable parameters (a training.stage.Fit) ->
    (final val loss, optimizer state). tr: the Trainer (training/trainer.py)."""
    run, world, module = tr.run, tr.world, phase.module
    cpu_speed.speed_up(module)  # its no-grad passes (validation, calibration) as bench's
    params, optimizer = make_optimizer(module, phase.lr)
    plumbing = Phase(tr, phase.name, module, optimizer, phase.fingerprint, phase.steps,
                     phase.evaluate, phase.tokens_per_step)
    forward = ddp.wrap(world, module, phase.loss)  # phase.loss itself in one process
    module.train()
    for step in range(plumbing.start, phase.steps):  # > 0: an interrupted run resumes
        lr_now = lr_at(step, phase.steps, phase.lr, run.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        # the step's batch in --grad-accum micro-steps, and under torchrun a shard of each per
        # process: the gradients add up to the whole batch's (DDP averages them over processes)
        loss_val = 0.0
        for micro in range(run.grad_accum):
            tr.set_rows(ddp.shard(world, run.grad_accum, run.batch_size, micro))
            with ddp.sync_if_last(forward, micro, run.grad_accum), tr.autocast():
                loss = forward(step)
            if run.grad_accum > 1:
                loss = loss / run.grad_accum
            loss_val += loss.item()
            loss.backward()
        tr.set_rows(None)
        loss_val = ddp.mean(world, loss_val)  # the whole batch's loss, the same in every process
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        plumbing.check(step, loss_val, grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if phase.after_step is not None:
            phase.after_step(step + 1)
        plumbing.after(step + 1, loss_val, lr_now)  # progress, validation, the resume file
    return plumbing.finish(phase.keep_resume), optimizer.state_dict()


# -----------------------------------------------------------------------------
# the stages in order


def run_stage(tr, name):
    """One stage, driven from here: its train() is a generator that yields each phase it wants
    trained (a Fit) and gets back what fit() above made of it; it returns its val loss."""
    stage = STAGES[name].train(tr, tr.run.settings[name])
    result = None
    while True:
        try:
            phase = stage.send(result)
        except StopIteration as finished:
            return finished.value
        result = fit(tr, phase)


def run_stages(tr, run):
    """Every stage in order (or just --only), skipping those whose checkpoint is current."""
    for name, stage in STAGES.items():
        if flags.left_out(run, name):
            continue
        phases = [n for n, _ in stage.phases(run.settings[name], run)]
        if not run.force and is_current(tr, name):
            print(f"{name}: {tr.path(name)} exists, skipping (--force to retrain)")
            tr.clock.finish(*phases)
            continue
        tr.start(name)
        val = run_stage(tr, name)
        ddp.barrier(run.world)  # every rank reads what rank 0 wrote only after it is written
        if not os.path.exists(tr.path(name)):
            raise TrainingError(f"{name}: its stage ended without writing {tr.path(name)}: its "
                                f"train() saves it, tr.save({name!r}, ...) (training/stage.py)")
        for phase in phases if run.world.main else ():
            resume_file = os.path.join(run.out_dir, f"{phase}.resume.pt")
            if os.path.exists(resume_file):
                os.remove(resume_file)
        print(f"{name}: done in {time.time() - tr.stage_t0:.0f}s, val loss {val:.4f}, "
              f"wrote {tr.path(name)}")
        if name == "target":
            tr.forget_target()  # the drafters must see the freshly trained target


def build_parser(preset=None):
    """train.py's flags (training/flags.py), from every stage's settings."""
    return flags.build_parser(STAGES, preset)


def resolve_args(argv=None):
    """The command line -> the run: its settings, and every stage's in run.settings."""
    return flags.resolve_args(argv, STAGES)


def main(argv=None):
    run = resolve_args(argv)
    cpu_speed.enable()
    flags.check_out_dir(run, STAGES)
    if run.threads:
        torch.set_num_threads(run.threads)
    tf32_before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    world, stdout = run.world, sys.stdout
    run.device_resolved = ddp.start(world, run.device_resolved)  # cuda:LOCAL_RANK per rank
    if not world.main:  # rank 0 alone prints (errors still reach stderr)
        sys.stdout = open(os.devnull, "w")
    tf32 = allow_tf32(run.device_resolved)
    t0 = time.time()
    try:
        tr = Trainer(run, STAGES, flags.plan(run, STAGES))
        precision = "bfloat16 autocast" if run.use_bf16 else "float32"
        procs = f", {world.size} processes (torchrun)" if world.size > 1 else ""
        print(f"device {tr.device}, torch {torch.__version__}, {torch.get_num_threads()} threads"
              f"{procs}, preset {run.preset}, training in {precision}"
              + (", TF32 matmuls" if tf32 else ""))
        run_stages(tr, run)
        print(f"train.py finished in {(time.time() - t0) / 60:.1f} minutes")
    finally:  # TF32 is for training only: float32 inference in the same process stays float32
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_before
        if sys.stdout is not stdout:
            sys.stdout.close()
            sys.stdout = stdout
        if world.size > 1 and isinstance(sys.exc_info()[1], Exception):
            command.ending()  # ending on an error: torchrun's SIGTERM in the teardown is quiet
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
