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
larger model, not yet run on a GPU). Every preset field is also a flag. Training runs under
bfloat16 autocast where the device measurably does bfloat16 fast (--bf16), else in float32.

The drafters all learn from one distillation set: the target's own continuations of corpus
prompts, written once to out/distill.pt (a quarter of them sampled, the rest greedy).
"""

import argparse
import dataclasses
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import data as datamod
from gpt import (GPT, GPTConfig, CheckpointError, load_checkpoint, load_target, number, path_arg,
                 pick_device, ArgumentParser, save_checkpoint, state_hash)
from draft_dflash import (DFlash, DFlashConfig, default_taps, dflash_loss, sample_anchors,
                          target_continuations)
from draft_dspark import DSpark, DSparkConfig, calibrate, dspark_loss
from draft_mtp import MTP, MTPConfig, mtp_loss
from speculative import total_variation

# -----------------------------------------------------------------------------
# presets: every training default lives here. (The model configs' dataclass defaults -- GPTConfig,
# MTPConfig, DFlashConfig, DSparkConfig -- are for using those classes on their own, in tests or a
# notebook; train.py always passes every field from the preset.) The CPU preset is the base; the
# others say only how they differ from it.

# measured on 2 CPU cores with fast bfloat16: ~19 minutes in all, the target a quarter, DFlash and
# DSpark together a half. DFlash drafts at block 16 but learns block 8 first (stage_dflash: why)
CPU = dict(
    n_layer=6, n_head=8, n_embd=256, block_size=256, batch_size=8,
    target_iters=1300, target_lr=2e-3, warmup=60,
    small_layers=1, small_embd=128, small_heads=4, small_iters=500, small_lr=3e-3,
    small_distill=1.0, small_text="gen",
    mtp_mode="posthoc", mtp_modules=1, mtp_lambda=0.3, mtp_iters=2000, mtp_lr=2e-3,
    mtp_distill=0.5, mtp_text="gen",
    gen_seqs=1024, gen_sampled=0.25, gen_temperature=0.8, feature_cache=1,
    dflash_layers=2, dflash_heads=8, dflash_block=16, dflash_gamma=3.0, dflash_anchors=8,
    dflash_iters=1000, dflash_lr=1e-3, dflash_text="gen", dflash_taps="auto",
    dflash_narrow_block=8, dflash_narrow_anchors=16, dflash_narrow_iters=5000,
    dflash_narrow_lr=2e-3,
    dspark_rank=256, dspark_iters=1000, dspark_lr=2e-3, dspark_calib_seqs=32, dspark_init="dflash",
    dspark_sampled_iters=400, dspark_sampled_block=5, dspark_sampled_anchors=16,
)

PRESETS = {
    "cpu": CPU,
    # one consumer GPU: wider, deeper, longer context, bigger batches, in bfloat16 autocast
    # (--bf16 auto) with TF32 matmuls. Never run yet: no GPU was at hand, so its run time is unknown
    # (a rough FLOP count says 20-30 minutes on a 3090-class card; an estimate, not a measurement)
    "cuda": {**CPU, **dict(
        n_layer=8, n_embd=512, block_size=512, batch_size=32,
        target_iters=4000, target_lr=1e-3, warmup=200,
        small_layers=2, small_embd=256, small_iters=2000, small_lr=2e-3,
        mtp_iters=2000, mtp_lr=1e-3, gen_seqs=2048, feature_cache=0,
        dflash_layers=3, dflash_block=16, dflash_gamma=7.0, dflash_anchors=32,
        dflash_iters=2000, dflash_lr=1e-3, dflash_narrow_iters=0,
        dspark_iters=2000, dspark_lr=1e-3, dspark_calib_seqs=256, dspark_sampled_iters=800,
        dspark_sampled_anchors=32)},
    # seconds: for the tests and for trying the pipeline end to end
    "tiny": {**CPU, **dict(
        n_layer=2, n_head=2, n_embd=32, block_size=64, batch_size=4,
        target_iters=30, target_lr=3e-3, warmup=5,
        small_embd=16, small_heads=2, small_iters=10, mtp_iters=10, mtp_lr=3e-3, gen_seqs=8,
        dflash_layers=1, dflash_heads=2, dflash_anchors=4, dflash_iters=6, dflash_lr=3e-3,
        dflash_narrow_anchors=4, dflash_narrow_iters=8, dflash_narrow_lr=3e-3,
        dspark_rank=8, dspark_iters=8, dspark_lr=3e-3, dspark_calib_seqs=4,
        dspark_sampled_iters=4, dspark_sampled_block=3, dspark_sampled_anchors=4)},
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
    "small_distill": "small draft model: weight of the KL-to-target loss (1 = pure distillation, "
                     "0 = data only)",
    "small_text": "small draft model: training text, 'gen' (the shared set the target wrote, see "
                  "--gen-seqs) or 'data' (the corpus)",
    "mtp_mode": "mtp: 'joint' (the target trains with L_main + lambda*L_mtp and writes mtp.pt "
                "too) or 'posthoc' (the head trains on the frozen target)",
    "mtp_modules": "mtp: chained MTP modules D (DeepSeek-V3: 1); deeper drafts reuse the last one",
    "mtp_lambda": "mtp: weight of the MTP loss in joint mode (DeepSeek-V3: 0.3)",
    "mtp_iters": "mtp: optimizer steps in posthoc mode",
    "mtp_lr": "mtp: peak learning rate in posthoc mode",
    "mtp_distill": "mtp: posthoc loss, weight of the KL to the target's next-next distribution (1 "
                   "= pure distillation, 0 = data only)",
    "mtp_text": "mtp: posthoc training text, 'gen' (the shared set the target wrote itself, see "
                "--gen-seqs) or 'data' (the corpus)",
    "gen_seqs": "how many sequences the target writes once (out/distill.pt) for every drafter "
                "stage with text 'gen'",
    "gen_sampled": "share of those sequences sampled at --gen-temperature instead of greedy (so "
                   "drafters also see sampled text)",
    "gen_temperature": "temperature of the sampled share (the papers regenerate at ~0.7)",
    "feature_cache": "1: run the target over the distillation set once and keep its logits and "
                     "states in host memory (bfloat16); 0: recompute them every step",
    "dflash_layers": "dflash: draft layers",
    "dflash_heads": "dflash: attention heads (width is the target's)",
    "dflash_block": "dflash: trained block size (anchor + block-1 masks); drafts up to block-1 "
                    "tokens (dspark: the same)",
    "dflash_gamma": "dflash and dspark: position weight decay, w_k = exp(-(k-1)/gamma) (paper: 4 "
                    "for block 8, 7 for 16; the CPU preset's 3 drafted best here at block 8)",
    "dflash_anchors": "dflash and dspark: random anchors (blocks) per training sequence",
    "dflash_iters": "dflash: optimizer steps at the full block (after the narrow phase, if any)",
    "dflash_lr": "dflash: peak learning rate at the full block",
    "dflash_narrow_block": "dflash: the block of the narrow phase it trains first (see "
                           "--dflash-narrow-iters)",
    "dflash_narrow_anchors": "dflash: anchors per training sequence in the narrow phase",
    "dflash_narrow_iters": "dflash: optimizer steps at --dflash-narrow-block before the full "
                           "block (0: no narrow phase)",
    "dflash_narrow_lr": "dflash: peak learning rate of the narrow phase",
    "dflash_text": "dflash and dspark: training text, 'gen' (the shared set the target wrote, see "
                   "--gen-seqs) or 'data' (the corpus); soft labels from the target either way",
    "dflash_taps": "dflash: target layers read as context, e.g. '1,2,3,4,5' ('auto': every block "
                   "but the last)",
    "dspark_rank": "dspark: rank r of the Markov head W1[x] W2 (its backbone takes the --dflash-* "
                   "shape and text)",
    "dspark_iters": "dspark: optimizer steps",
    "dspark_lr": "dspark: peak learning rate",
    "dspark_calib_seqs": "dspark: held-out target continuations for the confidence calibration "
                         "(0: none)",
    "dspark_init": "dspark: 'dflash' (the backbone starts from DFlash's own training at step "
                   "dflash_narrow_iters + dflash_iters - dspark_iters, out/dflash.branch.pt, "
                   "widened to the full block if it is narrower: both drafters then get the "
                   "same number of steps) or 'scratch'",
    "dspark_sampled_iters": "dspark: steps of its sampling weights, a copy fine-tuned on the "
                            "sampled share of the distillation set only, which speculative.py and "
                            "bench.py draft with when sampling (0: none; needs --dflash-text gen)",
    "dspark_sampled_block": "dspark: the block those steps train, anchor included: its first "
                            "dspark_sampled_block - 1 slots, what a sampled round drafts (k 3-4)",
    "dspark_sampled_anchors": "dspark: anchors per sequence in those steps",
}

# the allowed values of every preset field, checked by argparse before anything loads. The rest
# follow their preset's type: an int is a count (>= 1), a float a rate or scale (> 0).
FIELD_TYPES = {
    "warmup": number(int, 0),
    "dspark_calib_seqs": number(int, 0),
    "dspark_sampled_iters": number(int, 0),
    "dspark_sampled_block": number(int, 2),
    "feature_cache": number(int, 0, 1),
    "dflash_block": number(int, 2),
    "dflash_narrow_block": number(int, 2),
    "dflash_narrow_iters": number(int, 0),
    "small_distill": number(float, 0, 1),
    "mtp_distill": number(float, 0, 1),
    "gen_sampled": number(float, 0, 1),
    "mtp_lambda": number(float, 0),
}
FIELD_CHOICES = {
    "mtp_mode": ["joint", "posthoc"],
    "small_text": ["gen", "data"],
    "mtp_text": ["gen", "data"],
    "dflash_text": ["gen", "data"],
    "dspark_init": ["dflash", "scratch"],
}


def parse_bool(text):
    """A yes/no preset field: bool('False') would be True, so spell the values out."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a yes/no value (use 1/0, true/false, yes/no or on/off)")


