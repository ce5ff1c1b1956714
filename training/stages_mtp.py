"""
training/stages_mtp.py -- MTP's stage of train.py: the modules trained post hoc on the frozen
target (the default), or alongside the target in its own stage (--mtp-mode joint: new_mtp and
save_mtp, which training/stages.py calls). The loss is draft_mtp.py's; this file builds the
modules from the settings, draws the anchors its unrolled steps train at, and saves out/mtp.pt.
"""

import torch

from draft_mtp import MTP, MTPConfig, mtp_loss, unroll_anchors

# -----------------------------------------------------------------------------
# MTP: train.py runs train_mtp(trainer) as its "mtp" stage (posthoc), or trains the modules inside
# its target stage (joint: new_mtp, then save_mtp)


def check_unroll(flag, steps, block_size):
    """At start-up, what unroll_anchors would refuse only once training ran: a training window
    (block_size tokens, block_size - 1 inputs) must hold `steps` labels after an anchor."""
    if steps >= block_size - 1:
        raise ValueError(f"{flag} {steps} needs a longer --block-size than {block_size}")


def mtp_phases(a):
    """The train_loop phases this stage runs: (name, steps); none in joint mode, where the head
    trains inside the target's stage."""
    if a.mtp_mode == "posthoc" and a.mtp_unroll > 1 and a.mtp_modules > 1:
        raise ValueError(f"--mtp-unroll {a.mtp_unroll} unrolls ONE module over its own recursion, "
                         f"but --mtp-modules is {a.mtp_modules}: use one of them (--mtp-unroll 1 "
                         "trains chained modules)")
    check_unroll("--mtp-unroll", a.mtp_unroll, a.block_size)
    return [("mtp", a.mtp_iters)] if a.mtp_mode == "posthoc" else []


def new_mtp(tr, target_cfg):
    """A freshly initialised MTP for a target of this config."""
    torch.manual_seed(tr.args.seed + 2)
    return MTP(MTPConfig.for_target(target_cfg, tr.args.mtp_modules)).to(tr.device)


def save_mtp(tr, mtp, mode):
    """out/mtp.pt, with the head's own val loss: CE on t_{i+2} (comparable across modes)."""
    target, _ = tr.target()
    last = target.config.n_layer  # the MTP head reads the last block's states
    mtp.eval()
    val = tr.val_loss(
        lambda x, y: mtp_loss(mtp, target, target(x, hidden_layers=(last,))[2][last], x, y))
    print(f"mtp ({mode}): val CE of the token after next {val:.4f}")
    steps = tr.args.target_iters if mode == "joint" else None  # joint: it trained with the target
    tr.save("mtp", mtp.config.to_dict(), mtp, {"val_loss": val, "mode": mode}, steps=steps)
    return val


def train_mtp(tr):
    """MTP post hoc: the head trains on the frozen target's hidden states. (In joint mode the
    target stage already wrote out/mtp.pt; this runs only if that target predates it.)"""
    a = tr.args
    target, target_ckpt = tr.target()
    if a.mtp_mode == "joint":
        print("mtp: out/target.pt was trained without the MTP loss, so the head trains post hoc "
              "on it (`python train.py --only target --force` retrains both jointly)")
    mtp = new_mtp(tr, target.config)
    last = target.config.n_layer
    n_params = sum(p.numel() for p in mtp.parameters())
    print(f"mtp: {n_params / 1e6:.2f}M trainable parameters, {mtp.config}")
    batches = tr.distill.batches(a.mtp_text)

    def loss_of(w, t_logits, hid, step=-1):
        """w (B, T) windows: inputs w[:, :-1], labels w[:, 1:]; the target's features on w give
        the module's inputs (h) and the distillation teacher (its logits), causal, so [:, :-1] is
        x's. The unrolled steps' anchors are drawn from a generator seeded by the step (the
        validation's: step -1)."""
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step + 5_555_555)
        anchors = tr.per_row(lambda B: unroll_anchors(B, w.size(1) - 1, a.mtp_unroll,
                                                      a.mtp_anchors, g, w.device), w.size(0))
        return mtp_loss(mtp, target, hid[last][:, :-1], w[:, :-1], w[:, 1:], t_logits[:, :-1],
                        a.mtp_distill, a.mtp_unroll, a.mtp_beta, anchors)

    fingerprint = {"stage": "mtp", "config": mtp.config.to_dict(),
                   "target": target_ckpt["model_hash"],
                   "iters": a.mtp_iters, "lr": a.mtp_lr, "distill": a.mtp_distill,
                   "text": a.mtp_text, "gen": tr.distill.key(a.mtp_text), "seed": a.seed,
                   "unroll": (a.mtp_unroll, a.mtp_anchors, a.mtp_beta)}
    tr.fit("mtp", mtp, lambda s: loss_of(*batches(s), s),
           lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x))),  # corpus windows
           steps=a.mtp_iters, lr=a.mtp_lr, fingerprint=fingerprint,
           tokens_per_step=a.batch_size * a.block_size)
    return save_mtp(tr, mtp, "posthoc")
