"""DeepSeek-V3 (`deepseek_v3` family) against transformers' DeepseekV3ForCausalLM, and its sharded plans
against the unsharded reference.

A tiny random DeepseekV3ForCausalLM is built offline (2 dense blocks then 2 moe blocks, 8 experts in 4
groups of which 2 are kept, one shared expert, a query latent, YaRN with mscale_all_dim), every weight
and the routers' correction biases redrawn away from HF's init, and saved as transformers writes it
(each expert's projections apart; `model.layers.{i}` numbering the blocks of both repeats in turn).
Loaded into single, expert-parallel, tensor-parallel and pipeline plans on the shared worker pool:
logits within 1e-4 of transformers', greedy tokens equal; exported back and read by transformers'
from_pretrained: the same logits. The sharded plans train against the unsharded reference (outputs,
gradients, parameters after AdamW steps, in float64) from these redrawn weights and biases.
"""

from __future__ import annotations

import json
import math
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
MODEL = ("model m = deepseek_v3 { vocab = 64, hidden = 32, layers = 4, first_dense = 2, heads = 4, ffn = 48,"
         " expert_ffn = 16, q_lora_rank = 16, kv_lora_rank = 12, qk_nope_head_dim = 8, qk_rope_head_dim = 4,"
         " v_head_dim = 8, experts = 8, top_k = 2, groups = 4, topk_groups = 2, routed_scaling = 2.5,"
         " shared_experts = 1, rope_type = yarn, rope_factor = 4.0, rope_original_positions = 16.0,"
         " rope_mscale = 1.0, rope_mscale_all_dim = 1.0, dtype = fp32 }")
# Tensor parallelism splits the heads (the latents' down-projections whole), the dense MLP's, the
# experts' and the shared expert's ffn, and the vocabulary; the routers stay whole.
TP = ("    layout { batch -> data, experts -> data, heads -> tensor, ffn -> tensor, expert_ffn -> tensor,"
      " shared_ffn -> tensor, vocab -> tensor }\n"
      "    shard blocks.*.mlp.router replicate\n    shard {dense,blocks}.*.attn.{q_a,kv_a} replicate\n")
PLANS = {  # mesh axes, plan body
    "single": ("one = 1", ""),
    # the experts split over data (expert parallelism)
    "data2_experts": ("data = 2", "    layout { batch -> data, experts -> data }\n"),
    # expert parallelism over data inside tensor parallelism
    "data2_tensor2_experts": ("data = 2, tensor = 2", TP),
    # stage 0 holds both dense blocks and the first moe block: a stage across the two repeats
    "pipeline2_data2_experts": ("pipeline = 2, data = 2",
                                "    layout { batch -> data, experts -> data }\n    microbatches = 2\n"
                                "    stages over pipeline {\n        0: embed, dense[0:2], blocks[0:1]\n"
                                "        1: blocks[1:2], norm, lm_head\n    }\n    schedule 1f1b\n"),
    # expert parallelism over data beside context parallelism: each context rank routes its part of
    # the sequences, and the correction bias's load counts every token once (summed over data x context)
    "data2_context2_experts": ("data = 2, context = 2",
                               "    layout { batch -> data, seq -> context, experts -> data }\n"),
    # the experts over data x context: 2 of 8 on each of the 4 ranks, each context rank's tokens
    # travelling to them (torchtitan folds EP over dp_shard x cp)
    "data2_context2_experts_over_both": ("data = 2, context = 2",
                                         "    layout { batch -> data, seq -> context, experts -> data * context }\n"),
    # the experts over data x tensor (torchtitan's EP over dp_shard x tp, etp = 1): each tensor rank
    # routes half the tokens to whole experts, 2 of 8 on each rank, the outputs all-gathered back
    "data2_tensor2_experts_over_both": ("data = 2, tensor = 2",
                                        TP.replace("experts -> data,", "experts -> data * tensor,")
                                        .replace(" expert_ffn -> tensor,", "")),
    # and over data x context x tensor: 1 of 8 experts on each of 8 ranks
    "data2_context2_tensor2_experts_over_all": ("data = 2, context = 2, tensor = 2",
                                                TP.replace("batch -> data, experts -> data,",
                                                           "batch -> data, seq -> context, experts -> data * context * tensor,")
                                                .replace(" expert_ffn -> tensor,", "")),
    # and inside tensor parallelism: 8 ranks, data x context x tensor
    "data2_context2_tensor2_experts": ("data = 2, context = 2, tensor = 2",
                                       TP.replace("batch -> data,", "batch -> data, seq -> context,")),
}
# the plans whose model moves its correction biases (balance_rate): the update compared too
BALANCED = {"data2_context2_experts", "data2_context2_experts_over_both", "data2_context2_tensor2_experts",
            "data2_tensor2_experts_over_both", "data2_context2_tensor2_experts_over_all"}


