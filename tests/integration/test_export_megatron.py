"""`meshc export --to megatron`: the written pretrain_gpt.py line, validated by megatron-core's own configs.

Megatron-LM's parser (megatron/training/arguments.py) is not in the megatron-core wheel, so the line is
parsed back here by a small argparse that spells each flag as arguments.py does (read at Megatron-LM
d98e8a6): the flags arguments.py generates from TransformerConfig's fields (ArgumentGroupFactory: the
field name with dashes) must name a field of megatron-core's TransformerConfig. The parsed values then
build megatron-core's TransformerConfig (its __post_init__ refuses the combinations Megatron does not
run: a pipeline layout that does not fit, recomputation or MoE settings it lacks), and, for the
distributed optimizer, its OptimizerConfig and DistributedDataParallelConfig, all on CPU. The values
must be the plan's: sizes, stages, batch, recomputation, precision and the model's shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from meshllm_dsl.checker import check_file  # noqa: E402
from meshllm_dsl.cli.main import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.mesh"))

# (flag, argparse kwargs) as arguments.py declares them; `field` marks those generated from TransformerConfig.
_INT, _FLOAT, _STR, _TRUE = {"type": int}, {"type": float}, {"type": str}, {"action": "store_true"}
MEGATRON_FLAGS: dict[str, tuple[dict[str, Any], bool]] = {
    "--tensor-model-parallel-size": (_INT, True), "--pipeline-model-parallel-size": (_INT, True),
    "--num-layers-per-virtual-pipeline-stage": (_INT, False), "--pipeline-model-parallel-layout": (_STR, False),
    "--context-parallel-size": (_INT, True), "--expert-model-parallel-size": (_INT, True),
    "--expert-tensor-parallel-size": (_INT, True), "--sequence-parallel": (_TRUE, True),
    "--use-distributed-optimizer": (_TRUE, False), "--use-megatron-fsdp": (_TRUE, False),
    "--data-parallel-sharding-strategy": ({"type": str, "choices": ["no_shard", "optim", "optim_grads",
                                                                     "optim_grads_params"]}, False),
    "--ckpt-format": ({"type": str, "choices": ["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"]}, False),
    "--micro-batch-size": (_INT, False), "--global-batch-size": (_INT, False), "--seq-length": (_INT, False),
    "--reset-attention-mask": (_TRUE, False), "--reset-position-ids": (_TRUE, False),  # _add_data_args
    "--recompute-granularity": ({"type": str, "choices": ["full", "selective"]}, True),
    "--recompute-method": ({"type": str, "choices": ["uniform", "block"]}, True),
    "--recompute-num-layers": (_INT, True), "--recompute-modules": ({"nargs": "*", "type": str}, True),
    "--bf16": (_TRUE, True), "--grad-reduce-in-bf16": (_TRUE, False),
    "--fp8-format": ({"type": str, "choices": ["e4m3", "hybrid"]}, False),
    "--fp8-recipe": ({"type": str, "choices": ["tensorwise", "delayed", "mxfp8", "blockwise"]}, True),
    "--first-last-layers-bf16": (_TRUE, True), "--num-layers-at-start-in-bf16": (_INT, True),
    "--num-layers-at-end-in-bf16": (_INT, True),
    "--num-layers": (_INT, True), "--hidden-size": (_INT, True), "--ffn-hidden-size": (_INT, True),
    "--num-attention-heads": (_INT, True), "--group-query-attention": (_TRUE, False),
    "--attention-dropout": (_FLOAT, True), "--hidden-dropout": (_FLOAT, True),
    "--num-query-groups": (_INT, True), "--kv-channels": (_INT, True),
    "--normalization": ({"type": str, "choices": ["LayerNorm", "RMSNorm"]}, True),
    "--norm-epsilon": (_FLOAT, False), "--swiglu": (_TRUE, False), "--openai-gelu": (_TRUE, False),
    "--position-embedding-type": ({"type": str, "choices": ["learned_absolute", "rope", "yarn", "mrope",
                                                             "relative", "none"]}, False),
    "--max-position-embeddings": (_INT, False), "--rotary-base": (_INT, False), "--use-rope-scaling": (_TRUE, False),
    "--rope-scaling-factor": (_FLOAT, False), "--disable-bias-linear": (_TRUE, False),
    "--add-qkv-bias": (_TRUE, True), "--qk-layernorm": (_TRUE, True),
    "--untie-embeddings-and-output-weights": (_TRUE, False), "--vocab-size": (_INT, False),
    "--make-vocab-size-divisible-by": (_INT, False),
    "--num-experts": (_INT, False), "--moe-router-topk": (_INT, True), "--moe-ffn-hidden-size": (_INT, True),
    "--moe-router-load-balancing-type": ({"type": str, "nargs": "+"}, False),
    "--moe-aux-loss-coeff": ({"type": float, "nargs": "+"}, False), "--moe-z-loss-coeff": (_FLOAT, True),
    "--moe-token-dispatcher-type": ({"type": str, "choices": ["allgather", "alltoall", "flex"]}, True),
    "--moe-router-pre-softmax": (_TRUE, True), "--moe-shared-expert-intermediate-size": (_INT, True),
    "--moe-shared-expert-gate": (_TRUE, True),
    # multi-latent attention (_add_mla_args) and the router's (generated from TransformerConfig)
    "--multi-latent-attention": (_TRUE, True), "--q-lora-rank": (_INT, False), "--kv-lora-rank": (_INT, False),
    "--qk-head-dim": (_INT, False), "--qk-pos-emb-head-dim": (_INT, False), "--v-head-dim": (_INT, False),
    "--rope-type": ({"type": str, "choices": ["rope", "yarn"]}, False), "--rotary-scaling-factor": (_FLOAT, False),
    "--mscale": (_FLOAT, False), "--mscale-all-dim": (_FLOAT, False), "--rotary-percent": (_FLOAT, False),
    "--moe-router-score-function": ({"type": str, "choices": ["softmax", "sigmoid"]}, True),
    "--moe-router-enable-expert-bias": (_TRUE, True), "--moe-router-bias-update-rate": (_FLOAT, True),
    "--moe-router-num-groups": (_INT, True), "--moe-router-group-topk": (_INT, True),
    "--moe-router-topk-scaling-factor": (_FLOAT, True),
    "--moe-router-dtype": ({"type": str, "choices": ["fp32", "fp64"]}, True),
    "--moe-layer-freq": ({"type": str}, False),
}


def _moe_freq(x: str | None) -> int | list[int]:
    """arguments.py's moe_freq_type: an int, or a list expression of digits, brackets, + and *."""
    if x is None:
        return 1
    if "[" not in x:
        return int(x)
    assert not re.search(r"[^,\d\[\]\(\)\+\*]", x), x
    return list(eval(x))  # noqa: S307 - the pattern holds only list arithmetic, as Megatron evaluates it


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=False)
    for flag, (kwargs, _) in MEGATRON_FLAGS.items():
        p.add_argument(flag, **kwargs)
    return p