def field_type(field):
    """The argparse type of a preset field's flag: its rule in FIELD_TYPES, else from its type."""
    kind = type(CPU[field])
    if field in FIELD_TYPES:
        return FIELD_TYPES[field]
    return {int: number(int, 1), float: number(float, above=0), bool: parse_bool}.get(kind, kind)


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
            raise datamod.DataError(f"the {split} split has only {len(arr)} tokens; it needs more "
                                    f"than {self.T + 1}: use more data or a smaller --block-size")
        offset = 0 if split == "train" else 7_919_000
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + offset)
        ix = torch.randint(len(arr) - self.T - 1, (B or self.B,), generator=g).tolist()
        x = torch.stack([torch.from_numpy(arr[i:i + self.T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(arr[i + 1:i + 1 + self.T].astype(np.int64)) for i in ix])
        return x.to(device), y.to(device)


# -----------------------------------------------------------------------------
# one generic training loop for every stage


class TrainingError(RuntimeError):
    pass


def fast_bf16(device):
    """Does bfloat16 autocast speed training up on this device? CUDA: if the GPU has bfloat16.
    CPU: measured, not assumed -- a (256 x 1024) @ (1024 x 1024) product in both dtypes, the
    fastest of a few tries each. CPUs with AVX512-BF16 or AMX run it ~2x faster (a target training
    step here: 480 ms -> 240 ms); CPUs without emulate bfloat16 and would be slower. MPS: no."""
    if str(device).startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    if str(device) != "cpu":
        return False

    # the two dtypes take turns, so a busy moment slows both alike: timed one after the other, a
    # burst of other work during the bfloat16 tries once sent a whole run to float32, 2x slower
    pairs = {dt: (torch.randn(256, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt))
             for dt in (torch.bfloat16, torch.float32)}
    best = {dt: float("inf") for dt in pairs}
    for _ in range(8):
        for dt, (a, b) in pairs.items():
            t0 = time.perf_counter()
            a @ b
            best[dt] = min(best[dt], time.perf_counter() - t0)
    return best[torch.bfloat16] < 0.7 * best[torch.float32]


def allow_tf32(device):
    """On CUDA, let the float32 matmuls that autocast leaves in float32 use TF32 tensor cores
    (Ampere and later; 10-bit mantissa products, float32 sums: what every GPU training recipe
    does). CPU and MPS: untouched, so CPU runs stay bit-identical. Returns whether it was switched
    on."""
    if not str(device).startswith("cuda"):
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def autocast(args, device):
    """The context every training forward runs in: bfloat16 autocast (parameters, optimizer state
    and the loss's reductions stay float32) where it pays, else a no-op."""
    return torch.autocast(device_type=str(device).split(":")[0], dtype=torch.bfloat16,
                          enabled=args.use_bf16)


def lr_at(step, iters, peak, warmup):
    """Linear warmup, then cosine decay to a tenth of the peak (nanoGPT)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    ratio = (step - warmup) / max(1, iters - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, ratio))))


def resume(name, module, opt, resume_path, fingerprint, iters):
    """Load an interrupted run of this stage into module and opt if its resume file fits (same
    fingerprint, same shapes); returns the step to start at (0: from scratch)."""
    if not os.path.exists(resume_path):
        return 0
    try:
        r = load_checkpoint(resume_path, "resume", stage=name)
    except CheckpointError as e:
        print(f"{name}: ignoring an unreadable resume file ({e})")
        return 0
    if r.get("fingerprint") != fingerprint:
        print(f"{name}: the resume file is from a run with other settings; starting over")
        return 0
    try:
        module.load_state_dict(r["state_dict"])
        opt.load_state_dict(r["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        # e.g. written by an older version of the code
        reason = str(e).splitlines()[0][:100]
        print(f"{name}: the resume file does not fit this model ({reason}); starting over")
        return 0
    print(f"{name}: resuming an interrupted run at step {r['step']}/{iters}")
    return r["step"]


def make_optimizer(module, lr):
    """AdamW over the trainable parameters, nanoGPT's way: weight decay on matrices only."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return params, torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def stop_if_diverged(name, step, loss_val, grad_norm, saved_step, resume_path):
    """A NaN or inf loss or gradient would poison the weights: stop with the step and what was
    kept instead."""
    if math.isfinite(loss_val) and math.isfinite(grad_norm):
        return
    if saved_step is not None:
        kept = f"the last good state (step {saved_step}) is kept in {resume_path}"
    else:
        kept = "no state of this stage was saved yet"
    bad = loss_val if not math.isfinite(loss_val) else grad_norm
    raise TrainingError(f"{name}: the loss (or its gradient) became {bad} "
                        f"at step {step}, so training stopped; {kept}. "
                        f"Try a lower learning rate (--{name}-lr).")


def train_loop(name, module, loss_fn, eval_fn, iters, lr, args, fingerprint, tokens_per_step,
               after_step=None, keep_resume=False):
    """Runs `iters` AdamW steps of loss_fn(step) on module's trainable parameters and returns
    (final val loss, optimizer state). Resumes from out/<name>.resume.pt if it was
    interrupted with the same fingerprint; saves that file every --ckpt-interval seconds, and at
    the last step too with keep_resume (a finished phase that a rerun then skips).
    after_step(n), if given, is called after the n-th optimizer step."""
    params, opt = make_optimizer(module, lr)
    resume_path = os.path.join(args.out_dir, f"{name}.resume.pt")
    start = resume(name, module, opt, resume_path, fingerprint, iters)
    saved_step = start if start else None

    def save_resume(step):
        nonlocal saved_step
        saved_step = step
        save_checkpoint({"kind": "resume", "fingerprint": fingerprint, "step": step,
                         "state_dict": module.state_dict(), "optimizer": opt.state_dict()},
                        resume_path)

    t_start = t_last = time.time()
    last_save, val = time.time(), float("nan")
    module.train()
    for step in range(start, iters):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, iters, lr, args.warmup)
        with autocast(args, args.device_resolved):
            loss = loss_fn(step)
        loss_val = loss.item()  # host sync: once per step, for the NaN check and the log
        grad_norm = float("nan")
        if math.isfinite(loss_val):
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        stop_if_diverged(name, step, loss_val, grad_norm, saved_step, resume_path)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if after_step is not None:
            after_step(done)
        if done % args.log_interval == 0 or done == iters:
            now = time.time()
            n_steps = (args.log_interval if done % args.log_interval == 0
                       else max(1, done % args.log_interval))  # since the last progress line
            ms = 1000 * (now - t_last) / n_steps
            t_last = now
            eta = (iters - done) * ms / 1000
            lr_now = opt.param_groups[0]['lr']
            print(f"{name} | step {done:5d}/{iters} | loss {loss_val:.4f} | lr {lr_now:.1e} | "
                  f"{ms:6.0f} ms/step | {tokens_per_step * 1000 / ms:7.0f} tok/s | "
                  f"ETA {int(eta // 60)}m{int(eta % 60):02d}s", flush=True)
        if done % args.eval_interval == 0 or done == iters:
            module.eval()
            val = eval_fn()
            module.train()
            print(f"{name} | step {done:5d} | val loss {val:.4f}", flush=True)
        if time.time() - last_save > args.ckpt_interval and done < iters:
            save_resume(done)
            last_save = time.time()
    if keep_resume and start < iters:
        save_resume(iters)
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
        self.device = args.device_resolved  # resolve_args picked it
        self.info = datamod.prepare_data(args.out_dir, args.data, args.vocab_size, args.tokenizer)
        self.batches = Batches(self.info, args.block_size, args.batch_size, args.seed)
        self._target = None
        self.distill = None  # the target's own text, shared by the drafter stages (distill_text)
        self.features = None  # the target's logits and states on it (feature_cache)
        # when the running stage started (for the budget in its checkpoint)
        self.stage_t0 = time.time()

    def path(self, stage):
        return os.path.join(self.args.out_dir, f"{stage}.pt")

    def forget_target(self):
        """After the target is retrained: drop it and everything computed from it (its text, its
        features)."""
        self._target, self.distill, self.features = None, None, None

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
            return sum(loss_of_batch(*self.batches.get("val", i, self.device)).item()
                       for i in range(n)) / n

    def drafter_meta(self, kind, config, state_dict, extra=None, steps=None):
        """Checkpoint dict for a drafter: it records which target and tokenizer it belongs to, and
        its training budget (optimizer steps, seconds of this stage), which bench.py prints."""
        _, target_ckpt = self.target()
        budget = {"steps": steps or getattr(self.args, f"{kind}_iters"),
                  "seconds": round(time.time() - self.stage_t0)}
        return {"kind": kind, "config": config, "state_dict": state_dict, "budget": budget,
                "target_hash": target_ckpt["model_hash"],
                "tokenizer_hash": self.info["tokenizer_hash"],
                **(extra or {})}


def cpu_state_dict(module):
    """A plain state_dict on the CPU: what every checkpoint holds, loadable on any device."""
    return cpu_tree(module.state_dict())


def cpu_tree(obj):
    """obj (e.g. an optimizer's state_dict) with every tensor in it moved to the CPU, so a
    checkpoint written on a GPU holds nothing that loads back onto that GPU."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: cpu_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_tree(v) for v in obj)
    return obj


def is_current(ctx, stage):
    """Does out/<stage>.pt exist and belong to the current target/tokenizer?"""
    path = ctx.path(stage)
    if not os.path.exists(path):
        return False
    try:
        ckpt = load_checkpoint(path, stage)
    except CheckpointError:  # truncated, garbage, or another kind of checkpoint: it is remade
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
# the stages, in the order they run: the target; the distillation set every drafter learns from
# (written once); then small, mtp, dflash and dspark


def stage_target(ctx):
    a = ctx.args
    cfg = GPTConfig(block_size=a.block_size, vocab_size=ctx.info["vocab_size"], n_layer=a.n_layer,
                    n_head=a.n_head, n_embd=a.n_embd)
    torch.manual_seed(a.seed)
    model = GPT(cfg).to(ctx.device)
    print(f"target: {model.num_params() / 1e6:.2f}M parameters, {cfg}")
    # joint: the MTP head trains alongside the target, L_main + λ·L_mtp
    mtp = new_mtp(ctx, cfg) if mtp_mode(a) == "joint" else None
    taps = (cfg.n_layer,) if mtp is not None else ()  # the last block's states, for the head

    def loss_fn(step):
        x, y = ctx.batches.get("train", step, ctx.device)
        _, loss, hid = model(x, y, hidden_layers=taps)
        # DeepSeek-V3: the MTP gradient flows into the target's trunk, embedding and head too
        if mtp is not None:
            loss = loss + a.mtp_lambda * mtp_loss(mtp, model, hid[cfg.n_layer], x, y)
        return loss

    fingerprint = {"stage": "target", "config": cfg.to_dict(),
                   "tokenizer": ctx.info["tokenizer_hash"],
                   "iters": a.target_iters, "lr": a.target_lr, "batch": a.batch_size,
                   "seed": a.seed, "mtp": None if mtp is None else (a.mtp_modules, a.mtp_lambda)}
    module = model if mtp is None else torch.nn.ModuleDict({"gpt": model, "mtp": mtp})
    val, opt_state = train_loop("target", module, loss_fn,
                                lambda: ctx.val_loss(lambda x, y: model(x, y)[1]),  # L_main only
                                a.target_iters, a.target_lr, a, fingerprint,
                                a.batch_size * a.block_size)
    sd = cpu_state_dict(model)
    save_checkpoint({"kind": "target", "config": cfg.to_dict(), "state_dict": sd,
                     "model_hash": state_hash(sd), "tokenizer_hash": ctx.info["tokenizer_hash"],
                     "step": a.target_iters, "optimizer": cpu_tree(opt_state), "val_loss": val,
                     "tokens_seen": a.target_iters * a.batch_size * a.block_size},
                    ctx.path("target"))
    # the head belongs to exactly this target: the mtp stage is now current and skipped
    if mtp is not None:
        ctx.forget_target()
        save_mtp(ctx, mtp, "joint")
    return val


def write_text(ctx, n_seqs, n_sampled, seed, split):
    """The target continues n_seqs short corpus prompts to full windows (block_size tokens): the
    first n_seqs - n_sampled greedily, the rest sampled at --gen-temperature. Batched decoding."""
    a = ctx.args
    target, _ = ctx.target()
    P = max(1, a.block_size // 8)
    prompts = ctx.batches.get(split, 10_000_000 + seed, ctx.device, B=n_seqs)[0][:, :P]
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    t0, chunks = time.time(), []
    for i in range(0, n_seqs, 128):
        rows = prompts[i:i + 128]
        # rows of this chunk written greedily
        greedy = max(0, min(len(rows), n_seqs - n_sampled - i))
        for part, temp in ((rows[:greedy], 0.0), (rows[greedy:], a.gen_temperature)):
            if len(part):
                chunks.append(target_continuations(target, part, a.block_size, temp, gen))
    print(f"the target wrote {n_seqs} x {a.block_size - P} tokens of {split} text ({n_sampled} "
          f"sampled at temperature {a.gen_temperature}) in {time.time() - t0:.0f}s")
    return torch.cat(chunks)


def distill_settings(ctx):
    """Everything the distillation set depends on: what out/distill.pt records, and what the
    resume fingerprint of every stage that learns from it records."""
    a = ctx.args
    return {"target": ctx.target()[1]["model_hash"], "seqs": a.gen_seqs,
            "sampled": round(a.gen_seqs * a.gen_sampled), "temperature": a.gen_temperature,
            "block_size": a.block_size, "seed": a.seed}


def distill_text(ctx):
    """The one distillation set every drafter learns from: the target's own continuations of
    corpus prompts (the papers regenerate their training text with the target, so a drafter
    learns what the target will say). Written once to out/distill.pt and reused by every stage
    and every later run, for as long as the target and the --gen-* settings are the same."""
    a = ctx.args
    if ctx.distill is None:
        want = distill_settings(ctx)
        path = os.path.join(a.out_dir, "distill.pt")
        try:
            ck = load_checkpoint(path, "distill") if os.path.exists(path) else None
        except CheckpointError:
            # truncated, garbage, a folder: it is only a cache of the target's text
            print(f"distill: {path} is unreadable; rewriting it")
            ck = None
        if ck is None or ck.get("settings") != want:
            t0 = time.time()
            ck = {"kind": "distill", "settings": want, "state_dict": {},
                  "tokens": write_text(ctx, a.gen_seqs, want["sampled"], a.seed, "train").cpu()}
            save_checkpoint(ck, path)
            # shared work: not charged to the stage that happened to ask first
            ctx.stage_t0 += time.time() - t0
        ctx.distill = ck["tokens"].to(ctx.device)
    return ctx.distill


def target_features(ctx, x):
    """The frozen target on windows x (B, T): its logits (B, T, V) and every layer's hidden
    states {layer: (B, T, d)}: the soft labels and the inputs of every drafter's loss."""
    target, _ = ctx.target()
    with torch.no_grad():
        logits, _, hid = target(x, hidden_layers=range(1, target.config.n_layer + 1))
    return logits, hid


def feature_cache(ctx):
    """target_features of the whole distillation set, computed once per run and kept in host
    memory in bfloat16 (~2.9 GB for the cpu preset): the drafter stages then never run the target
    while they train (it was 40% of a DFlash step). Computed under the training autocast, so the
    numbers are the ones an on-the-fly forward would give."""
    if ctx.features is None:
        pool, t0, chunks = distill_text(ctx), time.time(), []
        with autocast(ctx.args, ctx.device):
            for i in range(0, len(pool), 32):
                logits, hid = target_features(ctx, pool[i:i + 32])
                chunks.append((logits.to("cpu", torch.bfloat16),
                               {l: h.to("cpu", torch.bfloat16) for l, h in hid.items()}))
        ctx.features = (torch.cat([c[0] for c in chunks]),
                        {l: torch.cat([c[1][l] for c in chunks]) for l in chunks[0][1]})
        print("the target's logits and hidden states on the distillation set, once: "
              f"{time.time() - t0:.0f}s")
        ctx.stage_t0 += time.time() - t0  # shared work, like the set itself
    return ctx.features


def drafter_batches(ctx, kind, sampled_only=False):
    """step -> (x, logits, hidden): batch_size training windows for a drafter with the target's
    features on them. 'gen': rows of the shared distillation set (sampled_only: only its sampled
    share, the last rows, see write_text), features from the cache (--feature-cache 1) or
    computed per step; 'data': corpus windows, features per step."""
    a = ctx.args
    if kind not in ("gen", "data"):
        raise ValueError(f"unknown drafter text {kind!r}: use gen or data")
    pool = distill_text(ctx) if kind == "gen" else None
    cache = feature_cache(ctx) if pool is not None and a.feature_cache else None
    first = len(pool) - distill_settings(ctx)["sampled"] if sampled_only else 0

    def batch(step):
        if pool is None:
            x = ctx.batches.get("train", step, ctx.device)[0]
            return (x, *target_features(ctx, x))
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step + 7_777_777 * sampled_only)
        idx = first + torch.randint(len(pool) - first, (a.batch_size,), generator=g)
        x = pool[idx.to(ctx.device)]
        if cache is None:
            return (x, *target_features(ctx, x))
        logits = cache[0][idx].to(ctx.device)
        hid = {l: h[idx].to(ctx.device, torch.float32) for l, h in cache[1].items()}
        return x, logits, hid
    return batch


