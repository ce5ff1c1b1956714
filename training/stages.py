"""
training/stages.py -- how the target and each drafter train, as the stages of train.py: each stage's
phases, its resume fingerprint, its checkpoint, and whether the one in out/ is still current
(DFlash's and DSpark's stages are in training/stages_dflash.py).

Each draft_*.py file holds its network, how it drafts and its loss, the idea of how it learns. This
file is the plumbing around that loss: train.py calls train_<name>(trainer) for stage <name>, and
<name>_phases(args) first, to check the settings (runtime/settings.py) and plan the steps. A stage
gets everything from the Trainer (train.py): the target, the distillation set, fit() (the one
training loop, with resume) and save(). """

import hashlib
import os

import torch

from runtime import cpu_speed
from training import ddp
from training import pretrained
from runtime.checkpoint import (CheckpointError, cpu_state_dict, cpu_tree, load_checkpoint,
                        save_checkpoint, state_hash)
from draft_eagle import Eagle, EagleConfig, default_taps, eagle_loss
from draft_mtp import MTP, MTPConfig, mtp_loss, unroll_anchors
from draft_small import small_loss
from gpt import GPT, GPTConfig
from runtime.settings import DFLASH, DISTILL, DSPARK, EAGLE, MTP as MTP_SETTINGS, SHARED, SMALL, TARGET
from training.stages_dflash import dflash_phases, dspark_phases, train_dflash, train_dspark

# -----------------------------------------------------------------------------
# the small GPT: train.py runs train_small(trainer) as its "small" stage



def small_phases(a):
    """The train_loop phases this stage runs: (name, steps). Checks the settings too."""
    if a.small_embd % a.small_heads:
        raise ValueError(f"--small-embd ({a.small_embd}) must be a multiple of --small-heads "
                         f"({a.small_heads})")
    return [("small", a.small_iters)]


def train_small(tr):
    """A 1-2 layer GPT, distilled from the target on its own text -> out/small.pt."""
    a = tr.args
    target, target_ckpt = tr.target()
    cfg = GPTConfig(sequence_len=a.block_size, vocab_size=target.config.vocab_size,
                    n_layer=a.small_layers, n_head=a.small_heads, n_embd=a.small_embd)
    torch.manual_seed(a.seed + 1)
    model = GPT(cfg).to(tr.device)
    print(f"small: {model.num_params() / 1e6:.2f}M parameters, {cfg}")

    fingerprint = {"stage": "small", "config": cfg.to_dict(), "target": target_ckpt["model_hash"],
                   "iters": a.small_iters, "lr": a.small_lr, "distill": a.small_distill,
                   "seed": a.seed, "text": tr.distill.key(a.small_text)}
    batches = tr.distill.batches(a.small_text)
    val, _ = tr.fit("small", model,
                    lambda s: small_loss(model, *batches(s)[:2], a.small_distill),
                    lambda: tr.val_loss(lambda x, y: model(x, y)[1]),
                    steps=a.small_iters, lr=a.small_lr, fingerprint=fingerprint,
                    tokens_per_step=a.batch_size * a.block_size)
    tr.save("small", cfg.to_dict(), model, {"val_loss": val})
    return val


# -----------------------------------------------------------------------------
# MTP: train.py runs train_mtp(trainer) as its "mtp" stage (posthoc), or trains the head inside
# its target stage (joint: new_head, then save_head)


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


def new_head(tr, target_cfg):
    """A freshly initialised MTP for a target of this config."""
    torch.manual_seed(tr.args.seed + 2)
    return MTP(MTPConfig.for_target(target_cfg, tr.args.mtp_modules)).to(tr.device)


def save_head(tr, mtp, mode):
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
    mtp = new_head(tr, target.config)
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
    return save_head(tr, mtp, "posthoc")


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


# -----------------------------------------------------------------------------
# the target's stage (with --mtp-mode joint, the MTP head trains alongside it; with --init-from
# it is a pretrained GPT-2's, read from its folder instead)


def train_target(tr):
    """The target GPT on the corpus (with the MTP head in joint mode) -> out/target.pt."""
    a = tr.args
    if a.init_from:
        return import_target(tr)
    cfg = GPTConfig(sequence_len=a.block_size, vocab_size=tr.info["vocab_size"], n_layer=a.n_layer,
                    n_head=a.n_head, n_embd=a.n_embd)
    torch.manual_seed(a.seed)
    model = GPT(cfg).to(tr.device)
    print(f"target: {model.num_params() / 1e6:.2f}M parameters, {cfg}")
    mtp = new_head(tr, cfg) if a.mtp_mode == "joint" else None
    taps = (cfg.n_layer,) if mtp is not None else ()  # the last block's states, for the head

    def loss_fn(step):
        x, y = tr.data.get("train", step, tr.device)
        _, loss, hid = model(x, y, hidden_layers=taps)
        if mtp is not None:  # DeepSeek-V3: L_main + lambda L_mtp, into the whole target
            loss = loss + a.mtp_lambda * mtp_loss(mtp, model, hid[cfg.n_layer], x, y)
        return loss

    fingerprint = {"stage": "target", "config": cfg.to_dict(),
                   "tokenizer": tr.info["tokenizer_hash"],
                   "iters": a.target_iters, "lr": a.target_lr, "batch": a.batch_size,
                   "seed": a.seed, "mtp": None if mtp is None else (a.mtp_modules, a.mtp_lambda)}
    module = model if mtp is None else torch.nn.ModuleDict({"gpt": model, "mtp": mtp})
    val, opt_state = tr.fit("target", module, loss_fn,
                            lambda: tr.val_loss(lambda x, y: model(x, y)[1]),  # L_main only
                            steps=a.target_iters, lr=a.target_lr, fingerprint=fingerprint,
                            tokens_per_step=a.batch_size * a.block_size)
    sd = cpu_state_dict(model)
    save_checkpoint({"kind": "target", "config": cfg.to_dict(), "state_dict": sd,
                     "model_hash": state_hash(sd), "tokenizer_hash": tr.info["tokenizer_hash"],
                     "step": a.target_iters, "optimizer": cpu_tree(opt_state), "val_loss": val,
                     "tokens_seen": a.target_iters * a.batch_size * a.block_size,
                     "settings": stage_settings(a, "target")},
                    tr.path("target"))
    if mtp is not None:  # the head belongs to exactly this target: the mtp stage is now current
        ddp.barrier(tr.world)  # every rank reads the target.pt rank 0 just wrote
        tr.forget_target()
        save_head(tr, mtp, "joint")
    return val