def _plans() -> list[tuple[Path, str]]:
    out = []
    for path in EXAMPLES:
        result = check_file(path)
        if result.ok:
            out += [(path, name) for name in result.plans]
    return out


def _export(src: Path, plan: str, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(["export", str(src), "--plan", plan, "--to", "megatron", "-o", str(out)])
    return rc, capsys.readouterr().err


def script_args(script: Path) -> list[str]:
    """The arguments after `pretrain_gpt.py` in the written script, without the launcher's "$@"."""
    text = script.read_text()
    line = text[text.index("pretrain_gpt.py"):].replace("\\\n", " ")
    return [a for a in shlex.split(line)[1:] if a != "$@"]


def _configs(ns: argparse.Namespace) -> tuple[Any, Any, Any]:
    """megatron-core's TransformerConfig, OptimizerConfig and DistributedDataParallelConfig for the parsed
    line, as megatron/training/arguments.py's core_transformer_config_from_args and training.py build them."""
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dtype = torch.bfloat16 if ns.bf16 else torch.float32
    vpp = None
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        vpp = ns.num_layers // ns.pipeline_model_parallel_size // ns.num_layers_per_virtual_pipeline_stage
    layout = ns.pipeline_model_parallel_layout
    if layout is not None:
        vpp = len(layout.split("|")) // ns.pipeline_model_parallel_size
        vpp = vpp if vpp > 1 else None
    kw: dict[str, Any] = dict(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size, num_attention_heads=ns.num_attention_heads,
        ffn_hidden_size=ns.ffn_hidden_size, kv_channels=ns.kv_channels,
        attention_dropout=0.1 if ns.attention_dropout is None else ns.attention_dropout,
        hidden_dropout=0.1 if ns.hidden_dropout is None else ns.hidden_dropout,
        num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
        tensor_model_parallel_size=ns.tensor_model_parallel_size or 1,
        pipeline_model_parallel_size=ns.pipeline_model_parallel_size or 1,
        virtual_pipeline_model_parallel_size=vpp, pipeline_model_parallel_layout=layout,
        context_parallel_size=ns.context_parallel_size or 1,
        expert_model_parallel_size=ns.expert_model_parallel_size or 1,
        expert_tensor_parallel_size=ns.expert_tensor_parallel_size,
        sequence_parallel=ns.sequence_parallel, normalization=ns.normalization,
        layernorm_epsilon=ns.norm_epsilon, gated_linear_unit=ns.swiglu,
        activation_func=F.silu if ns.swiglu else F.gelu, add_bias_linear=not ns.disable_bias_linear,
        add_qkv_bias=ns.add_qkv_bias, qk_layernorm=ns.qk_layernorm,
        recompute_granularity=ns.recompute_granularity, recompute_method=ns.recompute_method,
        recompute_num_layers=ns.recompute_num_layers, bf16=ns.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        fp8=ns.fp8_format, first_last_layers_bf16=ns.first_last_layers_bf16,
        num_moe_experts=ns.num_experts, moe_router_topk=ns.moe_router_topk or 2,
        moe_ffn_hidden_size=ns.moe_ffn_hidden_size, moe_token_dispatcher_type=ns.moe_token_dispatcher_type or "allgather",
        moe_z_loss_coeff=ns.moe_z_loss_coeff,
    )
    if ns.recompute_modules is not None:
        kw["recompute_modules"] = ns.recompute_modules
    if ns.fp8_recipe is not None:
        kw["fp8_recipe"] = ns.fp8_recipe
    if ns.first_last_layers_bf16:
        kw["num_layers_at_start_in_bf16"] = ns.num_layers_at_start_in_bf16
        kw["num_layers_at_end_in_bf16"] = ns.num_layers_at_end_in_bf16
    if ns.moe_shared_expert_intermediate_size is not None:
        kw["moe_shared_expert_intermediate_size"] = ns.moe_shared_expert_intermediate_size
        kw["moe_shared_expert_gate"] = ns.moe_shared_expert_gate
    kw["moe_router_pre_softmax"] = ns.moe_router_pre_softmax
    if ns.moe_router_load_balancing_type is not None:
        kw["moe_router_load_balancing_type"] = ns.moe_router_load_balancing_type[0]
        kw["moe_aux_loss_coeff"] = ns.moe_aux_loss_coeff[0] if ns.moe_aux_loss_coeff else 0.0
    # the router and the dense / moe layer pattern (TransformerConfig fields, as arguments.py copies them)
    kw["moe_layer_freq"] = _moe_freq(ns.moe_layer_freq)
    kw["moe_router_score_function"] = ns.moe_router_score_function or "softmax"
    kw["moe_router_enable_expert_bias"] = ns.moe_router_enable_expert_bias
    for name in ("moe_router_bias_update_rate", "moe_router_num_groups", "moe_router_group_topk",
                 "moe_router_topk_scaling_factor", "moe_router_dtype"):
        if getattr(ns, name) is not None:
            kw[name] = getattr(ns, name)
    config_class: Any = TransformerConfig
    if ns.multi_latent_attention:  # core_transformer_config_from_args: MLATransformerConfig, its fields from args
        config_class = MLATransformerConfig
        kw.update(q_lora_rank=ns.q_lora_rank, kv_lora_rank=ns.kv_lora_rank or 32, qk_head_dim=ns.qk_head_dim or 128,
                  qk_pos_emb_head_dim=ns.qk_pos_emb_head_dim or 64, v_head_dim=ns.v_head_dim or 128,
                  rotary_scaling_factor=1.0 if ns.rotary_scaling_factor is None else ns.rotary_scaling_factor,
                  mscale=1.0 if ns.mscale is None else ns.mscale,
                  mscale_all_dim=0.0 if ns.mscale_all_dim is None else ns.mscale_all_dim,
                  rotary_base=ns.rotary_base or 10000, rotary_percent=ns.rotary_percent or 1.0)
        if ns.rope_type is not None:
            kw["rope_type"] = ns.rope_type
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = config_class(**kw)
        if tc.pipeline_model_parallel_layout is not None:  # as arguments.py's validate_args does
            tc.pipeline_model_parallel_layout.validate_layer_layout(tc.num_layers, 0)
        opt = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=ns.bf16, params_dtype=dtype,
                              use_distributed_optimizer=ns.use_distributed_optimizer)
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=ns.bf16 and not ns.grad_reduce_in_bf16,
            use_distributed_optimizer=ns.use_distributed_optimizer, use_megatron_fsdp=ns.use_megatron_fsdp,
            data_parallel_sharding_strategy=ns.data_parallel_sharding_strategy or "no_shard")
    return tc, opt, ddp