def distill_key(ctx, kind):
    """What a stage's resume fingerprint records of its text."""
    return distill_settings(ctx) if kind == "gen" else None


def stage_small(ctx):
    """The classic independent drafter: a 1-2 layer GPT, distilled from the target."""
    a = ctx.args
    target, _ = ctx.target()
    cfg = GPTConfig(block_size=a.block_size, vocab_size=target.config.vocab_size,
                    n_layer=a.small_layers, n_head=a.small_heads, n_embd=a.small_embd)
    torch.manual_seed(a.seed + 1)
    model = GPT(cfg).to(ctx.device)
    print(f"small: {model.num_params() / 1e6:.2f}M parameters, {cfg}")

    # w (B, T): inputs w[:, :-1], labels w[:, 1:]; p_logits: the target's on w
    def loss_of(w, p_logits, hid=None):
        logits, ce, _ = model(w[:, :-1], w[:, 1:])
        if a.small_distill == 0:
            return ce
        teacher = F.log_softmax(p_logits[:, :-1], -1)  # causal: the target's logits on w[:, :-1]
        logq = F.log_softmax(logits, -1)
        kl = F.kl_div(logq, teacher, log_target=True, reduction="batchmean") / logits.size(1)
        kl = kl + total_variation(logq, teacher.exp()).mean()  # why: speculative.total_variation
        return a.small_distill * kl + (1 - a.small_distill) * ce

    fingerprint = {"stage": "small", "config": cfg.to_dict(),
                   "target": ctx.target()[1]["model_hash"],
                   "iters": a.small_iters, "lr": a.small_lr, "distill": a.small_distill,
                   "seed": a.seed, "text": distill_key(ctx, a.small_text)}
    batches = drafter_batches(ctx, a.small_text)
    val, _ = train_loop("small", model, lambda s: loss_of(*batches(s)),
                        lambda: ctx.val_loss(lambda x, y: model(x, y)[1]),
                        a.small_iters, a.small_lr, a, fingerprint, a.batch_size * a.block_size)
    sd = cpu_state_dict(model)
    save_checkpoint(ctx.drafter_meta("small", cfg.to_dict(), sd, {"val_loss": val}),
                    ctx.path("small"))
    return val


