"""
training/stages_dflash.py -- DFlash's stage of train.py: its settings, its phases (the narrow block,
then the full block: the recipe is draft_dflash.py's, widen), the anchors each step trains at,
out/dflash.pt, and the state at the step where DSpark branches off (out/dflash.branch.pt:
training/stages_dspark.py starts there, so that the two drafters train the same number of steps).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

import draft_dflash
from draft_dflash import DFlash, DFlashConfig, dflash_loss, sample_anchors, widen
from runtime.checkpoint import cpu_state_dict, save_checkpoint
from runtime.settings import number, setting
from training.distill import check_vocab, restricted
from training.stage import Stage, dropped, usual_record


@dataclass
class DFlashSettings:
    """DFlash's settings: train.py's flags --dflash-<field>. DSpark's backbone is built from them
    too (training/stages_dspark.py), whence "dflash and dspark" in their help."""
    layers: int = setting(DFlashConfig.n_layer, "dflash: draft layers (the paper: 5 at 8B scale)",
                          cuda=3, gpt2=4, tiny=1, **{"real-cpu": 1, "real-gpu": 2})
    heads: int = setting(DFlashConfig.n_head, "dflash: attention heads (its width is the "
                         "target's; none: the target's heads)", gpt2=12, tiny=2,
                         **{"gpu-small": None, "real-cpu": None})
    block: int = setting(DFlashConfig.block, "dflash and dspark: the block they draft with, "
                         "anchor + block-1 masks (so up to block-1 drafts a round)",
                         type=number(int, 2), quick=8, **{"real-cpu": 8})
    gamma: float = setting(3.0, "dflash and dspark: position weight decay, w_k = exp(-(k-1)/gamma) "
                           "(the paper: 4 at block 8, 7 at 16)", cuda=7.0)
    anchors: int = setting(8, "dflash and dspark: random anchors (blocks) per training sequence at "
                           "the full block", cuda=32, quick=16, tiny=4,
                           **{"real-cpu": 32})
    iters: int = setting(1000, "dflash: steps at the full block, after the narrow phase (DFlash "
                         "trains --dflash-narrow-iters + these in all)", cuda=2000, gpt2=6000,
                         quick=400, tiny=6, **{"real-cpu": 2400, "real-gpu": 20000})
    lr: float = setting(1e-3, "dflash: peak learning rate at the full block", quick=2e-3, tiny=3e-3)
    narrow_block: int = setting(8, "dflash: the block of the narrow phase it trains first",
                                type=number(int, 2))
    narrow_anchors: int = setting(16, "dflash: anchors per training sequence in the narrow phase",
                                  tiny=4)
    narrow_iters: int = setting(5000, "dflash: steps at --dflash-narrow-block before the full "
                                "block (0: no narrow phase)", type=number(int, 0), cuda=0, quick=0,
                                tiny=8, **{"real-cpu": 0})
    narrow_lr: float = setting(2e-3, "dflash: peak learning rate of the narrow phase", tiny=3e-3)
    text: str = setting("gen", "dflash and dspark: training text, 'gen' (the distillation set the "
                        "target wrote) or 'data' (the corpus); soft labels from the target either "
                        "way", choices=["gen", "data"])
    taps: str = setting("auto", "dflash and dspark: target layers read as context, e.g. "
                        "'1,2,3,4,5' ('auto': every block but the last; 5 spread over a target "
                        "deeper than 8 layers)")
    vocab: int = setting(0, "dflash: its draft vocabulary, the N tokens the distillation set holds "
                         "most often (EAGLE-3's draft_vocab_size; the target still verifies over "
                         "its whole vocabulary); 0: the target's whole vocabulary",
                         type=number(int, 0), **{"real-cpu": 8192})
    arch: str = setting("auto", "dflash and dspark: their draft layers, 'gpt2' (GPT-2's, with "
                        "ALiBi and a learned embedding per mask slot) or 'qwen3' (the papers', "
                        "which speculators and vLLM serve: formats/speculators.py exports "
                        "them); "
                        "'auto': qwen3 for a Llama or Qwen target, gpt2 for a GPT-2 one",
                        choices=["auto", "gpt2", "qwen3"])


# -----------------------------------------------------------------------------
# its phases: the narrow block, then the full block (the recipe: draft_dflash.py, widen)


class BlockPhase(NamedTuple):
    """One phase of DFlash's training: its name, the block it trains, anchors a sequence, its
    steps and its peak learning rate."""
    name: str
    block: int
    anchors: int
    steps: int
    lr: float


def training_phases(settings, run):
    """DFlash's training as phases: with --dflash-narrow-iters, the narrow block first, then the
    full block."""
    target = run.settings["target"]
    if target.n_embd % heads(settings, target):
        raise ValueError(f"--dflash-heads ({settings.heads}) must divide the target's width, "
                         f"--n-embd ({target.n_embd})")
    full = BlockPhase("dflash", settings.block, settings.anchors, settings.iters, settings.lr)
    if settings.narrow_iters == 0:
        return [full]
    if settings.narrow_block >= settings.block:
        raise ValueError(f"--dflash-narrow-block ({settings.narrow_block}) must be smaller than "
                         f"--dflash-block ({settings.block}), or use --dflash-narrow-iters 0")
    return [BlockPhase("dflash-narrow", settings.narrow_block, settings.narrow_anchors,
                       settings.narrow_iters, settings.narrow_lr), full]


def check_anchors(run, block, n_anchors, flag):
    """A training window of --block-size tokens holds block_size - block anchors at most (each
    needs a context position before it and its whole block inside the window)."""
    if n_anchors > run.block_size - block:
        raise ValueError(f"a --block-size {run.block_size} window holds at most "
                         f"{max(0, run.block_size - block)} anchors of block {block}, not "
                         f"{n_anchors} ({flag}): use fewer, or a longer --block-size")


def phases(settings, run):
    """The phases this stage runs: (name, steps). Checks the settings too."""
    plan = training_phases(settings, run)
    for p in plan:
        check_anchors(run, p.block, p.anchors, "--dflash-narrow-anchors" if "narrow" in p.name
                      else "--dflash-anchors")
    own = run.vocab_size if getattr(run, "tokenizer", "bpe") == "bpe" else None  # or smaller
    check_vocab(settings.vocab, getattr(run, "target_vocab", None) or own)
    return [(p.name, p.steps) for p in plan]


def total_steps(settings, run):
    return sum(steps for _, steps in phases(settings, run))


def branch_step(settings, run):
    """Where DSpark branches off DFlash's training (--dspark-init dflash): after total_steps -
    dspark's iters steps, counted across the phases, so that DSpark's steps (the backbone's from
    DFlash, then its own) equal DFlash's. None: no branch (no DSpark stage, DSpark starts from
    scratch, or it gets as many steps as DFlash or more and starts from DFlash's final weights)."""
    dspark = run.settings.get("dspark")
    if dspark is None or dspark.init != "dflash" or dropped(run, "dspark"):
        return None
    n = total_steps(settings, run) - dspark.iters
    return n if n >= 1 else None


