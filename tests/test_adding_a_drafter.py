"""Adding a drafter, as the README says a student does it: in a copy of the project, the toy drafter
of tests/toy_drafter/ (heads on the target's last state) gets its lesson file, its stage file, its
line in registry/drafters.py (with its imports) and its own test, and nothing else. Then it trains
in train.py's tiny run, benches exact beside plain decoding, samples, and every shared test runs it;
and forgetting a piece fails, naming it."""

import contextlib
import os
import shutil
import subprocess
import sys

import pytest

from commands import refused
from conftest import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(ROOT, "tests", "toy_drafter")
# what the copy leaves out: what git ignores, and what a run writes
SKIP = shutil.ignore_patterns(".git", "out", "__pycache__", ".pytest_cache", "*.pyc", "*.tmp*")


def add_the_toy(repo):
    """The README's steps, and only they: draft_toy.py at the root, training/stages_toy.py, its
    line (with its imports) in registry/drafters.py, tests/test_toy.py."""
    shutil.copy(os.path.join(TOY, "draft_toy.py"), repo / "draft_toy.py")
    shutil.copy(os.path.join(TOY, "stages_toy.py"), repo / "training" / "stages_toy.py")
    shutil.copy(os.path.join(TOY, "toy_tests.py"), repo / "tests" / "test_toy.py")
    registry = repo / "registry" / "drafters.py"
    text = registry.read_text()
    lines = (("import draft_small\n", "import draft_toy\n"),
             ("from training.stage import Stage\n", "from training import stages_toy\n"),
             ("        Entry(draft_lookup),\n", "        Entry(draft_toy, stages_toy),\n"))
    for anchor, line in lines:
        assert anchor in text, anchor
        text = text.replace(anchor, anchor + line if anchor.startswith(("import", "from"))
                            else line + anchor)
    registry.write_text(text)


def python(repo, *argv, timeout=300):
    p = subprocess.run([sys.executable, *map(str, argv)], cwd=repo, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("fork") / "nanospec"
    shutil.copytree(ROOT, repo, ignore=SKIP)
    add_the_toy(repo)
    return repo


@pytest.fixture(scope="module")
def toy_out(repo, corpus):
    """train.py's tiny run in the copy, the toy among its stages."""
    out = repo / "out"
    rc, so, err = python(repo, "train.py", *tiny_args(corpus, out, "--threads", "1"))
    assert rc == 0, err[-3000:]
    assert "toy: done" in so and (out / "toy.pt").exists()
    return out


def test_the_toy_trains_benches_samples_and_runs_the_shared_tests(repo, toy_out):
    out = toy_out
    assert "--toy-heads" in python(repo, "train.py", "--help")[1]  # its settings are flags
    rc, so, err = python(repo, "bench.py", "--out-dir", out, "--methods", "ar,toy,hybrid",
                         "--hybrid-with", "toy", "--n-prompts", "2", "--max-new-tokens", "12",
                         "--dtype", "float64", "--json", "", "--plot", "", "--threads", "1")
    assert rc == 0, err[-3000:]
    rows = {line.split("|")[1].strip(): line for line in so.splitlines()
            if line.startswith("| ") and "100%" in line}
    assert {"ar", "toy", "hybrid"} <= set(rows), so[-2000:]  # every row exact
    rc, so, err = python(repo, "sample.py", "--out-dir", out, "--method", "toy",
                         "--max-new-tokens", "12", "--no-color")
    assert rc == 0 and "method toy" in so, err[-3000:]
    rc, so, err = python(repo, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "toy",
                         "tests/test_toy.py", "tests/test_speculative.py", "tests/test_batched.py",
                         "tests/test_layout.py", timeout=600)
    assert rc == 0, so[-3000:]
    passed = int(so.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 20, so[-500:]  # the shared tests ran the toy (its own test is one)


def test_forgetting_a_piece_fails_naming_it(repo, tmp_path):
    """Its own test, or its line in the registry: the tests that need it fail, saying what is
    missing, and the others still run."""
    fork = tmp_path / "nanospec"
    shutil.copytree(repo, fork, ignore=SKIP)
    os.remove(fork / "tests" / "test_toy.py")
    rc, so, _ = python(fork, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py",
                       "tests/test_speculative.py", "-k", "piece and toy or greedy and toy")
    assert rc != 0 and "toy has no test of its own: write tests/test_toy.py" in so, so[-2000:]
    assert "toy has no tests/test_toy.py with drafter_for(target)" in so, so[-2000:]
    assert "error" not in so.splitlines()[-1], so[-500:]  # failures, no collection error
    shutil.copy(repo / "registry" / "drafters.py", fork / "registry" / "drafters.py")
    registry = fork / "registry" / "drafters.py"
    registry.write_text(registry.read_text().replace("        Entry(draft_toy, stages_toy),\n", ""))
    rc, so, _ = python(fork, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py",
                       "-k", "root")
    assert rc != 0 and "draft_toy.py is at the root but registry/drafters.py has no line" in so


@contextlib.contextmanager
def changed(path, old, new):
    """A student's slip: `old` written as `new` in one file, for the time of the block."""
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))
    try:
        yield
    finally:
        path.write_text(text)


