"""
registry/drafters.py -- every drafter of the house, one line each, and what derives from the list.

A drafter declares itself once, in its own files. Its lesson file (draft_<name>.py) ends with
DRAFTER, a runtime.declaration.Declaration: its name, what it builds from its checkpoint, the
Drafter that runs it. If it has a checkpoint, its stage file (training/stages_<name>.py) ends with
STAGE, a training.stage.Stage: its settings and their defaults, its phases, how it trains, what a
step costs. The list below pairs the two, with the serving rule that decides its batches where
it has one (serving/batched.py) and the start-up profile that readies it where it weighs seconds.

From the list come train.py's stages (and --only, and their flags), bench.py's --methods,
sample.py's --method, --hybrid-with, the one loader of every drafter's checkpoint, what drafts a
batch, and the tests' lists of drafters. The list is built and checked when a
command first asks for it (drafters()): a line that misses a piece is one `error:` line there.
Adding a drafter: its lesson file, its stage file if it has a checkpoint, its line below (with its
import), and its own test (README: Adding a drafter of your own).
"""

import dataclasses
import functools
import os

import torch

import draft_dflash
import draft_dspark
import draft_eagle
import draft_hybrid
import draft_lookup
import draft_mtp
import draft_small
from runtime.declaration import Declaration
from runtime import cpu_speed
from runtime.checkpoint import load_trained
from runtime.profiling import profile_dspark, profile_hybrid
from runtime.settings import settings_of
from serving.batched import Measured
from training import (stages_dflash, stages_dspark, stages_eagle, stages_mtp, stages_small,
                      stages_target)
from training.stage import Stage


class RegistryError(ValueError):
    """A drafter's files lack something the house needs (the message names it): raised where a
    command first asks for the list, and shown as one `error:` line, as any setting it refuses."""


class Entry:
    """One drafter of the house: its lesson file, its stage file (None: it has no checkpoint to
    write), its serving rule (serving/batched.py: what decides its batches in the serving sweep;
    None: the drafter itself, speculative.Drafter's batch calls), whether it batches at all
    (False: it drafts for one request at a time) and ready(drafter), the start-up profile that
    readies it on the device in use, where it weighs seconds."""

    def __init__(self, lesson, stages=None, rule=None, batched=True, ready=None):
        self.declared = declared(lesson)
        self.stage = None if stages is None else getattr(stages, "STAGE", None)
        where = None if stages is None else stages.__name__.replace(".", "/") + ".py"
        if stages is not None and not isinstance(self.stage, Stage):
            raise RegistryError(f"{where} declares no STAGE: end it with STAGE = training.stage."
                                "Stage(settings=..., phases=..., train=..., step_cost=...) "
                                "(README: Adding a drafter of your own)")
        if (self.declared.network is None) != (self.stage is None):
            raise RegistryError(f"{self.declared.name}: a drafter whose checkpoint holds what it "
                                "built (its network) has a stage that writes it, and one without "
                                "has none: give its line both its network and its stage, or "
                                "neither")
        if self.stage is not None:
            check_settings(where, self.stage.settings)
        self.lesson, self.rule, self.batched, self.ready = lesson, rule, batched, ready

    @property
    def name(self):
        return self.declared.name


def declared(lesson):
    """A lesson file's DRAFTER = dict(name=..., drafter=..., ...), as a Declaration (what each
    field means: runtime/declaration.py)."""
    fields = getattr(lesson, "DRAFTER", None)
    if not isinstance(fields, dict):
        raise RegistryError(f"{lesson.__name__}.py declares no DRAFTER: end it with DRAFTER = "
                            "dict(name=..., drafter=..., ...) (README: Adding a drafter of your "
                            "own)")
    try:
        return Declaration(**fields)
    except TypeError as e:  # a field it does not know, or one it lacks
        raise RegistryError(f"{lesson.__name__}.py's DRAFTER: {str(e).replace('__init__()', 'it')} "
                            "(runtime/declaration.py says what it holds)") from None


