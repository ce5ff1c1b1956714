"""
formats/speculators.py -- a DFlash or DSpark drafter as the serving engines read one:
speculators' folder (vLLM's library), and such a folder read back as a drafter of this project.

speculators writes a drafter as two files, served by vLLM beside its target (--speculative-config):

    config.json        speculators_model_type (dflash | dspark), the draft layers' shape as a
                       Qwen3 config (transformer_layer_config), block_size, the target layers it
                       reads (aux_hidden_state_layer_ids: what vLLM captures for layer id L, the
                       stream entering layer L, which is the output of block L, this project's
                       tap L; so 1 <= L < the layer count), mask_token_id, whether the
                       anchor slot drafts (sample_from_anchor: this project's shift 1), DSpark's
                       Markov rank, and the verifier it drafts for
    model.safetensors  the drafter's own weights by Qwen3's names (fc, hidden_norm,
                       layers.N.self_attn.q_proj, ..., norm; DSpark's markov_head and
                       confidence_head); the embedding and LM head are the verifier's, not saved

Only a drafter of the papers' layers (draft_dflash.py's "qwen3": --dflash-arch qwen3, the default
for a Llama or Qwen target) has this layout; the rest is refused in one line naming what differs.

    python -m formats.speculators export DIR --out-dir out --method dflash
    python -m formats.speculators import DIR --out-dir out     # -> out/dflash.pt
    python -m formats.speculators check DIR --out-dir out      # speculators' own logits

docs/your_model.md takes a model folder to a served drafter with these.
"""

import functools
import json
import os
import re
import sys

import torch

if not __package__:  # run by its path (python path/to/it.py): find the project as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import draft_dflash
import draft_dspark
from draft_dflash import DFlashConfig
from runtime.checkpoint import CheckpointError, load_drafter_checkpoint, save_checkpoint
from runtime.command import atomic_write, run
from runtime.declaration import Declaration
from runtime.settings import ArgumentParser, expand
from formats import hf_folder, hf_llama
from formats.hf_folder import read_json, read_safetensors, write_safetensors
from runtime.target import load_target

KINDS = {m.DRAFTER["name"]: Declaration(**m.DRAFTER) for m in (draft_dflash, draft_dspark)}
VERSION = "0.9.0"  # the speculators release whose layout this writes (and was checked against)

# this project's module names -> speculators' (two where this project stacks two matrices in one:
# the first half of its rows is the first name's)
NAMES = {"fc": ("fc",), "ctx_norm": ("hidden_norm",), "norm": ("norm",),
         "ln_1": ("input_layernorm",), "attn.c_q": ("self_attn.q_proj",),
         "attn.c_kv": ("self_attn.k_proj", "self_attn.v_proj"),
         "attn.c_proj": ("self_attn.o_proj",), "attn.q_norm": ("self_attn.q_norm",),
         "attn.k_norm": ("self_attn.k_norm",), "ln_2": ("post_attention_layernorm",),
         "mlp.c_fc": ("mlp.gate_proj", "mlp.up_proj"), "mlp.c_proj": ("mlp.down_proj",),
         "w1": ("markov_head.markov_w1",), "conf": ("confidence_head.proj",)}


def their_names(name):
    """One of our state_dict's names (a DSpark's backbone.* included) -> speculators' names."""
    module, param = name.removeprefix("backbone.").rsplit(".", 1)
    layer = ""
    if module.startswith("layers."):
        _, i, module = module.split(".", 2)
        layer = f"layers.{i}."
    if module not in NAMES:
        raise KeyError(name)
    return [f"{layer}{m}.{param}" for m in NAMES[module]]


