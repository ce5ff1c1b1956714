"""
training/pretrained.py -- a pretrained model from a Hugging Face folder on disk, as the target.

gpt.py gave us the model and train.py trains it on the corpus; this file adds the other way a
user gets a target: weights they already have. `python train.py --init-from DIR` reads the
folder as the Hugging Face hub hands it out, with nothing downloaded. A GPT-2 folder is read
here; a Llama, Qwen2 or Qwen3 folder (llama.py's model) by training/hf_folder.py. GPT-2's:

    config.json                 n_embd, n_layer, n_head, n_positions, vocab_size, and
                                activation_function ("gelu_new": GPT-2's tanh-approximate GELU)
    model.safetensors           the weights (read with the safetensors package where it is
      or pytorch_model.bin      installed, else with the few lines below: the format is a JSON
                                header and raw bytes); the .bin with torch.load(weights_only=True)
    vocab.json + merges.txt     GPT-2's byte-level BPE, which tiktoken builds an Encoding from

The weights map onto gpt.GPT by name, as nanoGPT's from_pretrained maps them: GPT-2 stores the
four projections of each block (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) as Conv1D, the
transpose of an nn.Linear's weight; the output head is the token embedding (tied). The folder is
refused, one line naming what is wrong, if its weights are missing, its config is not GPT-2's,
or its tokenizer does not fit the weights' vocabulary.

The writer (write_folder) is here too: the tests write tiny GPT-2 folders with it, and
`--random` writes a GPT-2-small-shaped folder of random weights, whose forward cost `--cost`
measures against the toy target's (docs/results.md: a real-sized target).

    python -m training.pretrained DIR                      # check a folder: what it holds, does it load
    python -m training.pretrained DIR --random small       # write a random GPT-2-small-shaped folder
    python -m training.pretrained DIR --random smollm2-135m  # ... or SmolLM2-135M / Qwen3-0.6B-shaped
    python -m training.pretrained DIR --cost               # its forward cost at 1/8/16 tokens vs the toy
                                                  # (out/target.pt): docs/results.md
"""

import argparse
import dataclasses
import functools
import json
import os
import struct
import sys

import tiktoken.load
import torch

if not __package__:  # run by its path (python path/to/it.py): find the project as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.checkpoint import CheckpointError
from runtime.command import atomic_write, replacing, run
from training import hf_folder
from training.forward_cost import cost_models, report_cost
from training.data import Given
from training.tokenizer import EOT
from gpt import GPT, GELU, GPTConfig
from llama import Llama, LlamaConfig
from runtime.settings import ArgumentParser, expand, number, number_list, path_arg

# -----------------------------------------------------------------------------
# config.json

