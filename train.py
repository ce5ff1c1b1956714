"""
train.py -- trains the target GPT, then every drafter for it, as a list of stages.

    python train.py                      # everything, with the preset for this device
    python train.py --only target        # one stage
    python train.py --only small --force # retrain one stage even though its checkpoint exists
    python train.py --preset tiny        # a seconds-long smoke run (what the tests use)

Stages run in order; each writes out/<stage>.pt. A stage whose checkpoint exists (and was
trained against the current target and tokenizer) is skipped unless --force. While a stage
runs, its full training state goes to out/<stage>.resume.pt every few steps (atomically), so
a killed run picks up where it stopped: batches are drawn from a generator seeded by the
step number, so the resumed run sees the same data an uninterrupted one would have.

Presets are chosen by device (cpu: the whole script in about 20 minutes on 2 cores; cuda: a
larger model, ~10 minutes on one consumer GPU). Every preset field is also a flag.
"""

import argparse
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import data as datamod
from gpt import GPT, GPTConfig, CheckpointError, load_checkpoint, load_target, pick_device, save_checkpoint, state_hash

# -----------------------------------------------------------------------------
# presets: the defaults live here and only here

PRESETS = {
    # measured on a 2-core CPU: the target takes ~half of the ~20-minute budget
    "cpu": dict(n_layer=6, n_head=8, n_embd=256, block_size=256, batch_size=8,
                target_iters=1200, target_lr=2e-3, warmup=60,
                small_layers=1, small_embd=128, small_heads=4, small_iters=500, small_lr=3e-3, small_distill=1.0),
    # one consumer GPU, ~10 minutes: wider, deeper, longer context, bigger batches
    "cuda": dict(n_layer=8, n_head=8, n_embd=512, block_size=512, batch_size=32,
                 target_iters=4000, target_lr=1e-3, warmup=200,
                 small_layers=2, small_embd=256, small_heads=4, small_iters=2000, small_lr=2e-3, small_distill=1.0),
    # seconds: for the tests and for trying the pipeline end to end
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=64, batch_size=4,
                 target_iters=30, target_lr=3e-3, warmup=5,
                 small_layers=1, small_embd=16, small_heads=2, small_iters=10, small_lr=3e-3, small_distill=1.0),
}
PRESETS["mps"] = PRESETS["cuda"]

FIELD_HELP = {
    "n_layer": "target: number of transformer blocks",
    "n_head": "target: attention heads per block",
    "n_embd": "target: model width",
    "block_size": "context window (target and drafters)",
    "batch_size": "sequences per training step (every stage)",
    "target_iters": "target: optimizer steps",
    "target_lr": "target: peak learning rate",
    "warmup": "linear warmup steps before the cosine decay (every stage)",
    "small_layers": "small draft model: number of blocks",
    "small_embd": "small draft model: width",
    "small_heads": "small draft model: attention heads",
    "small_iters": "small draft model: optimizer steps",
    "small_lr": "small draft model: peak learning rate",
    "small_distill": "small draft model: weight of the KL-to-target loss (1 = pure distillation, 0 = data only)",
}

# -----------------------------------------------------------------------------
# data batches


