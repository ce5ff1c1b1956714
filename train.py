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
from draft_mtp import mtp_loss

# -----------------------------------------------------------------------------
# presets: the defaults live here and only here

PRESETS = {
    # measured on a 2-core CPU: the target takes ~half of the ~20-minute budget
    "cpu": dict(n_layer=6, n_head=8, n_embd=256, block_size=256, batch_size=8,
                target_iters=1200, target_lr=2e-3, warmup=60,
                small_layers=1, small_embd=128, small_heads=4, small_iters=500, small_lr=3e-3, small_distill=1.0,
                mtp_mode="posthoc", mtp_modules=1, mtp_lambda=0.3, mtp_iters=300, mtp_lr=2e-3, mtp_distill=1.0,
                mtp_text="gen", mtp_gen_seqs=256,
                dflash_layers=2, dflash_heads=8, dflash_block=16, dflash_gamma=7.0, dflash_anchors=16,
                dflash_iters=600, dflash_lr=2e-3, dflash_text="gen", dflash_gen_seqs=256, dflash_taps="auto",
                dspark_rank=64, dspark_iters=150, dspark_lr=2e-3, dspark_calib_seqs=32, dspark_init="dflash"),
    # one consumer GPU, ~10 minutes: wider, deeper, longer context, bigger batches
    "cuda": dict(n_layer=8, n_head=8, n_embd=512, block_size=512, batch_size=32,
                 target_iters=4000, target_lr=1e-3, warmup=200,
                 small_layers=2, small_embd=256, small_heads=4, small_iters=2000, small_lr=2e-3, small_distill=1.0,
                 mtp_mode="posthoc", mtp_modules=1, mtp_lambda=0.3, mtp_iters=2000, mtp_lr=1e-3, mtp_distill=1.0,
                 mtp_text="gen", mtp_gen_seqs=2048,
                 dflash_layers=3, dflash_heads=8, dflash_block=16, dflash_gamma=7.0, dflash_anchors=32,
                 dflash_iters=2000, dflash_lr=1e-3, dflash_text="gen", dflash_gen_seqs=2048, dflash_taps="auto",
                 dspark_rank=128, dspark_iters=2000, dspark_lr=1e-3, dspark_calib_seqs=256, dspark_init="dflash"),
    # seconds: for the tests and for trying the pipeline end to end
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=64, batch_size=4,
                 target_iters=30, target_lr=3e-3, warmup=5,
                 small_layers=1, small_embd=16, small_heads=2, small_iters=10, small_lr=3e-3, small_distill=1.0,
                 mtp_mode="posthoc", mtp_modules=1, mtp_lambda=0.3, mtp_iters=10, mtp_lr=3e-3, mtp_distill=1.0,
                 mtp_text="gen", mtp_gen_seqs=8,
                 dflash_layers=1, dflash_heads=2, dflash_block=8, dflash_gamma=4.0, dflash_anchors=4,
                 dflash_iters=10, dflash_lr=3e-3, dflash_text="gen", dflash_gen_seqs=8, dflash_taps="auto",
                 dspark_rank=8, dspark_iters=10, dspark_lr=3e-3, dspark_calib_seqs=4, dspark_init="dflash"),
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
    "mtp_mode": "mtp: 'joint' (the target trains with L_main + lambda*L_mtp and writes mtp.pt too) or 'posthoc' (the head trains on the frozen target)",
    "mtp_modules": "mtp: chained MTP modules D (DeepSeek-V3: 1); deeper drafts reuse the last one",
    "mtp_lambda": "mtp: weight of the MTP loss in joint mode (DeepSeek-V3: 0.3)",
    "mtp_iters": "mtp: optimizer steps in posthoc mode",
    "mtp_lr": "mtp: peak learning rate in posthoc mode",
    "mtp_distill": "mtp: posthoc loss, weight of the KL to the target's next-next distribution (1 = pure distillation, 0 = data only)",
    "mtp_text": "mtp: posthoc training text, 'gen' (the target's own greedy continuations, shared with dflash when --mtp-gen-seqs matches) or 'data'",
    "mtp_gen_seqs": "mtp: how many sequences the target writes for --mtp-text gen",
    "dflash_layers": "dflash: draft layers",
    "dflash_heads": "dflash: attention heads (width is the target's)",
    "dflash_block": "dflash: trained block size (anchor + block-1 masks); drafts up to block-1 tokens",
    "dflash_gamma": "dflash: position weight decay, w_k = exp(-(k-1)/gamma) (paper: 7 for block 16)",
    "dflash_anchors": "dflash: random anchors (blocks) per training sequence",
    "dflash_iters": "dflash: optimizer steps",
    "dflash_lr": "dflash: peak learning rate",
    "dflash_text": "dflash: training text, 'gen' (the target's own greedy continuations) or 'data' (the corpus); soft labels from the target either way",
    "dflash_gen_seqs": "dflash: how many sequences the target writes for --dflash-text gen",
    "dflash_taps": "dflash: target layers read as context, e.g. '1,2,3,4,5' ('auto': every block but the last)",
    "dspark_rank": "dspark: rank r of the Markov head W1[x] W2 (its backbone takes the --dflash-* shape and text)",
    "dspark_iters": "dspark: optimizer steps",
    "dspark_lr": "dspark: peak learning rate",
    "dspark_calib_seqs": "dspark: held-out target continuations for the confidence calibration (0: none)",
    "dspark_init": "dspark: 'dflash' (start the backbone from out/dflash.pt) or 'scratch'",
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

    saved_step = start if start else None

    def save_resume(step):
        nonlocal saved_step
        saved_step = step
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
        if math.isfinite(loss_val):
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()  # a NaN gradient would poison the weights
        if not (math.isfinite(loss_val) and math.isfinite(grad_norm)):
            kept = f"the last good state (step {saved_step}) is kept in {resume_path}" if saved_step is not None \
                else "no state of this stage was saved yet"
            raise TrainingError(f"{name}: the loss (or its gradient) became {loss_val if not math.isfinite(loss_val) else grad_norm} "
                                f"at step {step}, so training stopped; {kept}. "
                                f"Try a lower learning rate (--{name}-lr).")
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


