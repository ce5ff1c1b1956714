"""
trainer.py -- what wraps train.py's loop from outside: the Trainer a stage is handed, the plumbing
of each phase (resume files, the NaN stop, progress, validation), the data build and the guard on
a trained target, and the command line's flags and plan.

train.py holds the loop itself (fit: forward, loss.backward(), clip, optimizer.step(), the
learning-rate schedule) and runs the stages in order; training/stages.py and
training/stages_*.py say what each stage trains. A Trainer is everything a stage gets: the
training-side twin of speculative.Drafter. Each stage writes out/<stage>.pt, and is skipped while
that checkpoint belongs to the current target and records the same settings (unless --force). A
running phase saves its whole state to out/<name>.resume.pt every --ckpt-interval seconds,
atomically; batches come from generators seeded by the step, so a killed run resumes to the very
same weights. With --init-from the target's stage reads a Hugging Face folder (GPT-2, Llama,
Qwen2, Qwen3) instead of training; under torchrun every stage trains data-parallel, one shard of
each step's batch per process (training/ddp.py).
"""

import math
import os
import time

import torch

from runtime.checkpoint import (CheckpointError, cpu_state_dict, load_checkpoint, load_target,
                                save_checkpoint)
from runtime.devices import fast_bf16, pick_device
from runtime.settings import (GROUPS, PRESETS, PRESETS_OF, SETTINGS, ArgumentParser,
                              add_settings, path_arg, preset_values)
from training import data as datamod
from training import ddp, distill, pretrained
from training.stages import STAGES, stage_settings

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


def stop_if_diverged(name, step, loss_val, grad_norm, saved_step, path):
    """A NaN or inf loss or gradient would poison the weights: stop, saying what was kept."""
    if math.isfinite(loss_val) and math.isfinite(grad_norm):
        return
    kept = (f"the last good state (step {saved_step}) is kept in {path}" if saved_step is not None
            else "no state of this stage was saved yet")
    bad = loss_val if not math.isfinite(loss_val) else grad_norm
    lr = name if f"{name.replace('-', '_')}_lr" in SETTINGS else name.split("-")[0]
    raise TrainingError(f"{name}: the loss (or its gradient) became {bad} at step {step}, so "
                        f"training stopped; {kept}. Try a lower learning rate (--{lr}-lr).")


# one step of each phase next to one target step, on the reference CPU with the cpu preset
# (docs/results.md: training): the run's time estimate until it measures its own
STEP_COST = {"target": 1.0, "small": 0.43, "mtp": 0.40, "eagle": 0.42, "dflash-narrow": 0.31,
             "dflash": 0.30, "dspark": 0.39, "dspark-sampled": 0.27,
             "distill": 0.26}  # distill: per sequence


class Clock:
    """Progress lines, and the whole run's remaining time: the steps left in every phase still
    to run (plan: [(phase, steps)]), each costed at STEP_COST x the seconds a target step takes
    here, as last measured from the running phase. An estimate, better as each phase runs."""

    def __init__(self, plan):
        self.left, self.unit, self.t_last = dict(plan), None, time.time()

    def tick(self, name, done, steps, loss, lr, tokens, every):
        """After step `done` of phase `name`: a progress line every `every` steps."""
        if done % every and done != steps:
            return
        now = time.time()
        sec = (now - self.t_last) / (every if done % every == 0 else done % every)
        first, self.unit, self.t_last = self.unit is None, sec / STEP_COST.get(name, 1.0), now
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
        s = sum(n * STEP_COST.get(p, 1.0) * self.unit for p, n in self.left.items())
        return f"{int(s // 60)}m{int(s % 60):02d}s"


