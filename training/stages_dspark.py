"""
training/stages_dspark.py -- DSpark's stage of train.py: the network, its backbone started from
DFlash's training where it branched (draft_dspark.py: how it learns), DSpark's own steps, the
calibration of its confidences, and a copy tuned for sampling. What training/stages.py says of a
stage holds here.
"""

import dataclasses
import time

import torch

from draft_dflash import widen
from draft_dspark import DSpark, DSparkConfig, calibrate, dspark_loss
from runtime.checkpoint import cpu_state_dict, load_checkpoint
from training.stages_dflash import (anchored, branch_step, check_anchors, network_config,
                                     total_steps)

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
