"""
training/stages_dflash.py -- DFlash's and DSpark's training as stages of train.py: DFlash's
narrow-then-full recipe and the point where DSpark branches off it; DSpark's own steps, the
calibration of its confidences, and its weights for sampling. (training/stages.py: the other stages,
and what is said there of a stage holds here.) """

import dataclasses
import time

import torch

import draft_dflash
from runtime.checkpoint import cpu_state_dict, load_checkpoint, save_checkpoint
from draft_dflash import DFlash, DFlashConfig, dflash_loss, sample_anchors, widen
from draft_dspark import DSpark, DSparkConfig, calibrate, dspark_loss

# -----------------------------------------------------------------------------
# DFlash: train.py runs train_dflash(trainer) as its "dflash" stage: the narrow block, then the
# full block (the recipe: draft_dflash.py, widen). On the way, the stage saves its state at the
# step where DSpark branches off (out/dflash.branch.pt): DSpark's stage starts there, so the two
# drafters train the same number of steps.



def training_phases(a):
    """DFlash's training as phases (train_loop name, block, anchors a sequence, steps, peak lr):
    with --dflash-narrow-iters, the narrow block first, then the full block."""
    if a.n_embd % a.dflash_heads:
        raise ValueError(f"--dflash-heads ({a.dflash_heads}) must divide the target's width, "
                         f"--n-embd ({a.n_embd})")
    full = ("dflash", a.dflash_block, a.dflash_anchors, a.dflash_iters, a.dflash_lr)
    if a.dflash_narrow_iters == 0:
        return [full]
    if a.dflash_narrow_block >= a.dflash_block:
        raise ValueError(f"--dflash-narrow-block ({a.dflash_narrow_block}) must be smaller than "
                         f"--dflash-block ({a.dflash_block}), or use --dflash-narrow-iters 0")
    return [("dflash-narrow", a.dflash_narrow_block, a.dflash_narrow_anchors,
             a.dflash_narrow_iters, a.dflash_narrow_lr), full]


def check_anchors(a, block, n_anchors, flag):
    """A training window of --block-size tokens holds block_size - block anchors at most (each
    needs a context position before it and its whole block inside the window)."""
    if n_anchors > a.block_size - block:
        raise ValueError(f"a --block-size {a.block_size} window holds at most "
                         f"{max(0, a.block_size - block)} anchors of block {block}, not "
                         f"{n_anchors} ({flag}): use fewer, or a longer --block-size")


def dflash_phases(a):
    """The train_loop phases this stage runs: (name, steps). Checks the settings too."""
    plan = training_phases(a)
    for name, block, n_anchors, _, _ in plan:
        check_anchors(a, block, n_anchors, "--dflash-narrow-anchors" if "narrow" in name
                      else "--dflash-anchors")
    return [(name, steps) for name, _, _, steps, _ in plan]


def total_steps(a):
    return sum(steps for _, steps in dflash_phases(a))


def branch_step(a):
    """Where DSpark branches off DFlash's training (--dspark-init dflash): after total_steps -
    dspark_iters steps, counted across the phases, so that DSpark's steps (the backbone's from
    DFlash, then its own) equal DFlash's. None: no branch (DSpark starts from scratch, or it
    gets as many steps as DFlash or more and starts from DFlash's final weights)."""
    n = total_steps(a) - a.dspark_iters
    return n if a.dspark_init == "dflash" and n >= 1 else None


def dflash_taps(spec, n_layer):
    """'auto' or '1,3,5' -> a list of target layers."""
    if spec == "auto":
        return draft_dflash.default_taps(n_layer)
    try:
        return [int(t) for t in spec.split(",")]
    except ValueError:
        raise ValueError("--dflash-taps must be 'auto' or comma-separated layer numbers like "
                         f"1,3,5 (got {spec!r})") from None


def network_config(a, target_cfg, block=None):
    """The DFlash network the settings ask for (also DSpark's backbone: the same shape, so DSpark
    can start from it). The mask slots predict (shift 0), as in the DFlash paper: letting the
    anchor slot predict too (DeepSpec's shift 1) drafted worse (docs/experiments.md: DFlash: the
    masks predict (shift 0))."""
    return DFlashConfig(n_embd=target_cfg.n_embd, n_head=a.dflash_heads, n_layer=a.dflash_layers,
                        taps=dflash_taps(a.dflash_taps, target_cfg.n_layer),
                        block=block or a.dflash_block)


