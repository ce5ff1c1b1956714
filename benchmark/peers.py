"""
benchmark/peers.py -- the engines a user would pick instead, on the same weights: transformers'
generate (plain decoding, and its prompt-lookup decoding) and llama.cpp through llama-cpp-python
(plain decoding, and its LlamaPromptLookupDecoding) on the very GGUF the target came from, timed
beside every method bench.py runs (plain decoding and prompt lookup at least) in one process.

transformers gets the target's own weights (its GPT-2, Llama, Qwen2 or Qwen3 class, built from the
target's config; for a GGUF they equal transformers' own GGUF loading, tests/test_gguf.py), in the
run's dtype. llama.cpp reads the GGUF itself and computes on its quantized blocks with its own
kernels: the same model, other arithmetic, so its text may leave ours at a near-tie. Each engine
gets the same prompt ids, greedy, the same new tokens at most, and stops at the same end-of-turn
ids; every engine and method runs each prompt in a shuffled order (bench.py's interleaving), from a
cold cache (llama.cpp's prefix cache is reset). Each engine's speedup is over its own plain
decoding. Both peers are optional: where one is not installed, or cannot read the target
(llama.cpp reads GGUF files), its rows say why.

    python bench.py --methods ar,lookup --peers --prompts chat     # pip install transformers
"""

import os
import random
import statistics

import torch

from draft_lookup import LookupDrafter
from formats import hf_llama
from gpt import GPTConfig
from runtime.profiling import timed
from sampler import Sampler
from speculative import generate_plain, generate_speculative

LOOKUP_TOKENS = 10  # every engine's prompt lookup drafts this many: transformers' documented value


# -----------------------------------------------------------------------------
# the same model in transformers


def family_of(cfg):
    """transformers' family of a llama.LlamaConfig: Qwen3's q/k norms, Qwen2's q/k/v-only biases,
    else Llama's."""
    if cfg.qk_norm:
        return "qwen3"
    return "qwen2" if cfg.qkv_bias and not cfg.proj_bias else "llama"


def to_transformers(target, eos):
    """transformers' own model class holding the target's weights (GPT-2's Conv1D stores a Linear
    weight transposed; the Llama family's as formats/hf_llama.py writes a folder)."""
    import transformers
    c = target.config
    if isinstance(c, GPTConfig):
        cfg = transformers.GPT2Config(vocab_size=c.vocab_size, n_positions=c.sequence_len,
                                      n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
                                      activation_function=c.activation, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5)
        sd = {n: w.t() if n.startswith("transformer.h.") and n.endswith(
            ("c_attn.weight", "c_fc.weight", "c_proj.weight")) else w
            for n, w in target.state_dict().items()}
    else:
        family = family_of(c)
        d = hf_llama.config_json(target, family, eos)
        cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        sd = hf_llama.from_llama(target)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).to(
        dtype=target.lm_head.weight.dtype, device=target.lm_head.weight.device).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", True) else set()
    if unexpected or set(missing) - tied - {m for m in missing if m.endswith("attn.bias")}:
        raise ValueError(f"the target's weights do not map onto {type(hf).__name__}: missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}")
    return hf


def hf_generate(hf, prompt, n, stop, lookup=None):
    """transformers' greedy generate: n new tokens at most, ending at a stop id (kept)."""
    x = torch.tensor([prompt], device=hf.device)
    kw = dict(prompt_lookup_num_tokens=lookup) if lookup else {}
    ends = dict(eos_token_id=sorted(stop), pad_token_id=min(stop)) if stop else dict(
        eos_token_id=None, pad_token_id=0, min_new_tokens=n)
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                          do_sample=False, **ends, **kw)
    return out[0, len(prompt):].tolist()


# -----------------------------------------------------------------------------
# llama.cpp on the GGUF


