"""The Llama family as the target (llama.py; formats/hf_llama.py reads its Hugging Face folders):
the logits of transformers' own LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM in
float64 where transformers is installed, and of an independent forward written out from the
folder's tensors everywhere; the KV cache with rollback equal to a fresh prefill; every drafter,
tree and batch token-identical to plain decoding on a tiny Llama and a tiny Qwen3; folders of
other architectures refused in one line; the tiny pipeline end to end on a folder, the docs'
recipe (docs/your_model.md) in its CPU smoke version."""

import json
import math
import os
import shutil
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bench
import train
from conftest import LLAMAS, make, tiny_args, tiny_llama, within
from llama import Llama, LlamaConfig, rope_frequencies
from registry import drafters as registry
from serving.batched import serve
from sampler import Sampler
from speculative import generate_plain, generate_speculative
from test_batched import batched_drafter, batches, ragged_prompts
from test_pretrained import refused
from tree import BlockTree, Branches, generate_tree, same_cost
from formats import hf_folder, hf_gpt2, hf_llama, pretrained, speculators, tokenizer
from training import data, stages_dflash, tokenizer as bpe
from runtime.target import load_target

FAMILIES = sorted(LLAMAS)
VOCAB = 384


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return tiny_llama(request.param)


def prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


# -----------------------------------------------------------------------------
# the model: a cache that rolls back, and every drafter exact on it


def test_the_cache_with_rollback_equals_a_fresh_prefill(target):
    idx = torch.randint(0, target.config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = target(idx)[0]
        cache = target.new_cache()
        target(idx[:, :20], cache=cache)
        target(torch.randint(0, 64, (1, 9)), cache=cache)  # a verify whose tokens are all rejected
        cache.rollback(20)
        parts = [target(idx[:, 20:30], cache=cache)[0]]
        parts += [target(idx[:, t:t + 1], cache=cache)[0] for t in range(30, 50)]
    assert cache.k.size(2) == target.config.n_kv_head < target.config.n_head  # grouped K/V heads
    assert (torch.cat(parts, 1) - full[:, 20:]).abs().max().item() < 1e-12


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_every_drafter_is_token_identical(target, drafter_name, mode):
    drafter = make(drafter_name, target)
    rounds = 0
    for seed, p in enumerate(prompts(6, target.config.vocab_size)):
        ref = generate_plain(target, p, 40, Sampler(mode, 0.8, None, seed))
        out, stats = generate_speculative(target, drafter, p, 40, within(drafter, 4),
                                          Sampler(mode, 0.8, None, seed))
        assert out == ref, f"prompt {seed}"
        rounds += stats.rounds
    assert rounds > 0


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_trees_and_ragged_batches_are_token_identical(target, mode):
    trees = [BlockTree(make("dspark", target), nodes=12, width=2),
             BlockTree(make("dflash", target), nodes=16, cost=same_cost),
             Branches(make("lookup", target), make("dspark", target), 10, 8, sure=4)]
    ps = ragged_prompts(5, target.config.vocab_size, seed=3, window=target.config.sequence_len)
    refs = [generate_plain(target, p, 30, Sampler(mode, 0.8, None, 7)) for p in ps]
    for d in trees:
        for p, ref in zip(ps, refs):
            assert generate_tree(target, d, p, 30, Sampler(mode, 0.8, None, 7))[0] == ref
    for name in (n for n in registry.names() if batches(n)):
        d = batched_drafter(name, target, len(ps))
        out, _ = serve(target, d, ps, 30, within(d, 4),
                                  Sampler(mode, 0.8, None, 7))
        assert out == refs, name


# -----------------------------------------------------------------------------
# the folder: an independent forward of its tensors, and transformers' own model


def reference_logits(hf, c, idx):
    """The family's forward written out from a folder's tensors (its own names), independent of
    llama.py: RMSNorm, q/k/v (with biases and q/k norms where present), RoPE on (i, i + hs/2)
    pairs with the angles in float32 as the family computes them, grouped K/V heads repeated,
    causal softmax, SwiGLU. Default RoPE (no scaling)."""
    T, hd, nh, nkv = idx.size(1), c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    eps = c["rms_norm_eps"]
    rms = lambda x, w: w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    lin = lambda x, p: x @ hf[p + ".weight"].T + (hf[p + ".bias"] if p + ".bias" in hf else 0)  # noqa
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(T).float()[:, None] * inv  # (T, hd/2), float32
    cos, sin = torch.cat([ang.cos()] * 2, -1).double(), torch.cat([ang.sin()] * 2, -1).double()
    turn = lambda x: x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin  # noqa
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = hf["model.embed_tokens.weight"][idx]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, hf[p + "input_layernorm.weight"])
        q = lin(h, p + "self_attn.q_proj").view(1, T, nh, hd)
        k = lin(h, p + "self_attn.k_proj").view(1, T, nkv, hd)
        v = lin(h, p + "self_attn.v_proj").view(1, T, nkv, hd)
        if p + "self_attn.q_norm.weight" in hf:
            q, k = rms(q, hf[p + "self_attn.q_norm.weight"]), rms(k, hf[p + "self_attn.k_norm.weight"])
        q, k, v = turn(q.transpose(1, 2)), turn(k.transpose(1, 2)), v.transpose(1, 2)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~causal, float("-inf"))
        x = x + lin((att.softmax(-1) @ v).transpose(1, 2).reshape(1, T, nh * hd),
                    p + "self_attn.o_proj")
        h = rms(x, hf[p + "post_attention_layernorm.weight"])
        x = x + lin(F.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"),
                    p + "mlp.down_proj")
    head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    return rms(x, hf["model.norm.weight"]) @ head.T