def anchored(tr, x, t_logits, hid, step, cfg, n_anchors):
    """A training batch for a block drafter: windows x, the target's tapped states on them (the
    context), its logits (the soft labels) and n_anchors random anchors a row. The anchors of
    step s come from a generator seeded with (seed, s), so a resumed run replays them."""
    g = torch.Generator().manual_seed(tr.args.seed * 7_919 + step)
    anchors = tr.per_row(lambda B: sample_anchors(B, x.size(1), n_anchors, cfg.block, cfg.shift,
                                                  g, tr.device), x.size(0))
    return x, {t: hid[t] for t in cfg.taps}, t_logits, anchors


def train_dflash(tr):
    """Every phase of training_phases, each starting from the one before -> out/dflash.pt (and
    out/dflash.branch.pt, DSpark's starting point)."""
    a = tr.args
    target, target_ckpt = tr.target()
    cfg = network_config(a, target.config)
    batches = tr.distill.batches(a.dflash_text)
    plan = training_phases(a)
    fingerprint = {"stage": "dflash", "config": cfg.to_dict(), "target": target_ckpt["model_hash"],
                   "phases": [p[1:] for p in plan], "text": a.dflash_text,
                   "gen": tr.distill.key(a.dflash_text), "gamma": a.dflash_gamma,
                   "seed": a.seed, "branch": branch_step(a)}
    net, done = None, 0
    for i, phase in enumerate(plan):
        net, val = train_phase(tr, fingerprint, batches, i, phase, net, done)
        done += phase[3]
    tr.save("dflash", cfg.to_dict(), net, {"val_loss": val, "text": a.dflash_text,
                                           "fingerprint": fingerprint}, steps=done)
    return val


def train_phase(tr, fingerprint, batches, i, phase, before, done):
    """Phase i, from the network `before` (the previous phase's, or None), after `done` steps of
    the earlier phases -> (its network, its val loss). Every phase but the last keeps its resume
    file when finished: a rerun skips it."""
    a = tr.args
    name, block, n_anchors, steps, lr = phase
    target = tr.target()[0]
    cfg = network_config(a, target.config, block)
    torch.manual_seed(a.seed + 3)
    net = DFlash(cfg, target).to(tr.device)
    if before is not None:
        widen(net, cpu_state_dict(before))
    n_params = sum(p.numel() for p in net.parameters())
    print(f"dflash: {n_params / 1e6:.2f}M trainable parameters, {cfg}, {n_anchors} anchors")

    def loss_of(x, t_logits, hid, step):
        return dflash_loss(net, *anchored(tr, x, t_logits, hid, step, cfg, n_anchors),
                           a.dflash_gamma)

    def after_step(n):
        if done + n == fingerprint["branch"]:  # written once, when reached (a resumed run has it)
            save_checkpoint({"kind": "dflash-branch", "fingerprint": fingerprint,
                             "state_dict": cpu_state_dict(net),
                             "budget": {"steps": done + n, "seconds": tr.elapsed()}},
                            tr.path("dflash.branch"))
    last = i == len(fingerprint["phases"]) - 1
    val, _ = tr.fit(name, net, lambda s: loss_of(*batches(s), s),
                    lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                    steps=steps, lr=lr, fingerprint={**fingerprint, "phase": i},
                    tokens_per_step=a.batch_size * n_anchors * block, after_step=after_step,
                    keep_resume=not last)
    return net, val


# -----------------------------------------------------------------------------
# DSpark: train.py runs train_dspark(trainer) as its "dspark" stage. The backbone takes DFlash's
# shape and text (the --dflash-* settings) and, by default, starts from DFlash's own training
# where it branched (branch_step); then DSpark's own steps, the calibration of its confidences,
# and its weights for sampling.


