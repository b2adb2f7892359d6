"""LoRA adapters written as a Hugging Face PEFT folder (``checkpoint.hf_peft``): transformers'
glm5_next with peft's ``PeftModel.from_pretrained`` gives genome-lm's adapted logits; bad input is
one line.

The transformers side runs in a subprocess: glm5_next must not see flash-linear-attention on a
CPU machine (``tests/model/hf_oracle.py``)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from genome_lm.checkpoint.hf_peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_peft_adapter
from genome_lm.checkpoint.huggingface import HFCheckpoint, load_hf_checkpoint
from genome_lm.config import LORA_TARGETS, PeftConfig
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.errors import GenomeLMError
from genome_lm.model.config import ModelConfig
from genome_lm.model.model import build_model
from genome_lm.model.peft import apply_lora
from tests.model.hf_oracle import TINY_TEXT, make_checkpoint

TOL = 1e-4
EVERY_LINEAR = [*LORA_TARGETS, "*.f_a_proj", "*.f_b_proj", "*.g_a_proj", "*.g_b_proj", "*.b_proj", "*.q_a_proj",
                "*.kv_a_proj_with_mqa", "*.indexer.wq_b", "*.indexer.wk", "*.indexer.weights_proj", "output_layer"]
CASES = {
    # KDA and MLA q/k/v/o, MLA q_b, every fc1 / fc2: dense, shared and routed experts
    "default": (list(LORA_TARGETS), 4),
    # every projection the hook adapts, the DSA indexer and the output layer too (rank 2: the KDA
    # b_proj has one output per head)
    "every_linear": (EVERY_LINEAR, 2),
    # some experts only (the others written as zeros), fc1 alone in one layer and fc2 alone in another
    "some_experts": (["*.self_attention.q_proj", "layers.1.mlp.experts.local_experts.2.linear_fc1",
                      "layers.2.mlp.experts.local_experts.[13].linear_fc2",
                      "layers.3.mlp.shared_experts.linear_fc1"], 4),
}

# transformers + peft: logits of the base model and of each adapter folder, and a check that peft
# holds exactly the file's tensors (a key it ignored or left at its initial value would show)
ORACLE = """
import json, sys
sys.modules["fla"] = None
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import Glm5NextForConditionalGeneration

ckpt, tokens, out, *adapters = sys.argv[1:]
ids = torch.load(tokens)
results = {}
for name in adapters:
    folder, _, case = name.partition("=")
    model = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(model, folder).eval()
    held = get_peft_model_state_dict(peft_model, save_embedding_layers=False)  # the adapters alone (lm_head's too)
    stored = load_file(folder + "/adapter_model.safetensors")
    if set(held) != set(stored):
        raise SystemExit(f"{case}: peft holds {sorted(set(held) - set(stored))[:3]}, the file has "
                         f"{sorted(set(stored) - set(held))[:3]}")
    for key, tensor in stored.items():
        if not torch.equal(held[key].float(), tensor.float()):
            raise SystemExit(f"{case}: {key} differs from the file")
    with torch.no_grad():
        results[case] = peft_model(input_ids=ids).logits.float()
        with peft_model.disable_adapter():
            results["base"] = peft_model(input_ids=ids).logits.float()
torch.save(results, out)
"""


def _tokens(seed=0, B=2, T=64):
    return torch.randint(4, 9, (B, T), generator=torch.Generator().manual_seed(seed))  # A C G T N


def _lora(targets, rank=4, alpha=8.0, dropout=0.0):
    return PeftConfig(method="lora", rank=rank, alpha=alpha, dropout=dropout, targets=targets)


def _adapted_model(hf_dir, pg, peft, seed=0):
    """genome-lm's model on the checkpoint's weights with random adapters (no lora_b zero)."""
    model = build_model(HFCheckpoint(hf_dir).config(), pg, ParallelSizes(), kernel_backend="torch").eval()
    load_hf_checkpoint(model, hf_dir)
    apply_lora(model, peft)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def _adapters(model):
    return {model.global_name(n): p.detach() for n, p in model.named_parameters() if ".lora_" in n}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", seed=4)


@pytest.fixture(scope="module")
def compared(hf_dir, tmp_path_factory):
    """(genome-lm's adapted logits, transformers + peft's) per case, and transformers' base logits."""
    tmp = tmp_path_factory.mktemp("peft")
    ids = _tokens()
    torch.save(ids, tmp / "tokens.pt")
    ours, folders = {}, []
    with parallel_context() as pg:
        for case, (targets, rank) in CASES.items():
            peft = _lora(targets, rank=rank)
            model = _adapted_model(hf_dir, pg, peft)
            with torch.no_grad():
                ours[case] = model(ids).logits.float()
            export_peft_adapter(_adapters(model), peft, model.cfg, tmp / case, like=hf_dir)
            folders.append(f"{tmp / case}={case}")
    result = subprocess.run([sys.executable, "-c", ORACLE, str(hf_dir), str(tmp / "tokens.pt"), str(tmp / "out.pt"),
                             *folders], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = torch.load(tmp / "out.pt")
    return ours, theirs, tmp


def _gap(ours, theirs):
    """Largest |logit difference| relative to the logits' scale (at least 1)."""
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1.0)).item()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_peft_on_transformers_gives_genome_lms_adapted_logits(compared, case):
    ours, theirs, _ = compared
    assert ours[case].shape == theirs[case].shape
    assert torch.isfinite(ours[case]).all()
    assert _gap(ours[case], theirs[case]) <= TOL, case
    # the adapters matter: without them transformers is far from genome-lm's adapted model
    assert _gap(ours[case], theirs["base"]) > 100 * TOL, case


