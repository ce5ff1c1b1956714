"""
train.py -- trains the target GPT, then every drafter for it, as a list of stages.

    python train.py                      # everything, with the preset for this device
    python train.py --preset quick       # every drafter, far fewer steps: the lesson in minutes
    python train.py --only small --force # retrain one stage even though its checkpoint exists
    python train.py --init-from DIR      # drafters for a pretrained GPT-2 (pretrained.py)
    torchrun --standalone --nproc_per_node=N train.py   # the same run on N processes (ddp.py)

The drafter files hold their models, how they draft and their losses; stages.py runs each as a
stage (a function train_<name>(trainer)); distill.py holds the text they learn from; settings.py
every setting and preset. This file holds what every stage shares: the one training loop, the
target's own stage and the command line. The `Trainer` is everything a stage gets: the training-side twin of
speculative.Drafter. Each stage writes out/<stage>.pt, and is skipped while that checkpoint
belongs to the current target and records the same settings (unless --force). A running phase
saves its whole state to out/<name>.resume.pt every --ckpt-interval seconds, atomically; batches
come from generators seeded by the step, so a killed run resumes to the very same weights.
With --init-from the target's stage reads a Hugging Face GPT-2 folder instead of training; under
torchrun every stage trains data-parallel, one shard of each step's batch per process.
"""

import math
import os
import sys
import time

import torch

import cpu_speed
import data as datamod
import ddp
import distill
import pretrained
from checkpoint import (CheckpointError, cpu_state_dict, load_checkpoint, load_target,
                        save_checkpoint)
from devices import allow_tf32, fast_bf16, pick_device
from settings import (GROUPS, PRESETS, PRESETS_OF, SETTINGS, ArgumentParser, add_settings,
                      path_arg, preset_values)
from stages import STAGES, is_current, stage_settings

# -----------------------------------------------------------------------------
# the pieces of the training loop

class TrainingError(RuntimeError):
    """Training went wrong in a way a flag can fix (the message names it)."""


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


