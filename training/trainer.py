"""
trainer.py -- the one training loop every stage runs, and what wraps it: the Trainer a stage is
handed, the plumbing of each phase (resume files, the NaN stop, progress, validation), the data
build and the guard on a trained target, what a stage's checkpoint records of its settings, and
the run's own settings.

The loop is Trainer.fit, nanoGPT's: set the learning rate from the schedule, forward to the loss,
loss.backward(), clip the gradient norm, optimizer.step(). A stage (training/stage.py) calls it
for each phase it trains and gets back the phase's validation loss; train.py runs the stages in
order. A Trainer is everything a stage gets besides its own settings: the training-side twin of
speculative.Drafter. Each stage writes out/<stage>.pt, and is skipped while that checkpoint belongs
to the current target and records the same settings and format (unless --force). A running phase
saves its whole state to out/<name>.resume.pt every --ckpt-interval seconds, atomically; batches
come from generators seeded by the step, so a killed run resumes to the very same weights. With
--init-from the target's stage reads a Hugging Face folder or a GGUF instead of training; under
torchrun every phase trains data-parallel, one shard of each step's batch per process
(training/ddp.py).
"""

import math
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from runtime import cpu_speed
from runtime.checkpoint import CheckpointError, cpu_tree, load_checkpoint, save_checkpoint
from runtime.settings import DEFAULT_VOCAB, number, setting, settings_of
from training import data as datamod
from training import chat_set, ddp, distill
from training.stage import usual_record
from runtime.target import load_target

# -----------------------------------------------------------------------------
# the run's own settings (each stage's are in its file; what they share, in training/stage.py)


@dataclass
class RunSettings:
    """The run's own settings: train.py's flags --vocab-size, ..., --grad-accum."""
    vocab_size: int = setting(DEFAULT_VOCAB, "BPE vocabulary size, end-of-text included",
                              type=number(int, 257, 65536))
    tokenizer: str = setting("bpe", "train our own BPE, or use tiktoken's gpt2 if it loads",
                             choices=["bpe", "gpt2"])
    seed: int = setting(1337, "seed for initialisation and batch sampling",
                        type=number(int, 0, 2**32 - 1))
    bf16: str = setting("auto", "bfloat16 autocast: auto = where this device measurably runs it "
                        "faster", choices=["auto", "on", "off"])
    threads: int = setting(None, "torch CPU threads (none: torch's choice)", type=number(int, 1))
    log_interval: int = setting(25, "steps between progress lines")
    # the drafters are judged by tau in bench.py, not by this loss on corpus text
    eval_interval: int = setting(2500, "steps between validation losses (the last step always "
                                 "has one)")
    ckpt_interval: float = setting(60.0, "seconds between resume checkpoints",
                                   type=number(float, 0))
    drafters: str = setting("all", "the drafter stages this run trains, comma-separated (e.g. "
                            "dflash,eagle), in the registry's order; all: every one",
                            **{"real-cpu": "dflash"})
    grad_accum: int = setting(1, "micro-steps per optimizer step in each process: the global "
                              "batch is split into processes x this many equal shards (less "
                              "memory, the same step)")


# -----------------------------------------------------------------------------
# one phase of the loop: resume, the NaN stop, progress


class TrainingError(RuntimeError):
    """Training went wrong in a way a flag can fix (the message names it)."""


def resume(name, module, opt, path, fingerprint, iters):
    """Load an interrupted run of this phase into module and opt if its resume file fits (same
    fingerprint, same shapes); returns the step to start at (0: from scratch)."""
    if not os.path.exists(path):
        return 0
    try:
        r = load_checkpoint(path, "resume", stage=name)
        if r.get("fingerprint") != fingerprint:
            raise CheckpointError("it is from a run with other settings")
        module.load_state_dict(r["state_dict"])
        opt.load_state_dict(r["optimizer"])
    except (CheckpointError, RuntimeError, ValueError, KeyError) as e:  # e.g. an older version's
        print(f"{name}: not resuming ({str(e).splitlines()[0][:100]}); starting over")
        return 0
    print(f"{name}: resuming an interrupted run at step {r['step']}/{iters}")
    return r["step"]


