"""
runtime/checkpoint.py -- checkpoints: written atomically, loaded safely, and the trained models
back.

Every checkpoint is a dict {kind, config, state_dict, hashes, step, ...} written by train.py.
This file writes and reads them (torch.load with weights_only=True: a file crafted to run code
when unpickled is refused, not run), loads the target, and loads any drafter by name, checked to
belong to that very target and tokenizer. The loaded models get the CPU's fast kernels
(cpu_speed.speed_up), every model alike.
"""

import hashlib
import os
import re

import torch

from runtime import cpu_speed
from runtime import profiling
from runtime.command import replacing
from runtime.devices import check_dtype, synchronize
from gpt import GPT, GPTConfig
from llama import Llama, LlamaConfig
from draft_dflash import DFlash, DFlashConfig, DFlashDrafter
from draft_dspark import DSpark, DSparkConfig, DSparkDrafter
from draft_eagle import Eagle, EagleConfig, EagleDrafter
from draft_hybrid import HybridDrafter
from draft_lookup import LookupDrafter
from draft_mtp import MTP, MTPConfig, MTPDrafter
from draft_small import DraftModel

# -----------------------------------------------------------------------------
# checkpoints: {kind, config dict, plain state_dict, hashes, step, ...}, written atomically


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not belong with the others."""


def state_hash(state_dict):
    """A short content hash of a state_dict: drafters record the hash of the target they were
    trained against, so a retrained target can never be silently paired with an old drafter."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(obj, path):
    """torch.save to a temp file in the same folder, then rename: a run killed mid-write
    leaves the previous file intact, never a half-written one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return  # one run over several processes (training/ddp.py): rank 0 alone writes files
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder where a checkpoint is written; move it away")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replacing(path) as tmp:
        torch.save(obj, tmp)


def load_checkpoint(path, kind, stage=None):
    """Load a checkpoint of the given kind with weights_only=True (a file crafted to run code
    when unpickled is refused, not run). Every failure is one clear CheckpointError."""
    stage = stage or kind
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder, not a checkpoint: move it away and run "
                              f"`python train.py --only {stage}`")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} not found: run `python train.py --only {stage}` "
                              "(or plain `python train.py`) to make it")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupted, or no checkpoint at all (a pickle with code)
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable nanospec checkpoint ({first}); "
                              f"delete it and run `python train.py --only {stage}`") from None
    if not isinstance(ckpt, dict) or ckpt.get("kind") != kind or "state_dict" not in ckpt:
        found = ckpt.get("kind") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{path} is not a {kind} checkpoint (found {found!r}); "
                              f"run `python train.py --only {stage} --force` to remake it")
    return with_current_names(ckpt)


def with_current_names(ckpt):
    """A checkpoint written before the lesson's two renames, read with today's names: the context
    window (a config's block_size, now sequence_len) and an MTP module's transformer layer (its
    weights under mods.<i>.block., now mods.<i>.layer.). Today's checkpoints pass unchanged."""
    cfg = ckpt.get("config")
    if isinstance(cfg, dict) and "block_size" in cfg:
        ckpt["config"] = {("sequence_len" if k == "block_size" else k): v for k, v in cfg.items()}
    old = re.compile(r"(^|\.)mods\.(\d+)\.block\.")
    if any(old.search(k) for k in ckpt["state_dict"]):
        ckpt["state_dict"] = {old.sub(r"\1mods.\2.layer.", k): v
                              for k, v in ckpt["state_dict"].items()}
    return ckpt


def cpu_state_dict(module):
    """A plain state_dict on the CPU: what every checkpoint holds, loadable on any device."""
    return cpu_tree(module.state_dict())


def cpu_tree(obj):
    """obj (e.g. an optimizer's state_dict) with every tensor in it moved to the CPU, so a
    checkpoint written on a GPU holds nothing that loads back onto that GPU."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: cpu_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_tree(v) for v in obj)
    return obj


def target_of(config):
    """The target a checkpoint's config describes: llama.Llama where it names that family (a
    Llama or Qwen folder's import), else gpt.GPT."""
    if config.get("family") == LlamaConfig.family:
        return Llama(LlamaConfig.from_dict(config))
    return GPT(GPTConfig.from_dict(config))


def load_target(path, device="cpu", dtype=torch.float32):
    """The trained target, in eval mode, plus its checkpoint dict (for the hashes)."""
    check_dtype(device, dtype)
    ckpt = load_checkpoint(path, "target")
    model = target_of(ckpt["config"])
    try:
        model.load_state_dict(ckpt["state_dict"])
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not match its own config ({str(e).splitlines()[0]}); "
                              "run `python train.py --only target --force`") from None
    return cpu_speed.speed_up(model.to(device=device, dtype=dtype).eval()), ckpt


# -----------------------------------------------------------------------------
# the drafters: each one's network back from its checkpoint (already checked to belong to this
# target), on the target's device and in its dtype


def load_small(ckpt, target, device, dtype):
    model = GPT(GPTConfig.from_dict(ckpt["config"]))
    model.load_state_dict(ckpt["state_dict"])
    return DraftModel(model.to(device=device, dtype=dtype).eval())