def dflash_taps(spec, n_layer, arch="gpt2"):
    """'auto' or '1,3,5' -> a list of target layers."""
    if spec == "auto":
        return draft_dflash.default_taps(n_layer, arch)
    try:
        return [int(t) for t in spec.split(",")]
    except ValueError:
        raise ValueError("--dflash-taps must be 'auto' or comma-separated layer numbers like "
                         f"1,3,5 (got {spec!r})") from None


def network_config(settings, target_cfg, block=None):
    """The DFlash network the settings ask for (also DSpark's backbone: the same shape, so DSpark
    can start from it). The mask slots predict (shift 0), as in the DFlash paper: letting the
    anchor slot predict too (DeepSpec's shift 1) drafted worse (docs/experiments.md: DFlash: the
    masks predict (shift 0))."""
    layers = layers_like(settings, target_cfg)
    return DFlashConfig(n_embd=target_cfg.n_embd, n_head=heads(settings, target_cfg),
                        n_layer=settings.layers, block=block or settings.block,
                        draft_vocab=settings.vocab,
                        taps=dflash_taps(settings.taps, target_cfg.n_layer, layers["arch"]),
                        **layers)


def arch_of(settings, family):
    """--dflash-arch as it resolves: 'auto' is the papers' layers for a Llama-family target (the
    family speculators and vLLM serve drafters for), GPT-2's for a GPT-2 one."""
    return settings.arch if settings.arch != "auto" else ("qwen3" if family == "llama" else "gpt2")


def layers_like(settings, target_cfg):
    """The draft layers' kind and, for the papers' ("qwen3"), their shape: the target's own
    where it is a Llama or a Qwen (its K/V heads and head size where the drafter has its head
    count, its MLP width, RoPE and norm), as speculators builds a drafter from its verifier's
    config; the mask slots take the target's last token id."""
    family = getattr(target_cfg, "family", "gpt2")
    arch = arch_of(settings, family)
    if arch == "gpt2":
        return {"arch": arch}
    shape = {"arch": arch, "mask_token": target_cfg.vocab_size - 1}
    if family == "llama":
        same_heads = heads(settings, target_cfg) == target_cfg.n_head
        shape.update(n_kv_head=target_cfg.n_kv_head if same_heads else None,
                     head_dim=target_cfg.head_dim if same_heads else None,
                     n_hidden=target_cfg.n_hidden, rope_base=target_cfg.rope_theta,
                     rope_scaling=target_cfg.rope_scaling, norm_eps=target_cfg.norm_eps)
    return shape