def mtp_mode(a):
    if a.mtp_mode not in ("joint", "posthoc"):
        raise ValueError(f"--mtp-mode must be joint or posthoc (got {a.mtp_mode!r})")
    return a.mtp_mode


def new_mtp(ctx, target_cfg):
    torch.manual_seed(ctx.args.seed + 2)
    return MTP(MTPConfig.for_target(target_cfg, ctx.args.mtp_modules)).to(ctx.device)


def save_mtp(ctx, mtp, mode):
    """out/mtp.pt, with the head's own val loss: CE on t_{i+2} (comparable across modes)."""
    target, _ = ctx.target()
    last = target.config.n_layer  # the MTP head reads the last block's states
    mtp.eval()
    val = ctx.val_loss(
        lambda x, y: mtp_loss(mtp, target, target(x, hidden_layers=(last,))[2][last], x, y))
    print(f"mtp ({mode}): val CE of the token after next {val:.4f}")
    sd = cpu_state_dict(mtp)
    # joint: it trained alongside the target
    steps = ctx.args.target_iters if mode == "joint" else None
    save_checkpoint(ctx.drafter_meta("mtp", mtp.config.to_dict(), sd,
                                     {"val_loss": val, "mode": mode}, steps), ctx.path("mtp"))
    return val


def stage_mtp(ctx):
    """MTP (draft_mtp.py), post hoc: the head trains on the frozen target's hidden states. In joint
    mode the target stage already wrote out/mtp.pt; we only get here if that target predates it."""
    a = ctx.args
    target, target_ckpt = ctx.target()
    if mtp_mode(a) == "joint":
        print("mtp: out/target.pt was trained without the MTP loss, so the head trains post hoc "
              "on it (`python train.py --only target --force` retrains both jointly)")
    mtp = new_mtp(ctx, target.config)
    last = target.config.n_layer  # the MTP head reads the last block's states
    n_params = sum(p.numel() for p in mtp.parameters())
    print(f"mtp: {n_params / 1e6:.2f}M trainable parameters, {mtp.config}")

    batches = drafter_batches(ctx, a.mtp_text)

    def loss_of(w, t_logits, hid):
        """w (B, T) windows: inputs w[:, :-1], labels w[:, 1:]; the target's features on w give
        the module's inputs (h) and the distillation teacher (its logits), causal, so [:, :-1] is
        x's."""
        return mtp_loss(mtp, target, hid[last][:, :-1], w[:, :-1], w[:, 1:], t_logits[:, :-1],
                        a.mtp_distill)

    fingerprint = {"stage": "mtp", "config": mtp.config.to_dict(),
                   "target": target_ckpt["model_hash"],
                   "iters": a.mtp_iters, "lr": a.mtp_lr, "distill": a.mtp_distill,
                   "text": a.mtp_text, "gen": distill_key(ctx, a.mtp_text), "seed": a.seed}

    # val: corpus windows
    train_loop("mtp", mtp, lambda s: loss_of(*batches(s)),
               lambda: ctx.val_loss(lambda x, y: loss_of(x, *target_features(ctx, x))),
               a.mtp_iters, a.mtp_lr, a, fingerprint, a.batch_size * a.block_size)
    return save_mtp(ctx, mtp, "posthoc")