# GPT-2's pre-tokenizer: tiktoken's pattern for its "gpt2" encoding
GPT2_PAT = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)"""
            r"""|\s""")
SHAPES = {  # --random's shapes: GPT-2 small, and one the tests' pipeline runs in seconds
    "small": dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024),
    "tiny": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64),
}
LLAMA_SHAPES = {  # --random's Llama-family shapes: (family, llama.LlamaConfig's fields)
    "smollm2-135m": ("llama", dict(n_embd=576, n_layer=30, n_head=9, n_kv_head=3, head_dim=64,
                                   n_hidden=1536, vocab_size=49152, sequence_len=8192,
                                   rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True)),
    "qwen3-0.6b": ("qwen3", dict(n_embd=1024, n_layer=28, n_head=16, n_kv_head=8, head_dim=128,
                                 n_hidden=3072, vocab_size=151936, sequence_len=40960,
                                 rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                                 tie_embeddings=True)),
    "llama-tiny": ("llama", dict(n_embd=32, n_layer=2, n_head=4, n_kv_head=2, head_dim=8,
                                 n_hidden=64, vocab_size=256 + 64 + 1, sequence_len=64)),
}
# config.json fields that would make the model compute something gpt.GPT does not -> what it is
OFF = {"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
       "add_cross_attention": False, "scale_attn_weights": True}


refuse = hf_folder.refuse  # "DIR is not a model folder train.py can use: why"


def read_config(folder):
    """config.json -> gpt.GPTConfig (sequence_len = n_positions), after checking it is GPT-2's,
    or llama.LlamaConfig for a Llama, Qwen2 or Qwen3 folder (training/hf_folder.py)."""
    c = read_json(folder)
    if hf_folder.field(folder, c, "model_type", hf_folder.STRING) in hf_folder.FAMILIES:
        return hf_folder.read_llama_config(folder, c)
    return read_gpt2_config(folder, c)


def read_json(folder):
    if not os.path.isdir(folder):
        raise refuse(folder, "there is no such folder")
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            c = json.load(f)
    except FileNotFoundError:
        raise refuse(folder, "it has no config.json") from None
    except (OSError, ValueError) as e:
        raise refuse(folder, f"its config.json is unreadable ({e})") from None
    if not isinstance(c, dict):
        raise refuse(folder, "its config.json is not a JSON object")
    return c


def read_gpt2_config(folder, c):
    if c.get("model_type") != "gpt2":
        raise refuse(folder, f"config.json says model_type {c.get('model_type')!r}, not one of "
                     f"{', '.join(['gpt2', *hf_folder.FAMILIES])}")
    field = functools.partial(hf_folder.field, folder, c)
    act = field("activation_function", hf_folder.STRING, "gelu_new")
    if act not in GELU:
        raise refuse(folder, f"config.json's activation_function {act!r} is not one of "
                     f"{sorted(GELU)}")
    need = ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size")
    n = {k: hf_folder.required(folder, c, k, hf_folder.POSITIVE_INT) for k in need}
    odd = [k for k, v in OFF.items() if field(k, hf_folder.BOOL, v) != v]
    if field("n_inner", hf_folder.POSITIVE_INT) not in (None, 4 * n["n_embd"]):
        odd.append(f"n_inner {c['n_inner']}")
    if field("layer_norm_epsilon", hf_folder.POSITIVE, 1e-5) != 1e-5:
        odd.append(f"layer_norm_epsilon {c['layer_norm_epsilon']}")
    if n["n_embd"] % n["n_head"]:
        odd.append(f"n_embd {n['n_embd']} not a multiple of n_head {n['n_head']}")
    if odd:
        raise refuse(folder, f"config.json sets {', '.join(odd)}, which gpt.py does not compute")
    return GPTConfig(sequence_len=n["n_positions"], vocab_size=n["vocab_size"],
                     n_layer=n["n_layer"], n_head=n["n_head"], n_embd=n["n_embd"],
                     dropout=0.0, bias=True, activation=act)


# -----------------------------------------------------------------------------
# the weights: model.safetensors or pytorch_model.bin

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path):
    """{name: tensor} of a .safetensors file: with the safetensors package if installed, else
    here (8 bytes little-endian header length, a JSON header {name: {dtype, shape,
    data_offsets}}, then the raw little-endian bytes)."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        load_file = None
    if load_file is not None:
        return load_file(path)
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        lo, hi = h["data_offsets"]
        raw = bytearray(blob[8 + n + lo:8 + n + hi])
        t = torch.frombuffer(raw, dtype=DTYPES[h["dtype"]]) if raw else torch.empty(0)
        out[name] = t.to(DTYPES[h["dtype"]]).reshape(h["shape"])
    return out


def write_safetensors(tensors, path, metadata=None):
    """The inverse of read_safetensors (the tests' folders; --random; a drafter's export, whose
    readers want metadata {"format": "pt"})."""
    names = {v: k for k, v in DTYPES.items()}
    header, chunks, at = ({"__metadata__": metadata} if metadata else {}), [], 0
    for name, t in tensors.items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(raw)]}
        chunks.append(raw)
        at += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    atomic_write(path, struct.pack("<Q", len(head)) + head + b"".join(chunks))


INDEX = "model.safetensors.index.json"  # a sharded checkpoint's: which shard holds each tensor


