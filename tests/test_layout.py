"""The house's layers, checked from the source: the root holds the lesson and the commands, the
machinery lives in packages, a lesson file imports only lesson files, the project's imports form
no cycle and none hides inside a function, no file outgrows a reader (README: the reading order);
every example in the lesson's docstrings runs as written, and every drafter's drafts a round; what
runs is what the lesson shows; and a drafter is declared once: every registered drafter has each
piece the house needs, and no file but the registry keeps its own list of drafters."""

import ast
import copy
import dataclasses
import doctest
import importlib
import os
import types

import pytest
import torch

import train
from registry import drafters as registry
from runtime.settings import settings_of
from speculative import Drafter
from training import flags
from training.stage import Stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the lesson: the targets, the loop, the trees, DFlash's draft layers, and every registered
# drafter's file
LESSON = ["gpt", "llama", "sampler", "ragged", "speculative", "tree", "dflash_layers",
          *(e.lesson.__name__ for e in registry.drafters())]
COMMANDS = ["train", "bench", "sample"]
PACKAGES = ["runtime", "formats", "serving", "training", "registry", "benchmark"]
MOST_LINES = 600  # a file a reader can hold in mind; write for the reader, not for this number


def project_modules():
    """{dotted module name: its path} of every project file: the root's and the packages'."""
    found = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
    for pkg in PACKAGES:
        for f in os.listdir(os.path.join(ROOT, pkg)):
            if f.endswith(".py") and f != "__init__.py":
                found[f"{pkg}.{f[:-3]}"] = os.path.join(ROOT, pkg, f)
    return found


def imports(module):
    """[(imported project module, whether the import is at the top level)] of one file."""
    modules = project_modules()
    tree = ast.parse(open(modules[module]).read())
    top, found = {id(n) for n in tree.body}, []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                     else node.module for a in node.names]
        found += [(n, id(node) in top) for n in names if n in modules]
    return found


def test_the_root_is_the_lesson_and_the_commands():
    root = sorted(m for m in project_modules() if "." not in m)
    unlisted = [m for m in root if m.startswith("draft_") and m not in LESSON]
    assert not unlisted, (f"{unlisted[0]}.py is at the root but registry/drafters.py has no line "
                          "for it (README: Adding a drafter of your own)")
    assert root == sorted(LESSON + COMMANDS), f"the root holds {root}"


@pytest.mark.parametrize("module", LESSON)
def test_a_lesson_file_imports_only_lesson_files(module):
    machinery = sorted({m for m, _ in imports(module)} - set(LESSON))
    assert not machinery, f"{module}.py imports the machinery: {machinery}"


def test_no_import_cycle_and_none_inside_a_function():
    modules = project_modules()
    graph = {m: sorted({n for n, _ in imports(m)}) for m in modules}
    hidden = [(m, n) for m in graph for n, at_top in imports(m) if not at_top]
    assert not hidden, f"imports inside a function: {hidden}"
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = "done"
    for m in graph:
        if m not in state:
            visit(m, [m])


def test_no_package_imports_one_above_it():
    """The packages stand in floors: a package imports only the lesson and the packages below it
    (runtime/ below formats/ and serving/, formats/ below training/, training/ and serving/ below
    registry/, registry/ below benchmark/)."""
    floor = {"runtime": 0, "formats": 1, "serving": 1, "training": 2, "registry": 3,
             "benchmark": 4}
    up = [(m, n) for m in project_modules() if "." in m for n, _ in imports(m)
          if "." in n and floor[n.split(".")[0]] > floor[m.split(".")[0]]]
    assert not up, f"imports of a package above: {up}"


def test_no_file_outgrows_a_reader():
    lines = {m: sum(1 for _ in open(p)) for m, p in project_modules().items()}
    over = {m: n for m, n in lines.items() if n > MOST_LINES}
    assert not over, f"over {MOST_LINES} lines: {over}"


# -----------------------------------------------------------------------------
# the lesson's examples, run as written


@pytest.mark.parametrize("module", LESSON)
def test_every_docstring_example_of_the_lesson_runs_as_written(module):
    """Every `>>>` example in a lesson file, as doctest runs it: nothing given but the file's own
    names, each example building the tiny target it needs."""
    dtype = torch.get_default_dtype()
    try:
        found = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    finally:
        torch.set_default_dtype(dtype)
    assert found.failed == 0, f"{module}.py: {found.failed} of {found.attempted} examples failed"


