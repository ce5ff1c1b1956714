"""Adding a drafter, as the README says a student does it: in a copy of the project, the toy drafter
of tests/toy_drafter/ (heads on the target's last state) gets its lesson file, its stage file, its
line in registry/drafters.py (with its imports) and its own test, and nothing else. Then it trains
in train.py's tiny run, benches exact beside plain decoding, samples, and every shared test runs it;
and forgetting a piece fails, naming it."""

import os
import shutil
import subprocess
import sys

import pytest

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
             ("    Entry(draft_lookup),\n", "    Entry(draft_toy, stages_toy),\n"))
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


def test_the_toy_trains_benches_samples_and_runs_the_shared_tests(repo, corpus):
    out = repo / "out"
    rc, so, err = python(repo, "train.py", *tiny_args(corpus, out, "--threads", "1"))
    assert rc == 0, err[-3000:]
    assert "toy: done" in so and (out / "toy.pt").exists()
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
    registry.write_text(registry.read_text().replace("    Entry(draft_toy, stages_toy),\n", ""))
    rc, so, _ = python(fork, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py",
                       "-k", "root")
    assert rc != 0 and "draft_toy.py is at the root but registry/drafters.py has no line" in so
