"""GPT-OSS (`gpt_oss` family) against transformers' GptOssForCausalLM, and its sharded plans against the
unsharded reference.

A tiny random GptOssForCausalLM is built offline with every weight redrawn away from HF's init (sinks,
q / k / v / o biases, router bias and expert biases nonzero, norms away from one, weights large
enough that the clamped SwiGLU's clamps bind), saved in transformers' own layout (experts fused and
3-D, gate / up interleaved), loaded into single, tensor-parallel and expert-parallel plans on the
shared worker pool: logits within 1e-4 of transformers', greedy tokens equal; exported back
and read by transformers' from_pretrained: the same logits. The sharded plans train against the
unsharded reference (outputs, gradients, parameters after AdamW steps) from these redrawn weights
too, so sinks and biases are exercised away from their zero / one init.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from hf_models import export_job, logits_job  # noqa: E402
from moe_redrawn import redrawn_compare_job  # noqa: E402
from moe_specs import compile_spec, plan_spec  # noqa: E402
from reference_jobs import compare_job  # noqa: E402

from meshllm_dsl.runtime.jobs.compare import TOLERANCE  # noqa: E402

N_NEW = 5
MODEL = ("model m = gpt_oss { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, head_dim = 8, ffn = 24,"
         " experts = 4, top_k = 2, window = 4, rope_factor = 4.0, rope_original_positions = 16, dtype = fp32 }")
TP = "heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor"
PLANS = {  # mesh axes, plan body
    "single": ("one = 1", ""),
    "tensor2": ("tensor = 2", f"    layout {{ {TP} }}\n    shard blocks.*.mlp.router replicate\n"),
    # the attention core (with its sinks) rerun in backward
    "tensor2_recompute_attention": ("tensor = 2", f"    layout {{ {TP} }}\n    shard blocks.*.mlp.router replicate\n"
                                    "    recompute = attention\n"),
    # experts split over data (expert parallelism) inside tensor parallelism
    "data2_tensor2_experts": ("data = 2, tensor = 2",
                              f"    layout {{ {TP}, batch -> data, experts -> data }}\n"
                              "    shard blocks.*.mlp.router replicate\n"),
    # examples/gpt_oss_120b.mesh's layout in small: experts over an axis of their own, ZeRO-3 over the other
    "data2_expert2_zero3": ("data = 2, expert = 2",
                            "    layout { batch -> data * expert, experts -> expert }\n"
                            "    shard blocks.*.mlp.router replicate\n    shard blocks.*.attn.{q,k,v,o} replicate\n"
                            "    shard embed replicate\n    shard lm_head replicate\n"
                            "    optimizer adamw { zero 3 over data }\n"),
    "context2_tensor2": ("context = 2, tensor = 2",
                         f"    layout {{ {TP}, seq -> context }}\n    shard blocks.*.mlp.router replicate\n"),
    "pipeline2_tensor2": ("pipeline = 2, tensor = 2",
                          f"    layout {{ {TP} }}\n    shard blocks.*.mlp.router replicate\n"
                          "    microbatches = 2\n    stages over pipeline balanced\n"),
}


def compiled(plan: str, tmp_path: Path) -> tuple[str, int, str]:
    axes, body = PLANS[plan]
    return compile_spec(plan_spec(axes, MODEL, body, batch=4), f"gpt_oss_{plan}", tmp_path)


def _config() -> Any:
    return tf.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0})


def build_gpt_oss(directory: Path, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    hf = tf.GptOssForCausalLM(_config()).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("sinks"):
                p.copy_(noise)
            elif p.dim() == 1 or "bias" in name:
                p.copy_(0.2 * noise)
            elif "experts" in name:
                p.copy_(1.5 * noise)  # pre-activations past swiglu_limit (7), so both clamps bind
            else:
                p.copy_(0.25 * noise)
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("gpt_oss") / "gpt_oss"
    return directory, build_gpt_oss(directory)


def _tokens() -> Any:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


def test_the_tiny_model_clamps_both_sides(model: Any) -> None:
    """The redrawn experts reach the clamps: a test that never clamps could not tell the activation."""
    _, hf = model
    seen: list[Any] = []
    experts = hf.model.layers[0].mlp.experts
    handle = experts.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    with torch.no_grad():
        hf(_tokens())
    handle.remove()
    gate_up = seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up[..., ::2] > 7.0).any() and (gate_up[..., 1::2] < -7.0).any()


@pytest.mark.parametrize("plan", ["single", "tensor2", "data2_tensor2_experts", "pipeline2_tensor2", "context2_tensor2"])
def test_weights_give_transformers_logits_and_tokens(plan: str, model: Any, pool: Any, tmp_path: Path) -> None:
    directory, hf = model
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        want_tokens = hf.generate(tokens[:1], max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW)
    path, n, _ = compiled(plan, tmp_path)
    logits, generated = pool.run(logits_job, n, path, str(directory), tokens, N_NEW)[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert generated.tolist() == want_tokens.tolist()


def test_export_round_trips_through_transformers(model: Any, pool: Any, tmp_path: Path) -> None:
    directory, hf = model
    path, n, _ = compiled("tensor2", tmp_path)
    for source, out in ((str(directory), tmp_path / "export"), (None, tmp_path / "own_config")):
        pool.run(export_job if source else _own_config_export_job, n, path, str(directory), str(out), 5 * 10**9)
        back = tf.GptOssForCausalLM.from_pretrained(out).eval()
        tokens = _tokens()
        with torch.no_grad():
            assert (back(tokens).logits - hf(tokens).logits).abs().max().item() == 0.0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "own_config" / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("model.layers.1.mlp.experts.gate_up_proj").get_shape()) == (4, 32, 48)


def _own_config_export_job(ctx: Any, path: str, weights: str, out: str, max_shard_bytes: int) -> None:
    """On every rank: load ``weights`` and export with meshllm's own config.json (no source given)."""
    from meshllm_dsl.runtime.hf.weights import export_hf
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    export_hf(program.build(ctx.mesh(program.axes), weights=weights), out, max_shard_bytes=max_shard_bytes)


