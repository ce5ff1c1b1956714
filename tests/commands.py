"""Running the project's commands as a user would, in this process, and reading what they left:
the helpers tests/test_fuzz.py and tests/test_bad_input.py share.

Commands run through their real `if __name__ == "__main__"` block (runpy), so exactly the errors
a user would see as one line are one line here, and anything else escapes as the traceback it
would be."""

import contextlib
import hashlib
import io
import os
import random
import runpy
import sys

import pytest
import torch

import bench
import sample
import train
from registry import drafters as registry
from conftest import tiny_args
from formats import hf_gpt2
from training import data, forward_cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARSERS = {"train.py": train.build_parser, "bench.py": bench.build_parser,
           "sample.py": sample.build_parser, "training/data.py": data.build_parser,
           "training/forward_cost.py": forward_cost.build_parser}
DATA_FILES = ["tokenizer.tiktoken", "train.bin", "val.bin", "data_meta.json"]
CHECKPOINTS = [f"{stage}.pt" for stage in registry.stages()]  # the target's, every learned drafter's


def run(script, *argv):
    """`python script argv`, in this process: (exit code, stdout, stderr). A SystemExit with a
    message is what Python would print to stderr; any other exception is a traceback: it fails
    the test, naming the command line."""
    out, err, argv0, threads = io.StringIO(), io.StringIO(), sys.argv, torch.get_num_threads()
    sys.argv, code = [script, *map(str, argv)], 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) or e.code is None else 1
        if isinstance(e.code, str):
            err.write(e.code + "\n")
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 -- what would be a traceback
        command = f"python {script} {' '.join(map(str, argv))}"
        pytest.fail(f"`{command}` ended in a traceback: {type(e).__name__}: {e}")
    finally:
        sys.argv = argv0
        torch.set_num_threads(threads)  # --threads must not leak into the other tests
    return code or 0, out.getvalue(), err.getvalue()


def refused(res, *needles):
    """One 'error:' line on stderr, naming each needle, and a non-zero exit code."""
    code, out, err = res
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), res
    assert "Traceback" not in out + err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def succeeded(res):
    code, out, err = res
    assert code == 0 and "Traceback" not in out + err and "error" not in err, res
    return out


def snapshot(folder):
    """{relative path: sha256} of every file, and a marker for every folder, under folder."""
    snap = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            snap[os.path.relpath(os.path.join(root, d), folder)] = "folder"
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
                snap[os.path.relpath(os.path.join(root, f), folder)] = digest
    return snap


def damage(path, how):
    """Damage one file in place: truncate it, overwrite it with garbage, delete it, or put a
    folder there."""
    size = os.path.getsize(path)
    if how == "truncate":
        os.truncate(path, size // 2)
    elif how == "garbage":
        with open(path, "wb") as f:
            f.write(random.Random(size).randbytes(size))  # same size: only the hash can tell
    else:
        os.remove(path)
        if how == "folder":
            os.mkdir(path)


DAMAGES = ["truncate", "garbage", "delete", "folder"]


def fast(script, out, corpus, *extra):
    """The cheapest full run of each command on the tiny out/ (every train.py stage is current;
    one thread: the tiny models gain nothing from more, and a busy machine loses a lot); extra:
    more of train.py's flags."""
    if script == "training/forward_cost.py":  # a random GPT-2 folder, timed beside the tiny target
        gpt2 = out.parent / "gpt2"
        if not gpt2.exists():
            hf_gpt2.write_folder(hf_gpt2.random_gpt2("tiny", 321), hf_gpt2.synthetic_merges(64),
                                 gpt2)
        return [gpt2, "--sizes", "1", "--repeats", "1", "--context", "4", "--toy",
                out / "target.pt", "--threads", "1"]
    return {"train.py": tiny_args(corpus, out, "--bf16", "off", "--threads", "1", *extra),
            "training/data.py": ["--data", corpus, "--vocab-size", "384", "--out-dir", out],
            "bench.py": ["--out-dir", out, "--methods", "ar,small", "--n-prompts", "1",
                         "--max-new-tokens", "3", "--repeats", "1", "--sweep", "",
                         "--threads", "1",
                         *(["--plot", ""] if "--plot" in flags("bench.py") else [])],
            "sample.py": ["--out-dir", out, "--max-new-tokens", "3", "--no-color"]}[script]


def flags(script):
    return {o for a in PARSERS[script]()._actions for o in a.option_strings}


def with_flag(argv, flag, value):
    """argv with flag set to value (replaced if it is there, else added)."""
    if flag not in argv:
        return [*argv, flag, value]
    i = argv.index(flag)
    return [*argv[:i + 1], value, *argv[i + 2:]]