def import_target(tr):
    """out/target.pt from the --init-from folder (training/pretrained.py): the weights as they are, the
    context window cut to --block-size; its loss on the corpus's validation windows printed."""
    a = tr.args
    # the token files are the folder's tokenizer's: prepare() rebuilds them when its ranks change
    model = cpu_speed.speed_up(pretrained.load_folder(a.init_from, a.block_size)[0].to(tr.device))
    print(f"target: {model.num_params() / 1e6:.2f}M parameters from {a.init_from}, "
          f"{model.config}")
    val = tr.val_loss(lambda x, y: model(x, y)[1])
    sd = cpu_state_dict(model)
    save_checkpoint({"kind": "target", "config": model.config.to_dict(), "state_dict": sd,
                     "model_hash": state_hash(sd), "tokenizer_hash": tr.info["tokenizer_hash"],
                     "step": 0, "val_loss": val, "tokens_seen": 0, "init_from": a.init_from,
                     "settings": stage_settings(a, "target")},
                    tr.path("target"))
    return val


def weights_id(folder):
    """Which model a folder holds, for the target stage's settings: the sha256 of its config.json
    and weights file (a pretrained target is re-read when either changes)."""
    h = hashlib.sha256()
    names = [n for n in ("config.json", "model.safetensors", "pytorch_model.bin")
             if os.path.isfile(os.path.join(folder, n))][:2]
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return f"{' + '.join(names)} {h.hexdigest()[:16]}"


def target_phases(a):
    """The target stage's train_loop phases: (name, steps). Checks its settings too."""
    if a.init_from:
        if a.mtp_mode == "joint":
            raise ValueError("--mtp-mode joint trains the MTP head inside the target's training, "
                             "and with --init-from the target is not trained: use --mtp-mode "
                             "posthoc")
        return []
    if a.n_embd % a.n_head:
        raise ValueError(f"--n-embd ({a.n_embd}) must be a multiple of --n-head ({a.n_head})")
    return [("target", a.target_iters)]


STAGES = {  # stage -> (its function, its train_loop phases [(name, steps)], its settings)
    "target": (train_target, target_phases, TARGET),
    "small": (train_small, small_phases, SMALL),
    "mtp": (train_mtp, mtp_phases, MTP_SETTINGS),
    "eagle": (train_eagle, eagle_phases, EAGLE),
    "dflash": (train_dflash, dflash_phases, DFLASH),
    "dspark": (train_dspark, dspark_phases, {**DFLASH, **DSPARK}),  # DFlash's backbone
}


def stage_settings(args, stage):
    """The settings a stage's checkpoint records: one trained with other values is not current.
    The target's include the MTP head's in joint mode, where it trains inside the target stage."""
    if stage == "target" and args.init_from:  # read, not trained: which weights, what context
        return {"init_from": os.path.abspath(args.init_from),
                "weights": weights_id(args.init_from), "block_size": args.block_size}
    names = [*SHARED, *STAGES[stage][2]]
    if stage != "target":
        names += [*DISTILL]
    else:
        names += ["mtp_mode"] + (["mtp_modules", "mtp_lambda"] if args.mtp_mode == "joint" else [])
    return {"seed": args.seed, **{n: getattr(args, n) for n in names}}


def is_current(tr, stage):
    """Does out/<stage>.pt exist, belong to the current target and tokenizer, and record the
    settings of this run?"""
    path = tr.path(stage)
    if not os.path.exists(path):
        return False
    try:
        ckpt = load_checkpoint(path, stage)
    except CheckpointError:  # truncated, garbage, or another kind of checkpoint: it is remade
        print(f"{stage}: {path} is unreadable; retraining it")
        return False
    if (ckpt.get("tokenizer_hash") != tr.info["tokenizer_hash"] if stage == "target"
            else ckpt.get("target_hash") != tr.target()[1]["model_hash"]):
        print(f"{stage}: {path} was trained against another target or tokenizer; retraining it")
        return False
    had = ckpt.get("settings") or {}
    changed = [f"{k} {had.get(k)} -> {v}" for k, v in stage_settings(tr.args, stage).items()
               if had.get(k) != v]
    if changed:
        print(f"{stage}: {path} was trained with other settings ({', '.join(changed[:4])}"
              f"{', ...' if len(changed) > 4 else ''}); retraining it")
    return not changed
