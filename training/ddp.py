"""
training/ddp.py -- one training run across several processes: torchrun and DistributedDataParallel.

train.py trains every stage in one process; this file adds what it takes for N processes
(`torchrun --standalone --nproc_per_node=N train.py`, one per GPU, or CPU processes on gloo) to
be that same run, data-parallel:

- World: which process this is. torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them
  the world is one process and nothing here does anything (a plain `python train.py` behaves
  exactly as it did before this file existed).
- Each optimizer step is the preset's global batch (--batch-size) split into world x
  --grad-accum equal shards (`shard`): rank r's micro-step m takes rows
  [(m * world + r) * s, ... + s) of the very batch one process would draw for that step. DDP
  averages the gradients over the ranks, and each micro loss is divided by --grad-accum, so the
  step is the one process's step on the whole batch (tests/test_ddp.py: float64, 1e-10).
- Rank 0 alone writes files (checkpoint.save_checkpoint returns at once on the other ranks) and prints;
  the others wait
  at a barrier where they would read what it wrote.
- The distillation set is written in shards, one per rank, and gathered (gather_rows).
- A rank that fails prints one `error: rank R of N: ...` line and exits; torchrun then stops the
  others, so the run ends instead of hanging (and a rerun resumes from rank 0's resume files).
"""

import datetime
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

from runtime import command

# -----------------------------------------------------------------------------
# the world: this process's rank among how many


class World:
    def __init__(self, rank=0, size=1, local_rank=0):
        self.rank, self.size, self.local_rank = rank, size, local_rank

    @property
    def main(self):
        return self.rank == 0

    def __repr__(self):
        return f"rank {self.rank} of {self.size}"


def world_of_env():
    """The World torchrun describes in the environment (one process without it)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return World()
    return World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                 int(os.environ.get("LOCAL_RANK", 0)))


def start(world, device):
    """Join the process group (NCCL on CUDA, gloo otherwise) -> this rank's device. A rank that
    waits on the others for 2 hours fails instead of waiting for ever (the other ranks wait for
    rank 0 while it builds the token files: minutes on a large --data)."""
    if world.size == 1:
        return device
    if device.startswith("mps"):
        raise ValueError("torchrun on an Apple GPU: gloo, the backend there, cannot carry MPS "
                         "tensors; train in one process (python train.py)")
    if device.startswith("cuda"):
        device = f"cuda:{world.local_rank}"
        torch.cuda.set_device(device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
    return device


def barrier(world):
    if world.size > 1:
        dist.barrier()


def stop(world):
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


# what the backends say when the process at the other end of a collective is gone
LOST = ("closed by peer", "Connection reset", "NCCL communicator was aborted", "Broken pipe")


def fail(world, e, shared):
    """End this rank on exception e with at most one line for the whole run, exit status 1.
    shared: an error every rank meets alike (a setting, a file, the loss: every rank has the same
    ones), which rank 0 reports for all; another rank reports it only if the run is still going
    5 seconds later (its error was its own). A collective that failed because another rank had
    already stopped says nothing: that rank's line says why."""
    command.ending()  # torchrun's SIGTERM, once rank 0 has spoken, ends this rank quietly
    text = str(e).strip()
    if any(s in text for s in LOST):
        raise SystemExit(1)
    if shared and not world.main:
        time.sleep(5)  # rank 0's exit makes torchrun stop this rank first
    first = text.splitlines()[0] if text else ""
    line = str(e) if shared else f"{type(e).__name__}: {first}"
    print(f"error: {world}: {line}", file=sys.stderr, flush=True)
    raise SystemExit(1)


# -----------------------------------------------------------------------------
# the batch, split: which rows of a step's global batch a micro-step of this rank takes


def shard(world, accum, batch_size, micro):
    """The slice of the global batch's rows that rank `world.rank` takes in micro-step `micro` of
    `accum`, or None for all of them (one process, no accumulation)."""
    parts = world.size * accum
    if parts == 1:
        return None
    rows = batch_size // parts
    first = (micro * world.size + world.rank) * rows
    return slice(first, first + rows)


def check_split(world, accum, batch_size):
    if batch_size % (world.size * accum):
        raise ValueError(f"--batch-size {batch_size} does not split into {world.size} processes x "
                         f"--grad-accum {accum} equal shards: make it a multiple of "
                         f"{world.size * accum}")


# -----------------------------------------------------------------------------
# one optimizer step's gradients, over the ranks and the micro-steps


class LossOf(nn.Module):
    """module with loss_fn as its forward: what DDP wraps, so that the gradients of every
    parameter loss_fn reaches through `module` are averaged over the ranks in backward."""

    def __init__(self, module, loss_fn):
        super().__init__()
        self.module, self.loss_fn = module, loss_fn

    def forward(self, step):
        return self.loss_fn(step)


def wrap(world, module, loss_fn):
    """step -> loss: loss_fn itself in one process, else through DistributedDataParallel."""
    if world.size == 1:
        return loss_fn
    # every trainable parameter of every phase takes part in its loss: no search for unused ones
    return nn.parallel.DistributedDataParallel(LossOf(module, loss_fn))


def sync_if_last(forward, micro, accum):
    """The context of micro-step `micro` of `accum`: under DDP, no gradient all-reduce but on the
    last one (the gradients of the others add up locally first); nothing in one process."""
    if micro == accum - 1 or not isinstance(forward, nn.parallel.DistributedDataParallel):
        return nullcontext()
    return forward.no_sync()


def mean(world, value):
    """A float's mean over the ranks (itself in one process)."""
    if world.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return t.item() / world.size


# -----------------------------------------------------------------------------
# work split by rows and gathered: the distillation set


def my_rows(world, n):
    """The contiguous rows [lo, hi) of n that this rank computes (equal counts but the last)."""
    per = -(-n // world.size)
    return min(n, world.rank * per), min(n, (world.rank + 1) * per)


def gather_rows(world, rows, n):
    """Every rank's my_rows(world, n) block of rows (a (hi - lo, ...) tensor) -> all n rows, in
    order, on every rank."""
    if world.size == 1:
        return rows
    per = -(-n // world.size)
    padded = torch.zeros((per, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    padded[:len(rows)] = rows
    out = [torch.empty_like(padded) for _ in range(world.size)]
    dist.all_gather(out, padded)
    return torch.cat(out)[:n]
