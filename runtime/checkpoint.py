"""
runtime/checkpoint.py -- checkpoints: written atomically, loaded safely.

Every checkpoint is a dict {kind, config, state_dict, hashes, step, ...} written by train.py.
This file writes and reads them (torch.load with weights_only=True: a file crafted to run code
when unpickled is refused, not run), and reads a drafter's back, checked to belong to the very
target and tokenizer it is loaded for, as the Drafter its declaration (runtime/declaration.py)
builds. Which drafters there are is not its business: registry/drafters.py lists them and loads
each by name; the target comes back in runtime/target.py.
"""

import hashlib
import os

import torch

from runtime.command import replacing

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


def load_drafter_checkpoint(path, name, target_ckpt, sampling="greedy"):
    """A drafter's checkpoint (written by train.py's stage `name`), checked to belong to this very
    target and tokenizer. For coupled and rejection sampling its weights are its sampling weights
    where it has them (DSpark's 'sampled' entry, training/stages_dspark.py). -> (the checkpoint,
    what its training cost: [{steps, seconds}], a warm start's first)."""
    ckpt = load_checkpoint(path, name, stage=name)
    for what, key, want in (("target", "target_hash", target_ckpt["model_hash"]),
                            ("tokenizer", "tokenizer_hash", target_ckpt["tokenizer_hash"])):
        if ckpt.get(key) != want:
            raise CheckpointError(f"{path} was trained against {what} {str(ckpt.get(key))[:16]} "
                                  f"but the current {what} is {str(want)[:16]}: "
                                  f"run `python train.py --only {name} --force` to retrain it")
    tuned = ckpt.get("sampled") if sampling != "greedy" else None
    budget = [b for b in (ckpt.get("init_budget"), ckpt.get("budget"), tuned and tuned["budget"])
              if b]
    if tuned:
        ckpt = {**ckpt, "state_dict": tuned["state_dict"]}
    return ckpt, budget


def load_trained(declared, path, target, target_ckpt, device="cpu", dtype=torch.float32,
                 sampling="greedy"):
    """A trained drafter back from its checkpoint at `path`: what its declaration
    (runtime/declaration.py) builds from the checkpoint's config, its state loaded in (a network:
    its weights, moved to `device` in `dtype`, in eval mode; anything else with a
    load_state_dict, a datastore say, as it is), and the Drafter around it, its training's cost
    in drafter.budget."""
    ckpt, budget = load_drafter_checkpoint(path, declared.name, target_ckpt, sampling)
    try:
        built = declared.network(ckpt["config"], target)
        built.load_state_dict(ckpt["state_dict"])
        if isinstance(built, torch.nn.Module):
            built = built.to(device=device, dtype=dtype).eval()
        drafter = declared.drafter(built, target)
    except (RuntimeError, ValueError, TypeError) as e:  # another layout: names, config fields
        raise CheckpointError(f"{path} does not fit its config ({str(e).splitlines()[0][:120]}); "
                              f"run `python train.py --only {declared.name} --force`") from None
    drafter.budget = budget  # what its training cost
    return drafter