def _layout_counts(tc: Any) -> list[int]:
    """Blocks per virtual stage i (rank i % pp, chunk i // pp) in megatron-core's parsed layout."""
    from megatron.core.transformer.enums import LayerType

    lay = tc.pipeline_model_parallel_layout
    pp = tc.pipeline_model_parallel_size
    vpp = tc.virtual_pipeline_model_parallel_size or 1
    return [lay.layout[i % pp][i // pp].count(LayerType.decoder) for i in range(pp * vpp)]


def test_generated_flags_name_transformer_config_fields() -> None:
    """The flags arguments.py generates from TransformerConfig are its fields' names with dashes."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    generated = [flag[2:].replace("-", "_") for flag, (_, gen) in MEGATRON_FLAGS.items() if gen]
    assert [g for g in generated if g not in fields] == []
    from meshllm_dsl.interop.megatron import FLAGS

    assert sorted(set(FLAGS) - set(MEGATRON_FLAGS)) == []  # every flag the export writes is spelled here


ACCEPTED = {  # every example plan the export takes; the others are refused (test_examples_refused)
    ("gpt2_small", "train"), ("llama2_70b_train", "train_64"), ("tiny_llama", "train"),
    ("tiny_llama_context", "train"), ("tiny_llama_fp8", "train"), ("tiny_llama_fsdp", "train"),
    ("tiny_mixtral", "train"), ("tiny_mixtral_experts", "train"), ("tiny_qwen2_moe_experts_zero", "zero1"),
}


@pytest.mark.parametrize(("src", "plan"), _plans(), ids=lambda x: x.stem if isinstance(x, Path) else x)
def test_example(src: Path, plan: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.sh"
    rc, err = _export(src, plan, out, capsys)
    if (src.stem, plan) not in ACCEPTED:
        assert rc == 1 and "error[E12" in err and "help:" in err and "^" in err, err
        assert not out.exists()
        return
    assert rc == 0, err
    p = check_file(src).plans[plan]
    ns = _parser().parse_args(script_args(out))
    tc, opt, ddp = _configs(ns)
    tp, pp, cp = tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.context_parallel_size
    dp = p.mesh.devices // (tp * pp * cp)
    assert tp * pp * cp * dp == p.mesh.devices
    assert (pp, cp, dp, tc.expert_model_parallel_size) == (
        p.pipeline_size, p.context_size, p.data_size,
        p.mesh.size(*p.roles.expert) if p.roles.expert else 1)
    assert tc.sequence_parallel == bool(p.roles.sequence)
    # Megatron's global batch = micro batch x data-parallel size x microbatches
    assert ns.global_batch_size == p.batch and ns.seq_length == p.seq
    assert ns.global_batch_size // (ns.micro_batch_size * dp) == p.microbatches
    if pp > 1:
        counts = [sum(x.stop - x.start for x in s.pieces if x.start is not None) for s in p.stages]
        vpp = tc.virtual_pipeline_model_parallel_size or 1
        assert vpp == p.virtual and len(counts) == pp * vpp
        if tc.pipeline_model_parallel_layout is not None:  # megatron-core's own parse of the layout string
            assert _layout_counts(tc) == counts
        else:
            assert {ns.num_layers_per_virtual_pipeline_stage or ns.num_layers // pp} == set(counts)
    v = dict(p.model.values)
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size, tc.num_attention_heads) == (
        v["layers"], v["hidden"], v["ffn"], v["heads"])
    assert ns.vocab_size == v["vocab"]
    assert tc.attention_dropout == tc.hidden_dropout == 0.0  # meshllm's models have none
    assert tc.num_query_groups == v.get("kv_heads", v["heads"])
    assert tc.num_moe_experts == v.get("experts")
    assert tc.bf16 == (p.dtype == "bf16")
    assert {"none": None, "blocks": "full", "attention": "selective"}[p.recompute] == tc.recompute_granularity
    assert (tc.fp8 is not None) == (p.float8 is not None)
    assert ddp.use_distributed_optimizer == opt.use_distributed_optimizer == (p.zero >= 1)
    assert ddp.data_parallel_sharding_strategy == {0: "no_shard", 1: "no_shard", 2: "optim_grads",
                                                   3: "optim_grads_params"}[p.zero]


def test_all_accepted_examples_exist() -> None:
    have = {(src.stem, plan) for src, plan in _plans()}
    assert ACCEPTED <= have


def test_pipeline_layout_uneven(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Stages of 3 and 1 blocks: the layout string, which megatron-core parses into those stages."""
    text = (ROOT / "examples" / "tiny_llama.mesh").read_text()
    text = text.replace("stages over pipeline balanced", "stages over pipeline {\n        0: embed, blocks[0:3]\n"
                        "        1: blocks[3:4], norm, lm_head\n    }")
    src = tmp_path / "uneven.mesh"
    src.write_text(text)
    rc, err = _export(src, "train", tmp_path / "u.sh", capsys)
    assert rc == 0, err
    ns = _parser().parse_args(script_args(tmp_path / "u.sh"))
    assert ns.pipeline_model_parallel_layout == "Ettt|tL"
    tc, _, _ = _configs(ns)
    assert _layout_counts(tc) == [3, 1]


MODEL = """model tiny = llama {
    vocab = 256
    hidden = 64
    layers = 4
    heads = 4
    kv_heads = 2
    ffn = 128
    dtype = bf16
}
"""

TP = """    shard blocks.*.attn.{q,k,v} column(tensor)
    shard blocks.*.attn.o row(tensor)
    shard blocks.*.mlp.{gate,up} column(tensor)
    shard blocks.*.mlp.down row(tensor)
    shard embed vocab_parallel(tensor)
    shard lm_head column(tensor)
"""
MIXED = "    precision { params = bf16, master = fp32, reduce = fp32 }\n"


def _spec(axes: str, body: str) -> str:
    return f"mesh m {{ axes {axes} }}\n{MODEL}\nplan train on m for tiny {{\n    batch = 8\n    seq = 32\n{body}}}\n"


@pytest.mark.parametrize(("name", "axes", "body", "code", "line"), [
    ("pure_bf16", "data = 2", "    layout { batch -> data }\n", "E1206", "plan train on m for tiny"),
    ("ops", "data = 2", "    layout { batch -> data }\n    recompute = ops\n" + MIXED, "E1206", "recompute = ops"),
    ("every", "data = 2", "    layout { batch -> data }\n    recompute = blocks every 2\n" + MIXED, "E1206",
     "recompute = blocks every 2"),
    ("gpipe", "pipeline = 2", "    microbatches = 2\n    stages over pipeline balanced\n    schedule gpipe\n" + MIXED,
     "E1201", "schedule gpipe"),
    ("rowwise", "data = 2", "    layout { batch -> data }\n"
     "    precision { params = bf16, master = fp32, reduce = fp32, matmul = fp8_rowwise }\n"
     "    optimizer adamw { zero 1 over data }\n", "E1206",
     "matmul = fp8_rowwise"),
    ("compile", "data = 2", "    layout { batch -> data }\n    compile = blocks\n" + MIXED, "E1206", "compile = blocks"),
    ("tp_partial", "tensor = 2", TP.replace("shard blocks.*.mlp.down row(tensor)",
                                            "shard blocks.*.mlp.down replicate").replace(
        "    shard blocks.*.mlp.{gate,up} column(tensor)\n", "    shard blocks.*.mlp.{gate,up} replicate\n") + MIXED,
     "E1205", "shard blocks.*.mlp.{gate,up} replicate"),
    ("zero_part", "rep = 2, data = 2", "    layout { batch -> rep * data }\n" + MIXED +
     "    optimizer adamw { zero 1 over data }\n", "E1206", "zero 1 over data"),
    ("context_balance", "cp = 2", "    layout { seq -> cp }\n    pack = documents\n    context_balance = ptrr\n" + MIXED,
     "E1206", "context_balance = ptrr"),
])
def test_refusals_are_located(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, axes: str,
                              body: str, code: str, line: str) -> None:
    src = tmp_path / f"{name}.mesh"
    src.write_text(_spec(axes, body))
    rc, err = _export(src, "train", tmp_path / f"{name}.sh", capsys)
    assert rc == 1, err
    assert f"error[{code}]" in err and line in err and "^" in err and "help:" in err, err
    assert not (tmp_path / f"{name}.sh").exists()


@pytest.mark.parametrize(("change", "words"), [
    ({"--tensor-model-parallel-size": "3"}, "num_attention_heads"),  # 4 heads over 3 ranks
    ({"--pipeline-model-parallel-layout": "Ettt|ttL"}, "layers"),  # 5 blocks in the layout, 4 in the model
    ({"--recompute-granularity": "selective", "--recompute-num-layers": "1"}, "recompute_num_layers"),
])
def test_megatron_core_refuses_a_tampered_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               change: dict[str, str], words: str) -> None:
    """The validator is megatron-core's: the exported line passes, the same line with a size changed fails."""
    out = tmp_path / "run.sh"
    rc, err = _export(ROOT / "examples" / "tiny_llama.mesh", "train", out, capsys)
    assert rc == 0, err
    args = script_args(out)
    _configs(_parser().parse_args(args))
    for flag, value in change.items():
        args = args[: args.index(flag) + 1] + [value] + args[args.index(flag) + 2:] if flag in args else [*args, flag, value]
    with pytest.raises((ValueError, AssertionError)) as exc:
        _configs(_parser().parse_args(args))
    assert words in str(exc.value)


def test_load_balancing_loss_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """meshllm's aux loss is transformers' over all layers at once; Megatron's is one per layer: not the same run."""
    text = (ROOT / "examples" / "tiny_mixtral.mesh").read_text().replace("    top_k = 2\n", "    top_k = 2\n    aux_loss_coef = 0.01\n")
    src = tmp_path / "aux.mesh"
    src.write_text(text)
    rc, err = _export(src, "train", tmp_path / "aux.sh", capsys)
    assert rc == 1 and "error[E1204]" in err and "`aux_loss_coef` = 0.01" in err and "help:" in err, err


def test_the_guide_shows_the_written_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/guides/export.md's Megatron example is what the export writes for llama2_70b_train's train_64."""
    rc, err = _export(ROOT / "examples" / "llama2_70b_train.mesh", "train_64", tmp_path / "run.sh", capsys)
    assert rc == 0, err
    written = (tmp_path / "run.sh").read_text()
    written = written[written.index("torchrun --nproc_per_node 64"):]
    assert written in (ROOT / "docs" / "guides" / "export.md").read_text()


@pytest.mark.parametrize(("setting", "field", "want"), [
    ("attn_bias = true\n    attn_out_bias = false", "add_qkv_bias", True), ("qk_norm = head", "qk_layernorm", True),
    ("head_dim = 32", "kv_channels", 32)])
def test_qwen_style_switches(tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: str, field: str,
                             want: Any) -> None:
    """Qwen2's q / k / v biases, Qwen3's per-head q / k norms, a head_dim of its own, in TransformerConfig."""
    text = (ROOT / "examples" / "tiny_llama.mesh").read_text().replace("    ffn = 128\n", f"    ffn = 128\n    {setting}\n")
    (tmp_path / "q.mesh").write_text(text)
    rc, err = _export(tmp_path / "q.mesh", "train", tmp_path / "q.sh", capsys)
    assert rc == 0, err
    tc, _, _ = _configs(_parser().parse_args(script_args(tmp_path / "q.sh")))
    assert getattr(tc, field) == want
    assert tc.add_bias_linear is False


def qwen_moe_spec(family: str) -> str:
    """examples/tiny_mixtral.mesh (data 2 x tensor 2) as a Qwen2-MoE (gated shared expert, q / k / v
    biases) or Qwen3-MoE (per-head q / k norms, top-k renormalised) model."""
    text = (ROOT / "examples" / "tiny_mixtral.mesh").read_text().replace("= mixtral {", f"= {family} {{")
    if family == "qwen2_moe":
        text = text.replace("    top_k = 2\n", "    top_k = 2\n    shared_ffn = 128\n").replace(
            "    shard blocks.*.mlp.router replicate\n",
            "    shard blocks.*.mlp.router replicate\n    shard blocks.*.mlp.shared_router replicate\n").replace(
            "ffn -> tensor,", "ffn -> tensor, shared_ffn -> tensor,")
    return text


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe(tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str) -> None:
    (tmp_path / "q.mesh").write_text(qwen_moe_spec(family))
    assert check_file(tmp_path / "q.mesh").ok
    rc, err = _export(tmp_path / "q.mesh", "train", tmp_path / "q.sh", capsys)
    assert rc == 0, err
    ns = _parser().parse_args(script_args(tmp_path / "q.sh"))
    tc, _, _ = _configs(ns)
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.tensor_model_parallel_size) == (4, 2, 2)
    if family == "qwen2_moe":  # HF Qwen2-MoE: q / k / v biases, softmax top-k not renormalised, gated shared expert
        assert tc.add_qkv_bias and tc.moe_router_pre_softmax and tc.moe_shared_expert_gate
        assert tc.moe_shared_expert_intermediate_size == 128
    else:
        assert tc.qk_layernorm and not tc.moe_router_pre_softmax and tc.moe_shared_expert_intermediate_size is None


# DeepSeek-V3-class models: examples/tiny_deepseek.mesh and examples/deepseek_v3_671b.mesh, GLM-4.5, with
# what Megatron-LM cannot say changed (see test_deepseek_refusals_are_located for those as they are)
_TINY_DS = (("rope_original_positions = 16.0", "rope_original_positions = 4096.0"), ("top_k = 2", "top_k = 4"))
_PLAN_FIX = (("recompute = ops", "recompute = blocks\n    precision { params = bf16, master = fp32, reduce = fp32 }"),)


def _variant(tmp_path: Path, name: str, changes: tuple[tuple[str, str], ...]) -> Path:
    text = (ROOT / "examples" / f"{name}.mesh").read_text()
    for old, new in changes:
        assert old in text, old
        text = text.replace(old, new)
    out = tmp_path / f"{name}.mesh"
    out.write_text(text)
    return out


def _layered_check(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[argparse.Namespace, Any, Any]:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    rc, err = _export(src, "train", tmp_path / "run.sh", capsys)
    assert rc == 0, err
    ns = _parser().parse_args(script_args(tmp_path / "run.sh"))
    tc, _, _ = _configs(ns)
    p = check_file(src).plans["train"]
    assert isinstance(tc, MLATransformerConfig) == any(u.kind == "mla" for r in p.model.items
                                                       for u in getattr(r, "body", ()))
    return ns, tc, p


@pytest.mark.parametrize("name", ["tiny_deepseek", "deepseek_v3_671b"])
def test_deepseek_v3(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Multi-latent attention, YaRN, sigmoid routing with the expert bias, groups, shared expert, dense first
    blocks: megatron-core's MLATransformerConfig built from the written flags holds the model's settings."""
    src = _variant(tmp_path, name, _TINY_DS if name == "tiny_deepseek" else _PLAN_FIX)
    ns, tc, p = _layered_check(src, tmp_path, capsys)
    body = {r.name: {u.name: u for u in r.body} for r in p.model.items if hasattr(r, "body")}
    attn, moe = body["blocks"]["attn"], body["blocks"]["mlp"]
    a, e = dict(attn.attrs), dict(moe.attrs)
    rope = dict(a["rope_scaling"])
    n_dense, n_moe = next(r.count for r in p.model.items if getattr(r, "name", "") == "dense"), next(
        r.count for r in p.model.items if getattr(r, "name", "") == "blocks")
    assert tc.multi_latent_attention and tc.qk_layernorm
    assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim) == (
        a["q_lora_rank"], a["kv_lora_rank"], a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"])
    assert (tc.rope_type, tc.rotary_scaling_factor, tc.mscale, tc.mscale_all_dim) == (
        "yarn", rope["factor"], rope["mscale"], rope["mscale_all_dim"])
    assert (tc.original_max_position_embeddings, tc.beta_fast, tc.beta_slow) == (
        rope["original_max_position_embeddings"], rope["beta_fast"], rope["beta_slow"])
    assert tc.rotary_base == a["rope_theta"] and tc.num_layers == n_dense + n_moe
    assert tc.moe_layer_freq == [0] * n_dense + [1] * n_moe
    assert tc.ffn_hidden_size == body["dense"]["mlp"].attr("ffn") and tc.moe_ffn_hidden_size == e["ffn"]
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_router_score_function) == (e["experts"], e["top_k"], "sigmoid")
    assert tc.moe_router_enable_expert_bias and tc.moe_router_bias_update_rate == e["balance_rate"]
    assert (tc.moe_router_num_groups, tc.moe_router_group_topk) == (e["groups"], e["topk_groups"])
    assert e["top_k"] // tc.moe_router_group_topk == 2  # Megatron scores a group by its top 2, as DeepSeek does
    assert tc.moe_router_topk_scaling_factor == e["routed_scaling"] and tc.moe_router_dtype == "fp32"
    assert tc.moe_shared_expert_intermediate_size == e["shared_ffn"] and not tc.moe_shared_expert_gate
    assert tc.layernorm_epsilon == 1e-6 and not tc.add_bias_linear and tc.gated_linear_unit
    assert tc.expert_model_parallel_size == p.mesh.size(*p.roles.expert)
    assert tc.expert_tensor_parallel_size == (p.mesh.size(*p.roles.tensor) if p.roles.tensor else 1)
    if name == "deepseek_v3_671b":  # 61 blocks over 16 stages: the layout string, as megatron-core parses it
        counts = [sum(x.stop - x.start for x in s.pieces if x.start is not None) for s in p.stages]
        assert _layout_counts(tc) == counts and sum(counts) == 61