def dspark_phases(a):
    """The train_loop phases this stage runs: (name, steps). Checks the settings too."""
    if a.dspark_sampled_iters and a.dspark_sampled_block > a.dflash_block:
        raise ValueError(f"--dspark-sampled-block ({a.dspark_sampled_block}) must be at most "
                         f"--dflash-block ({a.dflash_block})")
    check_anchors(a, a.dflash_block, a.dflash_anchors, "--dflash-anchors")
    if a.dspark_sampled_iters:
        check_anchors(a, a.dspark_sampled_block, a.dspark_sampled_anchors,
                                   "--dspark-sampled-anchors")
    out = [("dspark", a.dspark_iters)]
    return out + ([("dspark-sampled", a.dspark_sampled_iters)] if a.dspark_sampled_iters else [])


def train_dspark(tr):
    """The backbone (from DFlash's branch), the Markov and confidence heads, then calibration and
    the sampling weights -> out/dspark.pt."""
    a = tr.args
    target, target_ckpt = tr.target()
    backbone_cfg = network_config(a, target.config)
    cfg = DSparkConfig(rank=a.dspark_rank)
    torch.manual_seed(a.seed + 4)
    spark = DSpark(backbone_cfg, cfg, target).to(tr.device)
    n_params = sum(p.numel() for p in spark.parameters())
    print(f"dspark: {n_params / 1e6:.2f}M trainable parameters, {backbone_cfg}, {cfg}")
    init_budget = None
    if a.dspark_init == "dflash":  # warm start: DFlash's network is exactly DSpark's backbone
        state, init_budget = start_from_dflash(tr, backbone_cfg)
        widen(spark.backbone, state)  # a branch from the narrow phase: widened
    batches = tr.distill.batches(a.dflash_text)

    def loss_of(x, t_logits, hid, step):
        batch = anchored(tr, x, t_logits, hid, step, backbone_cfg, a.dflash_anchors)
        return dspark_loss(spark, *batch, a.dflash_gamma)

    fingerprint = {"stage": "dspark", "backbone": backbone_cfg.to_dict(), "config": cfg.to_dict(),
                   "target": target_ckpt["model_hash"], "init": a.dspark_init,
                   "iters": a.dspark_iters, "lr": a.dspark_lr, "text": a.dflash_text,
                   "gen": tr.distill.key(a.dflash_text),
                   "anchors": a.dflash_anchors, "gamma": a.dflash_gamma, "seed": a.seed,
                   "init_budget": init_budget}
    tune = sampling_weights_wanted(tr)
    # keep_resume: a run stopped in the sampling steps that follow does not redo these
    val, _ = tr.fit("dspark", spark, lambda s: loss_of(*batches(s), s),
                    lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                    steps=a.dspark_iters, lr=a.dspark_lr, fingerprint=fingerprint,
                    tokens_per_step=a.batch_size * a.dflash_anchors * backbone_cfg.block,
                    keep_resume=tune)
    extra = {"val_loss": val, "text": a.dflash_text, "init_budget": init_budget}
    if a.dspark_calib_seqs > 0:
        extra["ece_before"], extra["ece_after"] = calibrate_on_held_out(tr, spark, backbone_cfg)
    budget = tr.budget()  # DSpark's own: it ends here, before the sampling weights
    if tune:
        extra["sampled"] = sampling_weights(tr, spark, fingerprint)
    config = {"backbone": backbone_cfg.to_dict(), "dspark": cfg.to_dict()}
    tr.save("dspark", config, spark, extra, budget=budget)
    return val


def start_from_dflash(tr, backbone_cfg):
    """--dspark-init dflash: DSpark's backbone weights and the budget they cost, from DFlash's
    branch (out/dflash.branch.pt, see branch_step) or, without one, its final
    out/dflash.pt."""
    a = tr.args
    dfl = load_checkpoint(tr.path("dflash"), "dflash")
    same_target = dfl.get("target_hash") == tr.target()[1]["model_hash"]
    if not same_target or dfl["config"] != backbone_cfg.to_dict():
        raise ValueError(f"--dspark-init dflash needs {tr.path('dflash')} trained on this "
                         "target with the same --dflash-* shape: run "
                         "`python train.py --only dflash` first, or use --dspark-init scratch")
    branch = (dfl.get("fingerprint") or {}).get("branch")
    if branch is None:
        print(f"dspark: backbone initialised from {tr.path('dflash')} (its final weights)")
        return dfl["state_dict"], dfl.get("budget")
    br = load_checkpoint(tr.path("dflash.branch"), "dflash-branch", "dflash")
    if br.get("fingerprint") != dfl["fingerprint"]:
        raise ValueError(f"{tr.path('dflash.branch')} is not from the run that wrote "
                         f"{tr.path('dflash')}: run `python train.py --only dflash --force`")
    if branch != branch_step(a):
        print(f"dspark: note: DFlash branched at step {branch}, not at DFlash's steps - "
              f"--dspark-iters = {total_steps(a) - a.dspark_iters}: the budgets "
              "differ (retrain dflash to match them)")
    print(f"dspark: backbone initialised from DFlash's state at step {branch} "
          f"({tr.path('dflash.branch')})")
    return br["state_dict"], br["budget"]