def load_mtp(ckpt, target, device, dtype):
    cfg = MTPConfig.from_dict(ckpt["config"])
    tc = target.config
    if (cfg.n_embd, cfg.n_head, cfg.sequence_len) != (tc.n_embd, tc.n_head, tc.sequence_len):
        raise RuntimeError(f"MTP config {cfg} does not fit the target {tc}")
    mtp = MTP(cfg)
    mtp.load_state_dict(ckpt["state_dict"])
    return MTPDrafter(mtp.to(device=device, dtype=dtype).eval(), target)


def load_eagle(ckpt, target, device, dtype):
    cfg = EagleConfig.from_dict(ckpt["config"])
    tc = target.config
    if ((cfg.n_embd, cfg.n_head, cfg.sequence_len) != (tc.n_embd, tc.n_head, tc.sequence_len)
            or not all(1 <= t <= tc.n_layer for t in cfg.taps)):
        raise RuntimeError(f"EAGLE config {cfg} does not fit the target {tc}")
    net = Eagle(cfg)
    net.load_state_dict(ckpt["state_dict"])
    return EagleDrafter(net.to(device=device, dtype=dtype).eval(), target)


def load_dflash(ckpt, target, device, dtype):
    net = DFlash(DFlashConfig.from_dict(ckpt["config"]), target)
    net.load_state_dict(ckpt["state_dict"])
    return DFlashDrafter(net.to(device=device, dtype=dtype).eval())


def load_dspark(ckpt, target, device, dtype):
    backbone_cfg = DFlashConfig.from_dict(ckpt["config"]["backbone"])
    spark = DSpark(backbone_cfg, DSparkConfig(**ckpt["config"]["dspark"]), target)
    spark.load_state_dict(ckpt["state_dict"])
    return DSparkDrafter(spark.to(device=device, dtype=dtype).eval())


DRAFTERS = {  # name -> (its loader, checkpoint file in out/, train.py stage that makes it)
    "small": (load_small, "small.pt", "small"),
    "mtp": (load_mtp, "mtp.pt", "mtp"),
    "eagle": (load_eagle, "eagle.pt", "eagle"),
    "dflash": (load_dflash, "dflash.pt", "dflash"),
    "dspark": (load_dspark, "dspark.pt", "dspark"),
    "lookup": (None, None, None),  # prompt lookup: nothing to train, nothing to load
    # prompt lookup and a learned drafter (HYBRID_WITH unless told), chosen round by round: no
    # weights of its own, the learned one's checkpoint
    "hybrid": (None, None, None),
}
HYBRID_WITH = "dspark"  # the learned drafter the hybrid pairs with the lookup: the strongest one


def load_drafter(name, out_dir, target, target_ckpt, device="cpu", dtype=torch.float32,
                 sampling="greedy", hybrid_with=HYBRID_WITH):
    """A drafter by name, for `target`, on `device` in `dtype`, ready to run: a trained one
    is checked to belong to this very target and tokenizer; one without weights (prompt lookup)
    is simply built. sampling: the mode it will draft in; a checkpoint with sampling weights
    (DSpark's 'sampled' entry, stages.sampling_weights) loads those for coupled and rejection
    sampling. hybrid_with: the learned drafter the hybrid pairs with prompt lookup. The drafters
    that weigh seconds (DSpark, the hybrid) are profiled here, on the device in use."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: choose from {', '.join(DRAFTERS)}")
    if name == "lookup":
        return LookupDrafter(target.config.vocab_size)
    if name == "hybrid":
        if hybrid_with not in DRAFTERS or hybrid_with in ("lookup", "hybrid"):
            raise ValueError(f"the hybrid pairs prompt lookup with a learned drafter, not "
                             f"{hybrid_with!r}: choose from "
                             f"{', '.join(n for n in DRAFTERS if n not in ('lookup', 'hybrid'))}")
        learned = load_drafter(hybrid_with, out_dir, target, target_ckpt, device, dtype, sampling)
        hybrid = HybridDrafter(learned, target, costs=profiling.profile_hybrid(learned, target))
        hybrid.budget = learned.budget
        return hybrid
    load, fname, stage = DRAFTERS[name]
    path = os.path.join(out_dir, fname)
    ckpt = load_checkpoint(path, name, stage=stage)
    for what, key, want in (("target", "target_hash", target_ckpt["model_hash"]),
                            ("tokenizer", "tokenizer_hash", target_ckpt["tokenizer_hash"])):
        if ckpt.get(key) != want:
            raise CheckpointError(f"{path} was trained against {what} {str(ckpt.get(key))[:16]} "
                                  f"but the current {what} is {str(want)[:16]}: "
                                  f"run `python train.py --only {stage} --force` to retrain it")
    tuned = ckpt.get("sampled") if sampling != "greedy" else None
    if tuned:
        ckpt = {**ckpt, "state_dict": tuned["state_dict"]}
    try:
        drafter = cpu_speed.speed_up(load(ckpt, target, device, dtype))
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not fit its config ({str(e).splitlines()[0][:120]}); "
                              f"run `python train.py --only {stage} --force`") from None
    if isinstance(drafter, DSparkDrafter):
        drafter.sync = lambda: synchronize(device)
        profiling.profile_dspark(drafter)
    # what its training cost
    drafter.budget = [b for b in (ckpt.get("init_budget"), ckpt.get("budget"),
                                  tuned and tuned["budget"]) if b]
    return drafter
