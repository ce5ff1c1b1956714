"""
registry/drafters.py -- every drafter of the house, one line each, and what derives from the list.

A drafter declares itself once, in its own files. Its lesson file (draft_<name>.py) ends with
DRAFTER, a speculative.Declaration: its name, its network back from a checkpoint, the Drafter
that runs it. If it learns, its stage file (training/stages_<name>.py) ends with STAGE, a
training.stage.Stage: its settings and their defaults, its phases, how it trains, what a step
costs. The list below pairs the two, with the batched twin that drafts for many requests at once
where serving/ has one, and the start-up profile that readies it where it weighs seconds.

From the list come train.py's stages (and --only, and their flags), bench.py's --methods,
sample.py's --method, --hybrid-with, the one loader of every drafter's checkpoint, the batched
twin or its fallback, and the tests' lists of drafters. Adding a drafter: its lesson file, its
stage file if it learns, its line below (with its import), and its own test (README: Adding a
drafter of your own).
"""

import ast
import dataclasses
import inspect
import os

import torch

import draft_dflash
import draft_dspark
import draft_eagle
import draft_hybrid
import draft_lookup
import draft_mtp
import draft_small
from runtime import cpu_speed
from runtime.checkpoint import load_trained
from runtime.profiling import profile_dspark, profile_hybrid
from runtime.settings import settings_of
from serving.dflash import BatchDFlash, BatchDSpark
from serving.drafters import BatchMTP, BatchSmall, PerRow
from speculative import Declaration
from training import (stages_dflash, stages_dspark, stages_eagle, stages_mtp, stages_small,
                      stages_target)
from training.stage import Stage


class RegistryError(Exception):
    """A drafter's files lack something the house needs (the message names it)."""


class Entry:
    """One drafter of the house: its lesson file, its stage file (None: it does not learn), its
    batched twin (serving/: PerRow, one copy of it a row, unless it has its own; None: it drafts
    for one request at a time) and ready(drafter), the start-up profile that readies it on the
    device in use, where it weighs seconds."""

    def __init__(self, lesson, stages=None, batched=PerRow, ready=None):
        self.declared = getattr(lesson, "DRAFTER", None)
        if not isinstance(self.declared, Declaration):
            raise RegistryError(f"{lesson.__name__}.py declares no DRAFTER: end it with DRAFTER = "
                                "speculative.Declaration(name=..., drafter=..., ...) (README: "
                                "Adding a drafter of your own)")
        self.stage = None if stages is None else getattr(stages, "STAGE", None)
        if stages is not None and not isinstance(self.stage, Stage):
            raise RegistryError(f"{stages.__name__.replace('.', '/')}.py declares no STAGE: end "
                                "it with STAGE = training.stage.Stage(settings=..., phases=..., "
                                "train=..., step_cost=...) (README: Adding a drafter of your own)")
        if (self.declared.network is None) != (self.stage is None):
            raise RegistryError(f"{self.declared.name}: a drafter with a network learns it in a "
                                "stage, and one without has none to learn: give its line "
                                "both its network and its stage, or neither")
        if self.stage is not None:
            check_stage(self.declared.name, stages, self.stage)
        self.lesson, self.batched, self.ready = lesson, batched, ready

    @property
    def name(self):
        return self.declared.name


def check_stage(name, stages, stage):
    """What a stage file must hold for train.py, checked before anything trains: its settings a
    dataclass of setting() fields among them `iters` and `lr` (training/stage.py), and every
    out/<name>.pt it saves named after its drafter (a save's name read from its source)."""
    where, cls = stages.__name__.replace(".", "/") + ".py", stage.settings
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise RegistryError(f"{where}: its settings {getattr(cls, '__name__', cls)} are not a "
                            "dataclass: write @dataclass above the class (README: Adding a "
                            "drafter of your own)")
    try:
        fields = {n for n, _ in settings_of(cls)}
    except TypeError as e:
        raise RegistryError(f"{where}: {e}") from None
    missing = [f for f in ("iters", "lr") if f not in fields]
    if missing:
        raise RegistryError(f"{where}: {cls.__name__} has no {' and no '.join(missing)}: every "
                            "stage's settings name its steps `iters` and its peak learning rate "
                            "`lr` (train.py records the one and names the other's flag)")
    for saved in saved_names(stages):
        if saved != name:
            raise RegistryError(f"{where} saves {saved!r}, but the drafter is {name!r}: write "
                                f"tr.save({name!r}, ...) (its checkpoint is out/{name}.pt)")


def saved_names(module):
    """The literal names a stage file passes to tr.save(name, ...)."""
    tree = ast.parse(inspect.getsource(module))
    return [node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "save" and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)]


def listed():
    """Every drafter of the house, one line each, in reading order: train.py trains them, and
    bench.py shows them, in this order."""
    return [
        Entry(draft_small, stages_small, BatchSmall),
        Entry(draft_mtp, stages_mtp, BatchMTP),
        Entry(draft_eagle, stages_eagle, BatchMTP),
        Entry(draft_dflash, stages_dflash, BatchDFlash),
        Entry(draft_dspark, stages_dspark, BatchDSpark, ready=profile_dspark),
        Entry(draft_lookup),
        Entry(draft_hybrid, batched=None, ready=profile_hybrid),
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


try:  # a line that misses a piece: every command ends at its first import, in that one line
    DRAFTERS = listed()
    check(DRAFTERS)
except RegistryError as e:
    raise SystemExit(f"error: {e}") from None
BY_NAME = {e.name: e for e in DRAFTERS}


# -----------------------------------------------------------------------------
# what derives from the list


def names():
    """Every drafter's name, in the list's order."""
    return [e.name for e in DRAFTERS]


def entry(name):
    """A drafter's entry by name; an unknown name is one ValueError listing the registered."""
    if name not in BY_NAME:
        raise ValueError(f"unknown drafter {name!r}: choose from {', '.join(names())}")
    return BY_NAME[name]


def stages():
    """{name: training.stage.Stage} of train.py: the target's, then every drafter that learns."""
    return {"target": stages_target.STAGE, **{e.name: e.stage for e in DRAFTERS if e.stage}}


def partners():
    """The drafters another can be built around (the hybrid's learned half: --hybrid-with)."""
    return [e.name for e in DRAFTERS if e.declared.pairs]


def tree_drafters():
    """The drafters tree.BlockTree grows a token tree from (sample.py --tree, bench.py's trees)."""
    return [e.name for e in DRAFTERS if e.declared.trees]


def built_around():
    """The drafters built around a partner (those --hybrid-with applies to)."""
    return [e.name for e in DRAFTERS if e.declared.partner]


def default_partner():
    """The partner the first drafter built around one takes unless told (--hybrid-with)."""
    return next((e.declared.partner for e in DRAFTERS if e.declared.partner), None)


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


def batched(drafter, **options):
    """The batched twin of a batch-1 drafter (serving/batched.py runs it): its line's, where that
    twin takes this drafter, with the twin's own options (BatchDSpark's schedule), else one copy
    of it per row (PerRow)."""
    e = BY_NAME.get(drafter.name)
    twin = e.batched if e is not None else PerRow
    if twin is None:
        raise NotImplementedError(f"the {e.name} drafts one request at a time (batch 1)")
    if twin is not PerRow and twin.takes(drafter):
        return twin(drafter, **options)
    return PerRow(drafter)