def calibrate_on_held_out(tr, spark, backbone_cfg):
    """calibrate() on held-out text: the target's own greedy continuations of validation
    prompts, with 4x the training anchors a sequence (the late positions are fitted only on
    blocks that got that far). -> ECE before, after."""
    a = tr.args
    held = tr.distill.write(a.dspark_calib_seqs, 0, "val")
    n_anchors = min(4 * a.dflash_anchors, held.size(1) - backbone_cfg.block - backbone_cfg.shift)
    held = [held[i:i + a.batch_size] for i in range(0, len(held), a.batch_size)]
    # a generator, not a list: one batch's target logits at a time (they are large at scale)
    batches = (anchored(tr, x, *tr.distill.features(x), -1 - i, backbone_cfg, n_anchors)
               for i, x in enumerate(held))
    before, after = calibrate(spark, batches)
    print(f"dspark: confidence ECE (teacher-forced, held-out, drafts whose prefix matched) "
          f"{before:.3f} before calibration, {after:.3f} after; per-position temperatures "
          f"{[round(t, 2) for t in spark.conf_temp.tolist()]}")
    return before, after


def sampling_weights_wanted(tr):
    """Whether DSpark gets sampling weights: --dspark-sampled-iters, and sampled text to learn."""
    a = tr.args
    if not a.dspark_sampled_iters:
        return False
    if a.dflash_text != "gen" or tr.distill.settings()["sampled"] == 0:
        print("dspark: no sampling weights (they learn from the sampled share of the distillation "
              "set: --dflash-text gen and --gen-sampled > 0)")
        return False
    return True


def sampling_weights(tr, spark, fingerprint):
    """DSpark's weights for sampling: a copy of the trained network, fine-tuned on the sampled
    share of the distillation set only, and only on a block's first slots (the anchor and
    --dspark-sampled-block - 1 masks), what a sampled round drafts. Why a copy: DSpark's own steps
    learn from the set as it is (mostly greedy text), and more sampled text there trades greedy tau
    for sampled tau; a copy serves each mode (docs/experiments.md: DSpark: sampling weights). The
    later slots keep their weights, so any k still drafts. -> the 'sampled' entry of out/dspark.pt
    (checkpoint.load_drafter reads it)."""
    a = tr.args
    t0 = time.time()
    tuned = DSpark(spark.backbone.config, spark.config, tr.target()[0]).to(tr.device)
    tuned.load_state_dict(spark.state_dict())  # the calibrated confidence temperatures too
    narrow = dataclasses.replace(spark.backbone.config, block=a.dspark_sampled_block)
    batches = tr.distill.batches("gen", sampled_only=True)

    def loss_of(x, t_logits, hid, step):
        batch = anchored(tr, x, t_logits, hid, step, narrow, a.dspark_sampled_anchors)
        return dspark_loss(tuned, *batch, a.dflash_gamma, block=narrow.block)

    fingerprint = {**fingerprint, "sampled": [a.dspark_sampled_iters, a.dspark_sampled_block,
                                              a.dspark_sampled_anchors]}
    val, _ = tr.fit("dspark-sampled", tuned, lambda s: loss_of(*batches(s), s),
                    lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                    steps=a.dspark_sampled_iters, lr=a.dspark_lr, fingerprint=fingerprint,
                    tokens_per_step=a.batch_size * a.dspark_sampled_anchors * narrow.block)
    return {"state_dict": cpu_state_dict(tuned), "val_loss": val, "block": narrow.block,
            "budget": {"steps": a.dspark_sampled_iters, "seconds": round(time.time() - t0)}}