def parse_taps(spec, n_layer):
    """'auto' or '1,3,5' -> a list of target layers."""
    if spec == "auto":
        return default_taps(n_layer)
    try:
        return [int(t) for t in spec.split(",")]
    except ValueError:
        raise ValueError("--dflash-taps must be 'auto' or comma-separated layer numbers like "
                         f"1,3,5 (got {spec!r})") from None


def block_batch(ctx, x, t_logits, hid, step, cfg, n_anchors=None):
    """What DFlash and DSpark train on: windows x, the target's logits on them (the soft labels)
    and its hidden states (the context); the anchors (n_anchors a row, default --dflash-anchors)
    of step s come from a generator seeded with (seed, s), so a resumed run replays them."""
    g = torch.Generator().manual_seed(ctx.args.seed * 7_919 + step)
    anchors = sample_anchors(x.size(0), x.size(1), n_anchors or ctx.args.dflash_anchors,
                             cfg.block, cfg.shift, g, ctx.device)
    return x, {t: hid[t] for t in cfg.taps}, t_logits, anchors


def block_config(ctx):
    """The DFlash network, also DSpark's backbone: the same shape, so DSpark can start from it.
    The mask slots predict (shift 0, as in the DFlash paper): letting the anchor slot predict too
    (DeepSpec's shift 1) drafted worse here (600 steps, block 8: tau 2.60 at k = 8 vs 2.71 at
    k = 7)."""
    a = ctx.args
    tcfg = ctx.target()[0].config
    return DFlashConfig(n_embd=tcfg.n_embd, n_head=a.dflash_heads, n_layer=a.dflash_layers,
                        taps=parse_taps(a.dflash_taps, tcfg.n_layer), block=a.dflash_block)