@pytest.mark.slow
def test_the_folder_is_what_peft_reads(compared, hf_dir):
    _, _, tmp = compared
    config = json.loads((tmp / "default" / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.0)
    assert config["base_model_name_or_path"] == str(hf_dir)
    assert "model.language_model.layers.0.mlp.gate_proj" in config["target_modules"]
    assert "model.language_model.layers.0.self_attn.q_proj" in config["target_modules"]
    assert config["target_parameters"] == [f"model.language_model.layers.{i}.mlp.experts.{p}"
                                           for i in (1, 2, 3) for p in ("gate_up_proj", "down_proj")]
    tensors = load_file(tmp / "default" / ADAPTER_WEIGHTS)
    stem = "base_model.model.model.language_model.layers.1.mlp.experts."
    assert tensors[stem + "base_layer.lora_A.weight"].shape == (4 * 4, 32)  # gate_up_proj: [E r, H]
    assert tensors[stem + "base_layer.lora_B.weight"].shape == (2 * 16, 4 * 4)  # [2 F, r E]
    assert tensors[stem + "lora_A.weight"].shape == (4 * 4, 16)  # down_proj: [E r, F]
    every = json.loads((tmp / "every_linear" / ADAPTER_CONFIG).read_text())["target_modules"]
    assert {"lm_head", "model.language_model.layers.3.self_attn.indexer.wq_b",
            "model.language_model.layers.0.self_attn.forget_gate.f_a_proj"} <= set(every)
    some = json.loads((tmp / "some_experts" / ADAPTER_CONFIG).read_text())["target_parameters"]
    assert some == ["model.language_model.layers.1.mlp.experts.gate_up_proj",
                    "model.language_model.layers.2.mlp.experts.down_proj"]
    assert not list(tmp.glob("*.partial"))


def test_an_expert_without_its_adapter_adds_nothing_and_the_mapping_is_exact(tmp_path):
    """The routed experts' peft layout, computed by hand: expert e's update is
    scale * lora_B[:, k E + e] lora_A[e r + k] (summed over k), zero for an expert not targeted."""
    cfg = ModelConfig.from_hf({"model_type": "glm5_next", "text_config": TINY_TEXT})
    gen = torch.Generator().manual_seed(0)
    r, E, F, H = 2, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    tensors = {}
    for e in (0, 3):
        tensors[f"layers.1.mlp.experts.local_experts.{e}.linear_fc1.lora_a"] = torch.randn(r, H, generator=gen)
        tensors[f"layers.1.mlp.experts.local_experts.{e}.linear_fc1.lora_b"] = torch.randn(2, F, r, generator=gen)
    peft = _lora(["layers.1.mlp.experts.local_experts.[03].linear_fc1"], rank=r, alpha=3.0)
    export_peft_adapter(tensors, peft, cfg, tmp_path / "a")
    stored = load_file(tmp_path / "a" / ADAPTER_WEIGHTS)
    A = stored["base_model.model.model.language_model.layers.1.mlp.experts.lora_A.weight"]
    B = stored["base_model.model.model.language_model.layers.1.mlp.experts.lora_B.weight"]
    for e in range(E):
        delta = B.reshape(2 * F, r, E)[:, :, e] @ A.reshape(E, r, H)[e]
        if e in (0, 3):
            stem = f"layers.1.mlp.experts.local_experts.{e}.linear_fc1"
            want = tensors[stem + ".lora_b"].reshape(2 * F, r) @ tensors[stem + ".lora_a"]
            torch.testing.assert_close(delta, want)
        else:
            assert not delta.any()


def _one_adapter(stem="layers.0.self_attention.q_proj", out=16, n_in=32, r=4):
    return {f"{stem}.lora_a": torch.randn(r, n_in), f"{stem}.lora_b": torch.randn(out, r)}


@pytest.fixture(scope="module")
def cfg(hf_dir):
    return HFCheckpoint(hf_dir).config()


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.pop("layers.0.self_attention.q_proj.lora_b"),
     "adapter tensor layers.0.self_attention.q_proj.lora_b is missing"),
    (lambda t: t.update({"layers.0.self_attention.q_proj.lora_a": torch.randn(4, 31)}),
     "adapter tensor layers.0.self_attention.q_proj.lora_a has shape (4, 31), expected (4, 32)"),
    (lambda t: t.update({"layers.0.self_attention.q_proj.lora_b": torch.randn(16, 3)}),
     "adapter tensor layers.0.self_attention.q_proj.lora_b has shape (16, 3), expected (16, 4)"),
    (lambda t: t.update({"layers.0.mlp.linear_fc2.lora_a": torch.randn(4, 63), "layers.0.mlp.linear_fc2.lora_b":
                         torch.randn(32, 4)}),
     "adapter tensor layers.0.mlp.linear_fc2.lora_a has shape (4, 63), expected (4, 64)"),
    (lambda t: t.update({"layers.1.mlp.experts.local_experts.0.linear_fc2.lora_a": torch.randn(4, 16),
                         "layers.1.mlp.experts.local_experts.0.linear_fc2.lora_b": torch.randn(32, 4)}),
     "adapter tensor layers.1.mlp.experts.local_experts.1.linear_fc2.lora_a is missing"),
    (lambda t: t.update({"layers.0.self_attention.q_proj.weight": torch.randn(16, 32)}),
     "layers.0.self_attention.q_proj.weight: not an adapter tensor"),
    (lambda t: t.update({"layers.0.self_attention.conv_weight.lora_a": torch.randn(4, 4),
                         "layers.0.self_attention.conv_weight.lora_b": torch.randn(4, 4)}),
     "adapter layers.0.self_attention.conv_weight: no linear module of glm5_next corresponds to it"),
])
def test_bad_adapters_are_one_line_errors_naming_the_tensor(damage, message, hf_dir, cfg, tmp_path):
    tensors = _one_adapter()
    damage(tensors)
    with pytest.raises(GenomeLMError) as err:
        export_peft_adapter(tensors, _lora(list(LORA_TARGETS)), cfg, tmp_path / "out", like=hf_dir)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_shapes_are_checked_against_the_base_checkpoint(hf_dir, cfg, tmp_path):
    """With ``like``, a projection the config alone does not size (here the MLA q_b_proj) is
    checked against its weight in the base folder."""
    tensors = _one_adapter("layers.3.self_attention.q_b_proj", out=16, n_in=23)
    export_peft_adapter(tensors, _lora(list(LORA_TARGETS)), cfg, tmp_path / "loose")  # no base to check against
    with pytest.raises(GenomeLMError, match=r"q_b_proj.lora_a has shape \(4, 23\), expected \(4, 24\)"):
        export_peft_adapter(tensors, _lora(list(LORA_TARGETS)), cfg, tmp_path / "out", like=hf_dir)