def test_import_hf_writes_a_spec_whose_weights_give_transformers_logits(model: Any, pool: Any, tmp_path: Path) -> None:
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.cli.main import main
    from meshllm_dsl.codegen.emit import render_plan

    directory, hf = model
    out = tmp_path / "imported.mesh"
    assert main(["import-hf", str(directory), "-o", str(out), "--seq", "8"]) == 0
    text = out.read_text()
    assert "= gpt_oss {" in text and "rope_truncate = false" in text and "global_every = 2" in text
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
    ("attention_bias", False, "`attention_bias` = False drops the q, k, v and o biases"),
    ("layer_types", ["full_attention", "sliding_attention"], "`layer_types` = ['full_attention', 'sliding_attention'] is no pattern"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "`rope_parameters.rope_type` = 'linear'"),
    ("quantization_config", {"quant_method": "mxfp4"}, "`quantization_config` is set"),
    ("attention_dropout", 0.1, "`attention_dropout` = 0.1 drops attention probabilities"),
])
def test_import_hf_refuses_what_the_family_does_not_honour_by_name(field: str, value: Any, says: str,
                                                                   model: Any) -> None:
    from meshllm_dsl.interop.import_hf import ImportError_, model_settings

    cfg = json.loads((model[0] / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ImportError_, match=None) as err:
        model_settings(cfg, "config.json")
    assert says in str(err.value), str(err.value)


def test_a_checkpoint_with_other_settings_is_refused_in_one_line(model: Any, pool: Any, tmp_path: Path) -> None:
    from hf_models import error_job

    directory, _ = model
    path, n, _ = compiled("single", tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    for f in directory.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "config.json").read_text())
    cfg["swiglu_limit"] = 5.0
    (other / "config.json").write_text(json.dumps(cfg))
    (msg,) = set(pool.run(error_job, n, path, str(other)))
    assert "`swiglu_limit` is 5.0, but model `m` has swiglu_limit = 7.0" in msg, msg


@pytest.mark.parametrize("plan", list(PLANS))
def test_sharded_gpt_oss_equals_the_reference_from_redrawn_weights(plan: str, model: Any, pool: Any,
                                                                   tmp_path: Path) -> None:
    path, n, _ = compiled(plan, tmp_path)
    for errs in pool.run(redrawn_compare_job, n, path, str(model[0])):
        worst = max(errs, key=errs.__getitem__)
        assert errs[worst] <= TOLERANCE["float64"], (worst, errs[worst])
        assert any(k.startswith("grad ") and k.endswith("q.sinks") for k in errs)


