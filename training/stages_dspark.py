"""
training/stages_dspark.py -- DSpark's stage of train.py: its settings, the network, its backbone
started from DFlash's training where it branched (draft_dspark.py: how it learns), DSpark's own
steps, the calibration of its confidences, and a copy tuned for sampling. Its backbone takes
DFlash's shape and text (the --dflash-* settings: it builds on DFlash's stage).
"""

import dataclasses
import time
from dataclasses import dataclass

import torch

from draft_dflash import widen
from draft_dspark import DSpark, DSparkConfig, calibrate, dspark_loss
from runtime.checkpoint import cpu_state_dict, load_checkpoint
from runtime.settings import number, setting
from training.stage import Stage, usual_record
from training.stages_dflash import (anchored, branch_step, check_anchors, network_config,
                                    total_steps, with_arch)


@dataclass
class DSparkSettings:
    """DSpark's own settings: train.py's flags --dspark-<field>."""
    rank: int = setting(DSparkConfig.rank, "dspark: rank r of the Markov head W1[x] W2 (the "
                        "paper's 256)", tiny=8)
    iters: int = setting(1000, "dspark: optimizer steps of its own", cuda=2000, gpt2=4000,
                         quick=120, tiny=8)
    lr: float = setting(2e-3, "dspark: peak learning rate", cuda=1e-3, tiny=3e-3)
    init: str = setting("dflash", "dspark: 'dflash' (the backbone starts from DFlash's own "
                        "training dspark_iters steps before its end, so both drafters get the same "
                        "number of steps) or 'scratch'", choices=["dflash", "scratch"])
    calib_seqs: int = setting(32, "dspark: held-out target continuations for the confidence "
                              "calibration (0: none)", type=number(int, 0), cuda=256, quick=16,
                              tiny=4)
    sampled_iters: int = setting(400, "dspark: steps of its sampling weights, a copy fine-tuned on "
                                 "the sampled share of the distillation set, which bench.py and "
                                 "sample.py draft with when sampling (0: none)",
                                 type=number(int, 0), cuda=800, quick=20, tiny=4)
    sampled_block: int = setting(5, "dspark: the block those steps train, anchor included (what a "
                                 "sampled round drafts is its first slots)", type=number(int, 2),
                                 tiny=3)
    sampled_anchors: int = setting(16, "dspark: anchors per sequence in those steps", cuda=32,
                                   tiny=4)


def phases(settings, run):
    """The phases this stage runs: (name, steps). Checks the settings too."""
    backbone = run.settings["dflash"]
    if backbone.vocab:
        raise ValueError(f"--dflash-vocab {backbone.vocab}: DSpark drafts over the target's whole "
                         "vocabulary (its Markov head biases every token), and its backbone is "
                         "DFlash's: train both with --dflash-vocab 0, or leave dspark out "
                         "(--drafters)")
    if settings.sampled_iters and settings.sampled_block > backbone.block:
        raise ValueError(f"--dspark-sampled-block ({settings.sampled_block}) must be at most "
                         f"--dflash-block ({backbone.block})")
    check_anchors(run, backbone.block, backbone.anchors, "--dflash-anchors")
    if settings.sampled_iters:
        check_anchors(run, settings.sampled_block, settings.sampled_anchors,
                      "--dspark-sampled-anchors")
    out = [("dspark", settings.iters)]
    return out + ([("dspark-sampled", settings.sampled_iters)] if settings.sampled_iters else [])