def check_settings(where, cls):
    """A stage's settings, checked before anything trains: a dataclass of setting() fields (each
    with its help, its default and what each preset changes: train.py's flags)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise RegistryError(f"{where}: its settings {getattr(cls, '__name__', cls)} are not a "
                            "dataclass: write @dataclass above the class (README: Adding a "
                            "drafter of your own)")
    try:
        settings_of(cls)
    except TypeError as e:
        raise RegistryError(f"{where}: {e}") from None


def listed():
    """Every drafter of the house, one line each, in reading order: train.py trains them, and
    bench.py shows them, in this order."""
    return [
        Entry(draft_small, stages_small),
        Entry(draft_mtp, stages_mtp),
        Entry(draft_eagle, stages_eagle),
        Entry(draft_dflash, stages_dflash),
        Entry(draft_dspark, stages_dspark, Measured, ready=profile_dspark),
        Entry(draft_lookup),
        Entry(draft_hybrid, batched=False, ready=profile_hybrid),
    ]


def check(entries):
    """What no single line can see: each name a plain one (a Python name in lower case: it makes
    flags, files and test names) used once, not the target's or plain decoding's (bench.py's
    "ar"), and every drafter a line refers to (the stage it builds on, the partner it is built
    around) listed before it."""
    seen = {}
    for e in entries:
        name = e.name
        if not (name.isidentifier() and name == name.lower()) or name in ("target", "ar"):
            raise RegistryError(f"{name!r} cannot name a drafter: use a lower-case Python name, "
                                "not 'target' or 'ar'")
        if name in seen:
            raise RegistryError(f"two drafters are named {name!r} ({seen[name].lesson.__name__}.py "
                                f"and {e.lesson.__name__}.py): give each its own name")
        builds_on = e.stage.builds_on if e.stage else None
        if builds_on is not None and (seen.get(builds_on) is None or seen[builds_on].stage is None):
            raise RegistryError(f"{name}'s stage builds on {builds_on!r}, which is no learned "
                                "drafter listed before it")
        partner = e.declared.partner
        if partner is not None and (seen.get(partner) is None or not seen[partner].declared.pairs):
            raise RegistryError(f"{name} is built around {partner!r}, which is no drafter listed "
                                "before it that pairs (Declaration(pairs=True))")
        seen[name] = e


@functools.cache
def drafters():
    """The list, checked: built when a command first asks for it, so that a line that misses a
    piece is one RegistryError there (and asked again, raised again)."""
    entries = listed()
    check(entries)
    return entries


# -----------------------------------------------------------------------------
# what derives from the list


def names():
    """Every drafter's name, in the list's order."""
    return [e.name for e in drafters()]


def entry(name):
    """A drafter's entry by name; an unknown name is one ValueError listing the registered."""
    found = [e for e in drafters() if e.name == name]
    if not found:
        raise ValueError(f"unknown drafter {name!r}: choose from {', '.join(names())}")
    return found[0]


def stages():
    """{name: training.stage.Stage} of train.py: the target's, then every drafter that learns."""
    return {"target": stages_target.STAGE, **{e.name: e.stage for e in drafters() if e.stage}}


def partners():
    """The drafters another can be built around (the hybrid's learned half: --hybrid-with)."""
    return [e.name for e in drafters() if e.declared.pairs]


def tree_drafters():
    """The drafters tree.BlockTree grows a token tree from (sample.py --tree, bench.py's trees)."""
    return [e.name for e in drafters() if e.declared.trees]


def built_around():
    """The drafters built around a partner (those --hybrid-with applies to)."""
    return [e.name for e in drafters() if e.declared.partner]


def default_partner():
    """The partner the first drafter built around one takes unless told (--hybrid-with)."""
    return next((e.declared.partner for e in drafters() if e.declared.partner), None)


def load_drafter(name, out_dir, target, target_ckpt, device="cpu", dtype=torch.float32,
                 sampling="greedy", partner=None):
    """A drafter by name, for `target`, on `device` in `dtype`, ready to run: a trained one from
    out_dir/<name>.pt, checked to belong to this very target and tokenizer (for sampling, with its
    sampling weights where it has them); one with no network built; one built around a partner
    (the hybrid), around that one, loaded the same way (`partner`, else its own). Then its
    start-up profile, where it weighs seconds, on the device in use."""
    e = entry(name)
    d = e.declared
    if d.partner is not None:
        partner = partner or d.partner
        if partner not in partners():
            raise ValueError(f"the {name} drafter is built around a learned drafter, not "
                             f"{partner!r}: choose from {', '.join(partners())}")
        learned = load_drafter(partner, out_dir, target, target_ckpt, device, dtype, sampling)
        drafter = d.drafter(learned, target)
        drafter.budget = learned.budget
    elif d.network is None:
        drafter = d.drafter(None, target)
    else:  # with the CPU's faster kernels, as every model the commands load
        drafter = cpu_speed.speed_up(load_trained(d, os.path.join(out_dir, f"{name}.pt"), target,
                                                  target_ckpt, device, dtype, sampling))
    if e.ready is not None:
        e.ready(drafter)
    return drafter


def batched(drafter):
    """What decodes a batch for this drafter in the serving sweep (serving/batched.serve runs
    it): its line's serving rule around it, else the drafter itself (speculative.Drafter's batch
    calls)."""
    e = next((e for e in drafters() if e.name == drafter.name), None)
    if e is not None and not e.batched:
        raise NotImplementedError(f"the {e.name} drafts one request at a time (batch 1)")
    if e is not None and e.rule is not None:
        return e.rule(drafter)
    return drafter