class Batches:
    """Random windows from the uint16 token files. The window offsets of step s come from a
    generator seeded with (seed, s): training is reproducible and a resumed run replays exactly."""

    def __init__(self, info, block_size, batch_size, seed):
        self.files = {"train": info["train_bin"], "val": info["val_bin"]}
        self.T, self.B, self.seed = block_size, batch_size, seed

    def get(self, split, step, device, B=None):
        arr = np.memmap(self.files[split], dtype=np.uint16, mode="r")
        if len(arr) <= self.T + 1:
            raise datamod.DataError(f"the {split} split has only {len(arr)} tokens; it needs more than {self.T + 1}: use more data or a smaller --block-size")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + (0 if split == "train" else 7_919_000))
        ix = torch.randint(len(arr) - self.T - 1, (B or self.B,), generator=g).tolist()
        x = torch.stack([torch.from_numpy(arr[i:i + self.T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(arr[i + 1:i + 1 + self.T].astype(np.int64)) for i in ix])
        return x.to(device), y.to(device)


# -----------------------------------------------------------------------------
# one generic training loop for every stage


class TrainingError(RuntimeError):
    pass


def lr_at(step, iters, peak, warmup):
    """Linear warmup, then cosine decay to a tenth of the peak (nanoGPT)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    ratio = (step - warmup) / max(1, iters - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, ratio))))


def train_loop(name, module, loss_fn, eval_fn, iters, lr, args, fingerprint, tokens_per_step):
    """Runs `iters` AdamW steps of loss_fn(step) on module's trainable parameters and returns
    (final val loss, optimizer state). Resumes from out/<name>.resume.pt if it was
    interrupted with the same fingerprint; saves that file every --ckpt-interval seconds."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    resume_path = os.path.join(args.out_dir, f"{name}.resume.pt")
    start = 0
    if os.path.exists(resume_path):
        try:
            r = load_checkpoint(resume_path, "resume", stage=name)
        except CheckpointError as e:
            print(f"{name}: ignoring an unreadable resume file ({e})")
            r = None
        if r is not None and r.get("fingerprint") == fingerprint:
            module.load_state_dict(r["state_dict"])
            opt.load_state_dict(r["optimizer"])
            start = r["step"]
            print(f"{name}: resuming an interrupted run at step {start}/{iters}")
        elif r is not None:
            print(f"{name}: the resume file is from a run with other settings; starting over")

    def save_resume(step):
        save_checkpoint({"kind": "resume", "fingerprint": fingerprint, "step": step,
                         "state_dict": module.state_dict(), "optimizer": opt.state_dict()}, resume_path)

    t_start = t_last = time.time()
    last_save, val = time.time(), float("nan")
    module.train()
    for step in range(start, iters):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, iters, lr, args.warmup)
        loss = loss_fn(step)
        loss_val = loss.item()  # host sync: once per step, for the NaN check and the log
        if not math.isfinite(loss_val):
            kept = f"the last good state (step {start if step == start else 'saved'}) is kept in {resume_path}" \
                if os.path.exists(resume_path) else "nothing was saved for this stage"
            raise TrainingError(f"{name}: the loss became {loss_val} at step {step}; {kept}. "
                                f"Try a lower learning rate (--{name}-lr).")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % args.log_interval == 0 or done == iters:
            now = time.time()
            ms = 1000 * (now - t_last) / (args.log_interval if done % args.log_interval == 0 else max(1, done % args.log_interval))
            t_last = now
            eta = (iters - done) * ms / 1000
            print(f"{name} | step {done:5d}/{iters} | loss {loss_val:.4f} | lr {opt.param_groups[0]['lr']:.1e} | "
                  f"{ms:6.0f} ms/step | {tokens_per_step * 1000 / ms:7.0f} tok/s | ETA {int(eta // 60)}m{int(eta % 60):02d}s",
                  flush=True)
        if done % args.eval_interval == 0 or done == iters:
            module.eval()
            val = eval_fn()
            module.train()
            print(f"{name} | step {done:5d} | val loss {val:.4f}", flush=True)
        if time.time() - last_save > args.ckpt_interval and done < iters:
            save_resume(done)
            last_save = time.time()
    module.eval()
    if start == iters:
        val = eval_fn()
    print(f"{name}: {iters - start} steps in {time.time() - t_start:.0f}s")
    return val, opt.state_dict()


# -----------------------------------------------------------------------------
# shared context for the stages


class Context:
    def __init__(self, args):
        self.args = args
        self.device = pick_device(args.device)
        self.info = datamod.prepare_data(args.out_dir, args.data, args.vocab_size, args.tokenizer)
        self.batches = Batches(self.info, args.block_size, args.batch_size, args.seed)
        self._target = None

    def path(self, stage):
        return os.path.join(self.args.out_dir, f"{stage}.pt")

    def target(self):
        """The trained, frozen target (loaded once)."""
        if self._target is None:
            model, ckpt = load_target(self.path("target"), self.device)
            if ckpt["tokenizer_hash"] != self.info["tokenizer_hash"]:
                raise CheckpointError(f"{self.path('target')} was trained with tokenizer {ckpt['tokenizer_hash'][:12]} "
                                      f"but out/ now holds {self.info['tokenizer_hash'][:12]}: run `python train.py --only target --force`")
            for p in model.parameters():
                p.requires_grad_(False)
            self._target = (model, ckpt)
        return self._target

    def val_loss(self, loss_of_batch, n=8):
        with torch.no_grad():
            return sum(loss_of_batch(*self.batches.get("val", i, self.device)).item() for i in range(n)) / n

    def drafter_meta(self, kind, config, state_dict, extra=None):
        """Checkpoint dict for a drafter: it records which target and tokenizer it belongs to."""
        _, tckpt = self.target()
        return {"kind": kind, "config": config, "state_dict": state_dict,
                "target_hash": tckpt["model_hash"], "tokenizer_hash": self.info["tokenizer_hash"], **(extra or {})}


def is_current(ctx, stage):
    """Does out/<stage>.pt exist and belong to the current target/tokenizer?"""
    path = ctx.path(stage)
    if not os.path.exists(path):
        return False
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        print(f"{stage}: {path} is unreadable; retraining it")
        return False
    if stage == "target":
        ok = ckpt.get("tokenizer_hash") == ctx.info["tokenizer_hash"]
    else:
        ok = ckpt.get("target_hash") == ctx.target()[1]["model_hash"]
    if not ok:
        print(f"{stage}: {path} was trained against another target or tokenizer; retraining it")
    return ok


# -----------------------------------------------------------------------------
# the stages


def stage_target(ctx):
    a = ctx.args
    cfg = GPTConfig(block_size=a.block_size, vocab_size=ctx.info["vocab_size"], n_layer=a.n_layer,
                    n_head=a.n_head, n_embd=a.n_embd)
    torch.manual_seed(a.seed)
    model = GPT(cfg).to(ctx.device)
    print(f"target: {model.num_params() / 1e6:.2f}M parameters, {cfg}")

    def loss_fn(step):
        return model(*ctx.batches.get("train", step, ctx.device))[1]

    fingerprint = {"stage": "target", "config": cfg.to_dict(), "tokenizer": ctx.info["tokenizer_hash"],
                   "iters": a.target_iters, "lr": a.target_lr, "batch": a.batch_size, "seed": a.seed}
    val, opt_state = train_loop("target", model, loss_fn, lambda: ctx.val_loss(lambda x, y: model(x, y)[1]),
                                a.target_iters, a.target_lr, a, fingerprint, a.batch_size * a.block_size)
    sd = {k: v.cpu() for k, v in model.state_dict().items()}
    save_checkpoint({"kind": "target", "config": cfg.to_dict(), "state_dict": sd, "model_hash": state_hash(sd),
                     "tokenizer_hash": ctx.info["tokenizer_hash"], "step": a.target_iters, "optimizer": opt_state,
                     "val_loss": val, "tokens_seen": a.target_iters * a.batch_size * a.block_size}, ctx.path("target"))
    return val


def stage_small(ctx):
    """The classic independent drafter: a 1-2 layer GPT, distilled from the target."""
    a = ctx.args
    target, _ = ctx.target()
    cfg = GPTConfig(block_size=a.block_size, vocab_size=target.config.vocab_size, n_layer=a.small_layers,
                    n_head=a.small_heads, n_embd=a.small_embd)
    torch.manual_seed(a.seed + 1)
    model = GPT(cfg).to(ctx.device)
    print(f"small: {model.num_params() / 1e6:.2f}M parameters, {cfg}")

    def loss_of(x, y):
        logits, ce, _ = model(x, y)
        if a.small_distill == 0:
            return ce
        with torch.no_grad():
            p_logits = target(x)[0]
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(p_logits, -1), log_target=True, reduction="batchmean") / x.size(1)
        return a.small_distill * kl + (1 - a.small_distill) * ce

    fingerprint = {"stage": "small", "config": cfg.to_dict(), "target": ctx.target()[1]["model_hash"],
                   "iters": a.small_iters, "lr": a.small_lr, "distill": a.small_distill, "seed": a.seed}
    val, _ = train_loop("small", model, lambda s: loss_of(*ctx.batches.get("train", s, ctx.device)),
                        lambda: ctx.val_loss(lambda x, y: model(x, y)[1]),
                        a.small_iters, a.small_lr, a, fingerprint, a.batch_size * a.block_size)
    sd = {k: v.cpu() for k, v in model.state_dict().items()}
    save_checkpoint(ctx.drafter_meta("small", cfg.to_dict(), sd, {"val_loss": val}), ctx.path("small"))
    return val