def to_speculators(state_dict, head=None):
    """Our state_dict -> speculators' tensors (W2 of the Markov head is stored (r, V) here, as a
    Linear (V, r) there; the confidence temperatures are not weights: see confidence()). A draft
    vocabulary (our d2t: its target ids) is theirs as d2t (each id's offset from its place),
    t2d (which target ids are drafted) and lm_head, the rows of `head` (the target's LM head)
    it computes: an engine does not derive a reduced head from the verifier's."""
    out = {}
    for name, t in state_dict.items():
        if name == "d2t":
            out["d2t"] = t - torch.arange(len(t))
            out["t2d"] = torch.zeros(len(head), dtype=torch.bool).index_fill_(0, t, True)
            out["lm_head.weight"] = head[t].contiguous()
        elif name == "w2":
            out["markov_head.markov_w2.weight"] = t.t().contiguous()
        elif name != "conf_temp":
            names = their_names(name)
            out.update(zip(names, (c.contiguous() for c in t.chunk(len(names)))))
    return out


def from_speculators(tensors, like, folder):
    """speculators' tensors -> a state_dict shaped as `like` (a freshly built network's), every
    tensor accounted for: one missing, one left over or one of the wrong shape is an error."""
    left, sd = dict(tensors), {}
    for name, want in like.items():
        if name == "d2t":  # target ids from offsets; t2d and lm_head checked by folder_network
            d2t = left.pop("d2t", None)
            if d2t is None or d2t.shape != want.shape:
                raise ValueError(f"{folder}/model.safetensors lacks a d2t of {len(want)} tokens")
            sd[name] = d2t.long() + torch.arange(len(d2t))
            continue
        if name == "conf_temp":
            sd[name] = torch.ones_like(want)  # no temperatures there: sigmoid(z) as it is
            continue
        names = ["markov_head.markov_w2.weight"] if name == "w2" else their_names(name)
        missing = [n for n in names if n not in left]
        if missing:
            raise ValueError(f"{folder}/model.safetensors lacks {missing[0]}")
        t = torch.cat([left.pop(n) for n in names]).float()
        t = t.t() if name == "w2" else t
        if t.shape != want.shape:
            raise ValueError(f"{folder}/model.safetensors: {names[0]} is {tuple(t.shape)}, its "
                             f"config.json makes it {tuple(want.shape)}")
        sd[name] = t
    if left:
        raise ValueError(f"{folder}/model.safetensors holds weights this project does not compute "
                         f"({', '.join(sorted(left)[:3])})")
    return sd


# -----------------------------------------------------------------------------
# export: out/<method>.pt -> config.json + model.safetensors


EAGLE3 = ("this project's EAGLE-3 mixes the fused state and the token's embedding into one "
          "state (2d -> d) before a GPT-2 layer without positions; speculators' eagle3 feeds "
          "both to a Llama layer's attention (a first layer of doubled input), with rotary "
          "positions, over a reduced draft vocabulary (d2t/t2d) (docs/your_model.md)")


def block_network(kind, net):
    """The DFlash network that drafts the block: `net` itself, or a DSpark's backbone."""
    return net if kind == "dflash" else net.backbone


def exportable(kind, net, target_cfg):
    """Why this network cannot be written as speculators' (one line), or None."""
    cfg = block_network(kind, net).config
    if cfg.arch != "qwen3":
        return (f"this {kind} drafter is built of GPT-2's layers (LayerNorm, GELU, ALiBi, a "
                "learned embedding per mask slot) and speculators' of Qwen3's: train it with "
                "--dflash-arch qwen3")
    if cfg.alibi:
        return f"this {kind} drafter adds ALiBi to its attention, which speculators' does not"
    if target_cfg.n_layer in cfg.taps:
        return f"this {kind} drafter {LAST_TAP}: train it with --dflash-taps naming earlier layers"
    return None


# aux_hidden_state_layer_ids L: vLLM captures the stream entering layer L (0-based), the output of
# block L, this project's tap L; nothing enters a layer after the last
LAST_TAP = ("reads the target's last layer, and an engine's aux_hidden_state_layer_ids L is the "
            "stream entering layer L (vLLM's capture), which no layer after the last has")