def compiled(plan: str, tmp_path: Path) -> tuple[str, int, str]:
    axes, body = PLANS[plan]
    model = MODEL.replace(" dtype = fp32", " balance_rate = 0.05, dtype = fp32") if plan in BALANCED else MODEL
    return compile_spec(plan_spec(axes, model, body, batch=4), f"deepseek_v3_{plan}", tmp_path)


def _config() -> Any:
    return tf.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
        q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0})


def build_deepseek_v3(directory: Path, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    hf = tf.DeepseekV3ForCausalLM(_config()).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in hf.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if p.dim() == 1 else 0.3 * noise)  # norms away from one
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("deepseek_v3") / "deepseek_v3"
    return directory, build_deepseek_v3(directory)


def _tokens() -> Any:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


def test_the_tiny_model_routes_by_its_correction_bias(model: Any) -> None:
    """The redrawn correction bias changes which experts are chosen: a test where it does not could
    not tell a bias loaded from one left at zero."""
    _, hf = model
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        gates = [layer.mlp.gate for layer in hf.model.layers[2:]]
        saved = [g.e_score_correction_bias.clone() for g in gates]
        for g in gates:
            g.e_score_correction_bias.zero_()
        unbiased = hf(tokens).logits
        for g, s in zip(gates, saved, strict=True):
            g.e_score_correction_bias.copy_(s)
    assert (want - unbiased).abs().max().item() > 0.1


@pytest.mark.parametrize("plan", [*(p for p in PLANS if p not in BALANCED), "data2_tensor2_experts_over_both",
                                  "data2_context2_tensor2_experts_over_all"])
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


@pytest.mark.parametrize("plan", ["data2_tensor2_experts", "pipeline2_data2_experts", "data2_tensor2_experts_over_both"])
def test_export_round_trips_through_transformers(plan: str, model: Any, pool: Any, tmp_path: Path) -> None:
    """Exported with the source's config.json and with meshllm's own: transformers reads back the same
    model (the correction biases too: the logits are equal)."""
    from safetensors import safe_open

    directory, hf = model
    path, n, _ = compiled(plan, tmp_path)
    tokens = _tokens()
    for own, out in ((False, tmp_path / "export"), (True, tmp_path / "own_config")):
        if own:
            pool.run(own_config_export_job, n, path, str(directory), str(out))
        else:
            pool.run(export_job, n, path, str(directory), str(out), 5 * 10**9)
        back = tf.DeepseekV3ForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            assert (back(tokens).logits - hf(tokens).logits).abs().max().item() == 0.0
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            assert keys == set(f.keys())  # transformers' names, every one, nothing more
    cfg = json.loads((tmp_path / "own_config" / "config.json").read_text())
    assert (cfg["first_k_dense_replace"], cfg["n_group"], cfg["topk_group"], cfg["q_lora_rank"]) == (2, 4, 2, 16)


def test_import_hf_writes_a_spec_whose_weights_give_transformers_logits(model: Any, pool: Any, tmp_path: Path) -> None:
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.cli.main import main
    from meshllm_dsl.codegen.emit import render_plan

    directory, hf = model
    out = tmp_path / "imported.mesh"
    assert main(["import-hf", str(directory), "-o", str(out), "--seq", "8"]) == 0
    text = out.read_text()
    assert "= deepseek_v3 {" in text and "first_dense = 2" in text and "rope_mscale_all_dim = 1.0" in text
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
    ("scoring_func", "softmax", "`scoring_func` = 'softmax' is not supported"),
    ("topk_method", "greedy", "`topk_method` = 'greedy' is not supported"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "`rope_parameters.rope_type` = 'linear'"),
    ("quantization_config", {"quant_method": "fp8"}, "`quantization_config` is set"),
    ("first_k_dense_replace", 0, "`first_k_dense_replace` = 0"),
    ("first_k_dense_replace", 4, "`first_k_dense_replace` = 4"),
    ("rope_interleave", False, "`rope_interleave` = False"),
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


