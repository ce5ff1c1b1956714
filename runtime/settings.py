"""
runtime/settings.py -- the command lines' shared flag helpers, and settings written once.

A value is checked where it is parsed (a number in range, a path of the right kind), so a bad one is
one line, 'error: argument --flag: ...', before anything loads. A training setting is a field of a
settings dataclass (setting(): its default, its help, what each preset changes), declared where it
is used: each stage's beside its code (training/stages_*.py), the run's in training/; train.py
makes its flags from them (training/flags.py). The sampling flags are shared by sample.py and
bench.py.
"""

import argparse
import dataclasses
import math
import os
import sys
import tempfile

DEFAULT_VOCAB = 4096  # BPE vocabulary size, end-of-text included (training/data.py)

# -----------------------------------------------------------------------------
# command-line values: checked where they are parsed, so a bad one fails before anything loads


class RangeInHelp(argparse.HelpFormatter):
    """--help shows each numeric flag's range (the rule its type, number(), checks)."""

    def _get_help_string(self, action):
        rule = getattr(action.type, "rule", "")
        return f"{action.help} [{rule}]" if rule and action.help else action.help


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a refusal is one line, 'error: argument --flag: ...' (exit code 2), like every
    other refusal of the project's commands; --help still prints the usage, with every numeric
    flag's range."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=RangeInHelp, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def number(kind=int, lo=None, hi=None, above=None):
    """An argparse type: a `kind` (int or float) with lo <= x <= hi, or x > above. A bad value
    ends in one line, 'error: argument --flag: ...', naming the allowed range."""
    what = "an integer" if kind is int else "a number"
    bounds = [f">= {lo}" if lo is not None else None, f"> {above}" if above is not None else None,
              f"<= {hi}" if hi is not None else None]
    rule = " and ".join(b for b in bounds if b)

    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}"
                                             + (f" ({rule})" if rule else "")) from None
        if not (math.isfinite(x) and (lo is None or x >= lo) and (hi is None or x <= hi)
                and (above is None or x > above)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be {what} {rule}")
        if kind is int and abs(x) >= 2 ** 31:  # no count or size here is that large
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be {what} {rule}"
                                             " and below 2^31")
        return x
    parse.__name__ = what  # argparse names the type by it in its own messages
    parse.rule = f"{what} {rule}".strip()  # what --help shows
    return parse


def not_unicode(text):
    """Why `text` is not valid Unicode (None: it is): a byte that is not UTF-8 from a terminal
    of another encoding (Python keeps it as a lone surrogate, \\udc80..\\udcff), or a lone
    surrogate escape from a JSON file (\\ud800). No tokenizer encodes either."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        bad = text[e.start]
        what = (f"the byte 0x{ord(bad) - 0xDC00:02x}, which is not UTF-8 (a terminal in "
                "another encoding?)" if 0xDC80 <= ord(bad) <= 0xDCFF else
                f"a lone surrogate \\u{ord(bad):04x}")
        return f"holds {what} at character {e.start + 1}: give it as UTF-8 text"


def text_arg(text):
    """An argparse type for text a tokenizer will encode: valid Unicode, refused in one line."""
    why = not_unicode(text)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


text_arg.__name__ = "text"


def _made_blocked(p):
    """Can folder p not be made because a file sits where a folder above it must be?"""
    up = os.path.abspath(p)
    while not os.path.exists(up):
        up = os.path.dirname(up)
    return not os.path.isdir(up)


def _unwritable(folder):
    """Can this user not make a file in folder (or, if it does not exist yet, in the nearest folder
    above it)? Tried, not read from the permission bits: root passes those, and a read-only mount
    refuses everyone."""
    up = os.path.abspath(folder)
    while not os.path.exists(up):
        up = os.path.dirname(up)
    try:
        fd, probe = tempfile.mkstemp(dir=up, prefix=".nanospec-probe-")
    except OSError:
        return True
    os.close(fd)
    os.remove(probe)
    return False


PATH_RULES = {  # kind of path flag -> [(is this value wrong?, why)], checked in order
    "in": [(lambda p: not os.path.exists(p), "does not exist"),
           (os.path.isdir, "is a folder, not a file")],
    "data": [(lambda p: not os.path.exists(p), "does not exist"),
             (lambda p: not (os.path.isfile(p) or os.path.isdir(p)),
              "is neither a file nor a folder")],
    "folder": [(lambda p: not os.path.exists(p), "does not exist"),
               (lambda p: not os.path.isdir(p), "is not a folder")],
    "dir": [(lambda p: os.path.exists(p) and not os.path.isdir(p), "is a file, not a folder"),
            (_made_blocked, "cannot be made: a file is in the way"),
            (_unwritable, "cannot be written to (no permission, or a read-only disk)")],
    "checkpoints": [(lambda p: os.path.exists(p) and not os.path.isdir(p),
                     "is a file, not a folder")],
    "out": [(os.path.isdir, "is a folder, not a file"),
            (lambda p: not os.path.isdir(os.path.dirname(os.path.abspath(p))),
             "is in a folder that does not exist"),
            (lambda p: (not os.access(p, os.W_OK) if os.path.exists(p)
                        else _unwritable(os.path.dirname(os.path.abspath(p)))),
             "cannot be written (no permission, or a read-only disk)")],
}


def expand(text):
    """A path flag's value as the command uses it: `~` and `~user` expanded (argparse type)."""
    return os.path.expanduser(text)