@pytest.mark.parametrize("entry", registry.drafters(), ids=registry.names())
def test_every_drafter_drafts_a_round_as_its_docstring_shows(entry):
    """The Drafter class a drafter's file declares has an example that builds it and runs it
    against plain decoding (the test above runs it); the rounds it shows are the loop's."""
    classes = [c for c in vars(entry.lesson).values() if isinstance(c, type)
               and issubclass(c, Drafter) and c.__module__ == entry.lesson.__name__
               and getattr(c, "name", None) == entry.name]
    assert classes, f"{entry.lesson.__name__}.py has no Drafter class named {entry.name!r}"
    examples = [t for c in classes for t in doctest.DocTestFinder().find(c) if t.examples]
    source = "".join(e.source for t in examples for e in t.examples)
    assert "generate_speculative(" in source and "generate_plain(" in source, (
        f"{entry.lesson.__name__}.py: its Drafter's docstring shows no round against plain "
        "decoding (README: Adding a drafter of your own)")


# -----------------------------------------------------------------------------
# what runs is what the lesson shows


def functions_assigned_from_outside(path):
    """[(attribute, line)] where this file sets another object's attribute to a function: a
    lambda, or a function or class of its own or imported."""
    tree = ast.parse(open(path).read())
    callables = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    callables |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  for a in n.names}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if (isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name)
                                                          and target.value.id == "self")
                    and (isinstance(node.value, ast.Lambda)
                         or (isinstance(node.value, ast.Name) and node.value.id in callables)
                         or target.attr == "__class__")):
                found.append((target.attr, node.lineno))
    return found


# the only functions the machinery sets on the lesson's objects: kernels swapped from outside
# (the attention when training on a CPU, a Linear's CPU product), a device wait before a clock is
# read, and bench's ablation rows (copies of a drafter under a rule of benchmark/ablations.py's,
# reported as their own rows)
FROM_OUTSIDE = {"runtime.cpu_speed": {"sdpa", "__class__"}, "runtime.profiling": {"sync"},
                "benchmark.ablations": {"__class__"}}


def test_no_lesson_algorithm_is_replaced_at_run_time_from_outside():
    """A faster twin of a lesson function lives beside it, in the lesson file (DSpark's greedy
    chain on the host: draft_dspark.host_greedy_chain); the machinery swaps only kernels."""
    for module, path in project_modules().items():
        if module in LESSON:
            continue
        found = {attr for attr, _ in functions_assigned_from_outside(path)}
        extra = found - FROM_OUTSIDE.get(module, set())
        assert not extra, f"{module} sets {sorted(extra)} on the lesson's objects from outside"


# -----------------------------------------------------------------------------
# a drafter declared once: every piece the house needs, and no other list of drafters


@pytest.mark.parametrize("entry", registry.drafters(), ids=registry.names())
def test_every_registered_drafter_has_each_piece_the_house_needs(entry):
    """Its lesson file draft_<name>.py at the root; its stage, if it learns, in
    training/stages_<name>.py, each setting with its help and every phase with a step cost under
    every preset; its own test, tests/test_<name>.py, with drafter_for(target) for the shared
    tests. Each message names the missing piece (README: Adding a drafter of your own)."""
    name = entry.name
    assert entry.lesson.__name__ == f"draft_{name}", (
        f"the drafter {name!r} is declared in {entry.lesson.__name__}.py: name it draft_{name}.py")
    own = os.path.join(ROOT, "tests", f"test_{name}.py")
    assert os.path.exists(own), f"{name} has no test of its own: write tests/test_{name}.py"
    assert callable(getattr(importlib.import_module(f"test_{name}"), "drafter_for", None)), (
        f"tests/test_{name}.py has no drafter_for(target): the shared tests build {name} with it")
    if entry.stage is None:
        return
    stage = entry.stage
    assert isinstance(stage, Stage) and stage.train.__module__ == f"training.stages_{name}", (
        f"{name}'s stage lives in training/stages_{name}.py")
    for f in dataclasses.fields(stage.settings):  # a dataclass with iters and lr: the registry
        assert f.metadata.get("help"), f"{name}'s setting {f.name} has no help: use setting()"
    for preset in flags.PRESETS:  # each preset's phases named and costed (training/flags.py)
        try:
            train.resolve_args(["--preset", preset, "--device", "cpu"])
        except ValueError as e:  # gpt2 and gpu-small are sized for a folder's model (--init-from)
            assert "--init-from" in str(e), str(e)


