"""
runtime/settings.py -- every setting in its one home, and the command lines' shared flag helpers.

train.py's settings are tables: one per stage, each setting with its value in every preset (cpu, the
full run; quick; tiny, the tests'; cuda; mps; gpt2), its type and its help. train.py gathers them
into its flags and presets; training/stages.py reads them. The helpers check a flag's value where it
is parsed (a number in range, a path of the right kind), so a bad one is one line, 'error: argument
--flag: ...', before anything loads. The sampling flags are shared by sample.py and bench.py. """

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass

DEFAULT_VOCAB = 4096  # BPE vocabulary size, end-of-text included (training/data.py)

# -----------------------------------------------------------------------------
# command-line values: checked where they are parsed, so a bad one fails before anything loads


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a refusal is one line, 'error: argument --flag: ...' (exit code 2), like every
    other refusal of the project's commands; --help still prints the usage."""

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
        return x
    parse.__name__ = what  # argparse names the type by it in its own messages
    return parse


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


@dataclass
class Setting:
    """One training setting in its one home: its value in every preset, its type and its help.
    Each drafter's file lists its own (SETTINGS) beside the code that uses them; train.py gathers
    them into its presets and flags. Adding a setting touches that table and the code using it."""
    default: object       # the cpu preset's value (the base every other preset changes)
    help: str
    type: object = None   # the argparse type; None: from the default's (a count >= 1, a rate > 0)
    choices: list = None
    presets: dict = None  # {preset: value} where a preset differs from the cpu preset's

    def value(self, preset):
        """The value in `preset`, or a chain of them (("gpt2", "cuda"): gpt2's where it names
        one, else cuda's), else the cpu preset's."""
        for p in (preset if isinstance(preset, tuple) else (preset,)):
            if p in (self.presets or {}):
                return self.presets[p]
        return self.default

    def flag_type(self):
        """The argparse type: its own, else from its default's (a count >= 1, a rate > 0)."""
        if self.type is not None or self.choices is not None:
            return self.type or str
        return {int: number(int, 1), float: number(float, above=0)}.get(type(self.default), str)


def setting(default, help, type=None, choices=None, **presets):
    """Setting(...), written the way the tables read: setting(1000, "steps", tiny=6, cuda=2000)."""
    return Setting(default, help, type, choices, presets)


def add_settings(parser, groups, preset):
    """One flag per setting (--dflash-iters for dflash_iters), in one argparse group per table
    ({title: {name: Setting}}), each help showing the value `preset` gives it. The flags default
    to None, so a caller can tell a value given from one to take from the preset."""
    for title, table in groups.items():
        group = parser.add_argument_group(title)
        for name, s in table.items():
            value = s.value(preset)
            shown = preset[0] if isinstance(preset, tuple) else preset
            where = f", preset {shown}" if s.presets else ""
            group.add_argument("--" + name.replace("_", "-"), type=s.flag_type(),
                               choices=s.choices, default=None,
                               help=f"{s.help} (default: {'none' if value is None else value}"
                               f"{where})")


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
    return parse