def train(tr, settings):
    """The backbone (from DFlash's branch), the Markov and confidence heads, then calibration and
    the sampling weights -> out/dspark.pt."""
    run, dflash = tr.run, tr.run.settings["dflash"]
    target, target_ckpt = tr.target()
    backbone_cfg = network_config(dflash, target.config)
    spark_cfg = DSparkConfig(rank=settings.rank)
    torch.manual_seed(run.seed + 4)
    spark = DSpark(backbone_cfg, spark_cfg, target).to(tr.device)
    n_params = sum(p.numel() for p in spark.parameters())
    print(f"dspark: {n_params / 1e6:.2f}M trainable parameters, {backbone_cfg}, {spark_cfg}")
    init_budget = None
    if settings.init == "dflash":  # warm start: DFlash's network is exactly DSpark's backbone
        state, init_budget = start_from_dflash(tr, backbone_cfg)
        widen(spark.backbone, state)  # a branch from the narrow phase: widened
    batches = tr.distill.batches(dflash.text)

    def loss_of(x, t_logits, hid, step):
        batch = anchored(tr, x, t_logits, hid, step, backbone_cfg, dflash.anchors)
        return dspark_loss(spark, *batch, dflash.gamma)

    fingerprint = {"stage": "dspark", "backbone": backbone_cfg.to_dict(),
                   "config": spark_cfg.to_dict(), "target": target_ckpt["model_hash"],
                   "init": settings.init, "iters": settings.iters, "lr": settings.lr,
                   "text": dflash.text,
                   "gen": tr.distill.key(dflash.text), "anchors": dflash.anchors,
                   "gamma": dflash.gamma, "seed": run.seed, "init_budget": init_budget}
    tune = sampling_weights_wanted(tr, settings)
    # keep_resume: a run stopped in the sampling steps that follow does not redo these
    val = tr.fit("dspark", spark, lambda s: loss_of(*batches(s), s),
                 lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                 steps=settings.iters, lr=settings.lr, fingerprint=fingerprint,
                 tokens_per_step=run.batch_size * dflash.anchors * backbone_cfg.block,
                 keep_resume=tune).val_loss
    extra = {"val_loss": val, "text": dflash.text, "init_budget": init_budget}
    if settings.calib_seqs > 0:
        extra["ece_before"], extra["ece_after"] = calibrate_on_held_out(tr, settings, spark,
                                                                        backbone_cfg)
    budget = tr.budget()  # DSpark's own: it ends here, before the sampling weights
    if tune:
        extra["sampled"] = sampling_weights(tr, settings, spark, fingerprint)
    config = {"backbone": backbone_cfg.to_dict(), "dspark": spark_cfg.to_dict()}
    tr.save(config, spark, extra, budget=budget)
    return val


def start_from_dflash(tr, backbone_cfg):
    """--dspark-init dflash: DSpark's backbone weights and the budget they cost, from DFlash's
    branch (out/dflash.branch.pt, see branch_step) or, without one, its final out/dflash.pt."""
    dflash = tr.run.settings["dflash"]
    dfl = load_checkpoint(tr.path("dflash"), "dflash")
    same_target = dfl.get("target_hash") == tr.target()[1]["model_hash"]
    if not same_target or dfl["config"] != backbone_cfg.to_dict() or "fingerprint" not in dfl:
        raise ValueError(f"--dspark-init dflash needs {tr.path('dflash')} trained on this "
                         "target with the same --dflash-* shape: run "
                         "`python train.py --only dflash` first, or use --dspark-init scratch")
    branch = dfl["fingerprint"]["branch"]
    if branch is None:
        print(f"dspark: backbone initialised from {tr.path('dflash')} (its final weights)")
        return dfl["state_dict"], dfl.get("budget")
    br = load_checkpoint(tr.path("dflash.branch"), "dflash-branch", "dflash")
    if br.get("fingerprint") != dfl["fingerprint"]:
        raise ValueError(f"{tr.path('dflash.branch')} is not from the run that wrote "
                         f"{tr.path('dflash')}: run `python train.py --only dflash --force`")
    if branch != branch_step(dflash, tr.run):
        print(f"dspark: note: DFlash branched at step {branch}, not at DFlash's steps - "
              f"--dspark-iters = {total_steps(dflash, tr.run) - tr.run.settings['dspark'].iters}: "
              "the budgets differ (retrain dflash to match them)")
    print(f"dspark: backbone initialised from DFlash's state at step {branch} "
          f"({tr.path('dflash.branch')})")
    return br["state_dict"], br["budget"]