# (file, what the README's steps write, the slip, words the one line must hold)
SLIPS = [
    ("draft_toy.py", "DRAFTER = dict(", "DRAFT = dict(",
     ["draft_toy.py declares no DRAFTER"]),
    ("training/stages_toy.py", "STAGE = Stage(", "STAGES = Stage(",
     ["training/stages_toy.py declares no STAGE"]),
    ("draft_toy.py", "    network=lambda config, target: ToyHeads(ToyConfig(**config), target),\n",
     "", ["toy", "both its network and its stage"]),
    ("training/stages_toy.py", 'lr: float = setting(2e-3, "toy: peak learning rate")',
     "lr: float = 2e-3", ["training/stages_toy.py", "ToySettings.lr is not a setting",
                          "setting(default"]),
    ("training/stages_toy.py", "@dataclass\nclass ToySettings", "class ToySettings",
     ["training/stages_toy.py", "not a dataclass", "@dataclass"]),
]


@pytest.mark.parametrize("slip", SLIPS, ids=[s[2].split("(")[0].strip() or "no network"
                                             for s in SLIPS])
def test_a_slip_in_a_declaration_is_one_line_before_anything_trains(repo, corpus, tmp_path, slip):
    """Each command asks the registry for its list first: the slip stops train.py (and bench.py,
    and sample.py) in one line naming the piece and the fix, before the corpus is even read."""
    path, old, new, words = slip
    commands = [["train.py", *tiny_args(corpus, tmp_path / "out")]]
    if slip is SLIPS[0]:  # every command reads the registry first: bench.py and sample.py too
        commands += [["bench.py", "--help"], ["sample.py", "--help"]]
    with changed(repo / path, old, new):
        for argv in commands:
            res = python(repo, *argv)
            assert res[0] == 1 and refused(res, *words)
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_phase_not_named_after_its_stage_is_refused_before_training(repo, corpus, tmp_path):
    stage = repo / "training" / "stages_toy.py"
    with changed(stage, 'return [("toy", settings.iters)]', 'return [("heads", settings.iters)]'):
        res = python(repo, "train.py", *tiny_args(corpus, tmp_path / "out"))
    assert res[0] == 1 and refused(res, "phase 'heads' is not named after the stage")
    assert not (tmp_path / "out" / "target.pt").exists()


def test_a_drafter_that_lists_no_hidden_layers_is_one_line(repo, toy_out):
    """It reads the target's states without asking for them: bench and sample say so."""
    lesson = repo / "draft_toy.py"
    with changed(lesson, "        self.hidden_layers = (target.config.n_layer,)\n", ""):
        for argv in (["bench.py", "--methods", "ar,toy", "--n-prompts", "1", "--json", "",
                      "--plot", ""], ["sample.py", "--method", "toy", "--no-color"]):
            res = python(repo, *argv, "--out-dir", toy_out, "--max-new-tokens", "8")
            assert res[0] == 1 and refused(res, "lists no hidden_layers",
                                           "self.hidden_layers = (layer, ...)")


def test_its_own_test_fails_while_its_registry_line_is_missing(repo, tmp_path):
    """pytest -k toy runs the drafter's own test, and that fails naming the missing line."""
    fork = tmp_path / "nanospec"
    shutil.copytree(repo, fork, ignore=SKIP)
    registry = fork / "registry" / "drafters.py"
    registry.write_text(registry.read_text().replace("        Entry(draft_toy, stages_toy),\n", ""))
    rc, so, _ = python(fork, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_toy.py")
    assert rc != 0 and "draft_toy.py has no line in registry/drafters.py" in so, so[-2000:]
