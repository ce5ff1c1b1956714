"""
training/stages_mtp.py -- MTP's stage of train.py: the modules trained post hoc on the frozen target
(the default), or alongside the target in its own stage (--mtp-mode joint: new_mtp and save_mtp,
which training/stages_target.py calls). The loss is draft_mtp.py's; this file holds MTP's
settings, builds the modules from them, draws the anchors its unrolled steps train at, and saves
out/mtp.pt.
"""

from dataclasses import dataclass

import torch

from draft_mtp import MTP, MTPConfig, mtp_loss, unroll_anchors
from runtime.settings import number, setting
from training.stage import Stage


@dataclass
class MTPSettings:
    """MTP's settings: train.py's flags --mtp-<field>."""
    mode: str = setting("posthoc", "mtp: 'joint' (the target trains with L_main + lambda*L_mtp and "
                        "writes mtp.pt too) or 'posthoc' (the head trains on the frozen target)",
                        choices=["joint", "posthoc"])
    modules: int = setting(MTPConfig.n_modules, "mtp: chained MTP modules D (DeepSeek-V3: 1); "
                           "deeper drafts reuse the last one")
    lambda_: float = setting(0.3, "mtp: weight of the MTP loss in joint mode (DeepSeek-V3: 0.3)",
                             type=number(float, 0))
    iters: int = setting(1500, "mtp: optimizer steps in posthoc mode", gpt2=6000, quick=60, tiny=10)
    lr: float = setting(2e-3, "mtp: peak learning rate in posthoc mode", cuda=1e-3, tiny=3e-3)
    distill: float = setting(0.5, "mtp: posthoc loss, weight of the KL to the target's "
                             "distribution of the token after next (1 = pure distillation, 0 = "
                             "the text's own tokens only)", type=number(float, 0, 1))
    text: str = setting("gen", "mtp: posthoc training text, 'gen' (the distillation set the target "
                        "wrote) or 'data' (the corpus)", choices=["gen", "data"])
    unroll: int = setting(4, "mtp: posthoc, draft steps the one module is unrolled over in "
                          "training, each fed its own last output (FastMTP); 1 = depth 1 only, "
                          "DeepSeek-V3's", type=number(int, 1), tiny=3)
    anchors: int = setting(32, "mtp: posthoc, positions per training sequence at which steps 2.. "
                           "are unrolled (step 1 trains at every position)", type=number(int, 1),
                           tiny=8)
    beta: float = setting(0.6, "mtp: posthoc, weight decay of the unrolled steps' losses, "
                          "beta^(j-1) (FastMTP: 0.6)", type=number(float, above=0))


def check_unroll(flag, steps, block_size):
    """At start-up, what unroll_anchors would refuse only once training ran: a training window
    (block_size tokens, block_size - 1 inputs) must hold `steps` labels after an anchor."""
    if steps >= block_size - 1:
        raise ValueError(f"{flag} {steps} needs a longer --block-size than {block_size}")


def phases(settings, run):
    """The phases this stage runs: (name, steps); none in joint mode, where the head trains inside
    the target's stage. Checks the settings too."""
    if settings.mode == "posthoc" and settings.unroll > 1 and settings.modules > 1:
        raise ValueError(f"--mtp-unroll {settings.unroll} unrolls ONE module over its own "
                         f"recursion, but --mtp-modules is {settings.modules}: use one of them "
                         "(--mtp-unroll 1 trains chained modules)")
    check_unroll("--mtp-unroll", settings.unroll, run.block_size)
    return [("mtp", settings.iters)] if settings.mode == "posthoc" else []


def new_mtp(tr, settings, target_cfg):
    """A freshly initialised MTP for a target of this config."""
    torch.manual_seed(tr.run.seed + 2)
    return MTP(MTPConfig.for_target(target_cfg, settings.modules)).to(tr.device)


def save_mtp(tr, mtp, mode, steps=None):
    """out/mtp.pt, with the head's own val loss: CE on t_{i+2} (comparable across modes). steps:
    what it trained (joint: the target's steps; posthoc: its own)."""
    target, _ = tr.target()
    last = target.config.n_layer  # the MTP head reads the last block's states
    mtp.eval()
    val = tr.val_loss(
        lambda x, y: mtp_loss(mtp, target, target(x, hidden_layers=(last,))[2][last], x, y))
    print(f"mtp ({mode}): val CE of the token after next {val:.4f}")
    tr.save(mtp.config.to_dict(), mtp, {"val_loss": val, "mode": mode}, steps=steps, stage="mtp")
    return val


def train(tr, settings):
    """MTP post hoc: the head trains on the frozen target's hidden states. (In joint mode the
    target stage already wrote out/mtp.pt; this runs only if that target predates it.)"""
    run = tr.run
    target, target_ckpt = tr.target()
    if settings.mode == "joint":
        print("mtp: out/target.pt was trained without the MTP loss, so the head trains post hoc "
              "on it (`python train.py --only target --force` retrains both jointly)")
    mtp = new_mtp(tr, settings, target.config)
    last = target.config.n_layer
    n_params = sum(p.numel() for p in mtp.parameters())
    print(f"mtp: {n_params / 1e6:.2f}M trainable parameters, {mtp.config}")
    batches = tr.distill.batches(settings.text)

    def loss_of(w, t_logits, hid, step=-1):
        """w (B, T) windows: inputs w[:, :-1], labels w[:, 1:]; the target's features on w give
        the module's inputs (h) and the distillation teacher (its logits), causal, so [:, :-1] is
        x's. The unrolled steps' anchors are drawn from a generator seeded by the step (the
        validation's: step -1)."""
        g = torch.Generator().manual_seed(run.seed * 1_000_003 + step + 5_555_555)
        anchors = tr.per_row(lambda B: unroll_anchors(B, w.size(1) - 1, settings.unroll,
                                                      settings.anchors, g, w.device), w.size(0))
        return mtp_loss(mtp, target, hid[last][:, :-1], w[:, :-1], w[:, 1:], t_logits[:, :-1],
                        settings.distill, settings.unroll, settings.beta, anchors)

    fingerprint = {"stage": "mtp", "config": mtp.config.to_dict(),
                   "target": target_ckpt["model_hash"],
                   "iters": settings.iters, "lr": settings.lr, "distill": settings.distill,
                   "text": settings.text, "gen": tr.distill.key(settings.text), "seed": run.seed,
                   "unroll": (settings.unroll, settings.anchors, settings.beta)}
    tr.fit("mtp", mtp, lambda s: loss_of(*batches(s), s),
           lambda: tr.val_loss(lambda x, y: loss_of(x, *tr.distill.features(x))),  # corpus
           steps=settings.iters, lr=settings.lr, fingerprint=fingerprint,
           tokens_per_step=run.batch_size * run.block_size)
    return save_mtp(tr, mtp, "posthoc")


STAGE = Stage(settings=MTPSettings, phases=phases, train=train, step_cost={"mtp": 0.40})