def stop_if_diverged(name, step, loss_val, grad_norm, saved_step, path, lr_flag):
    """A NaN or inf loss or gradient would poison the weights: stop, saying what was kept and which
    learning rate to lower (lr_flag)."""
    if math.isfinite(loss_val) and math.isfinite(grad_norm):
        return
    kept = (f"the last good state (step {saved_step}) is kept in {path}" if saved_step is not None
            else "no state of this stage was saved yet")
    bad = loss_val if not math.isfinite(loss_val) else grad_norm
    raise TrainingError(f"{name}: the loss (or its gradient) became {bad} at step {step}, so "
                        f"training stopped; {kept}. Try a lower learning rate ({lr_flag}).")


DISTILL_COST = 0.26  # one sequence of the distillation set next to one target step (Clock)


class Clock:
    """Progress lines, and the whole run's remaining time: the steps left in every phase still
    to run (plan: [(phase, steps)]), each costed at its step cost (costs: {phase: a step's seconds
    over a target step's}, each stage's own, and DISTILL_COST a sequence of the distillation set)
    x the seconds a target step takes here, as last measured from the running phase. An
    estimate, better as each phase runs."""

    def __init__(self, plan, costs=None):
        self.left, self.unit, self.t_last = dict(plan), None, time.time()
        self.costs = {"distill": DISTILL_COST, **(costs or {})}

    def tick(self, name, done, steps, loss, lr, tokens, every):
        """After step `done` of phase `name`: a progress line every `every` steps."""
        if done % every and done != steps:
            return
        now = time.time()
        sec = (now - self.t_last) / (every if done % every == 0 else done % every)
        first, self.unit, self.t_last = self.unit is None, sec / self.costs.get(name, 1.0), now
        self.left[name] = steps - done
        if name != "target":  # a drafter is training: the distillation set is written
            self.left.pop("distill", None)
        if first:
            print(f"train.py: about {self.remaining()} left in all (an estimate, updated as it "
                  "goes)")
        eta = (steps - done) * sec
        print(f"{name} | step {done:5d}/{steps} | loss {loss:.4f} | lr {lr:.1e} | "
              f"{1000 * sec:6.0f} ms/step | {tokens / sec:7.0f} tok/s | "
              f"ETA {int(eta // 60)}m{int(eta % 60):02d}s | run ~{self.remaining()}", flush=True)

    def finish(self, *phases):
        for p in phases:
            self.left.pop(p, None)
        self.t_last = time.time()

    def remaining(self):
        s = sum(n * self.costs.get(p, 1.0) * self.unit for p, n in self.left.items())
        return f"{int(s // 60)}m{int(s % 60):02d}s"


