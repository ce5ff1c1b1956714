"""
training/hf_folder.py -- a Llama, Qwen2 or Qwen3 model from a Hugging Face folder on disk, as the
target (llama.py), with the tokenizer the folder ships.

training/pretrained.py reads GPT-2 folders and is the command that checks, writes and times a
folder; for a folder whose config.json names one of these families it calls this file:

    config.json        model_type llama | qwen2 | qwen3 (SmolLM2 is a llama folder): the widths,
                       heads and K/V heads, head_dim, rope_theta and the rope scaling Llama-3
                       names, rms_norm_eps, tie_word_embeddings, the biases
    model.safetensors  the weights (or its shards), by the family's names
                       (model.layers.0.self_attn.q_proj, ...),
                       mapped onto llama.py's (transformer.h.0.attn.c_attn: q, k and v stacked)
    tokenizer.json     read with the `tokenizers` package (optional: one error line names the
                       install where it is missing); a folder with only GPT-2's vocab.json +
                       merges.txt is read as training/pretrained.py reads GPT-2's, by tiktoken

A folder of another architecture, or a config that asks for something llama.py does not compute
(a sliding window, YaRN scaling, another activation), is refused in one line naming it.
"""

import json
import math
import os

import torch

from runtime.checkpoint import CheckpointError
from llama import Llama, LlamaConfig

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")  # what llama.rope_frequencies computes


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


# -----------------------------------------------------------------------------
# config.json -> llama.LlamaConfig


def rope_of(folder, c):
    """(rope_theta, rope_scaling or None) from a config in either layout: transformers 4's
    rope_theta + rope_scaling, or 5's rope_parameters holding both."""
    params = field(folder, c, "rope_parameters", OBJECT, {})
    scaling = field(folder, c, "rope_scaling", OBJECT) or {
        k: v for k, v in params.items() if k != "rope_theta"}
    theta = field(folder, params, "rope_theta", POSITIVE, where="config.json's rope_parameters") \
        or field(folder, c, "rope_theta", POSITIVE, 10000.0)
    part = "config.json's rope scaling"
    kind = (field(folder, scaling, "rope_type", STRING, where=part)
            or field(folder, scaling, "type", STRING, "default", where=part))
    if kind not in ROPE_TYPES:
        raise refuse(folder, f"config.json's rope scaling {kind!r} is not one of {ROPE_TYPES}")
    if kind == "default":
        return float(theta), None
    kinds = {"factor": POSITIVE, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE,
             "original_max_position_embeddings": POSITIVE_INT}
    need = ("factor",) if kind == "linear" else tuple(kinds)
    got = {k: field(folder, scaling, k, kinds[k], where=part) for k in need}
    missing = [k for k in need if got[k] is None]
    if missing:
        raise refuse(folder, f"config.json's {kind} rope scaling lacks {missing[0]}")
    if kind == "llama3" and got["high_freq_factor"] <= got["low_freq_factor"]:
        raise refuse(folder, f"config.json's llama3 rope scaling has high_freq_factor "
                     f"{got['high_freq_factor']}, not above low_freq_factor "
                     f"{got['low_freq_factor']}")
    return float(theta), {"rope_type": kind, **got}


