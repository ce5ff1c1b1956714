"""A pretrained GPT-2 from a Hugging Face folder (formats/hf_gpt2.py, train.py --init-from): a
tiny
GPT-2 folder the tests write loads with the logits of an independent GPT-2 forward (and of
transformers' GPT2LMHeadModel where it is installed), its tokenizer is GPT-2's byte-level BPE,
bad folders are refused in one line naming what is wrong, and the tiny pipeline runs on it end
to end, every drafter exact."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import bench
from registry import drafters as registry
from training import data
from training import tokenizer as bpe
from formats import hf_folder, hf_gpt2, pretrained, tokenizer
import train
from runtime.target import load_target
from gpt import GPT, GPTConfig
from tests.conftest import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 384

# -----------------------------------------------------------------------------
# a tiny GPT-2 folder: random weights, and a byte-level BPE trained on the tests' corpus


@pytest.fixture(scope="module")
def merges(corpus):
    train_docs, _ = data.load_documents(corpus)
    return hf_gpt2.merges_of(bpe.train_bpe(train_docs, VOCAB))


def tiny_model(activation="gelu_new", seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(sequence_len=64, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32,
                          activation=activation)).eval()
    with torch.no_grad():  # biases and norms away from their init, so a wrong map shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def folder(merges, tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    hf_gpt2.write_folder(tiny_model(), merges, d)
    return d


def copy_of(folder, tmp_path):
    dst = tmp_path / "gpt2"
    shutil.copytree(folder, dst)
    return dst


# -----------------------------------------------------------------------------
# the weights: the same model as GPT-2's own forward computes


def reference_logits(hf, n_head, idx):
    """GPT-2's forward written out from the Hugging Face state dict (Conv1D: x @ W + b; the
    tanh GELU; the head tied to wte), independent of gpt.py."""
    T = idx.shape[1]
    x = hf["transformer.wte.weight"][idx] + hf["transformer.wpe.weight"][:T]
    C = x.shape[-1]
    hs = C // n_head
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ln = lambda x, p: F.layer_norm(x, (C,), hf[p + ".weight"], hf[p + ".bias"], 1e-5)  # noqa
    conv = lambda x, p: x @ hf[p + ".weight"] + hf[p + ".bias"]  # noqa: E731
    for i in range(sum(k.endswith("ln_1.weight") for k in hf)):
        p = f"transformer.h.{i}."
        q, k, v = conv(ln(x, p + "ln_1"), p + "attn.c_attn").split(C, dim=-1)
        q, k, v = (t.view(1, T, n_head, hs).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2) / math.sqrt(hs)).masked_fill(~causal, float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(1, T, C)
        x = x + conv(y, p + "attn.c_proj")
        h = conv(ln(x, p + "ln_2"), p + "mlp.c_fc")
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        x = x + conv(h, p + "mlp.c_proj")
    return ln(x, "transformer.ln_f") @ hf["transformer.wte.weight"].T


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_the_folder_loads_with_gpt2s_own_logits(merges, tmp_path, weights):
    hf_gpt2.write_folder(tiny_model(), merges, tmp_path, weights)
    assert os.listdir(tmp_path).count("pytorch_model.bin" if weights == "bin"
                                      else "model.safetensors") == 1
    src = pretrained.read(str(tmp_path))
    model, given = pretrained.load(src), src.tokenizer
    assert model.config.activation == "gelu_new" and len(given.ranks) + 1 == VOCAB
    hf = {k: v.double() for k, v in hf_folder.read_weights(str(tmp_path)).items()}
    idx = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.double()(idx)[0]
    assert (ours - reference_logits(hf, 2, idx)).abs().max().item() < 1e-10


def test_transformers_computes_the_same_logits_on_the_folder(folder):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    model = pretrained.load(pretrained.read(str(folder)))
    idx = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(idx)[0] - theirs(idx).logits).abs().max().item()
    assert diff < 1e-4


def test_the_safetensors_reader_agrees_with_the_package(folder, tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64),
               "c": torch.randn(2, dtype=torch.float64), "e": torch.zeros(0)}
    hf_folder.write_safetensors(tensors, tmp_path / "t.safetensors")
    back = hf_folder.read_safetensors(str(tmp_path / "t.safetensors"))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) and back[k].dtype == tensors[k].dtype
               for k in tensors)
    st = pytest.importorskip("safetensors.torch")
    theirs = st.load_file(str(folder / "model.safetensors"))
    ours = hf_folder.read_weights(str(folder))
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)


def test_the_activation_is_the_configs_and_an_old_checkpoints_config_is_refused():
    old = {"sequence_len": 64, "vocab_size": VOCAB, "n_layer": 2, "n_head": 2, "n_embd": 32,
           "dropout": 0.0, "bias": True}  # a config written before the field existed
    with pytest.raises(ValueError, match=r"missing \['activation'\].*python train.py --force"):
        GPTConfig.from_dict(old)
    assert GPTConfig.from_dict(GPTConfig(**old).to_dict()).activation == "gelu"
    exact, tanh = tiny_model("gelu"), tiny_model("gelu_new")
    tanh.load_state_dict(exact.state_dict())
    idx = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(exact(idx)[0], tanh(idx)[0])
    with pytest.raises(ValueError, match="unknown activation"):
        GPTConfig.from_dict({**GPTConfig(**old).to_dict(), "activation": "relu"})


def test_a_shorter_context_keeps_the_first_positions(folder):
    full = pretrained.load(pretrained.read(str(folder)))
    short = pretrained.load(pretrained.read(str(folder)), sequence_len=32)
    idx = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(full(idx)[0], short(idx)[0])
    assert short.config.sequence_len == 32


# -----------------------------------------------------------------------------
# the tokenizer: GPT-2's byte-level BPE from vocab.json + merges.txt


def test_the_tokenizer_is_a_byte_level_bpe_that_round_trips(folder, merges):
    ranks, eot = hf_gpt2.read_ranks(str(folder))
    enc = tokenizer.encoding_from(ranks, hf_gpt2.GPT2_PAT)  # what the build's tokenizer file loads as
    assert eot == VOCAB - 1 and enc.n_vocab == VOCAB and enc.eot_token == eot
    text = "def f(x):\n    return x + 1  # ünïcode, \x00 and tabs\t\n"
    ids = tokenizer.encode(enc, text + tokenizer.EOT)
    assert tokenizer.decode(enc, ids) == text + tokenizer.EOT and ids[-1] == eot
    assert len(ids) < len(text.encode())  # the merges apply
    left, right = merges[0]  # the first merge is one token, ranked right after the 256 bytes
    assert ranks[left + right] == 256 and enc.encode_single_token(left + right) == 256
    assert sorted(ranks[bytes([b])] for b in range(256)) == list(range(256))
    # GPT-2's convention: printable bytes first, so b"!" (byte 33) is token 0
    assert ranks[b"!"] == 0


# -----------------------------------------------------------------------------
# refusals: one error line naming what is wrong


def refused(tmp_path, corpus, folder, *extra):
    with pytest.raises(SystemExit) as e:
        train.cli(tiny_args(corpus, tmp_path / "out", "--init-from", str(folder), *extra))
    msg = str(e.value)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def test_a_folder_without_weights_is_refused(folder, corpus, tmp_path):
    d = copy_of(folder, tmp_path)
    os.remove(d / "model.safetensors")
    assert "no weights (model.safetensors, its shards, or pytorch_model.bin)" in refused(tmp_path, corpus, d)


def test_unreadable_weights_are_refused(folder, corpus, tmp_path):
    d = copy_of(folder, tmp_path)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])
    assert "weights are unreadable" in refused(tmp_path, corpus, d)


@pytest.mark.parametrize("change,needle", [
    ({"model_type": "mistral"}, "model_type 'mistral', not one of gpt2, llama, qwen2, qwen3"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"n_inner": 100}, "n_inner 100"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"n_head": None}, "lacks n_head (a positive integer)"),
    ({"n_embd": "32"}, "n_embd is \"32\", not a positive integer"),
    ({"activation_function": ["gelu"]}, "activation_function is [\"gelu\"], not a string"),
    ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon is \"1e-5\", not a positive number"),
    ({"n_inner": True}, "n_inner is true, not a positive integer"),
])
def test_a_config_that_is_not_gpt2s_is_refused(folder, corpus, tmp_path, change, needle):
    d = copy_of(folder, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    assert needle in refused(tmp_path, corpus, d)


def test_a_tokenizer_that_does_not_fit_the_weights_is_refused(folder, corpus, tmp_path):
    d = copy_of(folder, tmp_path)
    lines = (d / "merges.txt").read_text().splitlines(keepends=True)
    (d / "merges.txt").write_text("".join(lines[:-1]))  # one merge fewer...
    vocab = json.loads((d / "vocab.json").read_text())
    last = max((v, k) for k, v in vocab.items() if k != hf_gpt2.EOT)[1]
    del vocab[last]
    vocab[hf_gpt2.EOT] -= 1
    (d / "vocab.json").write_text(json.dumps(vocab))  # ...and a vocab.json that agrees
    assert f"tokenizer has {VOCAB - 1} tokens, its weights' vocabulary {VOCAB}" in refused(
        tmp_path, corpus, d)
    vocab["zzz"] = 5  # a vocab.json that disagrees with merges.txt
    (d / "vocab.json").write_text(json.dumps(vocab))
    assert "vocab.json does not match its merges.txt" in refused(tmp_path, corpus, d)


def test_a_context_longer_than_the_models_is_refused(folder, corpus, tmp_path):
    assert "longer than" in refused(tmp_path, corpus, folder, "--block-size", "128")


def test_joint_mtp_needs_a_target_to_train(folder, corpus, tmp_path):
    assert "--mtp-mode posthoc" in refused(tmp_path, corpus, folder, "--mtp-mode", "joint")


# -----------------------------------------------------------------------------
# the tiny pipeline on the folder, end to end


@pytest.fixture(scope="module")
def pipeline(folder, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2_out")
    train.main(tiny_args(corpus, out, "--init-from", str(folder)))
    return out


def test_every_drafter_trains_for_the_folders_target_and_decodes_exactly(pipeline, folder,
                                                                          tmp_path):
    target, ckpt = load_target(str(pipeline / "target.pt"))
    assert ckpt["init_from"] == str(folder) and target.config.activation == "gelu_new"
    want = pretrained.load(pretrained.read(str(folder)))
    assert all(torch.equal(want.state_dict()[k], v) for k, v in target.state_dict().items())
    info = data.load_build(pipeline)
    assert info["vocab_size"] == VOCAB and info["pattern"] == hf_gpt2.GPT2_PAT
    res = bench.main(["--out-dir", str(pipeline), "--n-prompts", "2", "--max-new-tokens", "10",
                      "--prompt-len", "16", "--repeats", "1", "--sweep", "", "--plot", "",
                      "--dtype", "float64", "--json", str(tmp_path / "b.json")])
    assert set(registry.names()) <= set(res["methods"])
    assert all(r["exact_match"] == 1.0 for r in res["methods"].values())


def test_a_rerun_skips_every_stage_until_the_weights_change(pipeline, folder, corpus, tmp_path,
                                                             capsys, merges):
    out = tmp_path / "out"
    shutil.copytree(pipeline, out)
    d = copy_of(folder, tmp_path)
    args = tiny_args(corpus, out, "--init-from", str(folder))
    train.main(args)
    assert capsys.readouterr().out.count("exists, skipping") == len(registry.stages())
    hf_gpt2.write_folder(tiny_model(seed=1), merges, d)  # other weights, same tokenizer
    before = (out / "target.pt").read_bytes()
    with pytest.raises(SystemExit) as e:  # another folder's import replaces it only if asked
        train.cli(tiny_args(corpus, out, "--init-from", str(d), "--only", "target"))
    assert "would be imported over it" in str(e.value) and "--force" in str(e.value)
    assert (out / "target.pt").read_bytes() == before
    train.main(tiny_args(corpus, out, "--init-from", str(d), "--only", "target", "--force"))
    text = capsys.readouterr().out
    assert "target: done" in text and "data: reusing" in text
    assert load_target(str(out / "target.pt"))[1]["init_from"] == str(d)


def test_the_script_writes_checks_and_times_a_folder(tmp_path):
    p = subprocess.run([sys.executable, "-m", "formats.pretrained", str(tmp_path / "g"),
                        "--random", "tiny"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "GPT-2 2 layers x 32 wide" in p.stdout
    p = subprocess.run([sys.executable, "-m", "training.forward_cost", str(tmp_path / "g"),
                        "--repeats", "2", "--context", "32", "--toy", str(tmp_path / "none.pt")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "GPT-2 2 layers x 32 wide" in p.stdout and "T=16:" in p.stdout
    p = subprocess.run([sys.executable, "-m", "formats.pretrained", str(tmp_path / "missing")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.strip().startswith("error: ")


def test_the_gpt2_preset_resolves_against_gpt2_smalls_config(tmp_path):
    shape = hf_gpt2.SHAPES["small"]
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "activation_function": "gelu_new", "vocab_size": 50257,
        **shape}))
    # the folder is read whole where the flags are resolved: its tokenizer too, GPT-2's size
    hf_gpt2.write_tokenizer_files(hf_gpt2.synthetic_merges(50257 - 257), str(tmp_path))
    run = train.resolve_args(["--preset", "gpt2", "--init-from", str(tmp_path),
                              "--device", "cpu"])
    shape = run.settings["target"]
    assert (shape.n_layer, shape.n_head, shape.n_embd) == (12, 12, 768)
    dflash, small = run.settings["dflash"], run.settings["small"]
    assert run.batch_size == 16 and dflash.heads == 12 and small.embd == 384
    assert dflash.anchors == 32  # the cuda preset's, where gpt2 names none


def test_a_run_that_forgot_init_from_keeps_the_pretrained_build(pipeline, corpus, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(pipeline, out)
    with pytest.raises(SystemExit) as e:
        train.cli(tiny_args(corpus, out))
    assert "pass --init-from" in str(e.value) and str(e.value).startswith("error: ")
    assert load_target(str(out / "target.pt"))[1].get("init_from")  # still the imported one


def test_a_feature_cache_too_big_for_memory_is_computed_per_step(pipeline, folder, corpus,
                                                                  tmp_path, monkeypatch, capsys):
    from training import distill
    out = tmp_path / "out"
    shutil.copytree(pipeline, out)
    monkeypatch.setattr(distill, "CACHE_LIMIT", 1000)
    train.main(tiny_args(corpus, out, "--init-from", str(folder), "--only", "small", "--force"))
    text = capsys.readouterr().out
    assert "computing the target's features every step instead" in text
    assert "small: done" in text