def dflash_phases(a):
    """DFlash's training, as phases (block, anchors a sequence, steps, peak lr): with
    --dflash-narrow-iters, a narrow block first, then the full block (stage_dflash says why)."""
    full = (a.dflash_block, a.dflash_anchors, a.dflash_iters, a.dflash_lr)
    if a.dflash_narrow_iters == 0:
        return [full]
    if a.dflash_narrow_block >= a.dflash_block:
        raise ValueError(f"--dflash-narrow-block ({a.dflash_narrow_block}) must be smaller than "
                         f"--dflash-block ({a.dflash_block}), or use --dflash-narrow-iters 0")
    return [(a.dflash_narrow_block, a.dflash_narrow_anchors, a.dflash_narrow_iters,
             a.dflash_narrow_lr), full]


def dflash_steps(a):
    """DFlash's optimizer steps, every phase's."""
    return sum(iters for _, _, iters, _ in dflash_phases(a))


def branch_step(a):
    """Where DSpark branches off DFlash's training (--dspark-init dflash): after dflash_steps -
    dspark_iters steps (counted across the phases), so DSpark's steps (the backbone's from
    DFlash, then its own) equal DFlash's and the two compare at an equal budget. None: no branch
    (DSpark starts from scratch, or it is given as many steps as DFlash or more and starts from
    DFlash's final weights)."""
    n = dflash_steps(a) - a.dspark_iters
    return n if a.dspark_init == "dflash" and n >= 1 else None


def stage_dflash(ctx):
    """DFlash: a block-diffusion drafter on the target's hidden states (draft_dflash.py), trained
    in phases (dflash_phases). The first slots of a block decide whether a round goes on, and a
    narrow block (8) teaches them with twice the anchors per step; the full block (16) then
    starts from that network (DFlash.load_narrower) and learns its later slots. Trained at block
    16 from the start, the first slot stayed at 0.77-0.82 acceptance (see README). Also writes
    out/dflash.branch.pt, its state at branch_step(): DSpark's starting point."""
    a = ctx.args
    target_ckpt = ctx.target()[1]
    cfg = block_config(ctx)
    batches = drafter_batches(ctx, a.dflash_text)
    phases = dflash_phases(a)
    fingerprint = {"stage": "dflash", "config": cfg.to_dict(), "target": target_ckpt["model_hash"],
                   "phases": phases, "text": a.dflash_text,
                   "gen": distill_key(ctx, a.dflash_text), "gamma": a.dflash_gamma,
                   "seed": a.seed, "branch": branch_step(a)}
    state, done = None, 0
    for i, (_, _, iters, _) in enumerate(phases):
        net, val = dflash_phase(ctx, fingerprint, batches, i, state, done)
        state, done = cpu_state_dict(net), done + iters
    save_checkpoint(ctx.drafter_meta("dflash", cfg.to_dict(), state,
                                     {"val_loss": val, "text": a.dflash_text,
                                      "fingerprint": fingerprint}, steps=done), ctx.path("dflash"))
    return val


def dflash_phase(ctx, fingerprint, batches, i, state, done):
    """Phase i of DFlash's training, from `state` (the previous phase's weights, or None), after
    `done` steps of the earlier phases -> (net, val loss). Every phase but the last keeps its
    resume file when finished (out/dflash-narrow.resume.pt): a rerun skips it."""
    a = ctx.args
    block, n_anchors, iters, lr = fingerprint["phases"][i]
    cfg = dataclasses.replace(block_config(ctx), block=block)
    torch.manual_seed(a.seed + 3)
    net = DFlash(cfg, ctx.target()[0]).to(ctx.device)
    if state is not None:
        net.load_narrower(state)
    n_params = sum(p.numel() for p in net.parameters())
    print(f"dflash: {n_params / 1e6:.2f}M trainable parameters, {cfg}, {n_anchors} anchors")

    def loss_of(x, t_logits, hid, step):
        batch = block_batch(ctx, x, t_logits, hid, step, cfg, n_anchors)
        return dflash_loss(net, *batch, a.dflash_gamma)

    def after_step(n):
        if done + n == fingerprint["branch"]:  # written once, when reached (a resumed run has it)
            save_checkpoint({"kind": "dflash-branch", "fingerprint": fingerprint,
                             "state_dict": cpu_state_dict(net),
                             "budget": {"steps": done + n,
                                        "seconds": round(time.time() - ctx.stage_t0)}},
                            ctx.path("dflash.branch"))
    last = i == len(fingerprint["phases"]) - 1
    # val: corpus windows, fixed anchors
    val, _ = train_loop(
        "dflash" if last else "dflash-narrow", net, lambda s: loss_of(*batches(s), s),
        lambda: ctx.val_loss(lambda x, y: loss_of(x, *target_features(ctx, x), -1)),
        iters, lr, a, {**fingerprint, "phase": i}, a.batch_size * n_anchors * block, after_step,
        keep_resume=not last)
    return net, val