class Phase:
    """The plumbing around one phase of train.py's loop: its resume file (read back here: `start`
    is the step to begin at; written atomically every --ckpt-interval seconds), the stop on a NaN,
    the progress lines, the validation every --eval-interval steps. A run killed anywhere resumes
    to the very same weights: batches come from generators seeded by the step."""
    running = None  # the phase running now, for what an interruption says it kept (kept())

    def __init__(self, tr, name, module, opt, fingerprint, steps, eval_fn, tokens_per_step):
        self.tr, self.name, self.module, self.opt = tr, name, module, opt
        self.fingerprint, self.steps, self.eval_fn = fingerprint, steps, eval_fn
        self.tokens_per_step = tokens_per_step
        self.path = os.path.join(tr.args.out_dir, f"{name}.resume.pt")
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
        stop_if_diverged(self.name, step, loss_val, grad_norm, self.saved, self.path)

    def after(self, done, loss_val, lr):
        """After step `done`: a progress line, the validation, the resume file when due."""
        a = self.tr.args
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
        self.tr.clock.finish(self.name)
        Phase.running = None
        print(f"{self.name}: {self.steps - self.start} steps in {time.time() - self.t0:.0f}s")
        return self.val


def kept():
    """What an interrupted train.py kept, and how it goes on: its one line on Ctrl-C."""
    phase, again = Phase.running, "the same command"
    if phase is None:
        return f"every finished stage's checkpoint is kept: {again} goes on from the next stage"
    if phase.saved is None:
        return (f"{phase.name} had not saved its state yet (it does every --ckpt-interval "
                f"seconds), the finished stages are kept: {again} starts {phase.name} over")
    return (f"{phase.path} holds {phase.name} at step {phase.saved}/{phase.steps}, the finished "
            f"stages are kept: {again} resumes there")


# -----------------------------------------------------------------------------
# the data build, and the trained target it must not throw away


def prepare(args):
    """The corpus's token files and tokenizer (training/data.py): written by rank 0, then read by
    every
    rank. With --init-from the tokenizer is the folder's, else one trained here (or gpt2)."""
    given = None
    if args.init_from:
        given = pretrained.tokenizer_of(args.init_from, pretrained.read_config(args.init_from))
    else:
        keep_pretrained_build(args.out_dir)
    keep_trained_target(args)
    if args.world.main:
        info = datamod.prepare_data(args.out_dir, args.data, args.vocab_size,
                                    given.kind if given else args.tokenizer, True, given,
                                    force=args.force)
    ddp.barrier(args.world)
    return info if args.world.main else datamod.load_build(args.out_dir)  # read, never write


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


def keep_trained_target(args):
    """out/target.pt is not replaced without --force by a run that throws training away: an
    --init-from import over it, or a retraining on fewer tokens than it saw (`--preset quick` over
    the full run). A bigger one goes ahead, as the full run replaces the quick one. (A data build
    of another corpus or tokenizer would orphan it: training/data.py refuses that.)"""
    path = os.path.join(args.out_dir, "target.pt")
    if args.force or args.only not in (None, "target") or not os.path.exists(path):
        return
    try:
        ckpt = load_checkpoint(path, "target")
    except CheckpointError:  # unreadable: it is remade anyway, with a notice
        return
    had, now = ckpt.get("settings") or {}, stage_settings(args, "target")
    seen, tokens = ckpt.get("tokens_seen", 0), args.target_iters * args.batch_size * args.block_size
    if args.init_from and had.get("init_from") != now["init_from"]:
        why = f"--init-from {args.init_from} would be imported over it"
    elif not args.init_from and had != now and tokens < seen:
        why = f"it trained on {seen:,} tokens, this run's target would train on {tokens:,}"
    else:
        return
    made = (f"imported from {ckpt['init_from']}" if ckpt.get("init_from")
            else f"trained here, validation loss {ckpt.get('val_loss', float('nan')):.4f}")
    raise CheckpointError(f"{path} holds a target ({made}) that this run would replace: {why}. "
                          "Pass --force to replace it and retrain its drafters, or pick another "
                          "--out-dir")


# -----------------------------------------------------------------------------
# the Trainer: what a stage function gets (the training-side twin of speculative.Drafter)