STAGES = {"target": stage_target, "small": stage_small}

# -----------------------------------------------------------------------------
# command line


def build_parser():
    p = argparse.ArgumentParser(description="Train the nanospec target and its drafters.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="defaults for all sizes and steps (default: by device)")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--only", default=None, help=f"run one stage: {', '.join(STAGES)}")
    p.add_argument("--force", action="store_true", help="retrain stages even if their checkpoint exists")
    p.add_argument("--out-dir", default="out", help="where tokenizer, token files and checkpoints go")
    p.add_argument("--data", default=None, help="a text file or folder to train on (default: the Python stdlib sources)")
    p.add_argument("--vocab-size", type=int, default=datamod.DEFAULT_VOCAB, help="BPE vocabulary size, end-of-text included")
    p.add_argument("--tokenizer", default="bpe", choices=["bpe", "gpt2"], help="train our own BPE, or use tiktoken's gpt2 if it loads")
    p.add_argument("--seed", type=int, default=1337, help="seed for initialisation and batch sampling")
    p.add_argument("--log-interval", type=int, default=25, help="steps between progress lines")
    p.add_argument("--eval-interval", type=int, default=250, help="steps between validation losses")
    p.add_argument("--ckpt-interval", type=float, default=60.0, help="seconds between resume checkpoints")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    for field, help_text in FIELD_HELP.items():
        kind = type(PRESETS["cpu"][field])
        p.add_argument("--" + field.replace("_", "-"), type=kind, default=None, help=f"{help_text} (preset)")
    return p