@pytest.mark.parametrize("plan", ["tensor2", "data2_tensor2_experts"])
def test_sharded_gpt_oss_equals_the_reference_from_its_init(plan: str, pool: Any, tmp_path: Path) -> None:
    path, n, _ = compiled(plan, tmp_path)
    for rank_errs in pool.run(compare_job, n, path, 2):
        for dtype, errs in rank_errs.items():
            worst = max(errs, key=errs.__getitem__)
            assert errs[worst] <= TOLERANCE[dtype], (dtype, worst, errs[worst])


def test_the_planner_counts_gpt_oss_120b_as_transformers_does() -> None:
    """examples/gpt_oss_120b.mesh against GptOssForCausalLM built from the published config (GptOssConfig's
    defaults are gpt-oss-120b's) on the meta device: every parameter, sinks and biases included."""
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.planner import analyze as planner

    config = tf.GptOssConfig()
    assert (config.num_hidden_layers, config.hidden_size, config.num_local_experts, config.vocab_size) == (36, 2880, 128, 201088)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in tf.GptOssForCausalLM(config).parameters())
    (plan,) = check_file(str(Path(__file__).resolve().parents[2] / "examples" / "gpt_oss_120b.mesh")).plans.values()
    assert plan.model.numel == theirs == 116_829_156_672
    assert "parameters      116,829,156,672 (116.83B)" in planner.report_text(planner.analyze(plan))


def test_sinks_with_a_fused_qkv_projection_is_a_located_error() -> None:
    from meshllm_dsl.checker import check_text

    text = ("mesh m { axes one = 1 }\nmodel t {\n    embed = embedding(64, 32)\n    blocks = repeat(2) {\n"
            "        n = rmsnorm(32)\n        attn = attention(32, 4, fused_qkv = true, sinks = true)\n    }\n"
            "    head = linear(32, 64)\n}\nplan p on m for t {\n    batch = 1\n    seq = 8\n}\n")
    (d,) = check_text(text, "s.mesh").errors
    assert d.code == "E0304" and "sinks = true needs a separate q projection" in d.message
    assert d.span is not None and d.span.line == 6 and "fused_qkv = false" in (d.help or "")


@pytest.mark.parametrize(("plan", "share"), [("tensor2", 0.5), ("data2_tensor2_experts", 0.25)])
def test_weights_are_read_slice_by_slice(plan: str, share: float, model: Any, pool: Any, tmp_path: Path) -> None:
    """Each rank reads only its share of the fused experts (its experts, its ffn columns of each, gate's
    and up's by a strided read), never the whole gate_up_proj."""
    from hf_models import bytes_read_job
    from safetensors import safe_open

    directory, _ = model
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        sizes = {k: math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()}
    experts = sum(v for k, v in sizes.items() if ".experts." in k and not k.endswith("down_proj_bias"))
    rest = sum(sizes.values()) - experts
    path, n, _ = compiled(plan, tmp_path)
    for got in pool.run(bytes_read_job, n, path, str(directory)):
        # the experts' share, and at most all of the rest (the embedding, attention and down biases)
        assert share * experts <= got <= share * experts + rest, (got, experts, rest)
        assert got < share * experts + 0.75 * rest


def test_import_hf_reads_the_published_120b_config_as_the_example() -> None:
    """gpt-oss-120b's config.json as the hub has it (transformers 4's `rope_scaling` and top-level
    `rope_theta`), less its MXFP4 `quantization_config` (refused above), gives the settings of
    examples/gpt_oss_120b.mesh's model."""
    import attrs

    from meshllm_dsl.checker import check_file, check_text
    from meshllm_dsl.interop.import_hf import model_settings

    cfg = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
           "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False, "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                            "rope_type": "yarn", "truncate": False}, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
           "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "vocab_size": 201088}
    family, settings, positions = model_settings(cfg, "config.json")
    assert (family, positions) == ("gpt_oss", 131072)
    body = "\n".join(f"    {k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v, _ in settings)
    imported = check_text(f"model m = gpt_oss {{\n{body}\n}}\n", "m.mesh").models["m"]
    example = check_file(str(Path(__file__).resolve().parents[2] / "examples" / "gpt_oss_120b.mesh")).models["gpt_oss_120b"]
    assert imported.numel == example.numel == 116_829_156_672
    # every resolved setting the same (the dtype aside: the example trains in the family's bf16 too)
    assert dict(imported.values) == dict(example.values)
    assert imported.items == attrs.evolve(example, name="m").items
