"""
formats/hf_folder.py -- what every Hugging Face model folder has, whatever its model: a config.json
whose fields are checked where they are read, the weights in safetensors (one file or shards) or a
PyTorch pickle, and a tokenizer.json (formats/tokenizer.py reads it).

formats/hf_gpt2.py reads GPT-2's folders and formats/hf_llama.py the Llama family's on top of
this; formats/speculators.py reads and writes a drafter's folder with it. A folder is refused in
one line naming what is wrong (refuse()): a missing file, a field of the wrong type or an
impossible value, weights that do not load.
"""

import json
import math
import os
import struct

import torch

from runtime.checkpoint import CheckpointError
from runtime.command import atomic_write

def refuse(folder, why):
    return CheckpointError(f"{folder} is not a model folder train.py can use: {why}")


# what a config.json field may hold: (JSON types, what to call it, which values are possible)
POSITIVE_INT = ((int,), "a positive integer", lambda v: v >= 1)
POSITIVE = ((int, float), "a positive number", lambda v: 0 < v < math.inf)
BOOL = ((bool,), "true or false", None)
STRING = ((str,), "a string", None)
OBJECT = ((dict,), "a JSON object", None)


def field(folder, c, key, kind, default=None, where="config.json"):
    """c[key], or `default` where it is absent or null, checked to be of `kind` (POSITIVE_INT,
    ...): another JSON type or an impossible value is refused in one line naming the file, the
    key, what it holds and what it should (a bool is not a number here, as in JSON)."""
    v = c.get(key)
    if v is None:
        return default
    types, what, possible = kind
    if type(v) not in types or (possible is not None and not possible(v)):
        raise refuse(folder, f"{where}'s {key} is {json.dumps(v)[:60]}, not {what}")
    return v


def required(folder, c, key, kind):
    """field() where the key must be there."""
    v = field(folder, c, key, kind)
    if v is None:
        raise refuse(folder, f"config.json lacks {key} ({kind[1]})")
    return v



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
# the tokenizer: tokenizer.json (formats/tokenizer.py's HFTokenizer reads it)


def has_tokenizer_json(folder):
    return os.path.isfile(os.path.join(folder, "tokenizer.json"))