def cpu_state_dict(module):
    """A plain state_dict on the CPU: what every checkpoint holds, loadable on any device."""
    return {k: v.cpu() for k, v in module.state_dict().items()}


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
    mtp = new_mtp(ctx, cfg) if mtp_mode(a) == "joint" else None  # trains alongside: L_main + λ·L_mtp
    L = (cfg.n_layer,) if mtp is not None else ()

    def loss_fn(step):
        x, y = ctx.batches.get("train", step, ctx.device)
        _, loss, hid = model(x, y, hidden_layers=L)
        if mtp is not None:  # DeepSeek-V3: the MTP gradient flows into the target's trunk, embedding and head too
            loss = loss + a.mtp_lambda * mtp_loss(mtp, model, hid[cfg.n_layer], x, y)
        return loss

    fingerprint = {"stage": "target", "config": cfg.to_dict(), "tokenizer": ctx.info["tokenizer_hash"],
                   "iters": a.target_iters, "lr": a.target_lr, "batch": a.batch_size, "seed": a.seed,
                   "mtp": None if mtp is None else (a.mtp_modules, a.mtp_lambda)}
    val, opt_state = train_loop("target", model if mtp is None else torch.nn.ModuleDict({"gpt": model, "mtp": mtp}),
                                loss_fn, lambda: ctx.val_loss(lambda x, y: model(x, y)[1]),  # val: L_main only
                                a.target_iters, a.target_lr, a, fingerprint, a.batch_size * a.block_size)
    sd = cpu_state_dict(model)
    save_checkpoint({"kind": "target", "config": cfg.to_dict(), "state_dict": sd, "model_hash": state_hash(sd),
                     "tokenizer_hash": ctx.info["tokenizer_hash"], "step": a.target_iters, "optimizer": opt_state,
                     "val_loss": val, "tokens_seen": a.target_iters * a.batch_size * a.block_size}, ctx.path("target"))
    if mtp is not None:  # the head belongs to exactly this target: the mtp stage is now current and skipped
        ctx._target = None
        save_mtp(ctx, mtp, "joint")
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
    sd = cpu_state_dict(model)
    save_checkpoint(ctx.drafter_meta("small", cfg.to_dict(), sd, {"val_loss": val}), ctx.path("small"))
    return val