def settings_read(path):
    """The stage names a file reads settings of: run.settings["x"] or run.settings.get("x")."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "settings" and isinstance(node.slice, ast.Constant):
            found.add(node.slice.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" and isinstance(node.func.value, ast.Attribute) \
                and node.func.value.attr == "settings" and node.args \
                and isinstance(node.args[0], ast.Constant):
            found.add(node.args[0].value)
    return found


def test_a_stage_reads_the_settings_of_no_stage_it_does_not_declare():
    """Its own, the one it builds on, and those its Stage lists in reads: a reader of one stage
    file learns from its declaration which others it depends on."""
    for name, stage in registry.stages().items():
        path = os.path.join(ROOT, "training", f"stages_{name}.py")
        undeclared = settings_read(path) - {name, stage.builds_on, *stage.reads}
        assert not undeclared, f"training/stages_{name}.py reads {sorted(undeclared)}' settings: " \
                               "list them in its Stage(reads=...)"


def drafter_name_lists(path, names, most):
    """(line, names) of every literal list, tuple, set or dict in a file whose elements (a dict's
    keys) are `most` or more drafter names."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        items = node.keys if isinstance(node, ast.Dict) else (
            node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else [])
        named = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
        if len(set(named)) >= most:
            found.append((node.lineno, sorted(set(named))))
    return found


def test_no_file_but_the_registry_keeps_a_list_of_drafters():
    """Three or more drafter names written out together outside the tests (five inside) are a
    hand-kept list, which a new drafter would have to find: the registry's list is the one."""
    names = set(registry.names())
    paths = {m: p for m, p in project_modules().items() if m != "registry.drafters"}
    tests = os.path.join(ROOT, "tests")
    paths.update({f"tests.{f[:-3]}": os.path.join(tests, f) for f in os.listdir(tests)
                  if f.endswith(".py")})
    lists = {m: drafter_name_lists(p, names, 5 if m.startswith("tests.") else 3)
             for m, p in paths.items()}
    assert not {m: found for m, found in lists.items() if found}


def test_a_registry_line_that_misses_a_piece_says_which():
    """A line whose lesson file declares no DRAFTER, or whose stage file no STAGE, or a drafter
    with a network but no stage, is refused naming the piece (README: Adding a drafter of your
    own)."""
    bare = types.ModuleType("draft_toy")
    with pytest.raises(registry.RegistryError, match="draft_toy.py declares no DRAFTER"):
        registry.Entry(bare)
    bare.DRAFTER = dict(name="toy", drafter=None, netwrk=None)  # a slip in a field's name
    with pytest.raises(registry.RegistryError, match="draft_toy.py's DRAFTER: .*'netwrk'"):
        registry.Entry(bare)
    with pytest.raises(registry.RegistryError, match="stages_toy.py declares no STAGE"):
        registry.Entry(importlib.import_module("draft_small"),
                       types.ModuleType("training.stages_toy"))
    with pytest.raises(registry.RegistryError, match="both its network and its stage"):
        registry.Entry(importlib.import_module("draft_small"))
    small, hybrid = registry.entry("small"), registry.entry("hybrid")
    with pytest.raises(registry.RegistryError, match="named 'small'"):
        registry.check([small, small])
    with pytest.raises(registry.RegistryError, match="built around 'dspark', which is no"):
        registry.check([small, hybrid])  # its partner is not listed before it
    @dataclasses.dataclass
    class Plain:  # a field written without setting(): no help, no presets
        iters: int = 300
    with pytest.raises(TypeError, match=r"Plain.iters is not a setting: write it iters: int = "
                       r"setting\(default"):
        settings_of(Plain)
    for bad in ("my-drafter", "Big", "ar", "target"):
        renamed = copy.copy(small)
        renamed.declared = dataclasses.replace(small.declared, name=bad)
        with pytest.raises(registry.RegistryError, match="lower-case Python name"):
            registry.check([renamed])


def test_a_name_that_is_not_registered_is_one_line_listing_the_registered():
    unknown = "x".join(registry.names())  # no drafter is named so: no name is made up
    with pytest.raises(ValueError, match=f"unknown drafter '{unknown}': choose from " +
                       ", ".join(registry.names())):
        registry.entry(unknown)
    with pytest.raises(ValueError, match="built around a learned drafter, not 'lookup': choose "
                       "from " + ", ".join(registry.partners())):
        registry.load_drafter("hybrid", "out", None, None, partner="lookup")
