"""The house's layers, checked from the source: the root holds the lesson and the commands, the
machinery lives in packages, a lesson file imports only lesson files, the project's imports form
no cycle and none hides inside a function, and no file outgrows a reader (README: the reading
order)."""

import ast
import doctest
import importlib
import os

import pytest
import torch

from gpt import GPT, GPTConfig
from speculative import Sampler, generate_plain, generate_speculative
from tree import TreeDrafter, generate_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LESSON = ["gpt", "llama", "speculative", "tree", "draft_small", "draft_mtp", "draft_eagle", "draft_dflash",
          "draft_dspark", "draft_lookup", "draft_hybrid"]
COMMANDS = ["train", "bench", "sample"]
PACKAGES = ["runtime", "serving", "training", "benchmark"]
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


def test_no_file_outgrows_a_reader():
    lines = {m: sum(1 for _ in open(p)) for m, p in project_modules().items()}
    over = {m: n for m, n in lines.items() if n > MOST_LINES}
    assert not over, f"over {MOST_LINES} lines: {over}"


# the lesson's drafters, each built as its class docstring shows: no machinery applied
ALONE = {"draft_small": "DraftModel", "draft_mtp": "MTPDrafter", "draft_eagle": "EagleDrafter",
         "draft_dflash": "DFlashDrafter", "draft_dspark": "DSparkDrafter",
         "draft_lookup": "LookupDrafter", "draft_hybrid": "HybridDrafter", "tree": "BlockTree",
         "tree.Branches": "Branches"}


@pytest.mark.parametrize("where", sorted(ALONE))
def test_a_lesson_drafter_built_as_its_docstring_shows_runs_a_round(where):
    """The example in the class's docstring, run as written with a tiny random GPT as `target`
    (float64), builds `drafter`; it then drafts, and its rounds commit, token-identical to plain
    decoding (greedy) on a prompt that repeats itself (so that prompt lookup finds a match)."""
    cls = getattr(importlib.import_module(where.split(".")[0]), ALONE[where])
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2, n_embd=32)).eval()
        (example,) = [t for t in doctest.DocTestFinder().find(cls) if t.examples]
        example.globs["target"] = target
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(example, clear_globs=False)
        assert runner.failures == 0 and runner.tries >= 1
        drafter = example.globs["drafter"]
        prompt, sampler = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        if isinstance(drafter, TreeDrafter):
            out, stats = generate_tree(target, drafter, prompt, 12, sampler)
        else:
            out, stats = generate_speculative(target, drafter, prompt, 12,
                                              min(4, drafter.max_k or 4), sampler)
    finally:
        torch.set_default_dtype(dtype)
    assert out == generate_plain(target, prompt, 12, sampler)
    assert stats.rounds >= 1 and stats.drafted_at[0] >= 1  # it drafted, and its rounds committed