def path_arg(kind):
    """An argparse type for a path flag: 'in' a file to read, 'data' a file or folder to read,
    'folder' a folder to read, 'checkpoints' a folder to read if it exists (its files are checked
    later, with a message naming the stage to train), 'dir' a folder to write (made if missing),
    'out' a file to write. A value of the wrong kind ends in one line, 'error: argument --flag:
    ...', before anything runs. The value is the path with `~` expanded, here and only here: the
    check and the work read the same path (a shell leaves `--out-dir=~/run` unexpanded)."""
    def parse(text):
        p = expand(text)
        if not text:
            why = "is empty"
        else:
            why = next((why for wrong, why in PATH_RULES[kind] if wrong(p)), None)
        if why:
            raise argparse.ArgumentTypeError(f"{text!r} {why}")
        return p
    parse.__name__ = "a path"
    return parse


# -----------------------------------------------------------------------------
# settings: the fields of a settings dataclass, each with its default, its help and what each
# preset changes; a stage's settings are one such class (training/stage.py), and train.py's flags
# are made from them


def setting(default, help, type=None, choices=None, **presets):
    """One field of a settings dataclass, in its one home, written the way it reads:
    `iters: int = setting(1000, "steps", tiny=6, cuda=2000)`. default: the cpu preset's value (the
    base every other preset changes); type: the flag's argparse type (None: from the default's, a
    count >= 1 or a rate > 0); presets: {preset: value} where a preset differs from the cpu
    preset's: a preset names only what it changes."""
    return dataclasses.field(default=default, metadata={"help": help, "type": type,
                                                         "choices": choices, "presets": presets})


def value_in(f, preset):
    """A setting's value in `preset`, or in a chain of them (("gpt2", "cuda"): gpt2's where it
    names one, else cuda's), else its default (the cpu preset's)."""
    for p in (preset if isinstance(preset, tuple) else (preset,)):
        if p in f.metadata["presets"]:
            return f.metadata["presets"][p]
    return f.default


def flag_type(f):
    """A setting's argparse type: its own, else from its default's (a count >= 1, a rate > 0)."""
    m = f.metadata
    if m["type"] is not None or m["choices"] is not None:
        return m["type"] or str
    return {int: number(int, 1), float: number(float, above=0)}.get(type(f.default), str)


def settings_of(cls, prefix=""):
    """[(name, field)] of a settings dataclass: name is the flag's without the dashes, prefixed
    (the dflash stage's `block` is dflash_block, its flag --dflash-block); a trailing underscore
    (a field named like a Python keyword, `lambda_`) is not part of it."""
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not a setting: write it "
                            f"{f.name}: {getattr(f.type, '__name__', f.type)} = setting(default, "
                            "\"help\", preset=value, ...) (runtime/settings.py)")
    return [((f"{prefix}_" if prefix else "") + f.name.rstrip("_"), f)
            for f in dataclasses.fields(cls)]