def dspark_start(ctx, backbone_cfg):
    """--dspark-init dflash: DSpark's backbone weights and the budget they cost, from DFlash's
    branch (out/dflash.branch.pt, see branch_step) or, without one, its final out/dflash.pt."""
    dfl = load_checkpoint(ctx.path("dflash"), "dflash")
    same_target = dfl.get("target_hash") == ctx.target()[1]["model_hash"]
    if not same_target or dfl["config"] != backbone_cfg.to_dict():
        raise ValueError(f"--dspark-init dflash needs {ctx.path('dflash')} trained on this "
                         "target with the same --dflash-* shape: run "
                         "`python train.py --only dflash` first, or use --dspark-init scratch")
    branch = (dfl.get("fingerprint") or {}).get("branch")
    if branch is None:
        print(f"dspark: backbone initialised from {ctx.path('dflash')} (its final weights)")
        return dfl["state_dict"], dfl.get("budget")
    br = load_checkpoint(ctx.path("dflash.branch"), "dflash-branch", "dflash")
    if br.get("fingerprint") != dfl["fingerprint"]:
        raise ValueError(f"{ctx.path('dflash.branch')} is not from the run that wrote "
                         f"{ctx.path('dflash')}: run `python train.py --only dflash --force`")
    if branch != branch_step(ctx.args):
        print(f"dspark: note: DFlash branched at step {branch}, not at DFlash's steps - "
              f"--dspark-iters = {dflash_steps(ctx.args) - ctx.args.dspark_iters}: the budgets "
              "differ (retrain dflash to match them)")
    print(f"dspark: backbone initialised from DFlash's state at step {branch} "
          f"({ctx.path('dflash.branch')})")
    return br["state_dict"], br["budget"]


def stage_dspark(ctx):
    """DSpark (draft_dspark.py): the DFlash network as its backbone (same shape and text as
    --dflash-*, by default started from out/dflash.pt), plus the Markov head and the confidence
    head, then calibration."""
    a = ctx.args
    target, target_ckpt = ctx.target()
    backbone_cfg = block_config(ctx)
    cfg = DSparkConfig(rank=a.dspark_rank)
    torch.manual_seed(a.seed + 4)
    net = DSpark(backbone_cfg, cfg, target).to(ctx.device)
    n_params = sum(p.numel() for p in net.parameters())
    print(f"dspark: {n_params / 1e6:.2f}M trainable parameters, {backbone_cfg}, {cfg}")
    init_budget = None
    if a.dspark_init == "dflash":  # warm start: DFlash's network is exactly DSpark's backbone
        state, init_budget = dspark_start(ctx, backbone_cfg)
        net.backbone.load_narrower(state)  # a branch from the narrow phase: widened
    elif a.dspark_init != "scratch":
        raise ValueError(f"--dspark-init must be dflash or scratch (got {a.dspark_init!r})")
    batches = drafter_batches(ctx, a.dflash_text)

    def loss_of(x, t_logits, hid, step):
        batch = block_batch(ctx, x, t_logits, hid, step, backbone_cfg)
        return dspark_loss(net, *batch, a.dflash_gamma)

    fingerprint = {"stage": "dspark", "backbone": backbone_cfg.to_dict(), "config": cfg.to_dict(),
                   "target": target_ckpt["model_hash"], "init": a.dspark_init,
                   "iters": a.dspark_iters, "lr": a.dspark_lr, "text": a.dflash_text,
                   "gen": distill_key(ctx, a.dflash_text),
                   "anchors": a.dflash_anchors, "gamma": a.dflash_gamma, "seed": a.seed,
                   "init_budget": init_budget}
    tune = sampling_weights_wanted(ctx)
    # keep_resume: a run stopped in the sampling steps that follow does not redo these
    val, _ = train_loop("dspark", net, lambda s: loss_of(*batches(s), s),
                        lambda: ctx.val_loss(lambda x, y: loss_of(x, *target_features(ctx, x), -1)),
                        a.dspark_iters, a.dspark_lr, a, fingerprint,
                        a.batch_size * a.dflash_anchors * backbone_cfg.block, keep_resume=tune)
    extra = {"val_loss": val, "text": a.dflash_text, "init_budget": init_budget}
    if a.dspark_calib_seqs > 0:
        before, after = calibrate_dspark(ctx, net, backbone_cfg)
        extra.update(ece_before=before, ece_after=after)
    config = {"backbone": backbone_cfg.to_dict(), "dspark": cfg.to_dict()}
    ckpt = ctx.drafter_meta("dspark", config, cpu_state_dict(net), extra)  # its budget ends here
    if tune:
        ckpt["sampled"] = dspark_sampling_weights(ctx, net, fingerprint)
    save_checkpoint(ckpt, ctx.path("dspark"))
    return val


def sampling_weights_wanted(ctx):
    """Whether DSpark gets sampling weights: --dspark-sampled-iters, and sampled text to learn."""
    a = ctx.args
    if not a.dspark_sampled_iters:
        return False
    if a.dflash_text != "gen" or distill_settings(ctx)["sampled"] == 0:
        print("dspark: no sampling weights (they learn from the sampled share of the distillation "
              "set: --dflash-text gen and --gen-sampled > 0)")
        return False
    return True


def dspark_sampling_weights(ctx, net, fingerprint):
    """DSpark's weights for sampling: a copy of the trained network, fine-tuned on the sampled
    share of the distillation set only, and only on a block's first slots (the anchor and
    --dspark-sampled-block - 1 masks: a sampled round drafts 3). Why a copy: DSpark's own steps
    learn from the set as it is (a quarter sampled), and more sampled text there trades greedy tau
    for sampled tau (the README's "What does not yet hold"); a copy serves each mode. Why the
    first slots only: at 16 slots a step spends most of its work on slots a sampled round never
    drafts. The later slots keep their mask embeddings, so any k still drafts, past the trained
    slots worse. -> the 'sampled' entry of out/dspark.pt (speculative.load_drafter reads it)."""
    a = ctx.args
    t0, full = time.time(), net.backbone.config
    tuned = DSpark(full, net.config, ctx.target()[0]).to(ctx.device)
    tuned.load_state_dict(net.state_dict())  # the calibrated confidence temperatures too
    narrow = dataclasses.replace(full, block=a.dspark_sampled_block)
    batches = drafter_batches(ctx, "gen", sampled_only=True)

    def loss_of(x, t_logits, hid, step):
        batch = block_batch(ctx, x, t_logits, hid, step, narrow, a.dspark_sampled_anchors)
        return dspark_loss(tuned, *batch, a.dflash_gamma)

    fingerprint = {**fingerprint, "sampled": [a.dspark_sampled_iters, a.dspark_sampled_block,
                                              a.dspark_sampled_anchors]}
    tuned.backbone.config = narrow  # block_states reads the block from the config
    try:
        val, _ = train_loop(
            "dspark-sampled", tuned, lambda s: loss_of(*batches(s), s),
            lambda: ctx.val_loss(lambda x, y: loss_of(x, *target_features(ctx, x), -1)),
            a.dspark_sampled_iters, a.dspark_lr, a, fingerprint,
            a.batch_size * a.dspark_sampled_anchors * narrow.block)
    finally:
        tuned.backbone.config = full
    return {"state_dict": cpu_state_dict(tuned), "val_loss": val, "block": narrow.block,
            "budget": {"steps": a.dspark_sampled_iters, "seconds": round(time.time() - t0)}}


