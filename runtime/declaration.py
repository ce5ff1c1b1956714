"""
runtime/declaration.py -- what a drafter declares of itself, once, at the end of its lesson file:

    DRAFTER = dict(name="small", network=..., drafter=..., pairs=True)

A plain dict, so that the lesson imports nothing of the machinery: registry/drafters.py reads it
as a Declaration (a field it does not know is one error line) and lists the files; the commands'
names, the loader, train.py's stages and the tests' lists of drafters derive from it.
"""

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Declaration:
    """A drafter, as the rest of the house reads it.

    name      its name on every command line (bench.py --methods, sample.py --method), its
              checkpoint out/<name>.pt and train.py's stage for it (training/stages_<name>.py)
    drafter   drafter(built, target) -> the Drafter that runs it: around what network() built
              from its checkpoint, or None for one that builds nothing, or the partner drafter
              (below) it is built around
    network   network(config, target) -> what its checkpoint's state loads into (its network, or
              the tensors it builds without learning): config is the dict its stage saved; None:
              it has no checkpoint, and no stage
    pairs     whether it can be the learned half of the hybrid (draft_hybrid.py)
    partner   the drafter it is built around unless told (--hybrid-with), or None
    trees     whether tree.BlockTree grows a token tree from its block (sample.py --tree)
    syncs     what it reads back from the device or uploads to it itself, {call: (reads,
              uploads)} per call of the Drafter's (begin, propose, commit or their batch calls,
              whichever it writes), beyond the loop's one read a round: a rule it runs on the
              host (tests/test_device.py counts them)
    """
    name: str
    drafter: Callable
    network: Callable = None
    pairs: bool = False
    partner: str = None
    trees: bool = False
    syncs: dict = None
