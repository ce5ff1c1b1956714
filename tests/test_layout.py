"""The house's two layers, checked from the source: a lesson file imports only lesson files, the
project's imports form no cycle and none hides inside a function, and every file keeps to its
line budget (README: the reading order)."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LESSON = ["gpt", "speculative", "tree", "draft_small", "draft_mtp", "draft_eagle", "draft_dflash",
          "draft_dspark", "draft_lookup", "draft_hybrid"]
BUDGET = {"gpt": 350, "speculative": 400, "tree": 350, **{m: 450 for m in LESSON if m.startswith("draft_")}}
MACHINERY_BUDGET = 600


def project_modules():
    return sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def imports(module):
    """[(imported project module, whether the import is at the top level)] of one file."""
    tree = ast.parse(open(os.path.join(ROOT, module + ".py")).read())
    ours, found = set(project_modules()), []
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module.split(".")[0]]
        found += [(n, id(node) in top) for n in names if n in ours]
    return found


@pytest.mark.parametrize("module", LESSON)
def test_a_lesson_file_imports_only_lesson_files(module):
    machinery = sorted({m for m, _ in imports(module)} - set(LESSON))
    assert not machinery, f"{module}.py imports the machinery: {machinery}"


def test_no_import_cycle_and_none_inside_a_function():
    graph = {m: sorted({n for n, _ in imports(m)}) for m in project_modules()}
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


def test_every_file_keeps_to_its_line_budget():
    lines = {m: sum(1 for _ in open(os.path.join(ROOT, m + ".py"))) for m in project_modules()}
    over = {m: n for m, n in lines.items() if n > BUDGET.get(m, MACHINERY_BUDGET)}
    assert not over, f"over budget (lines): {over}"
    together = sum(lines[m] for m in ("gpt", "speculative", "draft_dflash"))
    assert together <= 1150, f"gpt + speculative + draft_dflash: {together} lines (budget 1150)"