class Phase:
    """The plumbing around one phase of the loop (Trainer.fit): its resume file (read back here:
    `start` is the step to begin at; written atomically every --ckpt-interval seconds), the stop on
    a NaN, the progress lines, the validation every --eval-interval steps. A run killed anywhere
    resumes to the very same weights: batches come from generators seeded by the step."""
    running = None  # the phase running now, for what an interruption says it kept (kept())

    def __init__(self, tr, name, module, opt, fingerprint, steps, eval_fn, tokens_per_step):
        self.tr, self.name, self.module, self.opt = tr, name, module, opt
        self.fingerprint, self.steps, self.eval_fn = fingerprint, steps, eval_fn
        self.tokens_per_step = tokens_per_step
        self.path = os.path.join(tr.run.out_dir, f"{name}.resume.pt")
        self.start = resume(name, module, opt, self.path, fingerprint, steps)
        self.saved = self.start if self.start else None  # the last step written to the file
        self.t0 = time.time()
        tr.clock.finish()  # the clock times this phase's steps from here
        self.last_save, self.val = time.time(), float("nan")
        Phase.running = self

    def save(self, step):
        self.saved = step
        save_checkpoint({"kind": "resume", "fingerprint": self.fingerprint, "step": step,
                         "state_dict": self.module.state_dict(),
                         "optimizer": self.opt.state_dict()}, self.path)

    def check(self, step, loss_val, grad_norm):
        """Before the optimizer step: a NaN or inf stops the run with the last good state kept."""
        stop_if_diverged(self.name, step, loss_val, grad_norm, self.saved, self.path,
                         self.tr.lr_flag(self.name))

    def after(self, done, loss_val, lr):
        """After step `done`: a progress line, the validation, the resume file when due."""
        a = self.tr.run
        self.tr.clock.tick(self.name, done, self.steps, loss_val, lr, self.tokens_per_step,
                           a.log_interval)
        if done % a.eval_interval == 0 or done == self.steps:
            self.val = self.tr.evaluate(self.name, done, self.module, self.eval_fn)
        if time.time() - self.last_save > a.ckpt_interval and done < self.steps:
            self.save(done)
            self.last_save = time.time()

    def finish(self, keep_resume):
        """The phase's val loss. keep_resume: the resume file is written at the last step too
        (a finished phase that a rerun then skips)."""
        if keep_resume and self.start < self.steps:
            self.save(self.steps)
        self.module.eval()
        if self.start == self.steps:
            self.val = self.eval_fn()
        if not math.isfinite(self.val):  # never written as done: its last state is kept
            if self.saved != self.steps:
                self.save(self.steps)
            raise TrainingError(f"{self.name}: its validation loss is {self.val} after "
                                f"{self.steps} steps: training diverged on held-out text, so "
                                f"nothing was written as done; its last state is kept in "
                                f"{self.path}. Try a lower learning rate "
                                f"({self.tr.lr_flag(self.name)}).")
        self.tr.clock.finish(self.name)
        Phase.running = None
        print(f"{self.name}: {self.steps - self.start} steps in {time.time() - self.t0:.0f}s")
        return self.val


def kept():
    """What an interrupted train.py kept, and how it goes on: its one line on Ctrl-C."""
    phase, again = Phase.running, "the same command"
    if phase is None and chat_set.saved is not None:
        done, n, path = chat_set.saved
        return (f"{path} keeps the chat set's {done}/{n} answers so far, and every finished "
                f"stage's checkpoint is kept: {again} answers the rest, then goes on")
    if phase is None:
        return f"every finished stage's checkpoint is kept: {again} goes on from the next stage"
    if phase.saved is None:
        return (f"{phase.name} had not saved its state yet (it does every --ckpt-interval "
                f"seconds), the finished stages are kept: {again} starts {phase.name} over")
    return (f"{phase.path} holds {phase.name} at step {phase.saved}/{phase.steps}, the finished "
            f"stages are kept: {again} resumes there")


# -----------------------------------------------------------------------------
# what a stage's checkpoint records of its settings, and whether the one in out/ is current


def recorded(run, stages, name):
    """The settings out/<name>.pt records, and its stage's format: one trained with other values,
    or written in another format, is not current. Its stage's own record (the target's), else the
    usual one (training.stage.usual_record)."""
    stage = stages[name]
    values = stage.records(run) if stage.records is not None else usual_record(run, name, stage)
    return {**values, "format": stage.format}


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
        why = datamod.mismatch(ckpt, tr.info, tr.run.out_dir)
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
    changed = [f"{k} {had.get(k)} -> {v}" for k, v in tr.recorded(stage).items()
               if had.get(k) != v]
    if changed:
        print(f"{stage}: {path} was trained with other settings ({', '.join(changed[:4])}"
              f"{', ...' if len(changed) > 4 else ''}); retraining it")
    return not changed