def test_import_hf_ignores_the_mtp_layers_as_transformers_does(model: Any) -> None:
    """transformers builds no multi-token-prediction module (num_nextn_predict_layers): neither does the import."""
    from meshllm_dsl.interop.import_hf import model_settings

    cfg = json.loads((model[0] / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    assert not hasattr(tf.DeepseekV3ForCausalLM(_config()).model, "mtp")
    _, settings, _ = model_settings(cfg, "config.json")
    assert ("layers", 4) in [(k, v) for k, v, _ in settings]


@pytest.mark.parametrize(("field", "value", "says"), [
    ("n_group", 2, "`n_group` is 2, but model `m` has groups = 4"),
    ("first_k_dense_replace", 1, "`first_k_dense_replace` is 1, but model `m` has first_dense"),
    ("routed_scaling_factor", 1.0, "`routed_scaling_factor` is 1.0, but model `m` has routed_scaling = 2.5"),
])
def test_a_checkpoint_with_other_settings_is_refused_in_one_line(field: str, value: Any, says: str, model: Any,
                                                                 pool: Any, tmp_path: Path) -> None:
    directory, _ = model
    path, n, _ = compiled("single", tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    for f in directory.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "config.json").read_text())
    cfg[field] = value
    (other / "config.json").write_text(json.dumps(cfg))
    (msg,) = set(pool.run(error_job, n, path, str(other)))
    assert says in msg, msg


@pytest.mark.parametrize("plan", [p for p in PLANS if p != "single"])
def test_sharded_deepseek_v3_equals_the_reference_from_redrawn_weights(plan: str, model: Any, pool: Any,
                                                                       tmp_path: Path) -> None:
    path, n, _ = compiled(plan, tmp_path)
    for errs in pool.run(redrawn_compare_job, n, path, str(model[0]), 2, True):
        worst = max(errs, key=errs.__getitem__)
        assert errs[worst] <= TOLERANCE["float64"], (worst, errs[worst])
        # gradients of both repeats' blocks, the latents' norms and the shared expert compared
        for leaf in ("dense.1.attn.kv_a.norm", "blocks.0.mlp.shared_down.weight", "blocks.1.mlp.router.weight"):
            assert f"grad {leaf}" in errs, sorted(errs)
        assert any(k.startswith("buffer ") and k.endswith("router.e_score_correction_bias") for k in errs)


@pytest.mark.parametrize("plan", ["context", "tensor"])
def test_the_experts_example_equals_the_unsharded_model(plan: str, pool: Any, tmp_path: Path) -> None:
    """examples/tiny_deepseek_experts.mesh, what `meshc verify --plan context|tensor` checks: the
    experts over data x context and over data x tensor, seq 32, from the seeded init, float32 and
    float64, the correction biases moving (balance_rate)."""
    from reference_jobs import compare_job

    from meshllm_dsl.checker import check_file
    from meshllm_dsl.codegen.emit import render_plan

    source = Path(__file__).resolve().parents[2] / "examples" / "tiny_deepseek_experts.mesh"
    result = check_file(str(source))
    checked = result.plans[plan]
    assert checked.roles.expert == ("data", plan)
    path = tmp_path / f"{plan}.py"
    path.write_text(render_plan(checked, source.name, source.read_text()))
    for rank_errs in pool.run(compare_job, checked.mesh.devices, str(path), 2):
        for dtype, errs in rank_errs.items():
            worst = max(errs, key=errs.__getitem__)
            assert errs[worst] <= TOLERANCE[dtype], (dtype, worst, errs[worst])
            assert any(k.startswith("buffer ") for k in errs)


def _step_loads_job(ctx: Any, path: str, steps: int) -> list[list[int]]:
    """Each optimizer step's load per moe layer as the correction bias's update sees it (summed
    over the balance group), on this rank."""
    from meshllm_dsl.runtime.moe import routing
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    seen: list[list[int]] = []
    update = routing.update_correction

    def noting(bias: Any, load: Any, rate: float) -> None:
        seen[-1].append(int(load.sum()))
        update(bias, load, rate)

    routing.update_correction = noting  # type: ignore[assignment]
    try:
        for step in range(steps):
            seen.append([])
            built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 3, step))
    finally:
        routing.update_correction = update  # type: ignore[assignment]
    return seen


@pytest.mark.parametrize(("plan", "copies"), [("data2_context2_experts", 1), ("data2_context2_experts_over_both", 1),
                                               ("data2_context2_tensor2_experts", 2), ("data2_tensor2_experts_over_both", 2),
                                               ("data2_context2_tensor2_experts_over_all", 2)])
def test_the_bias_update_counts_each_token_once_over_data_and_context(plan: str, copies: int, pool: Any,
                                                                      tmp_path: Path) -> None:
    """Each of the 2 moe layers' step load is batch 4 x seq 8 x top 2 pairs: every context rank's
    tokens in it once (a tensor group's ranks route the same tokens: each counted once per rank,
    which scales every expert's load alike and leaves the sign update as it is)."""
    path, n, _ = compiled(plan, tmp_path)
    for seen in pool.run(_step_loads_job, n, path, 2):
        assert seen == [[4 * 8 * 2 * copies] * 2] * 2, seen


