"""A drafter leaves the project and comes back (formats/speculators.py): DFlash and DSpark
drafters of the papers' layers, trained here for a tiny Qwen3 folder, written as speculators'
folder (vLLM's library), which vLLM serves; such a folder read back as a drafter that decodes
exactly. Everywhere: the folder's names and config, the round trip tensor for tensor, the imported
drafter exact through the loop, bench.py and sample.py, every refusal one line. Where speculators
is installed (a virtual environment of its own: CI runs without it): its own DFlashDraftModel and
DSparkDraftModel compute our logits on a folder transformers wrote, and a drafter speculators
wrote drafts exactly here."""

import json
import os
import shutil
import types

import pytest
import torch

import bench
import train
from registry import drafters as registry
from commands import refused, run, snapshot, succeeded
from conftest import tiny_args
from runtime.checkpoint import load_checkpoint, save_checkpoint
from sampler import Sampler
from speculative import generate_plain, generate_speculative
from test_llama import VOCAB, folder_model, their_folder
from formats import hf_folder, hf_gpt2, hf_llama, speculators as sf
from training import stages_dflash, trainer
from runtime.target import load_target

SCRIPT = "formats/speculators.py"
KINDS = ["dflash", "dspark"]


def pipeline(corpus, folder, out):
    """The tiny preset's target, DFlash and DSpark for the folder's model (the papers' layers:
    the default for a Llama or Qwen target)."""
    for stage in ("target", "dflash", "dspark"):
        train.main(tiny_args(corpus, out, "--init-from", str(folder), "--only", stage))
    return out


@pytest.fixture(scope="module")
def qwen3_run(corpus, tmp_path_factory):
    """A tiny Qwen3 folder this project wrote, and a run of it."""
    folder = tmp_path_factory.mktemp("qwen3")
    merges = hf_gpt2.synthetic_merges(VOCAB - 257)
    hf_llama.write_llama_folder(folder_model("qwen3", n_layer=3), merges, folder, "qwen3")
    return folder, pipeline(corpus, folder, tmp_path_factory.mktemp("qwen3_out"))


def exported(out, kind, folder, *extra):
    return run(SCRIPT, "export", folder, "--out-dir", out, "--method", kind, *extra)


def copy_of(out, tmp_path):
    shutil.copytree(out, tmp_path / "run")
    return tmp_path / "run"


def exact_everywhere(out, tmp_path, kinds):
    """bench.py greedy and coupled in float64 (every row exact), and sample.py, on out/."""
    for mode in ("greedy", "coupled"):
        res = bench.main(["--out-dir", str(out), "--methods", ",".join(["ar", *kinds]),
                          "--n-prompts", "2", "--max-new-tokens", "12", "--prompt-len", "16",
                          "--repeats", "1", "--sweep", "", "--plot", "", "--dtype", "float64",
                          "--sampling", mode, "--temperature", "0.8",
                          "--json", str(tmp_path / f"{mode}.json")])
        assert set(res["methods"]) == {"ar", *kinds}
        assert all(r["exact_match"] == 1.0 for r in res["methods"].values()), res["methods"]
    for kind in kinds:
        assert "tau =" in succeeded(run("sample.py", "--out-dir", out, "--method", kind,
                                        "--max-new-tokens", "12", "--no-color", "--device",
                                        "cpu"))


# -----------------------------------------------------------------------------
# everywhere: the folder, the round trip, the imported drafter exact, the refusals


def test_a_llama_or_qwen_target_gets_the_papers_layers_shaped_like_it(qwen3_run):
    target, _ = load_target(str(qwen3_run[1] / "target.pt"))
    run_ = train.resolve_args(["--preset", "tiny", "--init-from", str(qwen3_run[0])])
    cfg = stages_dflash.network_config(run_.settings["dflash"], target.config)
    tc = target.config
    assert (cfg.arch, cfg.alibi, cfg.bias, cfg.taps) == ("qwen3", False, False, [1, 2])
    assert (cfg.n_kv_head, cfg.head_dim, cfg.n_hidden, cfg.rope_base, cfg.norm_eps) == \
        (tc.n_kv_head, tc.head_dim, tc.n_hidden, tc.rope_theta, tc.norm_eps)
    assert cfg.mask_token == tc.vocab_size - 1
    gpt2 = stages_dflash.network_config(train.resolve_args(["--preset", "tiny"]).settings["dflash"],
                                        types.SimpleNamespace(n_embd=32, n_head=2, n_layer=2,
                                                              vocab_size=64))
    assert (gpt2.arch, gpt2.alibi, gpt2.taps) == ("gpt2", True, [1, 2])
    assert gpt2.to_dict()["arch"] == "gpt2"  # a checkpoint records its layers, GPT-2's too
    # what a checkpoint records: the layers as they resolve ('auto' is not what trained)
    assert trainer.recorded(run_, registry.stages(), "dspark")["dflash_arch"] == "qwen3"
    assert trainer.recorded(train.resolve_args(["--preset", "tiny"]), registry.stages(),
                            "dflash")["dflash_arch"] == "gpt2"


