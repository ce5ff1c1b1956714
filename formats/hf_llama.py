"""
formats/hf_llama.py -- a Llama, Qwen2 or Qwen3 model from a Hugging Face folder on disk, as the
target (llama.py), with the tokenizer the folder ships; and such a folder written.

formats/pretrained.py reads any model folder or GGUF file; for a folder whose config.json names one
of these families it calls this file (formats/hf_folder.py: what every folder has):

    config.json        model_type llama | qwen2 | qwen3 (SmolLM2 is a llama folder): the widths,
                       heads and K/V heads, head_dim, rope_theta and the rope scaling Llama-3
                       names, rms_norm_eps, tie_word_embeddings, the biases
    model.safetensors  the weights (or its shards), by the family's names
                       (model.layers.0.self_attn.q_proj, ...),
                       mapped onto llama.py's (transformer.h.0.attn.c_attn: q, k and v stacked)
    tokenizer.json     read with the `tokenizers` package (optional: one error line names the
                       install where it is missing); a folder with only GPT-2's vocab.json +
                       merges.txt is read as formats/hf_gpt2.py reads GPT-2's, by tiktoken

A folder of another architecture, or a config that asks for something llama.py does not compute
(a sliding window, YaRN scaling, another activation), is refused in one line naming it.
"""

import json
import os

import torch

from formats.hf_folder import (BOOL, OBJECT, POSITIVE, POSITIVE_INT, STRING, field, refuse,
                               required, write_safetensors)
from formats.hf_gpt2 import byte_chars, merges_of, write_tokenizer_files
from llama import Llama, LlamaConfig
from runtime.command import atomic_write

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")  # what llama.rope_frequencies computes
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
    max_position_embeddings (pretrained.load shortens it to --block-size)."""
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
# the tokenizer: tokenizer.json (formats/hf_folder.py's HFTokenizer reads it)


def eos_of(folder, c):
    """The id that ends a document: config.json's eos_token_id (the first, if a list)."""
    eos = c.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if type(eos) is not int or not 0 <= eos < c["vocab_size"]:
        raise refuse(folder, f"config.json's eos_token_id {eos!r} is not a token of its vocabulary")
    return eos


# -----------------------------------------------------------------------------
# writing a folder: the tests', and --random's of a real model's shape


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


def write_llama_folder(model, merges, folder, family, dtype=torch.float32):
    """A Hugging Face folder of a llama.Llama as `family` (FAMILIES) writes it:
    config.json, model.safetensors (in dtype), and GPT-2-style vocab.json + merges.txt of
    256 + len(merges) + 1 tokens, at most the model's vocabulary (the rest is padding)."""
    check_family(model.config, family)
    if 256 + len(merges) + 1 > model.config.vocab_size:
        raise ValueError(f"{len(merges)} merges make more tokens than the model's "
                         f"{model.config.vocab_size}")
    os.makedirs(folder, exist_ok=True)
    eot = write_tokenizer_files(merges, folder)
    atomic_write(os.path.join(folder, "config.json"),
                 json.dumps(config_json(model, family, eot), indent=2))
    sd = {k: v.to(dtype) for k, v in from_llama(model).items()}
    write_safetensors(sd, os.path.join(folder, "model.safetensors"))


def random_llama(shape, seed=0):
    """(family, a llama.Llama of LLAMA_SHAPES[shape] with the family's initialisation)."""
    family, fields = LLAMA_SHAPES[shape]
    torch.manual_seed(seed)
    return family, Llama(LlamaConfig(**fields)).eval()


