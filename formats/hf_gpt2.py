"""
formats/hf_gpt2.py -- GPT-2 from a Hugging Face folder on disk (gpt.py's model), and written as one.

    config.json                 n_embd, n_layer, n_head, n_positions, vocab_size, and
                                activation_function ("gelu_new": GPT-2's tanh-approximate GELU)
    model.safetensors           the weights (formats/hf_folder.py reads them)
      or pytorch_model.bin
    vocab.json + merges.txt     GPT-2's byte-level BPE, which tiktoken builds an Encoding from

The weights map onto gpt.GPT by name, as nanoGPT's from_pretrained maps them: GPT-2 stores the
four projections of each block (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) as Conv1D, the
transpose of an nn.Linear's weight; the output head is the token embedding (tied). The folder is
refused, one line naming what is wrong, if its weights are missing, its config is not GPT-2's,
or its tokenizer does not fit the weights' vocabulary.

The writer (write_folder) is here too: the tests write tiny GPT-2 folders with it, and
`python -m formats.pretrained DIR --random small` a GPT-2-small-shaped folder of random weights.
"""

import functools
import json
import os

import tiktoken.load
import torch

from formats import hf_folder
from formats.hf_folder import refuse
from formats.tokenizer import EOT  # GPT-2's end of text, the last token of its vocabulary
from gpt import GPT, GELU, GPTConfig
from runtime.command import atomic_write, replacing

# GPT-2's pre-tokenizer: tiktoken's pattern for its "gpt2" encoding
GPT2_PAT = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)"""
            r"""|\s""")
SHAPES = {  # --random's shapes: GPT-2 small, and one the tests' pipeline runs in seconds
    "small": dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024),
    "tiny": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64),
}
# config.json fields that would make the model compute something gpt.GPT does not -> what it is
OFF = {"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
       "add_cross_attention": False, "scale_attn_weights": True}

# -----------------------------------------------------------------------------
# config.json

def read_gpt2_config(folder, c):
    """A parsed config.json of model_type gpt2 -> gpt.GPTConfig (sequence_len = n_positions),
    after checking that it computes what gpt.py does."""
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
# the tokenizer: vocab.json + merges.txt -> tiktoken's ranks (formats/tokenizer.py: the Encoding)


def byte_chars():
    """GPT-2's printable stand-in for each byte in vocab.json and merges.txt: printable bytes
    are themselves, the rest chr(256 + n) in byte order (what tiktoken's loader undoes)."""
    keep = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


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


def load(folder, cfg, sequence_len=None):
    """gpt.GPT of the folder in float32 and eval mode; sequence_len: its first positions only."""
    model = to_gpt(folder, cfg, hf_folder.read_weights(folder))
    if sequence_len is not None and sequence_len != cfg.sequence_len:
        model = shorten(model, sequence_len)
    return model


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
        hf_folder.write_safetensors(sd, os.path.join(folder, "model.safetensors"))
    else:
        with replacing(os.path.join(folder, "pytorch_model.bin")) as tmp:
            torch.save(sd, tmp)


def random_gpt2(shape="small", vocab_size=50257, seed=0, activation="gelu_new"):
    """A GPT-2-shaped gpt.GPT with GPT-2's initialisation and no training."""
    s = SHAPES[shape]
    torch.manual_seed(seed)
    return GPT(GPTConfig(sequence_len=s["n_positions"], vocab_size=vocab_size, n_layer=s["n_layer"],
                         n_head=s["n_head"], n_embd=s["n_embd"], activation=activation)).eval()