# -----------------------------------------------------------------------------
# the data build, and the trained target it must not throw away


def prepare(run, stages):
    """The corpus's token files and tokenizer (training/data.py): written by rank 0, then read by
    every rank. With --init-from the tokenizer is the folder's, else one trained here (or
    gpt2)."""
    given = None
    if run.init_from:
        given = run.source.tokenizer
    else:
        keep_pretrained_build(run.out_dir)
    keep_trained_target(run, stages)
    if run.world.main:
        info = datamod.prepare_data(run.out_dir, run.data, run.vocab_size,
                                    given.kind if given else run.tokenizer, True, given,
                                    force=run.force)
    ddp.barrier(run.world)
    return info if run.world.main else datamod.load_build(run.out_dir)  # read, never write


def keep_pretrained_build(out_dir):
    """A build made for a pretrained model is not replaced by a run that forgot --init-from (it
    would retrain a nanospec target over the imported one)."""
    try:
        meta = datamod.read_meta(out_dir)
    except datamod.DataError:
        return
    if meta["tokenizer"] in datamod.FOLDER_KINDS:
        raise CheckpointError(f"{out_dir} holds the token files and target of the pretrained "
                              f"model in {meta.get('tokenizer_source', '?')}: pass --init-from "
                              "with it, or pick another --out-dir")


def keep_trained_target(run, stages):
    """out/target.pt is not replaced without --force by a run that throws training away: an
    --init-from import over it, or a retraining on fewer tokens than it saw (`--preset quick` over
    the full run). A bigger one goes ahead, as the full run replaces the quick one. (A data build
    of another corpus or tokenizer would orphan it: training/data.py refuses that.)"""
    path = os.path.join(run.out_dir, "target.pt")
    if run.force or run.only not in (None, "target") or not os.path.exists(path):
        return
    try:
        ckpt = load_checkpoint(path, "target")
    except CheckpointError:  # unreadable: it is remade anyway, with a notice
        return
    had, now = ckpt.get("settings") or {}, recorded(run, stages, "target")
    steps = run.settings["target"].target_iters
    seen, tokens = ckpt.get("tokens_seen", 0), steps * run.batch_size * run.block_size
    if run.init_from and had.get("init_from") != now["init_from"]:
        why = f"--init-from {run.init_from} would be imported over it"
    elif not run.init_from and had != now and tokens < seen:
        why = f"it trained on {seen:,} tokens, this run's target would train on {tokens:,}"
    else:
        return
    made = (f"imported from {ckpt['init_from']}" if ckpt.get("init_from")
            else f"trained here, validation loss {ckpt.get('val_loss', float('nan')):.4f}")
    raise CheckpointError(f"{path} holds a target ({made}) that this run would replace: {why}. "
                          "Pass --force to replace it and retrain its drafters, or pick another "
                          "--out-dir")


# -----------------------------------------------------------------------------
# the loop's schedule and optimizer, nanoGPT's


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


class Fitted(NamedTuple):
    """What Trainer.fit gives back of a phase."""
    val_loss: float
    optimizer_state: dict


# -----------------------------------------------------------------------------
# the Trainer: what a stage gets besides its own settings (the training-side twin of
# speculative.Drafter)