def name_list(choices):
    """An argparse type: comma-separated names from choices, at least one, each once."""
    def parse(text):
        names = [t.strip() for t in text.split(",") if t.strip()]
        wrong = [n for n in names if n not in choices]
        why = (f"names {wrong[0]!r}" if wrong else "is empty" if not names
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


# -----------------------------------------------------------------------------
# the settings tables: the run, the target, every stage, then each drafter's


PRESETS = {
    "cpu": "the full run, sized for 2 CPU cores (docs/results.md: Training)",
    "quick": "every drafter, far fewer steps: the lesson in minutes on a CPU",
    "tiny": "seconds: a smoke run of the whole pipeline (the tests use it)",
    "cuda": "one consumer GPU: wider, deeper, longer (never run yet: its time is unknown)",
    "mps": "Apple GPUs: the cuda preset",
    "gpt2": "GPT-2 small from --init-from on one consumer GPU: the cuda preset, with the "
            "drafters sized for a 768-wide 12-layer target (never run yet: an estimate of its "
            "time is in docs/experiments.md)",
    "gpu-small": "a 100M-1B Llama, Qwen or GPT-2 from --init-from on one consumer GPU: the gpt2 "
                 "preset, DFlash's heads the target's (docs/your_model.md; never run yet)",
}

RUN = {
    "vocab_size": setting(DEFAULT_VOCAB, "BPE vocabulary size, end-of-text included",
                          type=number(int, 257, 65536)),
    "tokenizer": setting("bpe", "train our own BPE, or use tiktoken's gpt2 if it loads",
                         choices=["bpe", "gpt2"]),
    "seed": setting(1337, "seed for initialisation and batch sampling",
                    type=number(int, 0, 2**32 - 1)),
    "bf16": setting("auto", "bfloat16 autocast: auto = where this device measurably runs it "
                    "faster", choices=["auto", "on", "off"]),
    "threads": setting(None, "torch CPU threads (none: torch's choice)", type=number(int, 1)),
    "log_interval": setting(25, "steps between progress lines"),
    # the drafters are judged by tau in bench.py, not by this loss on corpus text
    "eval_interval": setting(2500, "steps between validation losses (the last step always has "
                             "one)"),
    "ckpt_interval": setting(60.0, "seconds between resume checkpoints", type=number(float, 0)),
    "grad_accum": setting(1, "micro-steps per optimizer step in each process: the global batch "
                          "is split into processes x this many equal shards (less memory, the "
                          "same step)"),
}
TARGET = {
    "n_layer": setting(6, "target: transformer blocks", cuda=8, tiny=2),
    "n_head": setting(8, "target: attention heads per block", tiny=2),
    "n_embd": setting(256, "target: model width", cuda=512, tiny=32),
    "target_iters": setting(1300, "target: optimizer steps", cuda=4000, quick=120, tiny=30),
    "target_lr": setting(2e-3, "target: peak learning rate", cuda=1e-3, tiny=3e-3),
}
SHARED = {
    "block_size": setting(256, "context window (target and drafters; with --init-from at most "
                          "the model's, whose first positions are kept)", cuda=512, tiny=64),
    "batch_size": setting(8, "sequences per optimizer step (every stage; under torchrun the "
                          "global batch, split over the processes)", cuda=32, gpt2=16, tiny=4),
    "warmup": setting(60, "linear warmup steps before the cosine decay (every stage)",
                      type=number(int, 0), cuda=200, quick=20, tiny=5),
}
DISTILL = {
    "gen_seqs": setting(1024, "sequences the target writes once (out/distill.pt) for every "
                        "drafter stage with text 'gen'", cuda=2048, gpt2=4096, quick=128,
                        tiny=8),
    "gen_sampled": setting(0.25, "share of them sampled at --gen-temperature instead of greedy "
                           "(so drafters see sampled text too)", type=number(float, 0, 1)),
    "gen_temperature": setting(0.8, "temperature of the sampled share (the papers regenerate at "
                               "about 0.7)"),
    "feature_cache": setting(1, "1: run the target over the distillation set once and keep its "
                             "logits and states in host memory (bfloat16); 0: every step",
                             type=number(int, 0, 1), cuda=0),
}

SMALL = {
    "small_layers": setting(1, "small: number of blocks", cuda=2, gpt2=4),
    "small_embd": setting(128, "small: width", cuda=256, gpt2=384, tiny=16),
    "small_heads": setting(4, "small: attention heads", gpt2=6, tiny=2),
    "small_iters": setting(500, "small: optimizer steps", cuda=2000, gpt2=6000, quick=60,
                           tiny=10),
    "small_lr": setting(3e-3, "small: peak learning rate", cuda=2e-3),
    "small_distill": setting(1.0, "small: weight of the KL-to-target loss (1 = pure "
                             "distillation, 0 = the text's own tokens only)",
                             type=number(float, 0, 1)),
    "small_text": setting("gen", "small: training text, 'gen' (the distillation set the "
                          "target wrote) or 'data' (the corpus)", choices=["gen", "data"]),
}

MTP = {
    "mtp_mode": setting("posthoc", "mtp: 'joint' (the target trains with L_main + lambda*L_mtp "
                        "and writes mtp.pt too) or 'posthoc' (the head trains on the frozen "
                        "target)", choices=["joint", "posthoc"]),
    "mtp_modules": setting(1, "mtp: chained MTP modules D (DeepSeek-V3: 1); deeper drafts reuse "
                           "the last one"),
    "mtp_lambda": setting(0.3, "mtp: weight of the MTP loss in joint mode (DeepSeek-V3: 0.3)",
                          type=number(float, 0)),
    "mtp_iters": setting(1500, "mtp: optimizer steps in posthoc mode", gpt2=6000, quick=60,
                         tiny=10),
    "mtp_lr": setting(2e-3, "mtp: peak learning rate in posthoc mode", cuda=1e-3, tiny=3e-3),
    "mtp_distill": setting(0.5, "mtp: posthoc loss, weight of the KL to the target's "
                           "distribution of the token after next (1 = pure distillation, 0 = "
                           "the text's own tokens only)", type=number(float, 0, 1)),
    "mtp_text": setting("gen", "mtp: posthoc training text, 'gen' (the distillation set the "
                        "target wrote) or 'data' (the corpus)", choices=["gen", "data"]),
    "mtp_unroll": setting(4, "mtp: posthoc, draft steps the one module is unrolled over in "
                          "training, each fed its own last output (FastMTP); 1 = depth 1 only, "
                          "DeepSeek-V3's", type=number(int, 1), tiny=3),
    "mtp_anchors": setting(32, "mtp: posthoc, positions per training sequence at which steps 2.. "
                           "are unrolled (step 1 trains at every position)", type=number(int, 1),
                           tiny=8),
    "mtp_beta": setting(0.6, "mtp: posthoc, weight decay of the unrolled steps' losses, "
                        "beta^(j-1) (FastMTP: 0.6)", type=number(float, above=0)),
}

EAGLE = {
    "eagle_iters": setting(2000, "eagle: optimizer steps", gpt2=6000, quick=60, tiny=10),
    "eagle_lr": setting(2e-3, "eagle: peak learning rate", cuda=1e-3, tiny=3e-3),
    "eagle_unroll": setting(4, "eagle: draft steps unrolled in training on its own outputs (the "
                            "training-time test); 1 = teacher forcing only", tiny=3),
    "eagle_anchors": setting(32, "eagle: positions per training sequence at which steps 2.. are "
                             "unrolled (step 1 trains at every position)", tiny=8),
    "eagle_beta": setting(0.8, "eagle: weight decay of the unrolled steps' losses, beta^(j-1) "
                          "(EAGLE-3's code: 0.8)"),
    "eagle_distill": setting(0.5, "eagle: weight of the KL to the target's distribution (1 = "
                             "pure distillation, 0 = the text's own tokens only)",
                             type=number(float, 0, 1)),
    "eagle_taps": setting("auto", "eagle: the three target layers fused, e.g. '2,4,6' ('auto': "
                          "a third, two thirds and the last)"),
}

DFLASH = {
    "dflash_layers": setting(2, "dflash: draft layers (the paper: 5 at 8B scale)",
                             cuda=3, gpt2=4, tiny=1),
    "dflash_heads": setting(8, "dflash: attention heads (its width is the target's)", gpt2=12,
                            tiny=2),
    "dflash_block": setting(16, "dflash and dspark: the block they draft with, anchor + "
                            "block-1 masks (so up to block-1 drafts a round)",
                            type=number(int, 2), quick=8),
    "dflash_gamma": setting(3.0, "dflash and dspark: position weight decay, w_k = "
                            "exp(-(k-1)/gamma) (the paper: 4 at block 8, 7 at 16)", cuda=7.0),
    "dflash_anchors": setting(8, "dflash and dspark: random anchors (blocks) per training "
                              "sequence at the full block", cuda=32, quick=16, tiny=4),
    "dflash_iters": setting(1000, "dflash: steps at the full block, after the narrow phase "
                            "(DFlash trains --dflash-narrow-iters + these in all)",
                            cuda=2000, gpt2=6000, quick=400, tiny=6),
    "dflash_lr": setting(1e-3, "dflash: peak learning rate at the full block",
                         quick=2e-3, tiny=3e-3),
    "dflash_narrow_block": setting(8, "dflash: the block of the narrow phase it trains first",
                                   type=number(int, 2)),
    "dflash_narrow_anchors": setting(16, "dflash: anchors per training sequence in the narrow "
                                     "phase", tiny=4),
    "dflash_narrow_iters": setting(5000, "dflash: steps at --dflash-narrow-block before the "
                                   "full block (0: no narrow phase)", type=number(int, 0),
                                   cuda=0, quick=0, tiny=8),
    "dflash_narrow_lr": setting(2e-3, "dflash: peak learning rate of the narrow phase",
                                tiny=3e-3),
    "dflash_text": setting("gen", "dflash and dspark: training text, 'gen' (the distillation set "
                           "the target wrote) or 'data' (the corpus); soft labels from the "
                           "target either way", choices=["gen", "data"]),
    "dflash_taps": setting("auto", "dflash and dspark: target layers read as context, e.g. "
                           "'1,2,3,4,5' ('auto': every block but the last)"),
}

DSPARK = {
    "dspark_rank": setting(256, "dspark: rank r of the Markov head W1[x] W2 (the paper's 256)",
                           tiny=8),
    "dspark_iters": setting(1000, "dspark: optimizer steps of its own", cuda=2000, gpt2=4000,
                            quick=120, tiny=8),
    "dspark_lr": setting(2e-3, "dspark: peak learning rate", cuda=1e-3, tiny=3e-3),
    "dspark_init": setting("dflash", "dspark: 'dflash' (the backbone starts from DFlash's own "
                           "training dspark_iters steps before its end, so both drafters get "
                           "the same number of steps) or 'scratch'", choices=["dflash", "scratch"]),
    "dspark_calib_seqs": setting(32, "dspark: held-out target continuations for the confidence "
                                 "calibration (0: none)", type=number(int, 0),
                                 cuda=256, quick=16, tiny=4),
    "dspark_sampled_iters": setting(400, "dspark: steps of its sampling weights, a copy "
                                    "fine-tuned on the sampled share of the distillation set, "
                                    "which bench.py and sample.py draft with when sampling "
                                    "(0: none)", type=number(int, 0), cuda=800, quick=20, tiny=4),
    "dspark_sampled_block": setting(5, "dspark: the block those steps train, anchor included "
                                    "(what a sampled round drafts is its first slots)",
                                    type=number(int, 2), tiny=3),
    "dspark_sampled_anchors": setting(16, "dspark: anchors per sequence in those steps",
                                      cuda=32, tiny=4),
}

GROUPS = {  # --help's groups, in order: title -> settings table
    "the run": RUN, "target": TARGET, "every stage": SHARED,
    "the distillation set (training/distill.py)": DISTILL,
    "small (draft_small.py)": SMALL, "mtp (draft_mtp.py)": MTP, "eagle (draft_eagle.py)": EAGLE,
    "dflash (draft_dflash.py)": DFLASH, "dspark (draft_dspark.py)": DSPARK,
}
SETTINGS = {name: s for table in GROUPS.values() for name, s in table.items()}
# a preset that takes another's values where it names none of its own: preset -> the chain
PRESETS_OF = {"mps": ("cuda",), "gpt2": ("gpt2", "cuda"), "gpu-small": ("gpt2", "cuda")}


def preset_values(preset):
    """{setting: value} of one preset."""
    return {name: s.value(PRESETS_OF.get(preset, preset)) for name, s in SETTINGS.items()}