def folder_model(family, seed=0, **over):
    """A tiny llama.Llama as `family`'s folders make it (qwen2: biases on q, k, v only)."""
    fields = dict(sequence_len=64, vocab_size=VOCAB, n_layer=2, n_embd=32, n_hidden=64,
                  n_head=4, n_kv_head=2, head_dim=8, rope_theta=10000.0)
    fields.update({"llama": dict(qkv_bias=True, proj_bias=True),
                   "qwen2": dict(qkv_bias=True, tie_embeddings=True),
                   "qwen3": dict(qk_norm=True, head_dim=16, tie_embeddings=True)}[family])
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(**{**fields, **over})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p)) if p.dim() == 1 else None
    return model


@pytest.fixture(scope="module")
def merges(corpus):
    train_docs, _ = data.load_documents(corpus)
    return hf_gpt2.merges_of(bpe.train_bpe(train_docs, VOCAB))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def folder(request, merges, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf_llama.write_llama_folder(folder_model(request.param), merges, d, request.param)
    return d


def test_the_folder_loads_with_an_independent_forwards_logits(folder):
    src = pretrained.read(str(folder))
    model, given = pretrained.load(src), src.tokenizer
    c = json.loads((folder / "config.json").read_text())
    hf = {k: v.double() for k, v in hf_folder.read_weights(str(folder)).items()}
    idx = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.double()(idx)[0]
    assert (ours - reference_logits(hf, c, idx)).abs().max().item() < 1e-10
    assert len(given.ranks) + 1 == VOCAB and isinstance(model, Llama)


def float64_norms(model):
    """transformers' RMSNorm casts its input to float32 (right for half precision, a loss in
    float64): compute it in the input's precision instead, so float64 compares with float64."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                              self.variance_epsilon))
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(forward, m)
    return model


HF_CONFIGS = {  # transformers' own configs, rope scaling and every switch included
    "llama": dict(attention_bias=True, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=16, tie_word_embeddings=False),
}


def their_folder(family, folder, merges):
    """transformers' own model of `family` (HF_CONFIGS), random weights moved off their init,
    written to `folder` by transformers with the tests' tokenizer beside it."""
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the configs here are transformers 5's (rope_parameters)")
    cfg = transformers.AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, **HF_CONFIGS[family])
    torch.manual_seed(1)
    theirs = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.2 * torch.randn_like(p))
    theirs.save_pretrained(folder)
    hf_gpt2.write_tokenizer_files(merges, folder)
    return theirs


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_transformers_own_model_computes_the_same_logits(family, tmp_path, merges):
    theirs = their_folder(family, tmp_path, merges)
    model = pretrained.load(pretrained.read(str(tmp_path)))
    assert model.config.rope_scaling == (None if family != "llama" else {
        k: v for k, v in HF_CONFIGS["llama"]["rope_parameters"].items() if k != "rope_theta"})
    idx = torch.randint(0, VOCAB, (2, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = float64_norms(theirs.double())(idx, output_hidden_states=True)
        logits, _, hid = model.double()(idx, hidden_layers=(1,))
    assert (logits - want.logits).abs().max().item() < 1e-9
    assert (hid[1] - want.hidden_states[1]).abs().max().item() < 1e-9


def test_the_tokenizer_json_encodes_as_transformers_does(folder, tmp_path, merges):
    pytest.importorskip("tokenizers")
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    eot = hf_llama.write_tokenizer_json(hf_gpt2.read_ranks(str(d))[0], d / "tokenizer.json")
    src = pretrained.read(str(d))
    model, given = pretrained.load(src), src.tokenizer
    assert given.kind == "hf" and given.eot == eot == VOCAB - 1
    enc = tokenizer.HFTokenizer(d / "tokenizer.json", given.eot)
    text = "def f(x):\n    return x + 1  # ünïcode\n" + tokenizer.EOT
    ids = enc.encode(text)
    assert enc.decode(ids) == text and ids[-1] == eot and len(ids) < len(text)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    assert theirs(text, add_special_tokens=False)["input_ids"] == ids


def test_rope_scaling_stretches_only_the_long_wavelengths():
    base = LlamaConfig(head_dim=128, rope_theta=500000.0)
    s = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}
    plain, scaled = rope_frequencies(base), rope_frequencies(LlamaConfig(**{**vars(base),
                                                                           "rope_scaling": s}))
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 8192 / 4, wavelen > 8192
    assert torch.equal(scaled[short], plain[short]) and short.any()
    assert torch.allclose(scaled[long], plain[long] / 8) and long.any()
    mid = ~short & ~long
    assert mid.any() and ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


# -----------------------------------------------------------------------------
# refusals: one error line naming what is wrong


@pytest.mark.parametrize("change,needle", [
    ({"model_type": "mistral"}, "model_type 'mistral', not one of gpt2, llama, qwen2, qwen3"),
    ({"use_sliding_window": True}, "a sliding window, which llama.py does not compute"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"architectures": ["Qwen3ForSequenceClassification"]}, "is not Qwen3ForCausalLM"),
    ({"head_dim": 4}, "config.json implies"),
])
def test_a_config_llama_py_does_not_compute_is_refused(folder, corpus, tmp_path, change, needle):
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    cfg = json.loads((d / "config.json").read_text())
    if "architectures" in change:
        cfg["model_type"] = "qwen3"
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    assert needle in refused(tmp_path, corpus, d)