def calibrate_dspark(ctx, net, backbone_cfg):
    """DSpark's confidence calibration (draft_dspark.calibrate) on held-out text: the target's
    own greedy continuations of validation prompts, with 4x the training anchors a sequence (the
    late positions are fitted only on blocks that got that far). -> ECE before, after."""
    a = ctx.args
    held = write_text(ctx, a.dspark_calib_seqs, 0, a.seed, "val")
    n_anchors = min(4 * a.dflash_anchors, held.size(1) - backbone_cfg.block - backbone_cfg.shift)
    held = [held[i:i + a.batch_size] for i in range(0, len(held), a.batch_size)]
    # a generator, not a list: one batch's target logits at a time (8 x 268 MB on the cuda preset)
    held_batches = (block_batch(ctx, x, *target_features(ctx, x), -1 - i, backbone_cfg, n_anchors)
                    for i, x in enumerate(held))
    before, after = calibrate(net, held_batches)
    print(f"dspark: confidence ECE (teacher-forced, held-out, drafts whose prefix matched) "
          f"{before:.3f} before calibration, {after:.3f} after; per-position temperatures "
          f"{[round(t, 2) for t in net.conf_temp.tolist()]}")
    return before, after


STAGES = {
    "target": stage_target,
    "small": stage_small,
    "mtp": stage_mtp,
    "dflash": stage_dflash,
    "dspark": stage_dspark,
}
# the train_loop phases a stage runs besides its own (train_loop name -> out/<name>.resume.pt):
# their resume files go when the stage is done, with the stage's own
PHASES = {"dflash": ["dflash-narrow"], "dspark": ["dspark-sampled"]}

# -----------------------------------------------------------------------------
# command line


def build_parser():
    p = ArgumentParser(description="Train the nanospec target and its drafters.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="defaults for all sizes and steps (default: by device)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--only", default=None, help=f"run one stage: {', '.join(STAGES)}")
    p.add_argument("--force", action="store_true",
                   help="retrain stages even if their checkpoint exists")
    p.add_argument("--out-dir", type=path_arg("dir"), default="out",
                   help="where tokenizer, token files and checkpoints go")
    p.add_argument("--data", type=path_arg("data"), default=None,
                   help="a text file or folder to train on (default: the Python stdlib sources)")
    p.add_argument("--vocab-size", type=number(int, 257, 65536), default=datamod.DEFAULT_VOCAB,
                   help="BPE vocabulary size, end-of-text included")
    p.add_argument("--tokenizer", default="bpe", choices=["bpe", "gpt2"],
                   help="train our own BPE, or use tiktoken's gpt2 if it loads")
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=1337,
                   help="seed for initialisation and batch sampling")
    p.add_argument("--log-interval", type=number(int, 1), default=25,
                   help="steps between progress lines")
    # 2500: a DFlash validation pass costs ~1.6-2 s on the README's CPU (35 s of its stage at
    # 250), and the drafters are judged by tau in bench.py, not by this loss on corpus text
    p.add_argument("--eval-interval", type=number(int, 1), default=2500,
                   help="steps between validation losses (the last step always has one)")
    p.add_argument("--ckpt-interval", type=number(float, 0), default=60.0,
                   help="seconds between resume checkpoints")
    p.add_argument("--threads", type=number(int, 1), default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--bf16", default="auto", choices=["auto", "on", "off"],
                   help="bfloat16 autocast for training: auto = where this device measurably "
                        "runs it faster")
    for field, help_text in FIELD_HELP.items():
        p.add_argument("--" + field.replace("_", "-"), type=field_type(field),
                       choices=FIELD_CHOICES.get(field), default=None,
                       help=f"{help_text} (preset)")
    return p


def resolve_args(argv=None):
    args = build_parser().parse_args(argv)
    device = pick_device(args.device)
    preset = PRESETS[args.preset or device.split(":")[0]]
    for field in FIELD_HELP:
        if getattr(args, field) is None:
            setattr(args, field, preset[field])
    args.device_resolved = device
    args.use_bf16 = fast_bf16(device) if args.bf16 == "auto" else args.bf16 == "on"
    if args.only is not None and args.only not in STAGES:
        raise ValueError(f"unknown stage {args.only!r}: choose one of {', '.join(STAGES)}")
    dflash_phases(args)  # checks the phases now, not after the stages before DFlash have run
    if args.dspark_sampled_iters and args.dspark_sampled_block > args.dflash_block:
        raise ValueError(f"--dspark-sampled-block ({args.dspark_sampled_block}) must be at most "
                         f"--dflash-block ({args.dflash_block})")
    return args


def check_out_dir(out_dir):
    """A folder where train.py writes a file would fail only after the training: refuse it now."""
    names = [*datamod.BUILT, "distill.pt",
             *(f"{s}{end}" for s in STAGES for end in (".pt", ".resume.pt")), "dflash.branch.pt",
             *(f"{n}.resume.pt" for names in PHASES.values() for n in names)]
    for p in (os.path.join(out_dir, n) for n in names):
        if os.path.isdir(p):
            raise CheckpointError(f"{p} is a folder where train.py writes a file; move it away")


def main(argv=None):
    args = resolve_args(argv)
    check_out_dir(args.out_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    tf32 = allow_tf32(args.device_resolved)
    t0 = time.time()
    ctx = Context(args)
    precision = "bfloat16 autocast" if args.use_bf16 else "float32"
    print(f"device {ctx.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"preset {args.preset or ctx.device}, training in {precision}"
          + (", TF32 matmuls" if tf32 else ""))
    try:
        run_stages(ctx, args)
    finally:
        # TF32 is for training only: float32 inference in the same process (tests, notebooks)
        # stays float32
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    print(f"train.py finished in {(time.time() - t0) / 60:.1f} minutes")


def run_stages(ctx, args):
    """Every stage in order (or just --only), skipping those whose checkpoint is current."""
    for stage, fn in STAGES.items():
        if args.only and stage != args.only:
            continue
        if not args.force and is_current(ctx, stage):
            print(f"{stage}: {ctx.path(stage)} exists, skipping (--force to retrain)")
            continue
        ts = ctx.stage_t0 = time.time()
        val = fn(ctx)
        for name in (stage, *PHASES.get(stage, [])):
            resume = os.path.join(args.out_dir, f"{name}.resume.pt")
            if os.path.exists(resume):
                os.remove(resume)
        print(f"{stage}: done in {time.time() - ts:.0f}s, val loss {val:.4f}, "
              f"wrote {ctx.path(stage)}")
        if stage == "target":
            ctx.forget_target()  # the drafters must see the freshly trained target


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, TrainingError, datamod.DataError, ValueError) as e:
        raise SystemExit(f"error: {e}")