def shards(folder):
    """The shard files the folder's index names, in order."""
    with open(os.path.join(folder, INDEX)) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def weight_files(folder):
    """The names of the files that hold a folder's model, those that exist: config.json and the
    weights read_weights reads (one file, or the index and the shards it names)."""
    has = lambda name: os.path.isfile(os.path.join(folder, name))  # noqa: E731
    weights = next((n for n in ("model.safetensors", INDEX, "pytorch_model.bin") if has(n)), None)
    names = ["config.json", *([weights] if weights else [])]
    if weights == INDEX:
        try:
            names += shards(folder)
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # read_weights names what is wrong
    return [n for n in names if has(n)]


def read_weights(folder):
    """The folder's state dict (Hugging Face names), from whichever file it has: one
    model.safetensors, the shards its index names (model.safetensors.index.json), or
    pytorch_model.bin."""
    st, binary = os.path.join(folder, "model.safetensors"), os.path.join(folder, "pytorch_model.bin")
    try:
        if os.path.isfile(st):
            return read_safetensors(st)
        if os.path.isfile(os.path.join(folder, INDEX)):
            return {k: v for shard in shards(folder)
                    for k, v in read_safetensors(os.path.join(folder, shard)).items()}
        if os.path.isfile(binary):
            return torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not that format, a pickle with code in it
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise refuse(folder, f"its weights are unreadable ({first})") from None
    raise refuse(folder, "it has no weights (model.safetensors, its shards, or pytorch_model.bin)")


# -----------------------------------------------------------------------------
# Hugging Face names <-> gpt.GPT's

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def to_gpt(folder, cfg, hf):
    """Hugging Face GPT-2 state dict -> gpt.GPT(cfg)'s (float32). Accepts GPT2LMHeadModel's names
    (transformer.h.0...) and GPT2Model's (h.0...); drops the attention-mask buffers old files
    carry; refuses missing, extra or misshapen tensors and an untied head."""
    hf = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
          for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    head = hf.pop("lm_head.weight", None)
    model = GPT(cfg)
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    missing, extra = sorted(set(want) - set(hf)), sorted(set(hf) - set(want))
    if missing or extra:
        raise refuse(folder, f"its weights {'lack ' + missing[0] if missing else 'hold ' + extra[0]}"
                     f" ({len(missing)} missing, {len(extra)} unexpected)")
    sd = {}
    for name, w in hf.items():
        w = w.t() if name.endswith(CONV1D) else w
        if w.shape != want[name].shape:
            raise refuse(folder, f"{name} is {tuple(w.shape)}, config.json implies "
                         f"{tuple(want[name].shape)}")
        sd[name] = w.to(torch.float32)
    if head is not None and not torch.equal(head.to(torch.float32), sd["transformer.wte.weight"]):
        raise refuse(folder, "its lm_head is not its token embedding (GPT-2 ties them)")
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model.load_state_dict(sd)
    return model.eval()


def from_gpt(model):
    """gpt.GPT -> a GPT2LMHeadModel state dict (the inverse of to_gpt; lm_head left tied)."""
    return {k: (v.t() if k.endswith(CONV1D) else v).contiguous()
            for k, v in model.state_dict().items() if k != "lm_head.weight"}


# -----------------------------------------------------------------------------
# the tokenizer: vocab.json + merges.txt -> tiktoken's ranks (tokenizer.encoding_from: the Encoding)


def byte_chars():
    """GPT-2's printable stand-in for each byte in vocab.json and merges.txt: printable bytes
    are themselves, the rest chr(256 + n) in byte order (what tiktoken's loader undoes)."""
    keep = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def tokenizer_of(folder, cfg):
    """The folder's tokenizer (data.Given), checked against the weights' vocabulary: a Llama or
    Qwen folder's tokenizer.json (through the tokenizers package), else vocab.json + merges.txt
    (GPT-2's byte-level BPE, by tiktoken). A padded embedding may hold more rows than the
    tokenizer has tokens (Qwen's); GPT-2's holds exactly as many."""
    if isinstance(cfg, LlamaConfig) and hf_folder.has_tokenizer_json(folder):
        path = os.path.join(folder, "tokenizer.json")
        eot = hf_folder.eos_of(folder, read_json(folder))
        n = hf_folder.HFTokenizer(path, eot).n_vocab
        with open(path, "rb") as f:
            given = Given(os.path.abspath(folder), json=f.read(), eot=eot, n_vocab=n)
    else:
        if isinstance(cfg, LlamaConfig) and not all(os.path.isfile(os.path.join(folder, f))
                                                    for f in ("vocab.json", "merges.txt")):
            raise refuse(folder, "it has no tokenizer.json (a Llama or Qwen folder's tokenizer; "
                         "vocab.json + merges.txt would do too): copy it in from the model's "
                         "files")
        ranks, _ = read_ranks(folder)
        n = len(ranks) + 1
        given = Given(os.path.abspath(folder), ranks=ranks, pattern=GPT2_PAT, n_vocab=n)
    if n > cfg.vocab_size or (isinstance(cfg, GPTConfig) and n != cfg.vocab_size):
        raise refuse(folder, f"its tokenizer has {n} tokens, its weights' vocabulary "
                     f"{cfg.vocab_size}")
    return given