class Trainer:
    """Everything a stage gets (training/stages.py), so that no stage imports train.py:

    args, device           every setting (args.dflash_iters, ...) and the device
    target()               (the trained, frozen target, its checkpoint dict)
    distill                the drafters' text and the target's features on it (training/distill.py):
                           distill.batches(text) -> step -> (x, target logits, hidden states)
    fit(name, module, loss_fn, eval_fn, steps=, lr=, fingerprint=, tokens_per_step=)
                           train.py's loop, resumable (Phase) -> (val loss, optimizer state)
    val_loss(fn)           mean of fn(x, y) over fixed validation windows
    save(stage, config, module, extra)   out/<stage>.pt, tied to this target and tokenizer
    path(name), elapsed(), budget()
    """

    def __init__(self, args, plan=(), loop=None):
        self.args, self.device, self.world = args, args.device_resolved, args.world
        self.loop = loop  # train.fit: the one training loop
        self.info = prepare(args)
        self.data = datamod.Batches(self.info, args.block_size, args.batch_size, args.seed)
        self.forget_target()  # no target loaded yet, and so no distillation set
        self.rows = None  # this process's shard of the running step's batch (set_rows)
        self.stage, self.stage_t0, self.shared0 = None, time.time(), 0.0  # the running stage
        self.clock = Clock(plan)

    def path(self, name):
        return os.path.join(self.args.out_dir, f"{name}.pt")

    def elapsed(self):
        """Seconds of the running stage so far, less the shared work it happened to start (the
        distillation set: no single stage is charged for it)."""
        return round(time.time() - self.stage_t0 - (self.distill.shared - self.shared0))

    def start(self, stage):
        self.stage, self.stage_t0, self.shared0 = stage, time.time(), self.distill.shared

    def budget(self, steps=None):
        """What the running stage cost: its optimizer steps and seconds (bench.py prints it)."""
        return {"steps": steps or getattr(self.args, f"{self.stage}_iters"),
                "seconds": self.elapsed()}

    def forget_target(self):
        """Drop the loaded target and everything computed from it (after it is retrained)."""
        self._target = None
        self.distill = distill.DistillationSet(self.args, self.data, self.target, self.device)

    def target(self):
        """The trained, frozen target (loaded once)."""
        if self._target is None:
            model, ckpt = load_target(self.path("target"), self.device)
            why = datamod.mismatch(ckpt, self.info, self.args.out_dir)
            if why:
                raise CheckpointError(f"{why}, or retrain the target on this build with "
                                      "`python train.py --only target --force`")
            for p in model.parameters():
                p.requires_grad_(False)
            self._target = (model, ckpt)
        return self._target

    def val_loss(self, loss_of_batch, n=8):
        with torch.no_grad():
            return sum(loss_of_batch(*self.data.get("val", i, self.device)).item()
                       for i in range(n)) / n

    def save(self, stage, config, module, extra=None, steps=None, budget=None):
        """out/<stage>.pt for a drafter: its weights, the target and tokenizer it belongs to, and
        its training budget."""
        _, target_ckpt = self.target()
        save_checkpoint({"kind": stage, "config": config, "state_dict": cpu_state_dict(module),
                         "budget": budget or self.budget(steps),
                         "target_hash": target_ckpt["model_hash"],
                         "tokenizer_hash": self.info["tokenizer_hash"],
                         "settings": stage_settings(self.args, stage), **(extra or {})},
                        self.path(stage))

    def fit(self, name, module, loss_fn, eval_fn, **kw):
        """train.py's loop (`loop`, given at construction) over one phase: `steps` AdamW steps
        of loss_fn(step) on module -> (final val loss, optimizer state)."""
        return self.loop(self, name, module, loss_fn, eval_fn, **kw)

    def autocast(self):
        return torch.autocast(self.device.split(":")[0], torch.bfloat16, enabled=self.args.use_bf16)

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
        return draw(self.args.batch_size)[self.rows]

    def evaluate(self, name, step, module, eval_fn):
        module.eval()
        val = eval_fn()
        module.train()
        print(f"{name} | step {step:5d} | val loss {val:.4f}", flush=True)
        return val


# -----------------------------------------------------------------------------
# command line