def confidence(spark, uncalibrated):
    """DSpark's confidence head as speculators' computes it: one linear layer for every position.
    Temperatures the same at every position fold into it; per-position ones do not."""
    temps = spark.conf_temp
    w, b = spark.conf.weight.detach(), spark.conf.bias.detach()
    if uncalibrated or bool((temps == 1).all()):
        return w, b
    if bool((temps == temps[0]).all()):
        return w / temps[0], b / temps[0]
    raise ValueError("this DSpark's confidences are calibrated per position (temperatures "
                     f"{[round(t, 2) for t in temps.tolist()]}) and speculators' confidence head "
                     "has none: pass --uncalibrated to export the head as trained (the drafts are "
                     "the same, only its confidences differ), or train with --dspark-calib-seqs 0")


def layer_config(cfg, vocab_size, max_positions):
    """Our "qwen3" layers' shape as the transformer_layer_config speculators reads (Qwen3's)."""
    rope = {"rope_type": "default"} if cfg.rope_scaling is None else dict(cfg.rope_scaling)
    return {"model_type": "qwen3", "hidden_size": cfg.n_embd, "intermediate_size": cfg.n_hidden,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "attention_bias": cfg.bias,
            "rope_parameters": {**rope, "rope_theta": cfg.rope_base},
            "layer_types": ["full_attention"] * cfg.n_layer, "vocab_size": vocab_size,
            "max_position_embeddings": max_positions, "tie_word_embeddings": False}


def speculators_config(kind, net, target_cfg, verifier, dtype):
    """config.json for the network `net` (a DFlash, or a DSpark), drafting for `verifier`, its
    weights in `dtype`."""
    backbone = block_network(kind, net)
    cfg = backbone.config
    V = target_cfg.vocab_size
    c = {"architectures": ["DFlashDraftModel" if kind == "dflash" else "DSparkDraftModel"],
         "speculators_model_type": kind, "speculators_version": VERSION,
         "transformer_layer_config": layer_config(cfg, V, verifier["max_position_embeddings"]),
         "draft_vocab_size": cfg.draft_vocab or V, "block_size": cfg.block, "aux_hidden_state_layer_ids": cfg.taps,
         "mask_token_id": backbone.mask_token, "sample_from_anchor": cfg.shift == 1,
         "sliding_window_non_causal": False, "target_hidden_size": None,
         "tie_word_embeddings": False, "dtype": dtype,
         "speculators_config": {
             "algorithm": kind, "default_proposal_method": "greedy",
             "proposal_methods": [{"proposal_type": "greedy", "accept_tolerance": 0.0,
                                   "speculative_tokens": cfg.block - 1 + cfg.shift,
                                   "verifier_accept_k": 1}],
             "verifier": {"name_or_path": verifier["name_or_path"],
                          "architectures": verifier["architectures"]}}}
    if kind == "dspark":
        c.update(markov_rank=net.config.rank, markov_head_type="vanilla",
                 enable_confidence_head=True, confidence_head_with_markov=True)
    return c


def verifier_of(target_ckpt, name):
    """What config.json says of the verifier: its name (`name`, a hub id or a folder, else the
    hub id of the model the target was read from, else that folder), its transformers class and
    its own context, as the target's checkpoint recorded them when it was imported."""
    source = target_ckpt.get("init_from")
    if source is None:
        raise ValueError("the target was trained here, not read from a model, and vLLM serves a "
                         "drafter beside a model it loads: import one with --init-from")
    served = target_ckpt.get("source")
    if served is None:  # imported before its checkpoint recorded the model's class and context
        raise ValueError(f"the target's checkpoint predates what an export needs of {source}: "
                         "import the target again (train.py --init-from ... --only target "
                         "--force)")
    name = given_verifier(name) if name is not None else served["hub_id"]
    if name is None:
        if os.path.isfile(source):
            raise ValueError(f"the target was read from the GGUF {source}, which names no model "
                             "vLLM could load beside the drafter: name it with --verifier (a hub "
                             "id such as HuggingFaceTB/SmolLM2-135M-Instruct, or a folder)")
        if not os.path.isdir(source):
            raise ValueError(f"{source}, the folder the target was read from, is gone: name the "
                             "verifier with --verifier (the folder where the model is now, or "
                             "its hub id)")
        name = os.path.abspath(source)
    return {"name_or_path": name, "architectures": served["architectures"],
            "max_position_embeddings": served["context"]}


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # owner/name, or a bare name