def parse_taps(spec, n_layer):
    """'auto' or '1,3,5' -> a list of target layers."""
    from draft_dflash import default_taps
    if spec == "auto":
        return default_taps(n_layer)
    try:
        return [int(t) for t in spec.split(",")]
    except ValueError:
        raise ValueError(f"--dflash-taps must be 'auto' or comma-separated layer numbers like 1,3,5 (got {spec!r})") from None


def drafter_text(ctx, kind, n_seqs, seed, split="train"):
    """step -> (batch_size, block_size) training text for the block drafters. 'data': corpus
    windows. 'gen': the target's own greedy continuations of short corpus prompts, written once
    (DFlash trains on text the target regenerated, so it learns what the target will say) and
    shared by the stages of one run."""
    a = ctx.args
    if kind == "data":
        return lambda step: ctx.batches.get(split, step, ctx.device)[0]
    if kind != "gen":
        raise ValueError(f"unknown drafter text {kind!r}: use gen or data")
    from draft_dflash import target_continuations
    pools = ctx.__dict__.setdefault("_gen_text", {})
    if (n_seqs, seed, split) not in pools:
        target, _ = ctx.target()
        P = max(1, a.block_size // 8)
        prompts = ctx.batches.get(split, 10_000_000 + seed, ctx.device, B=n_seqs)[0][:, :P]
        t0 = time.time()
        pools[(n_seqs, seed, split)] = torch.cat([target_continuations(target, prompts[i:i + 64], a.block_size)
                                                  for i in range(0, n_seqs, 64)])
        print(f"the target wrote {n_seqs} x {a.block_size - P} tokens of {split} text in {time.time() - t0:.0f}s")
    pool = pools[(n_seqs, seed, split)]

    def batch(step):
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        return pool[torch.randint(n_seqs, (a.batch_size,), generator=g).to(ctx.device)]
    return batch


def block_batch(ctx, x, step, cfg):
    """What DFlash and DSpark train on, for token windows x: one no-grad target forward gives
    the context states AND the soft labels; the anchors of step s come from a generator seeded
    with (seed, s), so a resumed run replays them."""
    from draft_dflash import sample_anchors
    target, _ = ctx.target()
    with torch.no_grad():
        t_logits, _, hid = target(x, hidden_layers=cfg.taps)
    g = torch.Generator().manual_seed(ctx.args.seed * 7_919 + step)
    anchors = sample_anchors(x.size(0), x.size(1), ctx.args.dflash_anchors, cfg.block, cfg.shift, g, ctx.device)
    return x, hid, t_logits, anchors


def stage_dflash(ctx):
    """DFlash: a block-diffusion drafter on the target's hidden states (draft_dflash.py)."""
    from draft_dflash import DFlash, DFlashConfig, dflash_loss
    a = ctx.args
    target, tckpt = ctx.target()
    cfg = DFlashConfig(n_embd=target.config.n_embd, n_head=a.dflash_heads, n_layer=a.dflash_layers,
                       taps=parse_taps(a.dflash_taps, target.config.n_layer), block=a.dflash_block)
    torch.manual_seed(a.seed + 3)
    net = DFlash(cfg, target).to(ctx.device)
    print(f"dflash: {sum(p.numel() for p in net.parameters()) / 1e6:.2f}M trainable parameters, {cfg}")
    text = drafter_text(ctx, a.dflash_text, a.dflash_gen_seqs, a.seed)

    def loss_of(x, step):
        return dflash_loss(net, *block_batch(ctx, x, step, cfg), a.dflash_gamma)

    fingerprint = {"stage": "dflash", "config": cfg.to_dict(), "target": tckpt["model_hash"], "iters": a.dflash_iters,
                   "lr": a.dflash_lr, "text": a.dflash_text, "gen_seqs": a.dflash_gen_seqs, "anchors": a.dflash_anchors,
                   "gamma": a.dflash_gamma, "seed": a.seed}
    val, _ = train_loop("dflash", net, lambda s: loss_of(text(s), s),
                        lambda: ctx.val_loss(lambda x, y: loss_of(x, -1)),  # val: corpus windows, fixed anchors
                        a.dflash_iters, a.dflash_lr, a, fingerprint, a.batch_size * a.dflash_anchors * cfg.block)
    sd = cpu_state_dict(net)
    save_checkpoint(ctx.drafter_meta("dflash", cfg.to_dict(), sd, {"val_loss": val, "text": a.dflash_text}), ctx.path("dflash"))
    return val


def stage_dspark(ctx):
    """DSpark (draft_dspark.py): the DFlash backbone, same shape and text as --dflash-*, but the
    anchor slot predicts too; plus the Markov head and the confidence head, then calibration."""
    from draft_dflash import DFlashConfig
    from draft_dspark import DSpark, DSparkConfig, calibrate, dspark_loss
    a = ctx.args
    target, tckpt = ctx.target()
    bcfg = DFlashConfig(n_embd=target.config.n_embd, n_head=a.dflash_heads, n_layer=a.dflash_layers,
                        taps=parse_taps(a.dflash_taps, target.config.n_layer), block=a.dflash_block, shift=1)
    cfg = DSparkConfig(rank=a.dspark_rank)
    torch.manual_seed(a.seed + 4)
    net = DSpark(bcfg, cfg, target).to(ctx.device)
    print(f"dspark: {sum(p.numel() for p in net.parameters()) / 1e6:.2f}M trainable parameters, {bcfg}, {cfg}")
    if a.dspark_init == "dflash":  # warm start: the same backbone shape, only the slot -> token offset moves by one
        dfl = load_checkpoint(ctx.path("dflash"), "dflash")
        if dfl.get("target_hash") != tckpt["model_hash"] or {**dfl["config"], "shift": 1} != bcfg.to_dict():
            raise ValueError(f"--dspark-init dflash needs {ctx.path('dflash')} trained on this target with the same "
                             "--dflash-* shape: run `python train.py --only dflash` first, or use --dspark-init scratch")
        net.backbone.load_state_dict(dfl["state_dict"])
        print(f"dspark: backbone initialised from {ctx.path('dflash')}")
    elif a.dspark_init != "scratch":
        raise ValueError(f"--dspark-init must be dflash or scratch (got {a.dspark_init!r})")
    text = drafter_text(ctx, a.dflash_text, a.dflash_gen_seqs, a.seed)

    def loss_of(x, step):
        return dspark_loss(net, *block_batch(ctx, x, step, bcfg), a.dflash_gamma)

    fingerprint = {"stage": "dspark", "backbone": bcfg.to_dict(), "config": cfg.to_dict(), "target": tckpt["model_hash"],
                   "init": a.dspark_init,
                   "iters": a.dspark_iters, "lr": a.dspark_lr, "text": a.dflash_text, "gen_seqs": a.dflash_gen_seqs,
                   "anchors": a.dflash_anchors, "gamma": a.dflash_gamma, "seed": a.seed}
    val, _ = train_loop("dspark", net, lambda s: loss_of(text(s), s), lambda: ctx.val_loss(lambda x, y: loss_of(x, -1)),
                        a.dspark_iters, a.dspark_lr, a, fingerprint, a.batch_size * a.dflash_anchors * bcfg.block)
    extra = {"val_loss": val, "text": a.dflash_text}
    if a.dspark_calib_seqs > 0:  # held-out: the target's own continuations of validation prompts
        held = drafter_text(ctx, "gen", a.dspark_calib_seqs, a.seed, split="val")
        before, after = calibrate(net, [block_batch(ctx, held(s), -1 - s, bcfg) for s in range(max(1, a.dspark_calib_seqs // a.batch_size))])
        print(f"dspark: confidence ECE (teacher-forced, held-out) {before:.3f} before calibration, {after:.3f} after; "
              f"per-position temperatures {[round(t, 2) for t in net.conf_temp.tolist()]}")
        extra.update(ece_before=before, ece_after=after)
    sd = cpu_state_dict(net)
    save_checkpoint(ctx.drafter_meta("dspark", {"backbone": bcfg.to_dict(), "dspark": cfg.to_dict()}, sd, extra),
                    ctx.path("dspark"))
    return val


def mtp_mode(a):
    if a.mtp_mode not in ("joint", "posthoc"):
        raise ValueError(f"--mtp-mode must be joint or posthoc (got {a.mtp_mode!r})")
    return a.mtp_mode


def new_mtp(ctx, target_cfg):
    from draft_mtp import MTP, MTPConfig
    torch.manual_seed(ctx.args.seed + 2)
    return MTP(MTPConfig.for_target(target_cfg, ctx.args.mtp_modules)).to(ctx.device)


def save_mtp(ctx, mtp, mode):
    """out/mtp.pt, with the head's own val loss: CE on t_{i+2} (comparable across modes)."""
    target, _ = ctx.target()
    L = target.config.n_layer
    mtp.eval()
    val = ctx.val_loss(lambda x, y: mtp_loss(mtp, target, target(x, hidden_layers=(L,))[2][L], x, y))
    print(f"mtp ({mode}): val CE of the token after next {val:.4f}")
    sd = cpu_state_dict(mtp)
    save_checkpoint(ctx.drafter_meta("mtp", mtp.config.to_dict(), sd, {"val_loss": val, "mode": mode}), ctx.path("mtp"))
    return val


def stage_mtp(ctx):
    """MTP (draft_mtp.py), post hoc: the head trains on the frozen target's hidden states. In joint
    mode the target stage already wrote out/mtp.pt; we only get here if that target predates it."""
    a = ctx.args
    target, tckpt = ctx.target()
    if mtp_mode(a) == "joint":
        print("mtp: out/target.pt was trained without the MTP loss, so the head trains post hoc on it "
              "(`python train.py --only target --force` retrains both jointly)")
    mtp = new_mtp(ctx, target.config)
    L = target.config.n_layer
    print(f"mtp: {sum(p.numel() for p in mtp.parameters()) / 1e6:.2f}M trainable parameters, {mtp.config}")

    text = drafter_text(ctx, a.mtp_text, a.mtp_gen_seqs, a.seed)  # (B, block_size) token windows

    def loss_of(x, y):
        with torch.no_grad():  # one target forward gives the inputs (h) and the distillation teacher
            t_logits, _, hid = target(x, hidden_layers=(L,))
        return mtp_loss(mtp, target, hid[L], x, y, t_logits, a.mtp_distill)

    fingerprint = {"stage": "mtp", "config": mtp.config.to_dict(), "target": tckpt["model_hash"], "iters": a.mtp_iters,
                   "lr": a.mtp_lr, "distill": a.mtp_distill, "text": a.mtp_text, "gen_seqs": a.mtp_gen_seqs, "seed": a.seed}

    def train_step(step):
        w = text(step)  # (B, block_size): inputs w[:, :-1], labels w[:, 1:]
        return loss_of(w[:, :-1], w[:, 1:])

    train_loop("mtp", mtp, train_step, lambda: ctx.val_loss(loss_of),  # val: corpus windows
               a.mtp_iters, a.mtp_lr, a, fingerprint, a.batch_size * a.block_size)
    return save_mtp(ctx, mtp, "posthoc")


STAGES = {"target": stage_target, "small": stage_small, "mtp": stage_mtp, "dflash": stage_dflash, "dspark": stage_dspark}

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
        raise ValueError(f"unknown stage {args.only!r}: choose one of {', '.join(STAGES)}")
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
