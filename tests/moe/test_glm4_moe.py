"""GLM-4.5 (`glm4_moe` family) against transformers' Glm4MoeForCausalLM, and its sharded plans against
the unsharded reference.

A tiny random Glm4MoeForCausalLM is built offline (1 dense block then 2 moe blocks, 8 experts in 2
groups of which 1 is kept, one shared expert, grouped-query attention with q, k, v biases, rotary over
half of each head: partial_rotary_factor 0.5; per-head q / k norms in one variant), every weight and the
routers' correction biases redrawn away from HF's init, and saved as transformers writes it. Loaded into
single, expert-parallel, tensor-parallel and pipeline plans on the shared worker pool: logits within 1e-4 of
transformers', greedy tokens equal; exported back and read by transformers' from_pretrained: the same
logits. The sharded plans train against the unsharded reference (outputs, gradients, parameters after
AdamW steps, in float64) from these redrawn weights and biases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from hf_models import error_job, export_job, logits_job, own_config_export_job  # noqa: E402
from moe_redrawn import redrawn_compare_job  # noqa: E402
from moe_specs import compile_spec, plan_spec  # noqa: E402

from meshllm_dsl.runtime.jobs.compare import TOLERANCE  # noqa: E402

N_NEW = 5
VARIANTS = {  # the model's qk norm, transformers' use_qk_norm
    "qk_norm": ("head", True),
    "plain": ("none", False),
}


def _model(variant: str) -> str:
    return ("model m = glm4_moe { vocab = 64, hidden = 32, layers = 3, first_dense = 1, heads = 4, kv_heads = 2,"
            " head_dim = 16, rotary_dim = 8, ffn = 48, expert_ffn = 16, experts = 8, top_k = 2, groups = 2,"
            " topk_groups = 1, routed_scaling = 2.5, shared_experts = 1, attn_bias = true,"
            f" qk_norm = {VARIANTS[variant][0]}, norm_eps = 1e-5, rope_theta = 10000.0, dtype = fp32 }}")


# Tensor parallelism splits the heads (q and k norms whole: one scale per head_dim), the dense MLP's, the
# experts' and the shared expert's ffn, and the vocabulary; the routers stay whole.
TP = ("    layout { batch -> data, experts -> data, heads -> tensor, kv_heads -> tensor, ffn -> tensor,"
      " expert_ffn -> tensor, shared_ffn -> tensor, vocab -> tensor }\n"
      "    shard blocks.*.mlp.router replicate\n")
PLANS = {  # mesh axes, plan body
    "single": ("one = 1", ""),
    # the experts split over data (expert parallelism)
    "data2_experts": ("data = 2", "    layout { batch -> data, experts -> data }\n"),
    # expert parallelism over data inside tensor parallelism
    "data2_tensor2_experts": ("data = 2, tensor = 2", TP),
    # stage 0 holds the dense block and the first moe block: a stage across the two repeats
    "pipeline2_data2_experts": ("pipeline = 2, data = 2",
                                "    layout { batch -> data, experts -> data }\n    microbatches = 2\n"
                                "    stages over pipeline {\n        0: embed, dense[0:1], blocks[0:1]\n"
                                "        1: blocks[1:2], norm, lm_head\n    }\n    schedule 1f1b\n"),
}


def compiled(plan: str, tmp_path: Path, variant: str = "qk_norm") -> tuple[str, int, str]:
    axes, body = PLANS[plan]
    return compile_spec(plan_spec(axes, _model(variant), body, batch=4), f"glm4_moe_{variant}_{plan}", tmp_path)


def _config(use_qk_norm: bool) -> Any:
    return tf.Glm4MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=use_qk_norm, partial_rotary_factor=0.5, max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-5)


def build_glm4_moe(directory: Path, use_qk_norm: bool, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    hf = tf.Glm4MoeForCausalLM(_config(use_qk_norm)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            norm = p.dim() == 1 and not name.endswith(".bias")
            p.copy_(1.0 + 0.3 * noise if norm else 0.3 * noise)  # norms away from one, biases away from zero
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, str]:
    directory = tmp_path_factory.mktemp("glm4_moe") / request.param
    return directory, build_glm4_moe(directory, VARIANTS[request.param][1]), request.param


def _tokens() -> Any:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


def test_the_tiny_model_is_what_it_claims(model: Any) -> None:
    """Half of each head rotates, q, k, v carry biases, q / k norms as the variant says, and the redrawn
    correction bias changes which experts are chosen (a test where it does not could not tell a bias
    loaded from one left at zero)."""
    directory, hf, variant = model
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5
    attn = hf.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert hasattr(attn, "q_norm") == VARIANTS[variant][1]
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        gates = [layer.mlp.gate for layer in hf.model.layers[1:]]
        saved = [g.e_score_correction_bias.clone() for g in gates]
        for g in gates:
            g.e_score_correction_bias.zero_()
        unbiased = hf(tokens).logits
        for g, s in zip(gates, saved, strict=True):
            g.e_score_correction_bias.copy_(s)
    assert (want - unbiased).abs().max().item() > 0.1


@pytest.mark.parametrize("plan", list(PLANS))
def test_weights_give_transformers_logits_and_tokens(plan: str, model: Any, pool: Any, tmp_path: Path) -> None:
    directory, hf, variant = model
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        want_tokens = hf.generate(tokens[:1], max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW)
    path, n, _ = compiled(plan, tmp_path, variant)
    logits, generated = pool.run(logits_job, n, path, str(directory), tokens, N_NEW)[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert generated.tolist() == want_tokens.tolist()


@pytest.mark.parametrize("plan", ["single", "data2_tensor2_experts", "pipeline2_data2_experts"])
def test_export_round_trips_through_transformers(plan: str, model: Any, pool: Any, tmp_path: Path) -> None:
    """Exported with the source's config.json and with meshllm's own: transformers reads back the same
    model (the correction biases and the partial rotary too: the logits are equal)."""
    from safetensors import safe_open

    directory, hf, variant = model
    path, n, _ = compiled(plan, tmp_path, variant)
    tokens = _tokens()
    for own, out in ((False, tmp_path / "export"), (True, tmp_path / "own_config")):
        if own:
            pool.run(own_config_export_job, n, path, str(directory), str(out))
        else:
            pool.run(export_job, n, path, str(directory), str(out), 5 * 10**9)
        back = tf.Glm4MoeForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            assert (back(tokens).logits - hf(tokens).logits).abs().max().item() == 0.0
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            assert keys == set(f.keys())  # transformers' names, every one, nothing more
    cfg = json.loads((tmp_path / "own_config" / "config.json").read_text())
    assert (cfg["first_k_dense_replace"], cfg["n_group"], cfg["head_dim"], cfg["use_qk_norm"]) == \
        (1, 2, 16, VARIANTS[variant][1])
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5


def test_import_hf_writes_a_spec_whose_weights_give_transformers_logits(model: Any, pool: Any, tmp_path: Path) -> None:
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.cli.main import main
    from meshllm_dsl.codegen.emit import render_plan

    directory, hf, variant = model
    out = tmp_path / "imported.mesh"
    assert main(["import-hf", str(directory), "-o", str(out), "--seq", "8"]) == 0
    text = out.read_text()
    assert "= glm4_moe {" in text and "rotary_dim = 8" in text and "attn_bias = true" in text
    assert ("qk_norm = head" in text) == VARIANTS[variant][1]
    result = check_file(str(out))
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    path = tmp_path / "imported.py"
    path.write_text(render_plan(plan, out.name, text))
    tokens = _tokens()
    logits, _ = pool.run(logits_job, 1, str(path), str(directory), tokens, 0)[0]
    with torch.no_grad():
        assert (logits - hf(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("field", "value", "says"), [
    ("hidden_act", "gelu", "`hidden_act` = 'gelu' is not supported"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "`rope_parameters.rope_type` = 'linear'"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.35},
     "`rope_parameters.partial_rotary_factor` = 0.35 turns 5 of head_dim 16"),
    ("quantization_config", {"quant_method": "fp8"}, "`quantization_config` is set"),
    ("first_k_dense_replace", 0, "`first_k_dense_replace` = 0"),
    ("attention_dropout", 0.1, "`attention_dropout` = 0.1 drops attention probabilities"),
])
def test_import_hf_refuses_what_the_family_does_not_honour_by_name(field: str, value: Any, says: str,
                                                                   model: Any) -> None:
    from meshllm_dsl.interop.import_hf import ImportError_, model_settings

    cfg = json.loads((model[0] / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ImportError_) as err:
        model_settings(cfg, "config.json")
    assert says in str(err.value), str(err.value)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("n_group", 4, "`n_group` is 4, but model `m` has groups = 2"),
    ("partial_rotary_factor", 1.0, "`partial_rotary_factor` is 16, but model `m` has rotary_dim"),
    ("attention_bias", False, "`attention_bias` is False, but model `m` has attn_bias = True"),
])
def test_a_checkpoint_with_other_settings_is_refused_in_one_line(field: str, value: Any, says: str, model: Any,
                                                                 pool: Any, tmp_path: Path) -> None:
    directory, _, variant = model
    path, n, _ = compiled("single", tmp_path, variant)
    other = tmp_path / "other"
    other.mkdir()
    for f in directory.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "config.json").read_text())
    if field == "partial_rotary_factor":
        cfg["rope_parameters"][field] = value
    else:
        cfg[field] = value
    (other / "config.json").write_text(json.dumps(cfg))
    (msg,) = set(pool.run(error_job, n, path, str(other)))
    assert says in msg, msg


@pytest.mark.parametrize("plan", [p for p in PLANS if p != "single"])
def test_sharded_glm4_moe_equals_the_reference_from_redrawn_weights(plan: str, model: Any, pool: Any,
                                                                    tmp_path: Path) -> None:
    directory, _, variant = model
    path, n, _ = compiled(plan, tmp_path, variant)
    for errs in pool.run(redrawn_compare_job, n, path, str(directory), 2, True):
        worst = max(errs, key=errs.__getitem__)
        assert errs[worst] <= TOLERANCE["float64"], (worst, errs[worst])
        # gradients of both repeats' blocks, the attention's biases and the shared expert compared
        for leaf in ("dense.0.attn.q.bias", "blocks.0.mlp.shared_down.weight", "blocks.1.mlp.router.weight"):
            assert f"grad {leaf}" in errs, sorted(errs)
        assert any(k.startswith("buffer ") and k.endswith("router.e_score_correction_bias") for k in errs)


# GLM-4.5's config.json as the hub has it (zai-org/GLM-4.5; transformers 4's top-level rope_theta and
# partial_rotary_factor)
PUBLISHED = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_qk_norm": True, "vocab_size": 151552,
}


def test_import_hf_reads_the_published_config_as_the_355b_example() -> None:
    """The published config.json gives a model of examples/glm45_355b.mesh's 352,797,814,784 parameters:
    transformers' Glm4MoeForCausalLM built from it on the meta device (no MTP module) has as many."""
    from meshllm_dsl.checker import check_file, check_text
    from meshllm_dsl.interop.import_hf import model_settings

    family, settings, positions = model_settings(dict(PUBLISHED), "config.json")
    assert (family, positions) == ("glm4_moe", 131072)
    read = {k: v for k, v, _ in settings}
    assert (read["rotary_dim"], read["head_dim"], read["qk_norm"], read["attn_bias"], read["first_dense"]) == \
        (64, 128, "head", True, 3)
    body = "\n".join(f"    {k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v, _ in settings)
    imported = check_text(f"model m = glm4_moe {{\n{body}\n}}\n", "m.mesh").models["m"]
    example = check_file(str(Path(__file__).resolve().parents[2] / "examples" / "glm45_355b.mesh")).models["glm45"]
    config = tf.Glm4MoeConfig(**{k: v for k, v in PUBLISHED.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = tf.Glm4MoeForCausalLM(config)
    assert len(hf.model.layers) == 92  # num_nextn_predict_layers builds nothing
    assert imported.numel == example.numel == sum(p.numel() for p in hf.parameters()) == 352_797_814_784


@pytest.mark.parametrize("flag", ["--weights", "--export-hf"])
def test_launch_takes_the_partial_rotary_of_the_glm4_moe_layout(flag: str, tmp_path: Path) -> None:
    """The glm4_moe layout writes and checks config.json's partial_rotary_factor: `meshc run` takes its
    rotary_dim with a checkpoint (a Llama-shaped one still refuses it: tests/runtime/test_partial_rotary.py)."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.lower import model_description
    from meshllm_dsl.runtime.train import launch

    (plan,) = check_text(plan_spec("one = 1", _model("plain"), "", batch=4), "m.mesh").plans.values()
    model = model_description(plan)
    assert any(layer.get("rotary_dim") == 8 for rep in model["layers"] if rep["kind"] == "repeat" for layer in rep["body"])
    (tmp_path / "hf").mkdir()
    args = launch.parse_args([flag, str(tmp_path / ("hf" if flag == "--weights" else "out"))])
    launch.check_inputs(args, model, 8)


def test_the_written_config_holds_the_routing_left_at_its_defaults() -> None:
    """A moe layer's description leaves out groups / topk_groups / routed_scaling at 1 (GLM-4.5's own
    n_group and topk_group): the written config.json still has them, as transformers' defaults."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.lower import model_description
    from meshllm_dsl.runtime.hf import weights as hf

    text = _model("plain").replace(" groups = 2,", "").replace(" topk_groups = 1,", "").replace(" routed_scaling = 2.5,", "")
    (plan,) = check_text(plan_spec("one = 1", text, "", batch=4), "m.mesh").plans.values()
    cfg = hf.hf_config(model_description(plan), torch.float32)
    assert (cfg["n_group"], cfg["topk_group"], cfg["routed_scaling_factor"]) == (1, 1, 1.0)
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}