@pytest.mark.parametrize("kind", KINDS)
def test_an_exported_drafter_is_speculators_layout_and_reads_back_tensor_for_tensor(
        qwen3_run, kind, tmp_path):
    folder, out = qwen3_run
    succeeded(exported(out, kind, tmp_path / "exp", "--uncalibrated", "--dtype", "float32"))
    c = json.loads((tmp_path / "exp" / "config.json").read_text())
    net, target, _ = sf.trained_network(str(out), kind)
    cfg = net.config if kind == "dflash" else net.backbone.config
    assert c["speculators_model_type"] == kind and c["block_size"] == cfg.block
    assert c["aux_hidden_state_layer_ids"] == cfg.taps and c["mask_token_id"] == VOCAB - 1
    assert c["speculators_config"]["verifier"]["name_or_path"] == os.path.abspath(folder)
    assert c["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    assert c["transformer_layer_config"]["max_position_embeddings"] == \
        json.loads((folder / "config.json").read_text())["max_position_embeddings"]  # not 64
    layer = c["transformer_layer_config"]
    assert (layer["model_type"], layer["hidden_size"], layer["num_key_value_heads"]) == \
        ("qwen3", 32, cfg.n_kv_head)
    tensors = hf_folder.read_safetensors(str(tmp_path / "exp" / "model.safetensors"))
    per_layer = {"input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj", *(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj",
                                                                "o_proj", "q_norm", "k_norm"))}
    want = {f"layers.{i}.{m}.weight" for i in range(cfg.n_layer) for m in per_layer}
    want |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    if kind == "dspark":
        want |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert set(tensors) == want  # the target's embedding and head are the verifier's

    back = copy_of(out, tmp_path)
    succeeded(run(SCRIPT, "import", tmp_path / "exp", "--out-dir", back, "--force"))
    ours = load_checkpoint(str(out / f"{kind}.pt"), kind)["state_dict"]
    theirs = load_checkpoint(str(back / f"{kind}.pt"), kind)["state_dict"]
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():  # the temperatures are the one thing speculators' head lacks
        assert torch.equal(theirs[name], torch.ones_like(t) if name == "conf_temp" else t), name


@pytest.mark.parametrize("kind", KINDS)
def test_the_weights_are_bfloat16_unless_asked_and_read_back_as_written(qwen3_run, kind,
                                                                       tmp_path):
    """bfloat16 by default, as speculators writes them; the import reads back exactly that."""
    out = copy_of(qwen3_run[1], tmp_path)
    succeeded(exported(out, kind, tmp_path / "exp", "--uncalibrated"))
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = hf_folder.read_safetensors(str(tmp_path / "exp" / "model.safetensors"))
    raw = (tmp_path / "exp" / "model.safetensors").read_bytes()
    assert b'"BF16"' in raw and b'"F32"' not in raw
    trained = load_checkpoint(str(out / f"{kind}.pt"), kind)["state_dict"]
    succeeded(run(SCRIPT, "import", tmp_path / "exp", "--out-dir", out, "--force"))
    back = load_checkpoint(str(out / f"{kind}.pt"), kind)["state_dict"]
    for name in ("fc.weight", "layers.0.attn.c_q.weight"):
        name = name if kind == "dflash" else f"backbone.{name}"
        assert torch.equal(back[name], trained[name].bfloat16().float()), name
    assert len(tensors) > 0


def test_an_imported_drafter_decodes_exactly_through_the_loop_bench_and_sample(qwen3_run,
                                                                                tmp_path):
    out = copy_of(qwen3_run[1], tmp_path)
    for kind in KINDS:
        succeeded(exported(out, kind, tmp_path / kind, "--uncalibrated"))
        os.remove(out / f"{kind}.pt")
        succeeded(run(SCRIPT, "import", tmp_path / kind, "--out-dir", out))
        assert load_checkpoint(str(out / f"{kind}.pt"), kind)["imported_from"] == \
            str(tmp_path / kind)
    exact_everywhere(out, tmp_path, KINDS)