def prepare(args):
    """The corpus's token files and tokenizer (data.py): written by rank 0, then read by every
    rank. With --init-from the tokenizer is the folder's, else one trained here (or gpt2)."""
    given = None
    if args.init_from:
        ranks, _ = pretrained.read_ranks(args.init_from)
        given = (ranks, pretrained.GPT2_PAT, os.path.abspath(args.init_from))
    else:
        keep_pretrained_build(args.out_dir)
    keep_trained_target(args)
    if args.world.main:
        info = datamod.prepare_data(args.out_dir, args.data, args.vocab_size,
                                    "pretrained" if given else args.tokenizer, True, given,
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
    if meta["tokenizer"] == "pretrained":
        raise CheckpointError(f"{out_dir} holds the token files and target of the pretrained "
                              f"model in {meta.get('tokenizer_source', '?')}: pass --init-from "
                              "with it, or pick another --out-dir")


def keep_trained_target(args):
    """out/target.pt is not replaced without --force by a run that throws training away: an
    --init-from import over it, or a retraining on fewer tokens than it saw (`--preset quick` over
    the full run). A bigger one goes ahead, as the full run replaces the quick one. (A data build
    of another corpus or tokenizer would orphan it: data.py refuses that.)"""
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
    """Everything a stage needs from train.py, so no drafter file imports it:

    args, device           every setting (args.dflash_iters, ...) and the device
    target()               (the trained, frozen target, its checkpoint dict)
    distill                the drafters' text and the target's features on it (distill.py):
                           distill.batches(text) -> step -> (x, target logits, hidden states)
    fit(name, module, loss_fn, eval_fn, steps=, lr=, fingerprint=, tokens_per_step=)
                           the one training loop, resumable -> (val loss, optimizer state)
    val_loss(fn)           mean of fn(x, y) over fixed validation windows
    save(stage, config, module, extra)   out/<stage>.pt, tied to this target and tokenizer
    path(name), elapsed(), budget()
    """

    def __init__(self, args, plan=()):
        self.args, self.device, self.world = args, args.device_resolved, args.world
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
            if ckpt["tokenizer_hash"] != self.info["tokenizer_hash"]:
                raise CheckpointError(f"{self.path('target')} was trained with tokenizer "
                                      f"{ckpt['tokenizer_hash'][:12]} but out/ now holds "
                                      f"{self.info['tokenizer_hash'][:12]}: run "
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

    def fit(self, name, module, loss_fn, eval_fn, steps, lr, fingerprint, tokens_per_step,
            after_step=None, keep_resume=False):
        """The one training loop: `steps` AdamW steps of loss_fn(step) on module's trainable
        parameters -> (final val loss, optimizer state). Resumes out/<name>.resume.pt if it
        was interrupted with the same fingerprint; saves it every --ckpt-interval seconds, and
        at the last step too with keep_resume (a finished phase a rerun then skips).
        after_step(n), if given, runs after the n-th step."""
        a = self.args
        cpu_speed.speed_up(module)  # its no-grad passes (validation, calibration) as bench's
        params, opt = make_optimizer(module, lr)
        path = os.path.join(a.out_dir, f"{name}.resume.pt")
        start = resume(name, module, opt, path, fingerprint, steps)
        saved = start if start else None

        def save_resume(step):
            nonlocal saved
            saved = step
            save_checkpoint({"kind": "resume", "fingerprint": fingerprint, "step": step,
                             "state_dict": module.state_dict(), "optimizer": opt.state_dict()},
                            path)

        t0 = time.time()
        self.clock.finish()  # the clock times this phase's steps from here
        last_save, val = time.time(), float("nan")
        run = ddp.wrap(self.world, module, loss_fn)  # loss_fn itself in one process
        module.train()
        for step in range(start, steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr, a.warmup)
            loss_val = ddp.accumulate(self.world, run, step, a.grad_accum, self.autocast,
                                      self.set_rows, a.batch_size)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
            stop_if_diverged(name, step, loss_val, grad_norm, saved, path)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if after_step is not None:
                after_step(step + 1)
            self.clock.tick(name, step + 1, steps, loss_val, opt.param_groups[0]["lr"],
                            tokens_per_step, a.log_interval)
            if (step + 1) % a.eval_interval == 0 or step + 1 == steps:
                val = self.evaluate(name, step + 1, module, eval_fn)
            if time.time() - last_save > a.ckpt_interval and step + 1 < steps:
                save_resume(step + 1)
                last_save = time.time()
        if keep_resume and start < steps:
            save_resume(steps)
        module.eval()
        if start == steps:
            val = eval_fn()
        self.clock.finish(name)
        print(f"{name}: {steps - start} steps in {time.time() - t0:.0f}s")
        return val, opt.state_dict()

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
                       help="a Hugging Face GPT-2 folder (config.json, model.safetensors or "
                       "pytorch_model.bin, vocab.json, merges.txt) as the target, whose tokenizer "
                       "encodes the corpus and for which every drafter trains (default: none, "
                       "train nanospec's own target)")
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
    for _, phases, _ in STAGES.values():
        phases(args)  # the stages check their settings now, not after the stages before them
    return args


def take_shape(args):
    """With --init-from the target's shape is the folder's (config.json): the drafters' settings
    are checked against it, and the context window may only shrink."""
    cfg = pretrained.read_config(args.init_from)
    for name in ("n_layer", "n_head", "n_embd"):
        setattr(args, name, getattr(cfg, name))
    if args.block_size > cfg.block_size:
        raise ValueError(f"--block-size {args.block_size} is longer than {args.init_from}'s "
                         f"context window (n_positions {cfg.block_size})")


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
        tr = Trainer(args, plan(args))
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


def cli(argv=None):
    """main() with every error a flag can fix as one `error:` line and exit status 1; under
    torchrun any error at all, as one line naming its rank (ddp.fail: torchrun then stops the
    other ranks)."""
    world = ddp.world_of_env()
    try:
        main(argv)
    except (CheckpointError, TrainingError, datamod.DataError, ValueError) as e:
        if world.size == 1:
            raise SystemExit(f"error: {e}")
        ddp.fail(world, e, shared=True)
    except Exception as e:
        if world.size == 1:
            raise
        ddp.fail(world, e, shared=False)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: one line, from rank 0
        if world.size == 1:
            raise
        if world.main:
            print("train.py: interrupted; the same command resumes", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    cli()