def preset_values(cls, prefix, preset):
    """{name: value} of a settings dataclass in one preset."""
    return {name: value_in(f, preset) for name, f in settings_of(cls, prefix)}


def add_settings(group, cls, prefix, preset):
    """One flag per field of a settings dataclass (--dflash-iters for the dflash stage's iters),
    each help showing the value `preset` gives it. The flags default to None, so that a caller can
    tell a value given from one to take from the preset."""
    shown = preset[0] if isinstance(preset, tuple) else preset
    for name, f in settings_of(cls, prefix):
        value = value_in(f, preset)
        where = f", preset {shown}" if f.metadata["presets"] else ""
        group.add_argument("--" + name.replace("_", "-"), type=flag_type(f),
                           choices=f.metadata["choices"], default=None,
                           help=f"{f.metadata['help']} (default: "
                           f"{'none' if value is None else value}{where})")


def values_of(settings, prefix=""):
    """{name: value} of a settings object, by its flags' names (the dflash stage's dflash_block)."""
    return {name: getattr(settings, f.name) for name, f in settings_of(type(settings), prefix)}


def read_settings(cls, prefix, values):
    """The settings dataclass filled from {name: value} (a parsed command line's names)."""
    return cls(**{f.name: values[name] for name, f in settings_of(cls, prefix)})


def number_list(kind=int, lo=1):
    """An argparse type: comma-separated numbers, each >= lo and each once ('' for none): a value
    listed twice would be measured twice, the second overwriting the first."""
    one = number(kind, lo)

    def parse(text):
        values = [one(t.strip()) for t in text.split(",") if t.strip()]
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{text!r} lists {', '.join(map(str, twice))} more "
                                             "than once: give each value once")
        return values
    parse.__name__ = "list"
    parse.rule = f"comma-separated, each {one.rule}"
    return parse


def name_list(choices):
    """An argparse type: comma-separated names from choices, at least one, each once."""
    def parse(text):
        names = [t.strip() for t in text.split(",") if t.strip()]
        wrong = [n for n in names if n not in choices]
        why = (f"names {wrong[0]!r}, which is none of them" if wrong else "is empty" if not names
               else "lists a name twice" if len(set(names)) < len(names) else None)
        if why:
            raise argparse.ArgumentTypeError(f"{text!r} {why}: give each once, from "
                                             f"{', '.join(choices)}")
        return names
    parse.__name__ = "names"
    return parse


# -----------------------------------------------------------------------------
# the sampling flags (sample.py and bench.py)


DEFAULT_TEMPERATURE = 1.0  # the flag's default is None, so that parse_args can tell "not given"


def add_sampling_flags(p):
    """--sampling, --temperature, --top-k, --seed: the same four flags here and in bench.py."""
    p.add_argument("--sampling", default="greedy", choices=["greedy", "coupled", "rejection"],
                   help="acceptance rule (default: %(default)s)")
    p.add_argument("--temperature", type=number(float, above=0), default=None,
                   help=f"sampling temperature (coupled/rejection; default: {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-k", type=number(int, 1), default=None,
                   help="sample only among the k most likely tokens (default: all of them)")
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0,
                   help="sampling seed (default: %(default)s)")


def sampling_flag_problems(sampling, temperature_given, top_k_given):
    """The one-line warning for sampling flags the chosen mode does not use, or None. Greedy
    decoding takes the argmax, so --temperature and --top-k would be silently ignored. (Values
    no mode can use, like a temperature <= 0, are refused where they are parsed.)"""
    flags = (("--temperature", temperature_given), ("--top-k", top_k_given))
    unused = [f for f, given in flags if given]
    if sampling != "greedy" or not unused:
        return None
    return (f"warning: {' and '.join(unused)} unused: --sampling greedy takes the argmax "
            "(use coupled or rejection to sample)")


def parse_args(parser, argv=None):
    """parser.parse_args, warning (one line, on stderr) about sampling flags the mode ignores,
    then filling in the temperature's default."""
    a = parser.parse_args(argv)
    warning = sampling_flag_problems(a.sampling, a.temperature is not None, a.top_k is not None)
    if warning:
        print(warning, file=sys.stderr)
    if a.temperature is None:
        a.temperature = DEFAULT_TEMPERATURE
    return a