def test_folder_is_written_whole_and_readable_like_its_config(cfg, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(GenomeLMError, match="exists and is not empty"):
        export_peft_adapter(_one_adapter(), _lora(list(LORA_TARGETS)), cfg, tmp_path / "full")
    old = os.umask(0o022)
    try:
        out = export_peft_adapter(_one_adapter(), _lora(list(LORA_TARGETS)), cfg, tmp_path / "a",
                                  base_model_name_or_path="org/base", dtype=torch.bfloat16)
    finally:
        os.umask(old)
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
    assert not (tmp_path / "a.partial").exists()
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == "org/base"
    assert config["target_modules"] == ["model.language_model.layers.0.self_attn.q_proj"]
    assert config["target_parameters"] is None
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / ADAPTER_WEIGHTS).values())


def test_dropout_is_kept_unless_experts_are_adapted(cfg, tmp_path):
    """peft refuses dropout on parameter targets (routed experts): written as 0 there."""
    peft = _lora(list(LORA_TARGETS), dropout=0.1)
    export_peft_adapter(_one_adapter(), peft, cfg, tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / ADAPTER_CONFIG).read_text())["lora_dropout"] == 0.1
    tensors = {**_one_adapter()}
    for e in range(cfg.n_routed_experts):
        tensors.update(_one_adapter(f"layers.1.mlp.experts.local_experts.{e}.linear_fc2", out=32, n_in=16))
    export_peft_adapter(tensors, peft, cfg, tmp_path / "experts")
    assert json.loads((tmp_path / "experts" / ADAPTER_CONFIG).read_text())["lora_dropout"] == 0.0


def test_tensors_trained_whole_are_refused(cfg, tmp_path):
    """peft.train: base tensors trained beside the adapters, which the adapter folder cannot carry."""
    peft = PeftConfig(method="lora", rank=4, alpha=8.0, targets=list(LORA_TARGETS), train=["*.router.weight"])
    with pytest.raises(GenomeLMError, match=r"peft.train \['\*.router.weight'\] trained base tensors whole"):
        export_peft_adapter(_one_adapter(), peft, cfg, tmp_path / "a")
    assert not (tmp_path / "a").exists()
