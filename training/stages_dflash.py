"""
training/stages_dflash.py -- DFlash's stage of train.py: its phases (the narrow block, then the full
block: the recipe is draft_dflash.py's, widen), the anchors each step trains at, out/dflash.pt,
and the state at the step where DSpark branches off (out/dflash.branch.pt: training/stages_dspark.py
starts there). What training/stages.py says of a stage holds here.
"""

import torch

import draft_dflash
from runtime.checkpoint import cpu_state_dict, save_checkpoint
from draft_dflash import DFlash, DFlashConfig, dflash_loss, sample_anchors, widen

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