def llama_cpp_engines(path, n_ctx, threads):
    """{method: Llama} of llama-cpp-python: plain decoding, and its prompt lookup (a draft model
    asks for every position's logits, logits_all)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    kw = dict(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
              n_batch=512, verbose=False)
    return {"plain": Llama(**kw),
            "lookup": Llama(**kw, logits_all=True,
                            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS))}


def llama_cpp_generate(llm, prompt, n, stop):
    """llama.cpp's greedy decoding from a cold cache: n new tokens at most, ending at a stop id
    (kept). Its generate() yields ids and never stops by itself."""
    llm.reset()  # else it keeps the cache of a prompt that shares a prefix (and is faster)
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        out.append(tok)
        if tok in stop or len(out) == n:
            return out
    return out


# -----------------------------------------------------------------------------
# the table


def engines(target, weights, target_ckpt, args, methods=None):
    """({(engine, method): prompt -> ids}, {engine: why it is not there}). nanospec decodes with
    `target` (its arithmetic: --arithmetic), transformers with `weights` (the float model).
    methods: nanospec's rows, {name: prompt -> ids} (bench.py's methods), else plain decoding and
    prompt lookup."""
    n, stop, s = args.max_new_tokens, args.stop, Sampler("greedy")
    ours = LookupDrafter(target.config.vocab_size)
    methods = methods or {
        "plain": lambda p: generate_plain(target, p, n, s, stop=stop),
        f"prompt lookup ({ours.default_k})": lambda p: generate_speculative(
            target, ours, p, n, ours.default_k, s, stop=stop)[0]}
    runs = {("nanospec", name): run for name, run in methods.items()}
    missing = {}
    try:
        hf = to_transformers(weights, min(stop) if stop else 0)
        runs[("transformers", "plain")] = lambda p: hf_generate(hf, p, n, stop)
        runs[("transformers", f"prompt lookup ({LOOKUP_TOKENS})")] = lambda p: hf_generate(
            hf, p, n, stop, LOOKUP_TOKENS)
    except ImportError:
        missing["transformers"] = "not installed: pip install transformers"
    except Exception as e:  # a release without this model's class, ...: its rows only are lost
        missing["transformers"] = f"it did not load the model ({type(e).__name__}: {e})"[:200]
    source = target_ckpt.get("init_from") or ""
    if not (source.endswith(".gguf") and os.path.isfile(source)):
        missing["llama.cpp"] = ("it reads GGUF files, and this target came from "
                                f"{source or 'training here'}")
    else:
        try:
            cpp = llama_cpp_engines(source, target.config.sequence_len, torch.get_num_threads())
            runs[("llama.cpp", "plain")] = lambda p: llama_cpp_generate(cpp["plain"], p, n, stop)
            runs[("llama.cpp", f"prompt lookup ({LOOKUP_TOKENS})")] = \
                lambda p: llama_cpp_generate(cpp["lookup"], p, n, stop)
        except ImportError:
            missing["llama.cpp"] = ("llama-cpp-python is not installed (docs/your_model.md: "
                                    "how to build it)")
        except Exception as e:  # a file its release does not read
            missing["llama.cpp"] = f"it did not load {source} ({type(e).__name__}: {e})"[:200]
    return runs, missing


def table(target, weights, target_ckpt, prompts, args, device, methods=None):
    """Every engine and method over every prompt, `repeats` times, interleaved -> the JSON's
    "peers": {"rows": [{engine, method, arithmetic, tokens_per_s, speedup (over its own plain),
    vs_llama_cpp (over llama.cpp's plain, where it ran), same (prompts whose text is nanospec
    plain decoding's)}], "missing": {engine: why}, "versions"}. nanospec decodes with `target`,
    transformers with `weights` (the float model: the same one, or the one it was made from);
    methods: nanospec's rows, as engines() takes them."""
    runs, missing = engines(target, weights, target_ckpt, args, methods)
    arithmetic = {"nanospec": args.arithmetic_ran.split(" (")[0],
                  "transformers": str(weights.lm_head.weight.dtype).replace("torch.", ""),
                  "llama.cpp": "its own (the GGUF's blocks)"}
    names = list(runs)
    for name in names:  # warm-up: first calls allocate and pick kernels
        runs[name](prompts[0])
    times = {name: [] for name in names}
    outs = {name: [None] * len(prompts) for name in names}
    for rep in range(args.repeats):
        for name in names:
            times[name].append(0.0)
        for i, p in enumerate(prompts):
            for name in random.Random(rep * len(prompts) + i).sample(names, len(names)):
                t, outs[name][i] = timed(lambda: runs[name](p), device)
                times[name][-1] += t
    ref = outs[("nanospec", "plain")]
    cpp = times.get(("llama.cpp", "plain"))
    rows = []
    for engine, method in names:
        plain, mine = times[(engine, "plain")], times[(engine, method)]
        texts = outs[(engine, method)]
        rows.append({"engine": engine, "method": method, "arithmetic": arithmetic[engine],
                     "tokens_per_s": sum(map(len, texts)) / statistics.median(mine),
                     "speedup": statistics.median(a / b for a, b in zip(plain, mine)),
                     "vs_llama_cpp": cpp and statistics.median(a / b for a, b in zip(cpp, mine)),
                     "same": sum(o == r for o, r in zip(texts, ref))})
    return {"rows": rows, "missing": missing, "versions": versions(), "n_prompts": len(prompts)}


def versions():
    out = {"torch": torch.__version__}
    for name, module in (("transformers", "transformers"), ("llama.cpp", "llama_cpp")):
        try:
            out[name] = __import__(module).__version__
        except ImportError:
            pass
    return out


def report(peers):
    """The peer table, as bench.py prints it."""
    n = peers["n_prompts"]
    lines = ["the engines a user would pick instead, on the same weights ("
             + ", ".join(f"{k} {v}" for k, v in peers["versions"].items()) + "):",
             f"{'engine':<14}{'method':<22}{'arithmetic':<28}{'tokens/s':>9}"
             f"{'vs its own plain':>18}{'vs llama.cpp plain':>20}"
             f"{'same text as nanospec plain':>29}"]
    for r in peers["rows"]:
        vs = f"{r['vs_llama_cpp']:>19.2f}x" if r.get("vs_llama_cpp") else f"{'-':>20}"
        lines.append(f"{r['engine']:<14}{r['method']:<22}{r.get('arithmetic', ''):<28}"
                     f"{r['tokens_per_s']:>9.1f}{r['speedup']:>17.2f}x{vs}{r['same']:>23}/{n}")
    lines += [f"{engine}: no rows: {why}" for engine, why in peers["missing"].items()]
    return "\n".join(lines)