@pytest.mark.parametrize("change,needle", [
    ({"model_type": ["qwen3"]}, "model_type is [\"qwen3\"], not a string"),
    ({"rope_scaling": "llama3"}, "rope_scaling is \"llama3\", not a JSON object"),
    ({"rope_scaling": [8.0]}, "rope_scaling is [8.0], not a JSON object"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor is 0, not a positive number"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     "high_freq_factor 4.0, not above low_freq_factor 4.0"),
    ({"rope_theta": -1}, "rope_theta is -1, not a positive number"),
    ({"rope_parameters": {"rope_theta": "1e6"}}, "rope_theta is \"1e6\", not a positive number"),
    ({"hidden_size": "32"}, "hidden_size is \"32\", not a positive integer"),
    ({"num_key_value_heads": 2.0}, "num_key_value_heads is 2.0, not a positive integer"),
    ({"head_dim": 0}, "head_dim is 0, not a positive integer"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is \"yes\", not true or false"),
    ({"rms_norm_eps": 0}, "rms_norm_eps is 0, not a positive number"),
    ({"architectures": "Qwen3ForCausalLM"}, "architectures is \"Qwen3ForCausalLM\", not a list"),
    ({"hidden_act": ["silu"]}, "hidden_act is [\"silu\"], not a string"),
])
def test_a_config_field_of_the_wrong_type_or_an_impossible_value_is_refused(
        folder, corpus, tmp_path, change, needle):
    """Each value read from config.json is checked where it is read: one line naming the key,
    what it holds and what it should (before: a TypeError, or a target whose loss was nan)."""
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    assert needle in refused(tmp_path, corpus, d)
    assert not (tmp_path / "out" / "target.pt").exists()


def test_a_tokenizer_json_without_the_package_names_the_install(folder, corpus, tmp_path,
                                                                 monkeypatch):
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    (d / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    assert "needs the tokenizers package: pip install tokenizers" in refused(tmp_path, corpus, d)


# -----------------------------------------------------------------------------
# the pipeline on a folder: docs/your_model.md's recipe, CPU smoke version


@pytest.fixture(scope="module")
def pipeline(folder, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_out")
    train.main(tiny_args(corpus, out, "--init-from", str(folder)))
    return out


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_every_drafter_trains_for_the_folders_model_and_decodes_exactly(pipeline, folder,
                                                                        tmp_path, mode):
    target, ckpt = load_target(str(pipeline / "target.pt"))
    want = pretrained.load(pretrained.read(str(folder)), target.config.sequence_len)
    assert isinstance(target, Llama) and ckpt["init_from"] == str(folder)
    assert all(torch.equal(want.state_dict()[k], v) for k, v in target.state_dict().items())
    res = bench.main(["--out-dir", str(pipeline), "--n-prompts", "2", "--max-new-tokens", "10",
                      "--prompt-len", "16", "--repeats", "1", "--sweep", "", "--plot", "",
                      "--dtype", "float64", "--sampling", mode, "--temperature", "0.8",
                      "--json", str(tmp_path / "b.json")])
    assert set(registry.names()) <= set(res["methods"])
    assert all(r["exact_match"] == 1.0 for r in res["methods"].values())


def test_a_vocabulary_beyond_uint16_is_stored_in_four_bytes(corpus, tmp_path):
    pytest.importorskip("tokenizers")
    merges = hf_gpt2.synthetic_merges(70000 - 257)
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({a + b: 256 + i for i, (a, b) in enumerate(merges)})
    path = tmp_path / "tokenizer.json"
    eot = hf_llama.write_tokenizer_json(ranks, path)
    given = tokenizer.Given(str(tmp_path), json=path.read_bytes(), eot=eot)
    info = data.prepare_data(tmp_path / "out", corpus, tokenizer="hf", verbose=False, given=given)
    assert info["vocab_size"] == 70000 and eot == 69999
    assert os.path.getsize(info["val_bin"]) == 4 * info["n_val_tokens"]
    enc = tokenizer.encoding_of(data.load_build(tmp_path / "out"))
    ids = np.fromfile(info["val_bin"], dtype=np.uint32)
    _, val_docs = data.load_documents(corpus)
    assert enc.decode(ids) == "".join(doc + tokenizer.EOT for doc in val_docs)
    assert ids.max() >= 1 << 16  # ids a uint16 file could not hold
    x, y = data.Batches(info, 32, 4, 0).get("val", 0, "cpu")
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.max() < 70000


def test_sharded_weights_load_as_one_file(folder, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    sd = hf_folder.read_weights(str(d))
    names = sorted(sd)
    half = {n: ("model-00001-of-00002.safetensors" if i % 2 else
                "model-00002-of-00002.safetensors") for i, n in enumerate(names)}
    for shard in set(half.values()):
        hf_folder.write_safetensors({n: sd[n] for n in names if half[n] == shard}, d / shard)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": half}))
    os.remove(d / "model.safetensors")
    back = hf_folder.read_weights(str(d))
    assert back.keys() == sd.keys() and all(torch.equal(back[n], sd[n]) for n in names)


@pytest.mark.parametrize("shape,heads", [("smollm2-135m", 9), ("qwen3-0.6b", 16)])
def test_the_gpu_small_preset_sizes_the_drafters_for_the_folder(tmp_path, shape, heads):
    family, fields = hf_llama.LLAMA_SHAPES[shape]
    cfg = hf_llama.config_json(types.SimpleNamespace(config=LlamaConfig(**fields)), family, 0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # the folder is read whole where the flags are resolved: its tokenizer too (bytes will do)
    hf_llama.write_tokenizer_json({bytes([b]): b for b in range(256)}, tmp_path / "tokenizer.json")
    run = train.resolve_args(["--preset", "gpu-small", "--init-from", str(tmp_path),
                              "--device", "cpu"])
    dflash, shape = run.settings["dflash"], run.settings["target"]
    assert (shape.n_layer, shape.n_embd) == (fields["n_layer"], fields["n_embd"])
    assert stages_dflash.network_config(dflash, pretrained.read(str(tmp_path)).config).n_head == heads
    assert dflash.layers == 4 and run.batch_size == 16  # the gpt2 preset's
    run = train.resolve_args(["--preset", "gpu-small", "--init-from", str(tmp_path),
                              "--device", "cpu", "--dflash-heads", "8"])
    assert run.settings["dflash"].heads == 8  # a flag given wins


def test_the_docs_recipe_runs_on_a_tiny_random_folder(tmp_path, corpus):
    """docs/your_model.md's CPU version, command by command (on the tests' corpus)."""
    recipe = open(os.path.join(os.path.dirname(__file__), "..", "docs", "your_model.md")).read()
    folder, out = str(tmp_path / "tiny"), str(tmp_path / "tiny-out")
    steps = [("python -m formats.pretrained /tmp/tiny --random llama-tiny",
              lambda: pretrained.main([folder, "--random", "llama-tiny"])),
             ("python train.py --init-from /tmp/tiny --preset tiny --out-dir /tmp/tiny-out "
              "--only target", lambda: train.main(["--init-from", folder, "--preset", "tiny",
                                                   "--out-dir", out, "--only", "target",
                                                   "--data", corpus, "--device", "cpu"])),
             ("python train.py --init-from /tmp/tiny --preset tiny --out-dir /tmp/tiny-out "
              "--only dflash", lambda: train.main(["--init-from", folder, "--preset", "tiny",
                                                   "--out-dir", out, "--only", "dflash",
                                                   "--data", corpus, "--device", "cpu"])),
             ("python bench.py --out-dir /tmp/tiny-out --methods ar,dflash --dtype float64",
              lambda: bench.main(["--out-dir", out, "--methods", "ar,dflash", "--dtype",
                                  "float64", "--n-prompts", "2", "--max-new-tokens", "10",
                                  "--repeats", "1", "--plot", "", "--json",
                                  str(tmp_path / "b.json")])),
             ("python -m formats.speculators export /tmp/tiny-drafter --out-dir "
              "/tmp/tiny-out --method dflash",
              lambda: speculators.main(["export", str(tmp_path / "drafter"), "--out-dir",
                                        out, "--method", "dflash"]))]
    results = []
    for command, step in steps:
        assert command in recipe
        results.append(step())
    res = results[3]
    assert set(res["methods"]) == {"ar", "dflash"}
    assert all(r["exact_match"] == 1.0 for r in res["methods"].values())
    c = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert c["speculators_config"]["verifier"]["name_or_path"] == folder


def test_the_model_runs_built_as_its_docstring_shows():
    import doctest
    (example,) = [t for t in doctest.DocTestFinder().find(Llama) if t.examples]
    runner = doctest.DocTestRunner()
    runner.run(example, clear_globs=False)
    assert runner.failures == 0 and runner.tries == 2
    logits, hidden = example.globs["logits"], example.globs["hidden"]
    assert logits.shape == (1, 10, 97) and sorted(hidden) == [1, 2]


def test_the_device_check_of_the_recipe_runs_on_the_cpu(tmp_path, corpus):
    """benchmark/your_model_check.sh, the recipe as one GPU check, in its CPU smoke version."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "SHAPE": "llama-tiny", "DEVICE": "cpu", "PRESET": "tiny", "STEPS": "8",
           "BLOCK": "64", "DATA": corpus, "OUT": str(tmp_path / "o"), "PY": sys.executable}
    p = subprocess.run(["bash", "benchmark/your_model_check.sh"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "every row exact" in p.stdout
    c = json.loads((tmp_path / "o" / "drafter" / "config.json").read_text())
    assert c["speculators_model_type"] == "dflash"  # exported for vLLM
    rows = json.loads((tmp_path / "o" / "bench.json").read_text())["methods"]
    assert set(rows) == {"ar", "dflash", "lookup"}


def test_a_folder_with_a_tokenizer_json_trains_and_decodes_exactly(merges, corpus, tmp_path):
    """The folder's tokenizer.json (the tokenizers package) encodes the corpus, and the build keeps
    it: bench.py and sample.py read the same tokenizer back."""
    pytest.importorskip("tokenizers")
    d, out = tmp_path / "qwen3", tmp_path / "out"
    hf_llama.write_llama_folder(folder_model("qwen3"), merges, d, "qwen3")
    hf_llama.write_tokenizer_json(hf_gpt2.read_ranks(str(d))[0], d / "tokenizer.json")
    train.main(tiny_args(corpus, out, "--init-from", str(d)))
    info = data.load_build(out)
    assert info["kind"] == "hf" and (out / "tokenizer.json").read_bytes() == (
        d / "tokenizer.json").read_bytes()
    enc = tokenizer.encoding_of(info)
    _, val_docs = data.load_documents(corpus)
    ids = np.fromfile(info["val_bin"], dtype=info["token_dtype"])
    assert enc.decode(ids) == "".join(doc + tokenizer.EOT for doc in val_docs)
    res = bench.main(["--out-dir", str(out), "--n-prompts", "2", "--max-new-tokens", "10",
                      "--prompt-len", "16", "--repeats", "1", "--sweep", "", "--plot", "",
                      "--dtype", "float64", "--json", str(tmp_path / "b.json")])
    assert all(r["exact_match"] == 1.0 for r in res["methods"].values())


# -----------------------------------------------------------------------------
# the review's cases: half precision, defaults, older layouts, the guards


def test_the_rotary_angles_stay_float32_in_half_precision():
    model = tiny_llama("llama")
    want = rope_frequencies(model.config)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        for m in model.to(dtype).modules():
            if hasattr(m, "inv_freq"):
                assert m.inv_freq.dtype == torch.float32 and torch.equal(m.inv_freq, want)


def test_a_config_without_tie_word_embeddings_is_untied_as_transformers_reads_it(folder):
    c = json.loads((folder / "config.json").read_text())
    c.pop("tie_word_embeddings")
    assert not hf_llama.read_llama_config(str(folder), c).tie_embeddings


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_transformers_4s_config_layout_loads_the_same_model(family, tmp_path, merges):
    """rope_theta and rope_scaling as transformers 4 wrote them, not 5's rope_parameters."""
    theirs = their_folder(family, tmp_path, merges)
    c = json.loads((tmp_path / "config.json").read_text())
    rope = c.pop("rope_parameters", None) or {"rope_theta": c.get("rope_theta", 10000.0)}
    c["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        c["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(c))
    model = pretrained.load(pretrained.read(str(tmp_path)))
    idx = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(idx)[0], theirs(idx).logits, atol=1e-5, rtol=0)


def test_a_tokenizer_json_adds_what_its_post_processor_adds(folder, tmp_path):
    """A begin-of-text token, as Llama-3's tokenizer.json adds to every text: the build's
    documents and every prompt start with it, as transformers' tokenizer encodes them."""
    tokenizers = pytest.importorskip("tokenizers")
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    hf_llama.write_tokenizer_json(hf_gpt2.read_ranks(str(d))[0], d / "tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    bos = tok.token_to_id(tokenizer.EOT)  # the tests' folders have one special token
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{tokenizer.EOT} $A", special_tokens=[(tokenizer.EOT, bos)])
    tok.save(str(d / "tokenizer.json"))
    enc = tokenizer.HFTokenizer(d / "tokenizer.json", bos)
    ids = enc.encode("def f(x):")
    assert ids[0] == bos and ids[1:] == tok.encode("def f(x):", add_special_tokens=False).ids
    assert enc.encode_batch(["def f(x):"]) == [ids]
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    assert theirs("def f(x):")["input_ids"] == ids


def test_a_sharded_folders_every_shard_names_its_weights(folder, tmp_path):
    from training.stages_target import weights_id
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    sd = hf_folder.read_weights(str(d))
    names = sorted(sd)
    half = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    for shard in set(half.values()):
        hf_folder.write_safetensors({n: sd[n] for n in names if half[n] == shard}, d / shard)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": half}))
    os.remove(d / "model.safetensors")
    before = weights_id(str(d))
    assert "index" in before
    w = sd[names[1]].clone()
    w.view(-1)[0] += 1
    hf_folder.write_safetensors({n: (w if n == names[1] else sd[n]) for n in names
                                  if half[n] == half[names[1]]}, d / half[names[1]])
    assert weights_id(str(d)) != before  # a changed shard re-imports the target


def test_a_run_that_forgot_init_from_keeps_a_tokenizer_json_build(corpus, tmp_path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "out"
    ranks = {bytes([b]): b for b in range(256)}
    path = tmp_path / "tokenizer.json"
    eot = hf_llama.write_tokenizer_json(ranks, path)
    data.prepare_data(out, corpus, tokenizer="hf", verbose=False,
                      given=tokenizer.Given(str(tmp_path), json=path.read_bytes(), eot=eot))
    with pytest.raises(SystemExit) as e:
        train.cli(tiny_args(corpus, out, "--force"))
    assert "pass --init-from" in str(e.value) and str(e.value).startswith("error: ")