def read_ranks(folder):
    """vocab.json + merges.txt -> (tiktoken mergeable ranks, the end-of-text id), checked."""
    merges, vocab = (os.path.join(folder, n) for n in ("merges.txt", "vocab.json"))
    for p in (merges, vocab):
        if not os.path.isfile(p):
            raise refuse(folder, f"it has no {os.path.basename(p)} (the GPT-2 tokenizer)")
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken caches by path: a changed file must count
    try:
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(merges, vocab)
        with open(vocab, encoding="utf-8") as f:
            eot = json.load(f).get(EOT)
    except AssertionError:
        raise refuse(folder, "its vocab.json does not match its merges.txt") from None
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise refuse(folder, f"its vocab.json or merges.txt is unreadable ({e})") from None
    finally:
        if saved is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR")
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved
    if eot != len(ranks):
        raise refuse(folder, f"its vocab.json has {EOT} at {eot}, not after its {len(ranks)} "
                     "tokens")
    return ranks, eot


def load_folder(folder, sequence_len=None):
    """(the model in float32 and eval mode, its tokenizer as a data.Given) of a folder, every part
    checked: gpt.GPT for GPT-2, llama.Llama for the Llama family. sequence_len: a shorter context
    than the model's (GPT-2 keeps its first sequence_len positions; a Llama's cache is only
    smaller)."""
    cfg = read_config(folder)  # refuses a folder that is not there
    given = tokenizer_of(folder, cfg)
    if sequence_len is not None and sequence_len > cfg.sequence_len:
        raise CheckpointError(f"--block-size {sequence_len} is longer than {folder}'s context "
                              f"window ({cfg.sequence_len} positions)")
    if isinstance(cfg, LlamaConfig):
        cfg = dataclasses.replace(cfg, sequence_len=sequence_len or cfg.sequence_len)
        return hf_folder.to_llama(folder, cfg, read_weights(folder)), given
    model = to_gpt(folder, cfg, read_weights(folder))
    if sequence_len is not None and sequence_len != cfg.sequence_len:
        model = shorten(model, sequence_len)
    return model, given


def shorten(model, sequence_len):
    """The same model with a context window of sequence_len (its first sequence_len positions)."""
    cfg = GPTConfig(**{**model.config.to_dict(), "sequence_len": sequence_len})
    short = GPT(cfg)
    sd = model.state_dict()
    sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:sequence_len]
    short.load_state_dict(sd)
    return short.eval()


# -----------------------------------------------------------------------------
# writing a folder: the tests' tiny GPT-2, and --random's GPT-2-small-shaped one


def merges_of(ranks):
    """Mergeable ranks -> GPT-2's merge list [(left, right)], each token split into two tokens
    of lower rank (tiktoken's loader only concatenates them back)."""
    out = []
    for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) == 1:
            continue
        cut = next(i for i in range(1, len(tok))
                   if ranks.get(tok[:i], r) < r and ranks.get(tok[i:], r) < r)
        out.append((tok[:cut], tok[cut:]))
    return out


def synthetic_merges(n):
    """n merges making n distinct tokens of 2+ bytes, deterministically: a vocabulary of GPT-2's
    size for a folder of random weights (no corpus behind it)."""
    toks, seen, merges, i = [bytes([b]) for b in range(256)], set(), [], 0
    while len(merges) < n:
        a, b = toks[i % len(toks)], toks[(7 * i + 3) % 256]
        i += 1
        if a + b not in seen:
            seen.add(a + b)
            merges.append((a, b))
            toks.append(a + b)
    return merges