def given_verifier(name):
    """--verifier as config.json writes it: a folder here, or a hub id (unchecked offline)."""
    if os.path.isdir(name):
        return os.path.abspath(name)
    if not name:
        raise ValueError("--verifier is empty: give the verifier's folder or hub id, or leave "
                         "the flag out for the model the target was read from")
    if not HUB_ID.fullmatch(name) or os.path.exists(name) or name.startswith("."):
        raise ValueError(f"--verifier {name} is neither a folder here nor a hub id (owner/name): "
                         "give the folder where the model is, or its hub id")
    print(f"note: --verifier {name} is no folder here: written as a hub id, not checked (an "
          "engine downloads it from there)")
    return name


def trained_network(out_dir, kind):
    """out/<kind>.pt's network (its greedy weights) and the target it drafts for, in float32."""
    target, target_ckpt = load_target(os.path.join(out_dir, "target.pt"))
    ckpt, _ = load_drafter_checkpoint(os.path.join(out_dir, f"{kind}.pt"), kind, target_ckpt)
    net = KINDS[kind].network(ckpt["config"], target)
    net.load_state_dict(ckpt["state_dict"])
    return net.eval(), target, target_ckpt


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def export(out_dir, kind, folder, verifier=None, uncalibrated=False, force=False,
           dtype="bfloat16"):
    """out/<kind>.pt -> folder/config.json + folder/model.safetensors, the weights in `dtype`:
    bfloat16 as speculators writes them and the engines serve them (half float32's bytes), or
    float32, the weights exactly as trained (an import gives them back bit for bit)."""
    if kind == "eagle":
        raise ValueError(f"EAGLE-3 is not exported: {EAGLE3}")
    net, target, target_ckpt = trained_network(out_dir, kind)
    why = exportable(kind, net, target.config)
    if why:
        raise ValueError(why)
    config = speculators_config(kind, net, target.config, verifier_of(target_ckpt, verifier),
                                dtype)
    tensors = to_speculators({k: v.detach().float() if v.is_floating_point() else v.detach()
                              for k, v in net.state_dict().items()},
                             target.lm_head.weight.detach().float())
    if kind == "dspark":
        w, b = confidence(net, uncalibrated)
        tensors["confidence_head.proj.weight"], tensors["confidence_head.proj.bias"] = w, b
    tensors = {n: t.to(DTYPES[dtype]) if t.is_floating_point() else t for n, t in tensors.items()}
    ready_folder(folder, force)
    write_safetensors(tensors, os.path.join(folder, "model.safetensors"), {"format": "pt"})
    atomic_write(os.path.join(folder, "config.json"),
                 (json.dumps(config, indent=2) + "\n").encode())
    return config


def ready_folder(folder, force):
    """A folder to write into, holding no drafter already unless --force."""
    held = [n for n in ("config.json", "model.safetensors")
            if os.path.exists(os.path.join(folder, n))]
    if held and not force:
        raise ValueError(f"{folder} already holds {held[0]}: pick another folder, or pass --force "
                         "to replace it")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{folder} is a file, not a folder")
    os.makedirs(folder, exist_ok=True)


# -----------------------------------------------------------------------------
# import: config.json + model.safetensors -> out/<kind>.pt


