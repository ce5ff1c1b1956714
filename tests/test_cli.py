"""Every numeric flag of the four commands is checked where it is parsed: a bad value ends in
one 'error: argument --flag: ...' line naming the allowed range, exit code 2, before
any model or file loads; a good one parses. Table-driven over every flag, plus a seeded random
sweep, plus one real command line per command (no traceback)."""

import contextlib
import io
import os
import random
import subprocess
import sys

import pytest

import bench
import sample
import train
from registry import drafters as registry
from training import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARSERS = {"train.py": train.build_parser, "bench.py": bench.build_parser,
           "sample.py": sample.build_parser, "training/data.py": data.build_parser}


def numeric_flags(name):
    """(flag, type) of every flag whose value is a checked number or list of numbers."""
    p = PARSERS[name]()
    return [(action.option_strings[0], action.type) for action in p._actions
            if getattr(action.type, "__name__", "") in ("an integer", "a number", "list")
            and action.option_strings]


def refused(name, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        PARSERS[name]().parse_args([flag, value])
    err = capsys.readouterr().err
    assert (e.value.code == 2 and err.startswith(f"error: argument {flag}")
            and err.count("\n") == 1), err
    return err


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_numeric_flag_refuses_garbage_negatives_and_nan(name, capsys):
    flags = numeric_flags(name)
    assert len(flags) >= {"train.py": 35, "bench.py": 9, "sample.py": 4, "training/data.py": 1}[name]
    for flag, _ in flags:
        for bad in ("abc", "-5", "nan", "inf", "1e999", "2,x" if flag == "--sweep" else "1.5.2"):
            refused(name, flag, bad, capsys)


def test_counts_refuse_zero_and_the_message_names_the_range(capsys):
    positive = "must be an integer >= 1"
    assert positive in refused("train.py", "--dflash-iters", "0", capsys)  # trained nothing before
    assert positive in refused("bench.py", "--repeats", "0", capsys)  # ZeroDivisionError before
    assert positive in refused("train.py", "--threads", "0", capsys)  # set_num_threads before
    assert "<= 1" in refused("train.py", "--gen-sampled", "1.5", capsys)
    # int() message before
    assert "'x' is not an integer" in refused("bench.py", "--sweep", "1,x", capsys)
    assert "257" in refused("training/data.py", "--vocab-size", "10", capsys)
    refused("train.py", "--mtp-mode", "both", capsys)  # a choice, not a number


def test_a_seeded_random_sweep_of_values(capsys):
    """Random ints, floats and junk at every numeric flag: each either parses to an in-range value
    or is refused with the flag named; nothing else (no other exception, no traceback)."""
    rng = random.Random(0)
    junk = ["", " ", "0x10", "1_000", "--", "1e-400", "-0", "+3", "3.0", "٣"]
    for name in PARSERS:
        for flag, kind in numeric_flags(name):
            for _ in range(12):
                options = [str(rng.randint(-10, 10**6)), repr(rng.uniform(-5, 5)), rng.choice(junk)]
                value = rng.choice(options)
                try:
                    args = PARSERS[name]().parse_args([flag, value])
                except SystemExit as e:
                    err = capsys.readouterr().err
                    assert (e.code == 2 and err.startswith("error: argument")
                            and err.count("\n") == 1), (flag, value, err)
                    continue
                got = getattr(args, flag[2:].replace("-", "_"))
                # parsed values are exactly the checked ones
                assert got == kind(value), (flag, value)


def test_a_method_list_names_each_known_method_once():
    parse = bench.build_parser().parse_args
    assert parse(["--methods", "ar, dspark"]).methods == ["ar", "dspark"]
    unknown = "ar," + "x".join(registry.names())  # no drafter is named so: no name is made up
    for bad, why in [("ar,ar", "twice"), ("", "is empty"), (",", "is empty"),
                     (unknown, repr(unknown[3:]))]:
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
            parse(["--methods", bad])
        assert err.getvalue().startswith("error: argument --methods") and why in err.getvalue()


@pytest.mark.parametrize("command,flag,value", [(["train.py"], "--target-iters", "-1"),
                                                (["bench.py"], "--sweep", "1,x"),
                                                (["sample.py"], "--max-new-tokens", "0"),
                                                (["-m", "training.data"], "--vocab-size", "abc")])
def test_the_real_command_line_ends_in_one_error_line(command, flag, value, tmp_path):
    p = subprocess.run([sys.executable, *command, flag, value, "--out-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (p.returncode == 2 and p.stderr.startswith(f"error: argument {flag}")
            and p.stderr.count("\n") == 1)
    assert not os.listdir(tmp_path)  # refused before anything was written