def test_a_drafter_of_gpt2s_layers_is_refused_naming_the_flag(trained, tmp_path):
    assert "--dflash-arch qwen3" in refused(exported(trained, "dflash", tmp_path / "x"),
                                            "GPT-2's layers")
    assert not (tmp_path / "x").exists()


def test_eagle3_is_refused_saying_what_differs(qwen3_run, tmp_path):
    refused(exported(qwen3_run[1], "eagle", tmp_path / "x"), "EAGLE-3 is not exported",
            "d2t/t2d")
    assert not (tmp_path / "x").exists()


def test_confidences_calibrated_per_position_are_refused_unless_asked(qwen3_run, tmp_path):
    net, _, _ = sf.trained_network(str(qwen3_run[1]), "dspark")
    if bool((net.conf_temp == net.conf_temp[0]).all()):
        pytest.skip("the tiny preset calibrated one temperature")
    refused(exported(qwen3_run[1], "dspark", tmp_path / "x"), "--uncalibrated", "per position")


def test_one_temperature_folds_into_the_confidence_head():
    spark = types.SimpleNamespace(conf=torch.nn.Linear(5, 1), conf_temp=torch.full((4,), 2.5))
    w, b = sf.confidence(spark, uncalibrated=False)
    x = torch.randn(3, 5)
    want = torch.sigmoid(spark.conf(x) / 2.5)
    assert torch.allclose(torch.sigmoid(x @ w.T + b), want, atol=1e-7)
    spark.conf_temp = torch.tensor([1.0, 2.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="per position"):
        sf.confidence(spark, uncalibrated=False)
    assert sf.confidence(spark, uncalibrated=True)[0] is not None


def damaged(folder, how):
    """A copy-edit of a speculators folder: its config changed, or a tensor removed or added."""
    c = json.loads((folder / "config.json").read_text())
    tensors = hf_folder.read_safetensors(str(folder / "model.safetensors"))
    if how == "eagle3":
        c["speculators_model_type"] = "eagle3"
    elif how == "reduced vocabulary":
        c["draft_vocab_size"] = 100
    elif how == "wider":
        c["transformer_layer_config"]["hidden_size"] = 64
    elif how == "lacks a tensor":
        del tensors["layers.0.mlp.up_proj.weight"]
    elif how == "an extra tensor":
        tensors["d2t"] = torch.zeros(3)
    elif how == "a tap on the last layer":
        c["aux_hidden_state_layer_ids"] = [c["aux_hidden_state_layers_last"]]
    elif how == "no kind":
        del c["speculators_model_type"]
    elif how == "another model's vocabulary":
        c["transformer_layer_config"]["vocab_size"] = c["draft_vocab_size"] = 100
    elif how == "no model.safetensors":
        os.remove(folder / "model.safetensors")
        tensors = None
    elif how == "a cut safetensors file":
        raw = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(raw[:len(raw) // 2])
        tensors = None
    elif how in WRONG_TYPES:
        key, value = WRONG_TYPES[how]
        (c["transformer_layer_config"] if key == "model_type" else c)[key] = value
    (folder / "config.json").write_text(json.dumps(c))
    if tensors is not None:
        hf_folder.write_safetensors(tensors, folder / "model.safetensors")


WRONG_TYPES = {"a listed block size": ("block_size", [8]), "a zero block": ("block_size", 0),
               "taps as a string": ("aux_hidden_state_layer_ids", "1"),
               "a fractional tap": ("aux_hidden_state_layer_ids", [1.5]),
               "a listed mask token": ("mask_token_id", [1]),
               "a string for a bool": ("sample_from_anchor", "false"),
               "a listed kind": ("speculators_model_type", ["dflash"]),
               "listed layers": ("model_type", ["qwen3"])}


@pytest.mark.parametrize("how,needle", [
    *((how, f"{key} is {json.dumps(value)}") for how, (key, value) in WRONG_TYPES.items()),
    ("a cut safetensors file", "not a readable safetensors file"),
    ("eagle3", "EAGLE-3"), ("reduced vocabulary", "lacks a d2t of 100 tokens"),
    ("wider", "width"), ("lacks a tensor", "lacks layers.0.mlp.up_proj.weight"),
    ("an extra tensor", "d2t"), ("no model.safetensors", "model.safetensors not found"),
    ("a tap on the last layer", "no layer after the last has"),
    ("no kind", "names no speculators_model_type: it is not a speculators drafter's folder"),
    ("another model's vocabulary", "drafts for a model of 100 tokens")])
def test_a_folder_this_project_cannot_compute_is_refused_and_nothing_is_replaced(
        qwen3_run, tmp_path, how, needle):
    out = copy_of(qwen3_run[1], tmp_path)
    succeeded(exported(out, "dflash", tmp_path / "exp"))
    if how == "a tap on the last layer":  # the target's layer count, where damaged() sees it
        c = json.loads((tmp_path / "exp" / "config.json").read_text())
        c["aux_hidden_state_layers_last"] = load_target(str(out / "target.pt"))[0].config.n_layer
        (tmp_path / "exp" / "config.json").write_text(json.dumps(c))
    damaged(tmp_path / "exp", how)
    before = snapshot(out)
    refused(run(SCRIPT, "import", tmp_path / "exp", "--out-dir", out, "--force"), needle)
    assert snapshot(out) == before


def test_the_verifier_is_what_the_import_recorded_and_never_a_path_that_is_gone(qwen3_run,
                                                                                 tmp_path):
    """Its class and its context are the model's, as the target's import recorded them; its
    name the folder while it is there, else --verifier (refused without, in one line)."""
    out = copy_of(qwen3_run[1], tmp_path)
    ckpt = load_checkpoint(str(out / "target.pt"), "target")
    save_checkpoint({**ckpt, "init_from": str(tmp_path / "gone")}, str(out / "target.pt"))
    refused(exported(out, "dflash", tmp_path / "x"), "gone", "--verifier")
    assert not (tmp_path / "x").exists()
    for bad, needle in [(str(tmp_path / "missing"), "neither a folder here nor a hub id"),
                        ("", "--verifier is empty")]:
        refused(exported(out, "dflash", tmp_path / "x", "--verifier", bad), needle)
        assert not (tmp_path / "x").exists()
    said = succeeded(exported(out, "dflash", tmp_path / "x", "--verifier", "Org/Model"))
    assert "Org/Model is no folder here: written as a hub id, not checked" in said
    c = json.loads((tmp_path / "x" / "config.json").read_text())
    assert c["speculators_config"]["verifier"] == {"name_or_path": "Org/Model",
                                                   "architectures": ["Qwen3ForCausalLM"]}
    assert c["transformer_layer_config"]["max_position_embeddings"] == \
        json.loads((qwen3_run[0] / "config.json").read_text())["max_position_embeddings"]


def test_a_gguf_names_its_verifier_only_where_its_hub_id_is_known(tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    source = {"architectures": ["LlamaForCausalLM"], "context": 8192, "hub_id": None}
    ckpt = {"init_from": str(gguf_file), "source": source, "config": {"sequence_len": 64}}
    with pytest.raises(ValueError, match="names no model vLLM could load.*--verifier"):
        sf.verifier_of(ckpt, None)
    assert sf.verifier_of(ckpt, "Org/Model")["name_or_path"] == "Org/Model"
    hub = dict(ckpt, source=dict(source, hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert sf.verifier_of(hub, None) == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                         "architectures": ["LlamaForCausalLM"],
                                         "max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="trained here"):
        sf.verifier_of({"init_from": None, "config": {}}, "Org/Model")


def test_nothing_is_written_over_without_force(qwen3_run, tmp_path):
    out = copy_of(qwen3_run[1], tmp_path)
    succeeded(exported(out, "dflash", tmp_path / "exp"))
    before = snapshot(tmp_path)
    refused(exported(out, "dflash", tmp_path / "exp"), "--force")
    refused(run(SCRIPT, "import", tmp_path / "exp", "--out-dir", out), "--force")
    assert snapshot(tmp_path) == before


# -----------------------------------------------------------------------------
# where speculators is installed: its own models against ours


# -----------------------------------------------------------------------------
# a draft vocabulary: d2t, t2d and the head's rows, there and back


def with_draft_vocab(corpus, folder, out, tmp_path_factory):
    """A copy of a run whose DFlash is retrained over a draft vocabulary of 40 tokens."""
    copy = tmp_path_factory.mktemp("draft_vocab")
    shutil.copytree(out, copy, dirs_exist_ok=True)
    train.main(tiny_args(corpus, copy, "--init-from", str(folder), "--only", "dflash",
                         "--dflash-vocab", "40", "--force"))
    return copy


@pytest.fixture(scope="module")
def vocab_run(qwen3_run, corpus, tmp_path_factory):
    return with_draft_vocab(corpus, *qwen3_run, tmp_path_factory)


def test_a_draft_vocabulary_is_written_as_d2t_t2d_and_its_head_rows_and_reads_back(vocab_run,
                                                                                  tmp_path):
    out, folder = copy_of(vocab_run, tmp_path), tmp_path / "exp"
    succeeded(exported(out, "dflash", folder, "--dtype", "float32"))
    c = json.loads((folder / "config.json").read_text())
    t = hf_folder.read_safetensors(str(folder / "model.safetensors"))
    ours = load_checkpoint(str(out / "dflash.pt"), "dflash")
    d2t = ours["state_dict"]["d2t"]
    target = load_target(str(out / "target.pt"))[0]
    assert c["draft_vocab_size"] == 40 and ours["config"]["draft_vocab"] == 40
    assert torch.equal(t["d2t"] + torch.arange(40), d2t) and t["t2d"].dtype == torch.bool
    assert torch.equal(t["t2d"].nonzero().view(-1), d2t)
    assert torch.equal(t["lm_head.weight"], target.lm_head.weight[d2t])
    succeeded(run(SCRIPT, "import", folder, "--out-dir", out, "--force"))
    back = load_checkpoint(str(out / "dflash.pt"), "dflash")
    assert back["config"] == ours["config"]
    assert all(torch.equal(back["state_dict"][k], v) for k, v in ours["state_dict"].items())
    exact_everywhere(out, tmp_path, ["dflash"])


@pytest.mark.parametrize("how,needle", [("t2d", "its t2d does not mark the 40 target ids"),
                                        ("head", "its lm_head is not the target's LM head")])
def test_a_draft_vocabulary_read_otherwise_than_written_is_refused(vocab_run, tmp_path, how,
                                                                   needle):
    out, folder = copy_of(vocab_run, tmp_path), tmp_path / "exp"
    succeeded(exported(out, "dflash", folder))
    t = hf_folder.read_safetensors(str(folder / "model.safetensors"))
    if how == "t2d":
        t["t2d"] = t["t2d"].roll(1)
    else:
        t["lm_head.weight"] = t["lm_head.weight"] * 2
    hf_folder.write_safetensors(t, folder / "model.safetensors")
    before = snapshot(out)
    refused(run(SCRIPT, "import", folder, "--out-dir", out, "--force"), needle)
    assert snapshot(out) == before


@pytest.fixture(scope="module")
def hf_run(corpus, tmp_path_factory):
    """A tiny Qwen3 folder transformers wrote, and a run of it."""
    pytest.importorskip("speculators")
    folder = tmp_path_factory.mktemp("hf_qwen3")
    their_folder("qwen3", folder, hf_gpt2.synthetic_merges(VOCAB - 257))
    return folder, pipeline(corpus, folder, tmp_path_factory.mktemp("hf_qwen3_out"))


def float64_norms(monkeypatch):
    """Qwen3's RMSNorm in transformers casts to float32 (right for half precision): in the
    input's own precision instead, so that float64 compares with float64."""
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                              self.variance_epsilon))
    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", forward)


@pytest.mark.parametrize("kind", KINDS)
def test_speculators_own_model_of_an_exported_drafter_computes_our_logits(hf_run, kind,
                                                                          tmp_path, monkeypatch):
    folder = tmp_path / "exp"
    succeeded(exported(hf_run[1], kind, folder, "--uncalibrated"))
    _, diff = sf.compare(str(folder), str(hf_run[1]), torch.float32, "eager")
    assert max(diff.values()) <= 1e-4, diff
    # float64 as far as their code allows: their norms in float64 (float64_norms), and SDPA's
    # attention, as eager attention's softmax is float32 in transformers
    float64_norms(monkeypatch)
    _, diff = sf.compare(str(folder), str(hf_run[1]), torch.float64, "sdpa")
    assert max(diff.values()) <= 1e-10, diff
    assert "max |difference|" in succeeded(run(SCRIPT, "check", folder, "--out-dir", hf_run[1]))


def test_speculators_own_model_over_a_draft_vocabulary_computes_our_logits(hf_run, corpus,
                                                                          tmp_path,
                                                                          tmp_path_factory):
    out, folder = with_draft_vocab(corpus, *hf_run, tmp_path_factory), tmp_path / "exp"
    succeeded(exported(out, "dflash", folder, "--dtype", "float32"))
    _, diff = sf.compare(str(folder), str(out), torch.float32, "eager")
    assert max(diff.values()) <= 1e-4, diff


def test_check_reads_a_bfloat16_folder_in_float32_and_needs_no_verifier_folder(hf_run,
                                                                               tmp_path):
    """speculators' model loaded in the folder's dtype would compute in bfloat16: check computes
    both in float32. Its verifier gone: a note, and the check still runs (the target in out/ is
    the model it drafts for)."""
    folder = tmp_path / "exp"
    (tmp_path / "nowhere").mkdir()
    succeeded(exported(hf_run[1], "dflash", folder, "--verifier", str(tmp_path / "nowhere")))
    (tmp_path / "nowhere").rmdir()
    printed = succeeded(run(SCRIPT, "check", folder, "--out-dir", hf_run[1]))
    assert "is not a folder here" in printed and "max |difference|" in printed


def test_check_reads_a_dspark_whose_confidence_head_reads_no_markov_code(hf_run, tmp_path):
    folder = tmp_path / "exp"
    succeeded(exported(hf_run[1], "dspark", folder, "--uncalibrated", "--dtype", "float32"))
    c = json.loads((folder / "config.json").read_text())
    c["confidence_head_with_markov"] = False
    (folder / "config.json").write_text(json.dumps(c))
    tensors = hf_folder.read_safetensors(str(folder / "model.safetensors"))
    d = c["transformer_layer_config"]["hidden_size"]
    tensors["confidence_head.proj.weight"] = tensors["confidence_head.proj.weight"][:, :d]
    hf_folder.write_safetensors(tensors, folder / "model.safetensors", {"format": "pt"})
    _, diff = sf.compare(str(folder), str(hf_run[1]))
    assert max(diff.values()) <= 1e-4, diff


def speculators_wrote(kind, verifier, folder, seed=0):
    """A drafter written by speculators' own class: random weights (moved off their init, so a
    weight read into the wrong place shows), the verifier's embedding and head."""
    import transformers
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    vc = transformers.AutoConfig.from_pretrained(verifier).to_dict()
    vc.pop("layer_types", None)
    layers = transformers.Qwen3Config(**{**vc, "num_hidden_layers": 2})
    common = dict(transformer_layer_config=layers, draft_vocab_size=VOCAB, block_size=8,
                  aux_hidden_state_layer_ids=[1], mask_token_id=VOCAB - 1,
                  speculators_config=SpeculatorsConfig(
                      algorithm=kind, default_proposal_method="greedy",
                      proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=7)],
                      verifier=VerifierConfig(name_or_path=str(verifier),
                                              architectures=["Qwen3ForCausalLM"])))
    if kind == "dflash":
        model = DFlashDraftModel(DFlashSpeculatorConfig(**common))
    else:
        model = DSparkDraftModel(DSparkSpeculatorConfig(**common, markov_rank=8))
    model.load_verifier_weights()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" not in name and "lm_head" not in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def test_a_drafter_speculators_wrote_drafts_exactly_and_as_speculators_computes(hf_run,
                                                                                 tmp_path):
    out = copy_of(hf_run[1], tmp_path)
    for kind in KINDS:
        folder = speculators_wrote(kind, hf_run[0], tmp_path / f"their_{kind}")
        succeeded(run(SCRIPT, "import", folder, "--out-dir", out, "--force"))
        _, diff = sf.compare(str(folder), str(out), torch.float32, "eager")
        assert max(diff.values()) <= 1e-4, diff
        net, target, _ = sf.trained_network(str(out), kind)
        drafter = sf.KINDS[kind].drafter(net.double(), target.double())
        for mode in ("greedy", "coupled"):
            sampler = Sampler(mode, temperature=0.8, seed=3)
            prompt = list(range(5, 21))
            got, _ = generate_speculative(target, drafter, prompt, 16, 4, sampler)
            assert got == generate_plain(target, prompt, 16, Sampler(mode, temperature=0.8,
                                                                     seed=3))
    exact_everywhere(out, tmp_path, KINDS)