def read_folder(folder):
    """A speculators folder's config.json (parsed) and model.safetensors; one line why not."""
    paths = [os.path.join(folder, n) for n in ("config.json", "model.safetensors")]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"{missing[0]} not found: a speculators folder holds config.json and "
                         "model.safetensors")
    c = read_json(folder)  # a JSON object, or one line why not (as a model folder's)
    try:
        return c, read_safetensors(paths[1])
    except Exception as e:  # truncated, or not that format
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise ValueError(f"{paths[1]} is not a readable safetensors file ({first})") from None


def network_config(c, folder):
    """speculators' config.json -> (kind, the config our checkpoint of it holds), every value
    checked for its type and range (one line naming the key)."""
    try:
        return read_network_config(c, folder)
    except CheckpointError as e:
        raise ValueError(str(e)) from None


TAPS = ((list,), "a list of target layer numbers",
        lambda v: all(type(t) is int and t >= 1 for t in v) and len(v) > 0)
TOKEN = ((int,), "a token id", lambda v: v >= 0)
STRINGS = ((list,), "a list of strings", lambda v: all(isinstance(t, str) for t in v))


def read_network_config(c, folder):
    field = functools.partial(hf_folder.field, folder, c)
    kind = field("speculators_model_type", hf_folder.STRING)
    if kind is None:
        raise ValueError(f"{folder}/config.json names no speculators_model_type: it is not a "
                         "speculators drafter's folder (speculators writes dflash or dspark there)")
    if kind == "eagle3":
        raise ValueError(f"{folder} is an EAGLE-3 drafter, which this project does not read: "
                         f"{EAGLE3}")
    if kind not in KINDS:
        raise ValueError(f"{folder} is a {kind!r} drafter, not one of {', '.join(KINDS)}")
    tl = hf_folder.required(folder, c, "transformer_layer_config", hf_folder.OBJECT)
    tl = {"model_type": "qwen3", "max_position_embeddings": 1, **tl, "architectures": None}
    part = "config.json's transformer_layer_config"
    if hf_folder.field(folder, tl, "model_type", hf_folder.STRING, where=part) \
            not in hf_llama.FAMILIES:
        raise ValueError(f"{folder}'s draft layers are {tl['model_type']!r}, not Qwen3's")
    layer = hf_llama.read_llama_config(folder, tl)
    sliding = "sliding_attention" in (hf_folder.field(folder, tl, "layer_types", STRINGS,
                                                      where=part) or [])
    draft_vocab = field("draft_vocab_size", hf_folder.POSITIVE_INT, layer.vocab_size)
    reduced = draft_vocab < layer.vocab_size
    mask = field("mask_token_id", TOKEN)
    odd = [w for w, on in (("a sliding window", sliding), ("biases in the MLP", layer.mlp_bias),
                           (f"a reduced draft vocabulary ({draft_vocab} of {layer.vocab_size} "
                            "tokens), which DSpark's Markov head cannot draft over",
                            reduced and kind == "dspark"),
                           ("no mask_token_id", mask is None)) if on]
    rank = field("markov_rank", hf_folder.POSITIVE_INT, 256)
    if kind == "dspark":
        head = field("markov_head_type", hf_folder.STRING, "vanilla")
        odd += [w for w, on in ((f"a {head!r} Markov head", head != "vanilla"),
                                ("no confidence head",
                                 not field("enable_confidence_head", hf_folder.BOOL, True)))
                if on]
    if odd:
        raise ValueError(f"{folder}'s {kind} drafter has {odd[0]}, which this project does not "
                         "compute")
    field("confidence_head_with_markov", hf_folder.BOOL)  # read by imported(): checked here
    if draft_vocab > layer.vocab_size:
        raise ValueError(f"{folder}/config.json: draft_vocab_size {draft_vocab} is larger than "
                         f"its transformer_layer_config's vocab_size {layer.vocab_size}")
    cfg = DFlashConfig(n_embd=layer.n_embd, n_head=layer.n_head, n_layer=layer.n_layer,
                       taps=list(hf_folder.required(folder, c, "aux_hidden_state_layer_ids",
                                                    TAPS)),
                       block=hf_folder.required(folder, c, "block_size", hf_folder.POSITIVE_INT),
                       shift=int(field("sample_from_anchor", hf_folder.BOOL, kind == "dspark")),
                       rope_base=layer.rope_theta, arch="qwen3", bias=layer.qkv_bias,
                       n_kv_head=layer.n_kv_head, head_dim=layer.head_dim,
                       n_hidden=layer.n_hidden, norm_eps=layer.norm_eps,
                       rope_scaling=layer.rope_scaling, mask_token=mask,
                       draft_vocab=draft_vocab if reduced else 0)
    if kind == "dflash":
        return kind, cfg.to_dict()
    return kind, {"backbone": cfg.to_dict(), "dspark": {"rank": rank}}