def read_llama_config(folder, c):
    """A parsed config.json of one of FAMILIES -> llama.LlamaConfig, sequence_len the model's
    max_position_embeddings (pretrained.load_folder shortens it to --block-size)."""
    family = c["model_type"]
    names = field(folder, c, "architectures", ((list,), "a list of class names",
                                                lambda v: all(isinstance(n, str) for n in v)))
    if (names or [FAMILIES[family]])[0] != FAMILIES[family]:
        raise refuse(folder, f"config.json's architecture {names[0]!r} is not "
                     f"{FAMILIES[family]} (a causal language model)")
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size", "max_position_embeddings")
    size = {k: required(folder, c, k, POSITIVE_INT) for k in need}
    act = field(folder, c, "hidden_act", STRING, "silu")
    tp = field(folder, c, "pretraining_tp", POSITIVE_INT, 1)
    odd = [f"hidden_act {act!r}"] if act != "silu" else []
    odd += ["a sliding window"] if field(folder, c, "use_sliding_window", BOOL) else []
    odd += [f"pretraining_tp {tp}"] if tp != 1 else []
    if odd:
        raise refuse(folder, f"config.json sets {', '.join(odd)}, which llama.py does not compute")
    n_head = size["num_attention_heads"]
    n_kv = field(folder, c, "num_key_value_heads", POSITIVE_INT, n_head)
    head_dim = field(folder, c, "head_dim", POSITIVE_INT, size["hidden_size"] // n_head)
    if n_head % n_kv:
        raise refuse(folder, f"num_attention_heads {n_head} is not a multiple of "
                     f"num_key_value_heads {n_kv}")
    theta, scaling = rope_of(folder, c)
    bias = field(folder, c, "attention_bias", BOOL, False)
    return LlamaConfig(
        sequence_len=size["max_position_embeddings"], vocab_size=size["vocab_size"],
        n_layer=size["num_hidden_layers"], n_head=n_head, n_kv_head=n_kv,
        n_embd=size["hidden_size"], head_dim=head_dim, n_hidden=size["intermediate_size"],
        rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(field(folder, c, "rms_norm_eps", POSITIVE, 1e-6)),
        qkv_bias=True if family == "qwen2" else bias,
        proj_bias=False if family == "qwen2" else bias,
        mlp_bias=field(folder, c, "mlp_bias", BOOL, False), qk_norm=family == "qwen3",
        tie_embeddings=field(folder, c, "tie_word_embeddings", BOOL, False))  # transformers'


# -----------------------------------------------------------------------------
# the family's weight names <-> llama.py's


def names(cfg, i):
    """llama.py's name -> the family's name(s) for layer i (q, k, v and gate, up are stacked)."""
    hf, ours, qkv = f"model.layers.{i}.", f"transformer.h.{i}.", ("q_proj", "k_proj", "v_proj")
    out = {ours + "ln_1.weight": [hf + "input_layernorm.weight"],
           ours + "ln_2.weight": [hf + "post_attention_layernorm.weight"],
           ours + "attn.c_attn.weight": [hf + f"self_attn.{p}.weight" for p in qkv],
           ours + "attn.c_proj.weight": [hf + "self_attn.o_proj.weight"],
           ours + "mlp.c_fc.weight": [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
           ours + "mlp.c_proj.weight": [hf + "mlp.down_proj.weight"]}
    if cfg.qk_norm:
        for norm in ("q_norm", "k_norm"):
            out[ours + f"attn.{norm}.weight"] = [hf + f"self_attn.{norm}.weight"]
    if cfg.qkv_bias:
        out[ours + "attn.c_attn.bias"] = [hf + f"self_attn.{p}.bias" for p in qkv]
    if cfg.proj_bias:
        out[ours + "attn.c_proj.bias"] = [hf + "self_attn.o_proj.bias"]
    if cfg.mlp_bias:
        out[ours + "mlp.c_fc.bias"] = [hf + "mlp.gate_proj.bias", hf + "mlp.up_proj.bias"]
        out[ours + "mlp.c_proj.bias"] = [hf + "mlp.down_proj.bias"]
    return out


def name_map(cfg):
    out = {"transformer.wte.weight": ["model.embed_tokens.weight"],
           "transformer.ln_f.weight": ["model.norm.weight"]}
    for i in range(cfg.n_layer):
        out.update(names(cfg, i))
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ["lm_head.weight"]
    return out


def to_llama(folder, cfg, hf):
    """The family's state dict -> llama.Llama(cfg) in float32, every tensor accounted for: missing,
    unexpected or misshapen ones are refused, and so is a separate lm_head where the config says
    the head is tied (it would be silently ignored)."""
    # older files carry the rotary angles as buffers: llama.py computes them from the config
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings and "lm_head.weight" in hf and "model.embed_tokens.weight" in hf:
        if not torch.equal(hf.pop("lm_head.weight"), hf["model.embed_tokens.weight"]):
            raise refuse(folder, "config.json ties the output head to the embedding, but its "
                         "lm_head.weight differs from it")
    model = Llama(cfg)
    want, sd = model.state_dict(), {}
    wanted = {n for parts in name_map(cfg).values() for n in parts}
    missing, extra = sorted(wanted - set(hf)), sorted(set(hf) - wanted)
    if missing or extra:
        raise refuse(folder, f"its weights {'lack ' + missing[0] if missing else 'hold ' + extra[0]}"
                     f" ({len(missing)} missing, {len(extra)} unexpected)")
    for ours, parts in name_map(cfg).items():
        w = torch.cat([hf[p] for p in parts]) if len(parts) > 1 else hf[parts[0]]
        if w.shape != want[ours].shape:
            raise refuse(folder, f"{parts[0]} and the rest of {ours} are {tuple(w.shape)}, "
                         f"config.json implies {tuple(want[ours].shape)}")
        sd[ours] = w.to(torch.float32)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model.load_state_dict(sd)
    return model.eval()


def from_llama(model):
    """llama.Llama -> the family's state dict (the inverse of to_llama)."""
    cfg, sd = model.config, model.state_dict()
    out = {}
    for ours, parts in name_map(cfg).items():
        sizes = {1: [sd[ours].size(0)],
                 2: [cfg.n_hidden] * 2,
                 3: [cfg.n_head * cfg.head_dim] + [cfg.n_kv_head * cfg.head_dim] * 2}[len(parts)]
        out.update(zip(parts, (t.contiguous() for t in sd[ours].split(sizes))))
    return out


def config_json(model, family, eos):
    """config.json for model as transformers writes one of `family`."""
    c = model.config
    rope = {"rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling}
    return {"architectures": [FAMILIES[family]], "model_type": family, "hidden_size": c.n_embd,
            "intermediate_size": c.n_hidden, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head,
            "head_dim": c.head_dim, "max_position_embeddings": c.sequence_len,
            "vocab_size": c.vocab_size, "rms_norm_eps": c.norm_eps, "hidden_act": "silu",
            "tie_word_embeddings": c.tie_embeddings, "attention_bias": c.proj_bias,
            "mlp_bias": c.mlp_bias, "bos_token_id": eos, "eos_token_id": eos,
            "torch_dtype": "float32", **rope}


def check_family(cfg, family):
    """What `family`'s config.json can say of cfg: refuse a model the family's code would not
    compute as llama.py does."""
    qwen2 = (True, False)
    if family == "qwen2" and (cfg.qkv_bias, cfg.proj_bias) != qwen2:
        raise ValueError("a qwen2 folder has biases on q, k and v only")
    if family != "qwen2" and cfg.qkv_bias != cfg.proj_bias:
        raise ValueError(f"a {family} folder has attention biases on all four projections or none")
    if cfg.qk_norm != (family == "qwen3"):
        raise ValueError("q/k norms are Qwen3's, and every Qwen3 has them")


# -----------------------------------------------------------------------------
# the tokenizer: tokenizer.json through the `tokenizers` package


class HFTokenizer:
    """A tokenizer.json as the few methods of a tiktoken.Encoding the project calls: encode,
    encode_batch, decode, eot_token, n_vocab, is_special_token, decode_single_token_bytes. Special
    tokens written in the text (the end-of-text mark) are encoded as themselves, as tiktoken does
    with allowed_special, and a text gets what the tokenizer's own post-processor adds to every
    text (Llama-3's and TinyLlama's begin-of-text token; Qwen's and SmolLM2's add nothing), as the
    model saw its training documents and as transformers' tokenizer encodes a prompt."""

    def __init__(self, path, eot_token):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise CheckpointError(f"{path} needs the tokenizers package: pip install tokenizers") \
                from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the package raises its own exception type for bad files
            raise CheckpointError(f"{path} is not a tokenizer the tokenizers package reads "
                                  f"({str(e).splitlines()[0][:160]})") from None
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)
        self.eot_token = eot_token
        self.special = {t.content for t in self.tok.get_added_tokens_decoder().values()
                        if t.special}

    def encode(self, text, allowed_special=()):
        return self.tok.encode(text).ids

    def encode_batch(self, texts, allowed_special=()):
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def is_special_token(self, t):
        return self.tok.id_to_token(t) in self.special

    def decode_single_token_bytes(self, t):
        # a token that is part of a character decodes to U+FFFD here, not to its bytes: enough
        # for what reads it (benchmark/prompt_sets.py: which tokens end a line)
        return self.decode([t]).encode("utf-8")


def eos_of(folder, c):
    """The id that ends a document: config.json's eos_token_id (the first, if a list)."""
    eos = c.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if type(eos) is not int or not 0 <= eos < c["vocab_size"]:
        raise refuse(folder, f"config.json's eos_token_id {eos!r} is not a token of its vocabulary")
    return eos


def has_tokenizer_json(folder):
    return os.path.isfile(os.path.join(folder, "tokenizer.json"))