def heads(settings, target_cfg):
    """The draft layers' attention heads: the setting's, or (none) the target's."""
    return settings.heads or target_cfg.n_head


def anchored(tr, x, t_logits, hid, step, cfg, n_anchors):
    """A training batch for a block drafter: windows x, the target's tapped states on them (the
    context), its logits (the soft labels) and n_anchors random anchors a row. The anchors of
    step s come from a generator seeded with (seed, s), so a resumed run replays them."""
    g = torch.Generator().manual_seed(tr.run.seed * 7_919 + step)
    anchors = tr.per_row(lambda B: sample_anchors(B, x.size(1), n_anchors, cfg.block,
                                                  cfg.shift, g, tr.device), x.size(0))
    return x, {t: hid[t] for t in cfg.taps}, t_logits, anchors


# -----------------------------------------------------------------------------
# the stage


def train(tr, settings):
    """Every phase of training_phases, each starting from the one before -> out/dflash.pt (and
    out/dflash.branch.pt, DSpark's starting point)."""
    run = tr.run
    target, target_ckpt = tr.target()
    cfg = network_config(settings, target.config)
    vocab = tr.distill.frequent(settings.vocab).to(tr.device) if settings.vocab else None
    batches = tr.distill.batches(settings.text, layers=cfg.taps, vocab=vocab)
    plan = training_phases(settings, run)
    fingerprint = {"stage": "dflash", "config": cfg.to_dict(), "target": target_ckpt["model_hash"],
                   "phases": [(p.block, p.anchors, p.steps, p.lr) for p in plan],
                   "text": settings.text, "gen": tr.distill.key(settings.text),
                   "gamma": settings.gamma, "seed": run.seed, "branch": branch_step(settings, run)}
    net, done = None, 0
    for i, phase in enumerate(plan):
        net, val = train_phase(tr, settings, fingerprint, batches, i, phase, net, done, vocab)
        done += phase.steps
    tr.save(cfg.to_dict(), net, {"val_loss": val, "text": settings.text,
                                 "fingerprint": fingerprint})
    return val


def train_phase(tr, settings, fingerprint, batches, i, phase, before, done, vocab=None):
    """Phase i (a BlockPhase), from the network `before` (the previous phase's, or None), after
    `done` steps of the earlier phases -> (its network, its val loss). Every phase but the last
    keeps its resume file when finished: a rerun skips it. vocab: the draft vocabulary's target
    ids, or None."""
    target, n_anchors = tr.target()[0], phase.anchors
    cfg = network_config(settings, target.config, phase.block)
    torch.manual_seed(tr.run.seed + 3)
    net = DFlash(cfg, target).to(tr.device)
    if vocab is not None:
        net.d2t.copy_(vocab)
    if before is not None:
        widen(net, cpu_state_dict(before))
    n_params = sum(p.numel() for p in net.parameters())
    print(f"dflash: {n_params / 1e6:.2f}M trainable parameters, {cfg}, {n_anchors} anchors")

    def loss_of(x, t_logits, hid, step):
        return dflash_loss(net, *anchored(tr, x, t_logits, hid, step, cfg, n_anchors),
                           settings.gamma)

    def after_step(n):
        if done + n == fingerprint["branch"]:  # written once, when reached (a resumed run has it)
            save_checkpoint({"kind": "dflash-branch", "fingerprint": fingerprint,
                             "state_dict": cpu_state_dict(net),
                             "budget": {"steps": done + n, "seconds": tr.elapsed()}},
                            tr.path("dflash.branch"))
    last = i == len(fingerprint["phases"]) - 1
    val = tr.fit(phase.name, net, lambda s: loss_of(*batches(s), s),
                 lambda: tr.val_loss(lambda x, y: loss_of(
                     x, *restricted(*tr.distill.features(x, cfg.taps), vocab), -1)),
                 steps=phase.steps, lr=phase.lr, fingerprint={**fingerprint, "phase": i},
                 tokens_per_step=tr.run.batch_size * n_anchors * phase.block,
                 after_step=after_step, keep_resume=not last).val_loss
    return net, val


def with_arch(values, run):
    """A record of the settings (training.stage.usual_record) with --dflash-arch as it resolves
    for the target's family ('auto' is not what trained)."""
    return {**values, "dflash_arch": arch_of(run.settings["dflash"], run.target_family)}


def records(run):
    """What out/dflash.pt records of the settings (one trained with others is not current)."""
    return with_arch(usual_record(run, "dflash", STAGE), run)


STAGE = Stage(settings=DFlashSettings, phases=phases, train=train,
              step_cost={"dflash-narrow": 0.31, "dflash": 0.30}, reads=("target", "dspark"),
              files=("dflash.branch.pt",),
              records=records)