def folder_network(folder, out_dir):
    """A speculators folder read as this project's network, for the target in out/ ->
    (kind, its config, the network, the folder's config.json, the target's checkpoint)."""
    c, tensors = read_folder(folder)
    kind, config = network_config(c, folder)
    target, target_ckpt = load_target(os.path.join(out_dir, "target.pt"))
    vocab = c["transformer_layer_config"].get("vocab_size")
    if vocab != target.config.vocab_size:
        raise ValueError(f"{folder} drafts for a model of {vocab} tokens, and the target in "
                         f"{out_dir} has {target.config.vocab_size}: it was trained for another "
                         "model")
    taps = config["backbone"]["taps"] if kind == "dspark" else config["taps"]
    if target.config.n_layer in taps:
        raise ValueError(f"{folder}'s drafter {LAST_TAP} (aux_hidden_state_layer_ids {taps}, "
                         f"the target has {target.config.n_layer} layers)")
    net = KINDS[kind].network(config, target)  # a width the target lacks: refused here
    if kind == "dspark" and c.get("confidence_head_with_markov") is False and \
            "confidence_head.proj.weight" in tensors:
        w = tensors["confidence_head.proj.weight"]  # reads h only: the code part weighs nothing
        tensors["confidence_head.proj.weight"] = torch.cat([w, w.new_zeros(1, net.config.rank)], 1)
    reduced = kind == "dflash" and net.config.draft_vocab
    if reduced:
        head, t2d = tensors.pop("lm_head.weight", None), tensors.pop("t2d", None)
    net.load_state_dict(from_speculators(tensors, net.state_dict(), folder))
    if reduced:
        check_draft_vocab(folder, net, head, t2d, target)
    return kind, config, net.eval(), c, target, target_ckpt


def check_draft_vocab(folder, net, head, t2d, target):
    """A reduced draft vocabulary is read only where this project computes it as written: t2d
    naming the d2t's ids, and lm_head the target's LM head at those rows (at the folder's
    precision): this project's drafter gathers those rows, it keeps no head of its own."""
    V = target.config.vocab_size
    if t2d is None or t2d.shape != (V,) or not torch.equal(t2d.nonzero().view(-1),
                                                          net.d2t.sort().values):
        raise ValueError(f"{folder}/model.safetensors: its t2d does not mark the {len(net.d2t)} "
                         "target ids its d2t names")
    rows = target.lm_head.weight.detach()[net.d2t]
    if head is None or head.shape != rows.shape or not torch.equal(head, rows.to(head.dtype)):
        raise ValueError(f"{folder}/model.safetensors: its lm_head is not the target's LM head at "
                         "the draft vocabulary's rows (a head trained on its own, or another "
                         "model's): this project drafts with the target's rows and cannot read it")


