"""
runtime/target.py -- the target back from out/target.pt: the model its config describes (GPT-2's,
gpt.py, or the Llama family's, llama.py), its weights, on a device, with the CPU's faster kernels
as every model the commands load. train.py's drafter stages read it frozen; bench.py and sample.py
decode with it. Its stage, which writes the file, is training/stages_target.py.
"""

import torch

from gpt import GPT, GPTConfig
from llama import Llama, LlamaConfig
from runtime import cpu_speed
from runtime.checkpoint import CheckpointError, load_checkpoint
from runtime.devices import check_dtype


def target_of(config):
    """The target a checkpoint's config describes: llama.Llama where it names that family (a
    Llama or Qwen folder's import), else gpt.GPT."""
    if config.get("family") == LlamaConfig.family:
        return Llama(LlamaConfig.from_dict(config))
    return GPT(GPTConfig.from_dict(config))


def load_target(path, device="cpu", dtype=torch.float32):
    """The trained target, in eval mode, plus its checkpoint dict (for the hashes). With the CPU's
    faster kernels (runtime/cpu_speed.py), as every model the commands load."""
    check_dtype(device, dtype)
    ckpt = load_checkpoint(path, "target")
    try:
        model = target_of(ckpt["config"])
        model.load_state_dict(ckpt["state_dict"])
    except (RuntimeError, ValueError, TypeError) as e:  # another layout: names, config fields
        raise CheckpointError(f"{path} does not match its own config ({str(e).splitlines()[0]}); "
                              "run `python train.py --only target --force`") from None
    return cpu_speed.speed_up(model.to(device=device, dtype=dtype).eval()), ckpt