def test_glm45(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GLM-4.5: GQA with q / k / v biases, per-head q / k norms, half the head rotary (`--rotary-percent`),
    sigmoid routing without groups, a shared expert, 3 dense blocks."""
    src = _variant(tmp_path, "glm45_355b", _PLAN_FIX)
    ns, tc, p = _layered_check(src, tmp_path, capsys)
    v = dict(p.model.values)
    assert (tc.num_query_groups, tc.kv_channels, tc.add_qkv_bias, tc.qk_layernorm) == (8, 128, True, True)
    assert ns.rotary_percent == v["rotary_dim"] / v["head_dim"] == 0.5
    assert tc.moe_layer_freq == [0] * 3 + [1] * 89 and tc.moe_router_num_groups is None
    assert (tc.moe_router_score_function, tc.moe_router_topk_scaling_factor) == ("sigmoid", 2.5)
    assert (tc.num_moe_experts, tc.moe_ffn_hidden_size, tc.ffn_hidden_size) == (160, 1536, 12288)


@pytest.mark.parametrize(("changes", "words"), [
    ((), "YaRN `original_max_position_embeddings` = 16"),
    ((_TINY_DS[0],), "groups scored by their top 2 experts with top_k 2 of 2 groups"),
])
def test_deepseek_refusals_are_located(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       changes: tuple[tuple[str, str], ...], words: str) -> None:
    """examples/tiny_deepseek.mesh as it is: its YaRN base of 16 positions has no Megatron-LM flag, and
    Megatron scores a group by its top top_k / topk_groups experts (1 here), DeepSeek by its top 2."""
    src = _variant(tmp_path, "tiny_deepseek", changes)
    rc, err = _export(src, "train", tmp_path / "run.sh", capsys)
    assert rc == 1 and "error[E1204]" in err and words in err and "help:" in err and "^" in err, err
    assert not (tmp_path / "run.sh").exists()


def test_packed_documents_are_megatrons_reset_masks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pack = documents` / `positions = restart` are GPTDataset's reset_attention_mask / reset_position_ids:
    on rows meshllm's packer makes (documents end with an end-of-text id), megatron-core's own mask and
    position ids (``_get_ltor_masks_and_position_ids``) are the document mask and positions meshllm trains with."""
    import numpy as np
    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from meshllm_dsl.runtime.data.corpus import write_sidecars
    from meshllm_dsl.runtime.data.packing import Packer, corpus_packer
    from meshllm_dsl.runtime.model import documents
    from meshllm_dsl.runtime.model.layers import _allowed
    from meshllm_dsl.runtime.train.tokens import TOKEN_MAGIC

    src = tmp_path / "packed.mesh"
    src.write_text(_spec("cp = 2", "    layout { seq -> cp }\n    pack = documents\n    positions = restart\n" + MIXED))
    rc, err = _export(src, "train", tmp_path / "run.sh", capsys)
    assert rc == 0, err
    ns = _parser().parse_args(script_args(tmp_path / "run.sh"))
    assert ns.reset_attention_mask and ns.reset_position_ids
    _configs(ns)

    eos, gen = 0, np.random.default_rng(0)
    docs = [gen.integers(1, 200, size=int(n)).tolist() for n in gen.integers(1, 40, size=60)]
    path = tmp_path / "c.tokens"
    with open(path, "wb") as f:
        f.write(TOKEN_MAGIC + np.array([2, 256], dtype="<u4").tobytes())
        np.asarray([i for d in docs for i in [*d, eos]], dtype="<u2").tofile(f)
    write_sidecars(path, np.cumsum([0] + [len(d) + 1 for d in docs]), None)
    packer: Packer = corpus_packer(path, seq=32, seed=0)
    batch = packer.next_batch(8)
    for row in range(8):
        mask, _, pos = _get_ltor_masks_and_position_ids(batch.tokens[row], eos, True, True, False, True)
        packing = documents.Packing(batch.documents[row:row + 1], batch.documents[row:row + 1], None)
        ours = documents.same_document(_allowed(torch.arange(32), torch.arange(32), 0), packing)[0, 0]
        assert torch.equal(~mask[0], ours) and torch.equal(pos, batch.positions[row])