def imported(folder, out_dir, force=False):
    """folder (speculators') -> out/<kind>.pt, a drafter of the target in out/. -> its path."""
    kind, config, net, _, _, target_ckpt = folder_network(folder, out_dir)
    state = {k: v.detach() for k, v in net.state_dict().items()}
    path = os.path.join(out_dir, f"{kind}.pt")
    if os.path.exists(path) and not force:
        raise ValueError(f"{path} exists: move it away, or pass --force to replace it")
    save_checkpoint({"kind": kind, "config": config, "state_dict": state,
                     "target_hash": target_ckpt["model_hash"],
                     "tokenizer_hash": target_ckpt["tokenizer_hash"],
                     "imported_from": os.path.abspath(folder)}, path)
    return path


# -----------------------------------------------------------------------------
# check: speculators' own model of a folder against this project's drafter


def theirs_of(kind, folder, target, attention, dtype):
    """speculators' own model of `folder`, in `dtype` whatever the folder's (loaded in a bfloat16
    folder's own dtype it would compute in bfloat16), with the verifier's embedding, head and
    final norm taken from out/'s target, the model it drafts for (its verifier is not loaded)."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel
    cls = DFlashDraftModel if kind == "dflash" else DSparkDraftModel
    config = cls.config_class.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = attention
    config.speculators_config.verifier.name_or_path = None
    theirs = cls.from_pretrained(folder, config=config, dtype=torch.float32).to(dtype).eval()
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.transformer.wte.weight)
        rows = theirs.d2t + torch.arange(len(theirs.d2t)) if theirs.use_draft_vocab else \
            torch.arange(target.config.vocab_size)
        for head in (theirs.lm_head, theirs.verifier_lm_head):
            head.weight.copy_(target.lm_head.weight[rows])
        theirs.verifier_norm.weight.copy_(target.transformer.ln_f.weight)
    return theirs


def compare(folder, out_dir, dtype=torch.float32, attention="eager", seed=0):
    """Max |difference| between speculators' own model of `folder` (its eager attention, or
    `attention`) and this project's reading of the same folder (what import writes), both in
    `dtype` (float32 by default, whatever the folder's), on the same target states and blocks:
    their draft logits (DSpark's with the Markov bias) and DSpark's confidence logits. Needs
    speculators (and transformers) installed."""
    kind, _, net, c, target, _ = folder_network(folder, out_dir)
    net, target = net.to(dtype), target.to(dtype)
    theirs = theirs_of(kind, folder, target, attention, dtype)
    backbone = block_network(kind, net)
    cfg = backbone.config
    T = min(64, target.config.sequence_len)
    x = torch.randint(0, target.config.vocab_size, (1, T),
                      generator=torch.Generator().manual_seed(seed))
    anchors = torch.arange(1, T - cfg.block - 1, max(1, (T - cfg.block) // 4))[None]  # (1, A)
    with torch.no_grad():
        _, _, hid = target(x, hidden_layers=cfg.taps)
        h, tpos = draft_dflash.training_states(backbone, x, hid, anchors)  # (1, A, P, d)
        ours = backbone.logits(h)
        mask = torch.zeros(1, T, dtype=torch.long)
        mask[0, anchors[0]] = 1  # exactly these anchors: speculators picks from the valid ones
        hidden, logits, *_ = theirs._backbone_forward(
            torch.cat([hid[t] for t in cfg.taps], -1), x, mask, hid[cfg.taps[-1]],
            torch.zeros(1, T, dtype=torch.long), max_anchors=anchors.size(1))
        A, B = anchors.size(1), cfg.block
        logits, hidden = logits.view(A, B, -1), hidden.view(A, B, -1)
        out = {}
        if kind == "dspark":
            prev = x[0, tpos[0] - 1]  # (A, P): the token before each prediction
            ours = ours + net.markov(prev)
            slot_prev = torch.cat([prev[:, :1], prev], 1) if cfg.shift == 0 else prev
            logits = logits + theirs.markov_head.block_bias(prev_token_ids=slot_prev,
                                                            hidden_states=hidden)
            code = theirs.markov_head.markov_w1(slot_prev)
            with_code = c.get("confidence_head_with_markov", True)
            z = theirs.confidence_head(torch.cat([hidden, code], -1) if with_code else hidden)
            z = z[:, 1 - cfg.shift:]
            mine = torch.cat([net.features(h)[0], net.w1(prev)], -1) @ net.conf.weight[0] \
                + net.conf.bias
            out["confidence"] = (z - mine).abs().max().item()
        out["logits"] = (logits[:, 1 - cfg.shift:] - ours[0]).abs().max().item()
    return kind, out


def verifier_note(folder):
    """A line where the verifier the folder names is a path that is not a folder here (an
    engine loads the model from there), else None."""
    name = read_json(folder).get("speculators_config", {}).get("verifier", {}).get(
        "name_or_path")
    if isinstance(name, str) and os.path.isabs(name) and not os.path.isdir(name):
        return (f"note: its verifier, {name}, is not a folder here: an engine loads the model "
                "from there (export again with --verifier naming where it is)")
    return None


# -----------------------------------------------------------------------------
# the command


def build_parser():
    p = ArgumentParser(prog="python -m formats.speculators",
                       description="Write a trained DFlash or DSpark drafter as speculators' "
                       "folder (vLLM serves it), or read one as a drafter of out/'s target.")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="out/<method>.pt -> DIR/config.json + model.safetensors")
    im = sub.add_parser("import", help="DIR -> out/<its kind>.pt, for bench.py and sample.py")
    ck = sub.add_parser("check", help="speculators' own logits of DIR against out/'s drafter "
                        "(needs speculators installed)")
    for s in (ex, im, ck):
        s.add_argument("folder", type=expand, help="the speculators folder")
        s.add_argument("--out-dir", type=expand, default="out",
                       help="the run: its target.pt and the drafter (default: out)")
    for s in (ex, im):
        s.add_argument("--force", action="store_true",
                       help="replace what is there already (default: refuse)")
    ex.add_argument("--method", choices=[*sorted(KINDS), "eagle"], default="dflash",
                    help="the drafter to export (default: dflash; eagle is refused, saying why)")
    ex.add_argument("--verifier", default=None,
                    help="the verifier config.json names, a folder or a hub id (default: the "
                    "folder the target was read from)")
    ex.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                    help="the weights' dtype (default: bfloat16, as speculators writes them and "
                    "the engines serve them, half float32's size; float32: exactly as trained)")
    ex.add_argument("--uncalibrated", action="store_true",
                    help="dspark: export its confidence head without the per-position "
                    "temperatures it was calibrated with (default: refuse such a head)")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.command == "export":
        c = export(a.out_dir, a.method, a.folder, a.verifier, a.uncalibrated, a.force, a.dtype)
        verifier = c["speculators_config"]["verifier"]["name_or_path"]
        print(f"wrote {a.folder}: {a.method}, block {c['block_size']}, reading target layers "
              f"{c['aux_hidden_state_layer_ids']}, for {verifier}")
    elif a.command == "import":
        print(f"wrote {imported(a.folder, a.out_dir, a.force)} from {a.folder}")
    else:
        try:
            kind, diff = compare(a.folder, a.out_dir)  # the folder checked first
        except ImportError as e:
            raise ValueError(f"check needs speculators installed ({e}): pip install "
                             "speculators, in a virtual environment of its own") from None
        print(f"{kind}: max |difference| against speculators' own model, float32: " +
              ", ".join(f"{k} {v:.2e}" for k, v in diff.items()))
        note = verifier_note(a.folder)
        if note:
            print(note)
        if max(diff.values()) > 1e-4:
            raise ValueError("the logits differ by more than 1e-4")


if __name__ == "__main__":
    run(main, errors=(ValueError, CheckpointError, OSError))
