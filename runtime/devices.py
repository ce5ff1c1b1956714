"""
runtime/devices.py -- which device to run on, what it can do, and waiting for it before reading a
clock.

The lesson files never ask where they run: the commands (train.py, bench.py, sample.py) pick the
device here, once, and hand the models to it.
"""

import time

import torch


def pick_device(name="auto"):
    """'auto' -> cuda if present, else mps if it works, else cpu. Anything else must exist here:
    cpu, cuda or cuda:N (N below the number of GPUs), mps or mps:0. One clear ValueError if not,
    rather than a traceback from the first tensor put on it."""
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is not None and dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n and (dev.index is None or dev.index < n):
            return name
        if n:
            have = f"this machine has {n} CUDA device{'s' if n > 1 else ''} (cuda:0..cuda:{n - 1})"
        else:
            have = "this machine has no CUDA device"
        raise ValueError(f"device {name!r} is not available here: {have}; use --device cpu, "
                         "or auto to pick the best one")
    if dev is not None and (dev.type == "cpu" or (dev.type == "mps" and mps
                                                  and dev.index in (None, 0))):
        return name
    raise ValueError(f"device {name!r} is not available here: use --device cpu, "
                     "or auto to pick the best one")


def fast_bf16(device):
    """Does bfloat16 autocast speed training up on this device? CUDA: if the GPU has bfloat16.
    CPU: measured, not assumed -- a (256 x 1024) @ (1024 x 1024) product in both dtypes, the
    fastest of a few tries each: CPUs with AVX512-BF16 or AMX run it about twice as fast, CPUs
    without emulate bfloat16 and would be slower (docs/experiments.md: bfloat16). MPS: no."""
    if str(device).startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    if str(device) != "cpu":
        return False
    # the two dtypes take turns, so a busy moment slows both alike (timed one after the other, a
    # burst of other work during the bfloat16 tries once sent a whole run to float32)
    pairs = {dt: (torch.randn(256, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt))
             for dt in (torch.bfloat16, torch.float32)}
    best = {dt: float("inf") for dt in pairs}
    for _ in range(8):
        for dt, (a, b) in pairs.items():
            t0 = time.perf_counter()
            a @ b
            best[dt] = min(best[dt], time.perf_counter() - t0)
    return best[torch.bfloat16] < 0.7 * best[torch.float32]


def allow_tf32(device):
    """On CUDA, let the float32 matmuls autocast leaves in float32 use TF32 tensor cores (what
    every GPU training recipe does). CPU and MPS: untouched, so CPU runs stay bit-identical.
    Returns whether it was switched on."""
    if not str(device).startswith("cuda"):
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def check_dtype(device, dtype):
    """A dtype the device cannot hold is one clear ValueError, before any weights load."""
    if torch.device(device).type == "mps" and dtype == torch.float64:
        raise ValueError("float64 is not supported on mps (Apple GPUs have no float64): "
                         "use --dtype float32, or --device cpu for float64")


def synchronize(device):
    """Wait for the queued GPU work of `device` (a str like 'cuda:1' or 'mps:0', or a torch.device)
    before reading a clock; a no-op on CPU. The device type decides, never the exact string:
    tensors on a Mac report 'mps:0', and torch.cuda.synchronize() alone waits on the current GPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()