class Trainer:
    """Everything a stage gets besides its own settings, so that no stage imports train.py:

    fit(name, module, loss, ...)   the loop: trains one phase -> Fitted(val_loss, optimizer_state)
    run, device            the run's settings (run.block_size, run.seed, ...; run.settings: every
                           stage's settings, where one builds on another's) and the device
    target()               (the trained, frozen target, its checkpoint dict)
    distill                the drafters' text and the target's features on it (training/distill.py):
                           distill.batches(text) -> step -> (x, target logits, hidden states)
    corpus(split)          the corpus's tokens, for what is built from them without learning
    val_loss(fn)           mean of fn(x, y) over fixed validation windows
    save(config, state, extra)   out/<stage>.pt of the running stage, tied to this target and
                           tokenizer
    path(name), elapsed(), budget(), per_row(), recorded(stage)
    stages: {name: Stage} of the run (training/stage.py); plan: [(phase, steps)] it may train.
    """

    def __init__(self, run, stages, plan=()):
        self.run, self.stages, self.device, self.world = run, stages, run.device_resolved, run.world
        self.info = prepare(run, stages)
        self.data = datamod.Batches(self.info, run.block_size, run.batch_size, run.seed)
        self.forget_target()  # no target loaded yet, and so no distillation set
        self.rows = None  # this process's shard of the running step's batch (set_rows)
        self.stage, self.stage_t0, self.shared0 = None, time.time(), 0.0  # the running stage
        self.stage_steps = 0  # the optimizer steps of the running stage's phases so far
        self.clock = Clock(plan, {p: c for st in stages.values() for p, c in st.step_cost.items()})

    def fit(self, name, module, loss, evaluate, steps, lr, fingerprint, tokens_per_step,
            after_step=None, keep_resume=False):
        """The one training loop, every phase's: `steps` AdamW steps of loss(step), the loss of
        that step's batch, on module's trainable parameters, from a peak learning rate lr (warmup,
        then cosine decay). A step: loss(step) under bfloat16 autocast where the run uses it, in
        --grad-accum micro-steps (each loss divided by their number), loss.backward(), the
        gradients clipped to norm 1.0, optimizer.step() (AdamW, betas 0.9 and 0.95, weight decay
        0.1 on matrices only: make_optimizer). evaluate(): the validation loss, every --eval-interval steps and at
        the end. fingerprint: all the phase's result depends on (a resume file of another is not
        resumed); tokens_per_step: for the progress lines; after_step(n), if given, runs after the
        n-th step; keep_resume: keep the phase's resume file when it ends (a rerun skips it).
        -> Fitted(the final validation loss, the optimizer's state)."""
        run, world = self.run, self.world
        cpu_speed.speed_up(module)  # its no-grad passes (validation, calibration) as bench's
        params, optimizer = make_optimizer(module, lr)
        plumbing = Phase(self, name, module, optimizer, fingerprint, steps, evaluate,
                         tokens_per_step)
        forward = ddp.wrap(world, module, loss)  # loss itself in one process
        module.train()
        for step in range(plumbing.start, steps):  # > 0: an interrupted run resumes
            lr_now = lr_at(step, steps, lr, run.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr_now
            # the step's batch in --grad-accum micro-steps, and under torchrun a shard of each per
            # process: the gradients add up to the whole batch's (DDP averages them over processes)
            loss_val = 0.0
            for micro in range(run.grad_accum):
                self.set_rows(ddp.shard(world, run.grad_accum, run.batch_size, micro))
                with ddp.sync_if_last(forward, micro, run.grad_accum), self.autocast():
                    loss_now = forward(step)
                if run.grad_accum > 1:
                    loss_now = loss_now / run.grad_accum
                loss_val += loss_now.item()
                loss_now.backward()
            self.set_rows(None)
            loss_val = ddp.mean(world, loss_val)  # the whole batch's loss, in every process
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
            plumbing.check(step, loss_val, grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if after_step is not None:
                after_step(step + 1)
            plumbing.after(step + 1, loss_val, lr_now)  # progress, validation, the resume file
        self.stage_steps += steps
        return Fitted(plumbing.finish(keep_resume), optimizer.state_dict())

    def path(self, name):
        return os.path.join(self.run.out_dir, f"{name}.pt")

    def elapsed(self):
        """Seconds of the running stage so far, less the shared work it happened to start (the
        distillation set: no single stage is charged for it)."""
        return round(time.time() - self.stage_t0 - (self.distill.shared - self.shared0))

    def start(self, stage):
        self.stage, self.stage_t0, self.shared0 = stage, time.time(), self.distill.shared
        self.stage_steps = 0

    def budget(self, steps=None):
        """What the running stage cost: its optimizer steps (those of its phases so far, unless
        told) and seconds (bench.py prints it)."""
        return {"steps": steps or self.stage_steps, "seconds": self.elapsed()}

    def recorded(self, stage):
        """The settings out/<stage>.pt records (recorded(), above)."""
        return recorded(self.run, self.stages, stage)

    def lr_flag(self, phase):
        """The flag of a phase's learning rate: its own (--dflash-narrow-lr), else its stage's."""
        stage = self.stage or phase.split("-")[0]
        prefix = "" if stage == "target" else stage
        names = {n for n, _ in settings_of(self.stages[stage].settings, prefix)}
        for name in (f"{phase.replace('-', '_')}_lr", f"{stage}_lr"):
            if name in names:
                return "--" + name.replace("_", "-")
        return f"{stage}'s learning rate"

    def forget_target(self):
        """Drop the loaded target and everything computed from it (after it is retrained)."""
        self._target = None
        self.distill = distill.DistillationSet(self.run, self.data, self.target, self.device)

    def target(self):
        """The trained, frozen target (loaded once)."""
        if self._target is None:
            model, ckpt = load_target(self.path("target"), self.device)
            why = datamod.mismatch(ckpt, self.info, self.run.out_dir)
            if why:
                raise CheckpointError(f"{why}, or retrain the target on this build with "
                                      "`python train.py --only target --force`")
            for p in model.parameters():
                p.requires_grad_(False)
            self._target = (model, ckpt)
        return self._target

    def val_loss(self, loss_of_batch, n=8, rows=None):
        """The mean of loss_of_batch over n fixed validation batches (of `rows` windows each, or
        the run's batch size)."""
        with torch.no_grad():
            return sum(loss_of_batch(*self.data.get("val", i, self.device, rows)).item()
                       for i in range(n)) / n

    def corpus(self, split="train"):
        """The corpus's tokens of one split, (N,) ids in a read-only memory map of its token file
        (training/data.py): what a drafter that does not learn builds from."""
        return np.memmap(self.data.files[split], dtype=self.data.dtype, mode="r")

    def save(self, config, state, extra=None, steps=None, budget=None, stage=None):
        """out/<stage>.pt of the running stage (or of `stage`: the target's writes MTP's beside it
        in joint mode): config, what the declaration builds from it; state, its module or a dict
        of tensors; the target and tokenizer it belongs to, and its training budget."""
        stage = stage or self.stage
        if isinstance(state, torch.nn.Module):
            state = state.state_dict()
        _, target_ckpt = self.target()
        save_checkpoint({"kind": stage, "config": config, "state_dict": cpu_tree(state),
                         "budget": budget or self.budget(steps),
                         "target_hash": target_ckpt["model_hash"],
                         "tokenizer_hash": self.info["tokenizer_hash"],
                         "settings": self.recorded(stage), **(extra or {})},
                        self.path(stage))

    def autocast(self):
        return torch.autocast(self.device.split(":")[0], torch.bfloat16, enabled=self.run.use_bf16)

    def set_rows(self, rows):
        """Training batches take these rows of each step's global batch (None: all): this
        process's shard of a micro-step (ddp.shard)."""
        self.rows = self.data.rows = self.distill.rows = rows

    def per_row(self, draw, n):
        """draw(B) -> random draws for B rows (a stage's anchors), for a batch of n rows: drawn
        for the whole global batch and cut to this process's shard while one is set, so each
        row gets the draw it gets when one process takes the whole batch."""
        if self.rows is None:
            return draw(n)
        return draw(self.run.batch_size)[self.rows]

    def evaluate(self, name, step, module, eval_fn):
        module.eval()
        val = eval_fn()
        module.train()
        print(f"{name} | step {step:5d} | val loss {val:.4f}", flush=True)
        return val