def resolve_args(argv=None):
    args = build_parser().parse_args(argv)
    device = pick_device(args.device)
    preset = PRESETS[args.preset or device.split(":")[0]]
    for field in FIELD_HELP:
        if getattr(args, field) is None:
            setattr(args, field, preset[field])
    if args.only is not None and args.only not in STAGES:
        raise SystemExit(f"unknown stage {args.only!r}: choose one of {', '.join(STAGES)}")
    return args


def main(argv=None):
    args = resolve_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    ctx = Context(args)
    print(f"device {ctx.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, preset {args.preset or ctx.device}")
    for stage, fn in STAGES.items():
        if args.only and stage != args.only:
            continue
        if not args.force and is_current(ctx, stage):
            print(f"{stage}: {ctx.path(stage)} exists, skipping (--force to retrain)")
            continue
        ts = time.time()
        val = fn(ctx)
        resume = os.path.join(args.out_dir, f"{stage}.resume.pt")
        if os.path.exists(resume):
            os.remove(resume)
        print(f"{stage}: done in {time.time() - ts:.0f}s, val loss {val:.4f}, wrote {ctx.path(stage)}")
        if stage == "target":
            ctx._target = None  # drafters must see the freshly trained target
    print(f"train.py finished in {(time.time() - t0) / 60:.1f} minutes")


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, TrainingError, datamod.DataError, ValueError) as e:
        raise SystemExit(f"error: {e}")