def write_tokenizer_files(merges, folder):
    """vocab.json + merges.txt of a byte-level BPE: the 256 bytes, then merges in order, then
    end-of-text, whose id it returns."""
    chars = byte_chars()
    text = lambda tok: "".join(chars[b] for b in tok)  # noqa: E731
    order = sorted(range(256), key=lambda b: (chars[b] != chr(b), ord(chars[b])))
    vocab = {chars[b]: r for r, b in enumerate(order)}
    vocab.update({text(a + b): 256 + i for i, (a, b) in enumerate(merges)})
    vocab[EOT] = len(vocab)
    atomic_write(os.path.join(folder, "vocab.json"), json.dumps(vocab, ensure_ascii=False))
    atomic_write(os.path.join(folder, "merges.txt"),
                 "#version: 0.2\n" + "".join(f"{text(a)} {text(b)}\n" for a, b in merges))
    return vocab[EOT]


def write_tokenizer_json(ranks, path, eot="<|endoftext|>"):
    """A byte-level BPE tokenizer.json (the tokenizers package's format) of tiktoken-style ranks
    with end-of-text after them: the tests' folders. Needs the package."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    chars = byte_chars()
    text = lambda tok: "".join(chars[b] for b in tok)  # noqa: E731
    vocab = {text(t): r for t, r in ranks.items()}
    merges = [(text(a), text(b)) for a, b in merges_of(ranks)]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eot])
    atomic_write(path, tok.to_str())
    return json.loads(tok.to_str())["added_tokens"][0]["id"]


def write_folder(model, merges, folder, weights="safetensors"):
    """A Hugging Face GPT-2 folder of model (config.json, the weights, vocab.json, merges.txt)."""
    cfg = model.config
    if 256 + len(merges) + 1 != cfg.vocab_size:
        raise ValueError(f"{len(merges)} merges make {256 + len(merges) + 1} tokens, the model "
                         f"has {cfg.vocab_size}")
    os.makedirs(folder, exist_ok=True)
    eot = write_tokenizer_files(merges, folder)
    atomic_write(os.path.join(folder, "config.json"), json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "activation_function": cfg.activation, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_positions": cfg.sequence_len,
        "n_ctx": cfg.sequence_len, "vocab_size": cfg.vocab_size, "layer_norm_epsilon": 1e-5,
        "bos_token_id": eot, "eos_token_id": eot}, indent=2))
    sd = from_gpt(model)
    if weights == "safetensors":
        write_safetensors(sd, os.path.join(folder, "model.safetensors"))
    else:
        with replacing(os.path.join(folder, "pytorch_model.bin")) as tmp:
            torch.save(sd, tmp)


def write_llama_folder(model, merges, folder, family, dtype=torch.float32):
    """A Hugging Face folder of a llama.Llama as `family` (hf_folder.FAMILIES) writes it:
    config.json, model.safetensors (in dtype), and GPT-2-style vocab.json + merges.txt of
    256 + len(merges) + 1 tokens, at most the model's vocabulary (the rest is padding)."""
    hf_folder.check_family(model.config, family)
    if 256 + len(merges) + 1 > model.config.vocab_size:
        raise ValueError(f"{len(merges)} merges make more tokens than the model's "
                         f"{model.config.vocab_size}")
    os.makedirs(folder, exist_ok=True)
    eot = write_tokenizer_files(merges, folder)
    atomic_write(os.path.join(folder, "config.json"),
                 json.dumps(hf_folder.config_json(model, family, eot), indent=2))
    sd = {k: v.to(dtype) for k, v in hf_folder.from_llama(model).items()}
    write_safetensors(sd, os.path.join(folder, "model.safetensors"))


def random_llama(shape, seed=0):
    """(family, a llama.Llama of LLAMA_SHAPES[shape] with the family's initialisation)."""
    family, fields = LLAMA_SHAPES[shape]
    torch.manual_seed(seed)
    return family, Llama(LlamaConfig(**fields)).eval()