def test_import_hf_reads_the_published_config_as_the_671b_example() -> None:
    """DeepSeek-V3's config.json as the hub has it (transformers 4's `rope_scaling` with `type`, the
    original code's `aux_loss_alpha`, `seq_aux`, `moe_layer_freq`, `ep_size`), less its FP8
    `quantization_config` (refused above), gives a model of examples/deepseek_v3_671b.mesh's
    671,026,404,352 parameters (transformers' meta-device count, no MTP module)."""
    from meshllm_dsl.checker import check_file, check_text
    from meshllm_dsl.interop.import_hf import model_settings

    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
           "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
           "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
           "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
           "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
           "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
           "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
           "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}
    family, settings, positions = model_settings(cfg, "config.json")
    assert (family, positions) == ("deepseek_v3", 163840)
    read = {k: v for k, v, _ in settings}
    assert (read["first_dense"], read["rope_type"], read["rope_factor"], read["rope_mscale_all_dim"]) == (3, "yarn", 40.0, 1.0)
    body = "\n".join(f"    {k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v, _ in settings)
    imported = check_text(f"model m = deepseek_v3 {{\n{body}\n}}\n", "m.mesh").models["m"]
    example = check_file(str(Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3_671b.mesh")).models["deepseek_v3"]
    assert imported.numel == example.numel == 671_026_404_352


def test_several_repeats_outside_the_deepseek_v3_layout_are_refused_by_name() -> None:
    """Blocks of two kinds with Llama's attention: no Llama-shaped config.json holds them."""
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.codegen.lower import model_description
    from meshllm_dsl.runtime.hf import weights as hf

    (plan,) = check_file(str(Path(__file__).resolve().parents[2] / "examples" / "tiny_dense_moe.mesh")).plans.values()
    with pytest.raises(hf.WeightsError, match=r"model `tiny_dense_moe` has 2 repeats \(dense, blocks\); its Hugging Face "
                                              r"layout \(Llama\) has blocks of one kind"):
        hf.model_arch(model_description(plan))


def test_each_rank_reads_only_the_experts_it_holds(model: Any, pool: Any, tmp_path: Path) -> None:
    """Experts over data 2: each rank reads half of every moe layer's experts and all of the rest
    (the correction biases included), nothing more."""
    from hf_models import bytes_read_job
    from safetensors import safe_open

    directory, _ = model
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        sizes = {k: math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()}
    experts = sum(v for k, v in sizes.items() if ".mlp.experts." in k)
    rest = sum(sizes.values()) - experts
    path, n, _ = compiled("data2_experts", tmp_path)
    assert pool.run(bytes_read_job, n, path, str(directory)) == [experts // 2 + rest] * 2


def test_a_direct_query_projection_and_unscaled_rope_load_and_export(pool: Any, tmp_path: Path) -> None:
    """q_lora_rank null (one projection `q_proj`, as DeepSeek-V2-Lite) and default rope: import-hf's spec
    loads with transformers' logits, and its export is read back by transformers with the same."""
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.cli.main import main
    from meshllm_dsl.codegen.emit import render_plan

    config = _config()
    config.q_lora_rank = None
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(0)
    hf = tf.DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1.0 if p.dim() == 1 else 0.0))
    directory = tmp_path / "direct_q"
    hf.save_pretrained(directory)
    out = tmp_path / "direct_q.mesh"
    assert main(["import-hf", str(directory), "-o", str(out), "--seq", "8"]) == 0
    text = out.read_text()
    assert "q_lora_rank = 0" in text and "rope_type" not in text
    result = check_file(str(out))
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    path = tmp_path / "direct_q.py"
    path.write_text(render_plan(plan, out.name, text))
    tokens = _tokens()
    logits, _ = pool.run(logits_job, 1, str(path), str(directory), tokens, 0)[0]
    with torch.no_grad():
        want = hf(tokens).logits
    assert (logits - want).abs().max().item() <= 1e-4
    pool.run(own_config_export_job, 1, str(path), str(directory), str(tmp_path / "back"))
    back = tf.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.q_lora_rank is None
    with torch.no_grad():
        assert (back(tokens).logits - want).abs().max().item() == 0.0


def test_ungrouped_routing_writes_and_checks_its_config() -> None:
    """n_group 1 (Kimi K2's): the MODEL description leaves groups / topk_groups / routed_scaling out at
    their defaults, and the config.json written still says them."""
    import torch

    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.lower import model_description
    from meshllm_dsl.runtime.hf import weights as hf

    text = MODEL.replace("groups = 4, topk_groups = 2, routed_scaling = 2.5,", "groups = 1, topk_groups = 1, routed_scaling = 1.0,") + "\nmesh g { axes data = 1 }\n" \
        "plan p on g for m {\n    batch = 2\n    seq = 8\n}\n"
    (plan,) = check_text(text, "m.mesh").plans.values()
    desc = model_description(plan)
    cfg = hf.hf_config(desc, torch.float32)
    assert (cfg["n_group"], cfg["topk_group"], cfg["routed_scaling_factor"]) == (1, 1, 1.0)
    hf.check_config(desc, cfg, "config.json")  # what it wrote, it reads back
