"""
train.py -- trains the target GPT, then every drafter for it, with one training loop.

    python train.py                      # everything, with the preset for this device
    python train.py --preset quick       # every drafter, far fewer steps: the lesson in minutes
    python train.py --only small --force # retrain one stage even though its checkpoint exists
    python train.py --init-from DIR      # drafters for your own model (docs/your_model.md)
    torchrun --standalone --nproc_per_node=N train.py   # the same run on N processes

A stage (training/stages_<name>.py) is a plain function that says what trains: it builds its
network, hands each phase to the one training loop, tr.fit (training/trainer.py: the schedule,
forward to the loss, loss.backward(), the clip, optimizer.step()), and saves what it learned. The
target trains first, on the corpus (training/stages_target.py); then each drafter, in the
registry's order (registry/drafters.py), on text the target wrote itself and the target's own
logits and hidden states on it (training/distill.py), the target frozen. This file runs them in
order, each skipped while its checkpoint is current.

What wraps the loop is plumbing, applied from outside: the resume files and the NaN stop
(training.trainer.Phase), the split of a step's batch over processes under torchrun
(training/ddp.py), the flags and presets (training/flags.py, from each stage's settings).
"""

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
from training.trainer import Trainer, TrainingError, is_current, kept


def run_stages(tr, run):
    """Every stage in order (or just --only), skipping those whose checkpoint is current: each a
    plain function, stage.train(tr, settings), that writes out/<name>.pt and returns its val
    loss."""
    for name, stage in tr.stages.items():
        if flags.left_out(run, name):
            continue
        phases = [n for n, _ in stage.phases(run.settings[name], run)]
        if not run.force and is_current(tr, name):
            print(f"{name}: {tr.path(name)} exists, skipping (--force to retrain)")
            tr.clock.finish(*phases)
            continue
        tr.start(name)
        val = stage.train(tr, run.settings[name])
        ddp.barrier(run.world)  # every rank reads what rank 0 wrote only after it is written
        if not os.path.exists(tr.path(name)):
            raise TrainingError(f"{name}: its stage ended without writing {tr.path(name)}: its "
                                "train() saves it, tr.save(config, net, ...) (training/stage.py)")
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
    return flags.build_parser(registry.stages(), preset)


def resolve_args(argv=None):
    """The command line -> the run: its settings, and every stage's in run.settings."""
    return flags.resolve_args(argv, registry.stages())


def main(argv=None):
    stages = registry.stages()
    run = flags.resolve_args(argv, stages)
    cpu_speed.enable()
    flags.check_out_dir(run, stages)
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
        tr = Trainer(run, stages, flags.plan(run, stages))
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
