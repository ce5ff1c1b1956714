"""
training/stages_eagle.py -- EAGLE-3's stage of train.py: its settings, the network built from them
(which target layers it fuses), the anchors its unrolled steps train at, out/eagle.pt. The loss
and the training-time test are draft_eagle.py's and draft_mtp.py's.
"""

from dataclasses import dataclass

import torch

from draft_eagle import BETA, DISTILL, UNROLL, Eagle, EagleConfig, default_taps, eagle_loss
from draft_mtp import unroll_anchors
from runtime.settings import number, setting
from training.stage import Stage
from training.stages_mtp import check_unroll


@dataclass
class EagleSettings:
    """EAGLE-3's settings: train.py's flags --eagle-<field>. The loss is MTP's over the unrolled
    steps (draft_eagle.eagle_loss); with --eagle-unroll 1 it is plain teacher forcing."""
    iters: int = setting(2000, "eagle: optimizer steps", gpt2=6000, quick=60, tiny=10)
    lr: float = setting(2e-3, "eagle: peak learning rate", cuda=1e-3, tiny=3e-3)
    unroll: int = setting(UNROLL, "eagle: draft steps unrolled in training on its own outputs (the "
                          "training-time test); 1 = teacher forcing only", tiny=3)
    anchors: int = setting(32, "eagle: positions per training sequence at which steps 2.. are "
                           "unrolled (step 1 trains at every position)", tiny=8)
    beta: float = setting(BETA, "eagle: weight decay of the unrolled steps' losses, beta^(j-1) "
                          "(EAGLE-3's code: 0.8)")
    distill: float = setting(DISTILL, "eagle: weight of the KL to the target's distribution (1 = pure "
                             "distillation, 0 = the text's own tokens only)",
                             type=number(float, 0, 1))
    taps: str = setting("auto", "eagle: the three target layers fused, e.g. '2,4,6' ('auto': a "
                        "third, two thirds and the last)")


def eagle_taps(spec, n_layer):
    """'auto' or '2,4,6' -> a list of target layers, each 1..n_layer."""
    if spec == "auto":
        return default_taps(n_layer)
    try:
        taps = [int(t) for t in spec.split(",")]
    except ValueError:
        taps = []
    if not taps or not all(1 <= t <= n_layer for t in taps):
        raise ValueError(f"--eagle-taps must be 'auto' or comma-separated layers 1..{n_layer} "
                         f"like 2,4,6 (got {spec!r})")
    return taps


def phases(settings, run):
    """The phases this stage runs: (name, steps). Checks the settings too."""
    eagle_taps(settings.taps, run.settings["target"].n_layer)
    check_unroll("--eagle-unroll", settings.unroll, run.block_size)
    return [("eagle", settings.iters)]


def train(tr, settings):
    """EAGLE-3 on the frozen target, on the distillation set -> out/eagle.pt."""
    run = tr.run
    target, target_ckpt = tr.target()
    torch.manual_seed(run.seed + 5)
    cfg = EagleConfig.for_target(target.config, eagle_taps(settings.taps, target.config.n_layer))
    net = Eagle(cfg).to(tr.device)
    print(f"eagle: {sum(p.numel() for p in net.parameters()) / 1e6:.2f}M trainable parameters, "
          f"{cfg}, {settings.unroll} steps unrolled at {settings.anchors} anchors")
    batches = tr.distill.batches("gen")

    def loss_of(w, t_logits, hid, step):
        """Its draft steps unroll at anchors drawn by the step (the validation's: step -1)."""
        g = torch.Generator().manual_seed(run.seed * 1_000_003 + step + 3_333_333)
        anchors = tr.per_row(lambda B: unroll_anchors(B, w.size(1) - 1, settings.unroll,
                                                      settings.anchors, g, w.device), w.size(0))
        return eagle_loss(net, target, w, t_logits, hid, anchors, settings.unroll, settings.beta,
                          settings.distill)

    fingerprint = {"stage": "eagle", "config": cfg.to_dict(),
                   "target": target_ckpt["model_hash"], "iters": settings.iters, "lr": settings.lr,
                   "gen": tr.distill.key("gen"),
                   "unroll": (settings.unroll, settings.anchors, settings.beta),
                   "distill": settings.distill, "seed": run.seed}
    val = tr.fit("eagle", net, lambda s: loss_of(*batches(s), s),
                 lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                 steps=settings.iters, lr=settings.lr, fingerprint=fingerprint,
                 tokens_per_step=run.batch_size * run.block_size).val_loss
    tr.save(cfg.to_dict(), net, {"val_loss": val})
    return val


STAGE = Stage(settings=EagleSettings, phases=phases, train=train, step_cost={"eagle": 0.42},
              reads=("target",))
