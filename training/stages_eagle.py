"""
training/stages_eagle.py -- EAGLE-3's stage of train.py: the network built from the settings
(which target layers it fuses), the anchors its unrolled steps train at, out/eagle.pt. The loss
and the training-time test are draft_eagle.py's and draft_mtp.py's.
"""

import torch

from draft_eagle import Eagle, EagleConfig, default_taps, eagle_loss
from draft_mtp import unroll_anchors
from training.stages_mtp import check_unroll

# -----------------------------------------------------------------------------
# EAGLE-3: train.py runs train_eagle(trainer) as its "eagle" stage. The loss is MTP's over the
# unrolled steps (draft_eagle.eagle_loss); with --eagle-unroll 1 it is plain teacher forcing.


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


def eagle_phases(a):
    """The train_loop phases this stage runs: (name, steps). Checks the settings too."""
    eagle_taps(a.eagle_taps, a.n_layer)
    check_unroll("--eagle-unroll", a.eagle_unroll, a.block_size)
    return [("eagle", a.eagle_iters)]


def train_eagle(tr):
    """EAGLE-3 on the frozen target, on the distillation set -> out/eagle.pt."""
    a = tr.args
    target, target_ckpt = tr.target()
    torch.manual_seed(a.seed + 5)
    cfg = EagleConfig.for_target(target.config, eagle_taps(a.eagle_taps, target.config.n_layer))
    net = Eagle(cfg).to(tr.device)
    print(f"eagle: {sum(p.numel() for p in net.parameters()) / 1e6:.2f}M trainable parameters, "
          f"{cfg}, {a.eagle_unroll} steps unrolled at {a.eagle_anchors} anchors")
    batches = tr.distill.batches("gen")

    def loss_of(w, t_logits, hid, step):
        """Its draft steps unroll at anchors drawn by the step (the validation's: step -1)."""
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step + 3_333_333)
        anchors = tr.per_row(lambda B: unroll_anchors(B, w.size(1) - 1, a.eagle_unroll,
                                                      a.eagle_anchors, g, w.device), w.size(0))
        return eagle_loss(net, target, w, t_logits, hid, anchors, a.eagle_unroll, a.eagle_beta,
                          a.eagle_distill)

    fingerprint = {"stage": "eagle", "config": cfg.to_dict(), "target": target_ckpt["model_hash"],
                   "iters": a.eagle_iters, "lr": a.eagle_lr, "gen": tr.distill.key("gen"),
                   "unroll": (a.eagle_unroll, a.eagle_anchors, a.eagle_beta),
                   "distill": a.eagle_distill, "seed": a.seed}
    val, _ = tr.fit("eagle", net, lambda s: loss_of(*batches(s), s),
                    lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x), -1)),
                    steps=a.eagle_iters, lr=a.eagle_lr, fingerprint=fingerprint,
                    tokens_per_step=a.batch_size * a.block_size)
    tr.save("eagle", cfg.to_dict(), net, {"val_loss": val})
    return val