def build_parser(preset=None):
    """The flags; each setting's help shows the value `preset` gives it (what a run would use)."""
    p = ArgumentParser(description="Train the nanospec target and its drafters.")
    shown = preset or "cpu"
    first = p.add_argument_group("start here")
    first.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="the defaults of every setting below: "
                       + "; ".join(f"{k}: {v}" for k, v in PRESETS.items())
                       + " (default: by device: cpu, cuda or mps)")
    first.add_argument("--only", choices=list(STAGES), default=None,
                       help=f"run one stage ({', '.join(STAGES)}); default: all, in that order")
    first.add_argument("--force", action="store_true",
                       help="retrain stages even if their checkpoint exists (default: off)")
    first.add_argument("--out-dir", type=path_arg("dir"), default="out",
                       help="where tokenizer, token files and checkpoints go (default: out)")
    first.add_argument("--data", type=path_arg("data"), default=None,
                       help="a text file or folder to train on (default: the Python stdlib)")
    first.add_argument("--init-from", type=path_arg("folder"), default=None,
                       help="a Hugging Face folder of a GPT-2, Llama, Qwen2 or Qwen3 model "
                       "(config.json, model.safetensors, its tokenizer) as the target, whose "
                       "tokenizer encodes the corpus and for which every drafter trains "
                       "(docs/your_model.md; default: none, train nanospec's own target)")
    first.add_argument("--device", default="auto",
                       help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps (default: auto)")
    add_settings(p, GROUPS, PRESETS_OF.get(shown, shown))
    return p


def preset_of(argv):
    """The preset a command line asks for, or its device's (for --help's defaults)."""
    pre = ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default=None)
    pre.add_argument("--device", default="auto")
    known, _ = pre.parse_known_args(argv)
    if known.preset:
        return known.preset
    try:
        return pick_device(known.device).split(":")[0]
    except ValueError:
        return None


def resolve_args(argv=None):
    args = build_parser(preset_of(argv)).parse_args(argv)
    heads_given = args.dflash_heads is not None
    device = pick_device(args.device)
    args.preset = args.preset or device.split(":")[0]
    for name, value in preset_values(args.preset).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.device_resolved = device
    args.use_bf16 = fast_bf16(device) if args.bf16 == "auto" else args.bf16 == "on"
    args.world = ddp.world_of_env()  # one process, unless torchrun started this one
    ddp.check_split(args.world, args.grad_accum, args.batch_size)
    if args.init_from:
        take_shape(args)
        if args.preset == "gpu-small" and not heads_given:  # a width that splits as the target's
            args.dflash_heads = args.n_head
    for _, phases, _ in STAGES.values():
        phases(args)  # the stages check their settings now, not after the stages before them
    return args


def take_shape(args):
    """With --init-from the target's shape is the folder's (config.json): the drafters' settings
    are checked against it, and the context window may only shrink."""
    cfg = pretrained.read_config(args.init_from)
    for name in ("n_layer", "n_head", "n_embd"):
        setattr(args, name, getattr(cfg, name))
    if args.block_size > cfg.sequence_len:
        raise ValueError(f"--block-size {args.block_size} is longer than {args.init_from}'s "
                         f"context window ({cfg.sequence_len} positions)")


def check_out_dir(args):
    """A folder where train.py writes a file would fail only after the training: refuse it now."""
    phases = [n for _, ph, _ in STAGES.values() for n, _ in ph(args)]
    names = [*datamod.BUILT, "distill.pt", "dflash.branch.pt", *(f"{s}.pt" for s in STAGES),
             *(f"{n}.resume.pt" for n in phases)]
    for p in (os.path.join(args.out_dir, n) for n in names):
        if os.path.isdir(p):
            raise CheckpointError(f"{p} is a folder where train.py writes a file; move it away")


def plan(args):
    """[(phase, steps)] of every stage this run may train (for the time estimate)."""
    stages = [s for s in STAGES if not args.only or s == args.only]
    out = [(n, steps) for s in stages for n, steps in STAGES[s][1](args)]
    if any(s != "target" for s in stages) and not os.path.exists(
            os.path.join(args.out_dir, "distill.pt")):
        out.insert(1 if stages[0] == "target" else 0, ("distill", args.gen_seqs))
    return out