def calibrate_on_held_out(tr, settings, spark, backbone_cfg):
    """calibrate() on held-out text: the target's own greedy continuations of validation
    prompts, with 4x the training anchors a sequence (the late positions are fitted only on
    blocks that got that far). -> ECE before, after."""
    run, dflash = tr.run, tr.run.settings["dflash"]
    held = tr.distill.write(settings.calib_seqs, 0, "val")
    n_anchors = min(4 * dflash.anchors, held.size(1) - backbone_cfg.block - backbone_cfg.shift)
    held = [held[i:i + run.batch_size] for i in range(0, len(held), run.batch_size)]
    # a generator, not a list: one batch's target logits at a time (they are large at scale)
    batches = (anchored(tr, x, *tr.distill.features(x), -1 - i, backbone_cfg, n_anchors)
               for i, x in enumerate(held))
    before, after = calibrate(spark, batches)
    print(f"dspark: confidence ECE (teacher-forced, held-out, drafts whose prefix matched) "
          f"{before:.3f} before calibration, {after:.3f} after; per-position temperatures "
          f"{[round(t, 2) for t in spark.conf_temp.tolist()]}")
    return before, after


def sampling_weights_wanted(tr, settings):
    """Whether DSpark gets sampling weights: --dspark-sampled-iters, and sampled text to learn."""
    if not settings.sampled_iters:
        return False
    if tr.run.settings["dflash"].text != "gen" or tr.distill.settings()["sampled"] == 0:
        print("dspark: no sampling weights (they learn from the sampled share of the distillation "
              "set: --dflash-text gen and --gen-sampled > 0)")
        return False
    return True


def sampling_weights(tr, settings, spark, fingerprint):
    """DSpark's weights for sampling: a copy of the trained network, fine-tuned on the sampled
    share of the distillation set only, and only on a block's first slots (the anchor and
    --dspark-sampled-block - 1 masks), what a sampled round drafts. Why a copy: DSpark's own steps
    learn from the set as it is (mostly greedy text), and more sampled text there trades greedy tau
    for sampled tau; a copy serves each mode (docs/experiments.md: DSpark: sampling weights). The
    later slots keep their weights, so any k still drafts. -> the 'sampled' entry of out/dspark.pt
    (the loader reads it: runtime/checkpoint.load_drafter_checkpoint)."""
    run, dflash = tr.run, tr.run.settings["dflash"]
    t0 = time.time()
    tuned = DSpark(spark.backbone.config, spark.config, tr.target()[0]).to(tr.device)
    tuned.load_state_dict(spark.state_dict())  # the calibrated confidence temperatures too
    narrow = dataclasses.replace(spark.backbone.config, block=settings.sampled_block)
    batches = tr.distill.batches("gen", sampled_only=True)

    def loss_of(x, t_logits, hid, step):
        batch = anchored(tr, x, t_logits, hid, step, narrow, settings.sampled_anchors)
        return dspark_loss(tuned, *batch, dflash.gamma, block=narrow.block)

    fingerprint = {**fingerprint, "sampled": [settings.sampled_iters, settings.sampled_block,
                                              settings.sampled_anchors]}
    val = tr.fit("dspark-sampled", tuned, lambda s: loss_of(*batches(s), s),
                 lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                 steps=settings.sampled_iters, lr=settings.lr, fingerprint=fingerprint,
                 tokens_per_step=run.batch_size * settings.sampled_anchors * narrow.block).val_loss
    return {"state_dict": cpu_state_dict(tuned), "val_loss": val, "block": narrow.block,
            "budget": {"steps": settings.sampled_iters, "seconds": round(time.time() - t0)}}


def records(run):
    """What out/dspark.pt records of the settings: its own and DFlash's (with_arch)."""
    return with_arch(usual_record(run, "dspark", STAGE), run)


STAGE = Stage(settings=DSparkSettings, phases=phases, train=train,
              step_cost={"dspark": 0.39, "dspark-sampled": 0.27}, builds_on="dflash",
              records=records)