def random_gpt2(shape="small", vocab_size=50257, seed=0, activation="gelu_new"):
    """A GPT-2-shaped gpt.GPT with GPT-2's initialisation and no training."""
    s = SHAPES[shape]
    torch.manual_seed(seed)
    return GPT(GPTConfig(sequence_len=s["n_positions"], vocab_size=vocab_size, n_layer=s["n_layer"],
                         n_head=s["n_head"], n_embd=s["n_embd"], activation=activation)).eval()


# -----------------------------------------------------------------------------
# command line


def check_writable(folder, force):
    """--random's folder: one it can make or write to, and that holds nothing (a user's real
    GPT-2 weights are not replaced by random ones) unless --force."""
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
    p = ArgumentParser(prog="python -m training.pretrained",
                       description="Check, write or time a Hugging Face GPT-2 folder.")
    p.add_argument("folder", type=expand, help="the GPT-2 folder (config.json, weights, vocab.json, "
                   "merges.txt)")
    p.add_argument("--random", choices=sorted(SHAPES) + sorted(LLAMA_SHAPES), default=None,
                   help="write a folder of random weights of this shape (small: GPT-2 small; "
                   "tiny and llama-tiny: the tests'; smollm2-135m and qwen3-0.6b: those models' "
                   "shapes, in bfloat16 as the hub ships them) instead of reading one "
                   "(default: read)")
    p.add_argument("--force", action="store_true",
                   help="with --random, write into a folder that already holds files, replacing "
                   "them (default: refuse)")
    p.add_argument("--cost", action="store_true",
                   help="time the folder's forward of --sizes tokens against --toy's (default: "
                   "off)")
    p.add_argument("--sizes", type=number_list(), default=[1, 8, 16],
                   help="tokens per timed forward, comma-separated (default: 1,8,16)")
    p.add_argument("--toy", type=expand, default="out/target.pt",
                   help="the toy target to time beside it with --cost, if it exists "
                   "(default: out/target.pt)")
    p.add_argument("--context", type=number(int, lo=0), default=128,
                   help="cached positions before the timed forward (default: 128)")
    p.add_argument("--repeats", type=number(int, lo=1), default=30,
                   help="timed rounds (default: 30)")
    p.add_argument("--threads", type=number(int, lo=1), default=None,
                   help="torch CPU threads (default: torch's choice)")
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.random:
        check_writable(a.folder, a.force)
        write_random(a.random, a.folder)
    cfg = read_config(a.folder)
    need = a.context + max(a.sizes)  # --cost's: the cached context and the widest forward
    if a.cost and need > cfg.sequence_len:
        p.error(f"argument --context: {a.context} cached positions and a forward of "
                f"{max(a.sizes)} tokens do not fit in {a.folder}'s context window of "
                f"{cfg.sequence_len}")
    # a Llama's cache is as long as its context: tens of thousands of positions for Qwen3. The
    # check and --cost need only a short one (64 more: room for a block drafter's verify)
    short = min(cfg.sequence_len, need + 64) if isinstance(cfg, LlamaConfig) else None
    model, given = load_folder(a.folder, short)
    print(f"{a.folder}: {describe(model, cfg)}; tokenizer {given.n_vocab} tokens")
    if a.cost:
        with torch.no_grad():
            report_cost(cost_models(model, a.toy), a.context, a.sizes, a.repeats)


def write_random(shape, folder):
    if shape in LLAMA_SHAPES:
        family, model = random_llama(shape)
        vocab = model.config.vocab_size
        dtype = torch.bfloat16 if vocab > 1000 else torch.float32
        write_llama_folder(model, synthetic_merges(vocab - 257), folder, family, dtype)
        print(f"wrote a random {family} ({shape}, vocab {vocab}, {str(dtype)[6:]}) to {folder}")
        return
    vocab = 50257 if shape == "small" else 256 + 64 + 1
    write_folder(random_gpt2(shape, vocab), synthetic_merges(vocab - 257), folder)
    print(f"wrote a random GPT-2 ({shape}: {SHAPES[shape]}, vocab {vocab}) to {folder}")


def describe(model, cfg):
    """One line of what a folder's model is."""
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
