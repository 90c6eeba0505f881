"""`meshc import-megatron`: a Megatron-LM argument line as a .mesh plan, and the round trip.

Every example plan `--to megatron` exports is imported back from the written line; the imported spec
must check, export to the same line, and be the same plan: the devices and each role's size, batch,
sequence, microbatches, stages (blocks per stage, virtual stages, schedule), placements by rule,
ZeRO, recomputation, precision, float8 and the model's settings. Bad lines are located errors: an
unknown flag (E1207 with a caret under it), and values that do not divide through the checker's own
diagnostics, on spec lines that name the argument they came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshllm_dsl.checker import check_file
from meshllm_dsl.cli.main import main
from meshllm_dsl.ir import PlanIR

ROOT = Path(__file__).resolve().parents[2]

ACCEPTED = (("gpt2_small", "train"), ("llama2_70b_train", "train_64"), ("tiny_llama", "train"),
            ("tiny_llama_context", "train"), ("tiny_llama_fp8", "train"), ("tiny_llama_fsdp", "train"),
            ("tiny_mixtral", "train"), ("tiny_mixtral_experts", "train"), ("tiny_qwen2_moe_experts_zero", "zero1"))


def _script_args(script: Path) -> list[str]:
    import shlex

    text = script.read_text()
    line = text[text.index("pretrain_gpt.py"):].replace("\\\n", " ")
    return [a for a in shlex.split(line)[1:] if a != "$@"]


def _export(src: Path, plan: str, out: Path) -> list[str]:
    assert main(["export", str(src), "--plan", plan, "--to", "megatron", "-o", str(out)]) == 0
    return _script_args(out)


def _import(args: list[str], out: Path, devices: int | None, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    extra = ["--devices", str(devices)] if devices is not None else []
    rc = main(["import-megatron", "-o", str(out), *extra, "--", *args])
    return rc, capsys.readouterr().err


def _summary(p: PlanIR) -> dict[str, Any]:
    """The plan in Megatron's terms, free of the mesh's axis names."""
    roles = p.roles
    size = p.mesh.size

    def role(axes: tuple[str, ...]) -> str:
        return "tensor" if axes and axes == tuple(roles.tensor) else ("none" if not axes else "other")

    placements = [(path, pl.rule, role(tuple(pl.axes)), bool(pl.experts)) for path, pl in p.top_placements]
    for bc in p.block_classes:
        placements += [(f"{bc.repeat}.{i}.{path}", pl.rule, role(tuple(pl.axes)), bool(pl.experts))
                       for i in bc.indices for path, pl in bc.placements]
    stages = [[(x.item, x.start, x.stop) for x in s.pieces] for s in p.stages]
    v = dict(p.model.values)
    model = {k: v.get(k) for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "head_dim", "norm_eps",
                                   "rope_theta", "experts", "top_k", "aux_loss_coef", "positions", "tie_embeddings",
                                   "attn_bias")}
    return {
        "devices": p.mesh.devices, "family": p.model.family,
        "sizes": (p.pipeline_size, p.data_size, p.context_size, size(*roles.tensor) if roles.tensor else 1,
                  size(*roles.expert) if roles.expert else 1, p.sequence_size, p.zero_size),
        "batch": (p.batch, p.seq, p.microbatches), "stages": stages, "coords": [s.coord for s in p.stages],
        "schedule": (p.schedule, p.virtual) if p.pipeline_size > 1 else None,
        "zero": p.zero, "recompute": (p.recompute, p.recompute_every),
        "precision": (p.dtype, p.master_dtype or p.dtype, p.reduce_dtype or p.dtype),
        "float8": (p.float8.recipe, p.float8.layers) if p.float8 else None,
        "placements": sorted(placements), "model": model,
    }


@pytest.mark.parametrize(("name", "plan"), ACCEPTED)
def test_round_trip(name: str, plan: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = ROOT / "examples" / f"{name}.mesh"
    original = check_file(src).plans[plan]
    args = _export(src, plan, tmp_path / "a.sh")
    rc, err = _import(args, tmp_path / "imported.mesh", original.mesh.devices, capsys)
    assert rc == 0, err
    result = check_file(tmp_path / "imported.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    imported = result.plans["train"]
    assert _summary(imported) == _summary(original)
    assert _export(tmp_path / "imported.mesh", "train", tmp_path / "b.sh") == args


def test_uneven_layout_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "examples" / "tiny_llama.mesh").read_text().replace(
        "stages over pipeline balanced",
        "stages over pipeline {\n        0: embed, blocks[0:3]\n        1: blocks[3:4], norm, lm_head\n    }")
    (tmp_path / "u.mesh").write_text(text)
    args = _export(tmp_path / "u.mesh", "train", tmp_path / "u.sh")
    assert "--pipeline-model-parallel-layout" in args
    rc, err = _import(args, tmp_path / "i.mesh", 8, capsys)
    assert rc == 0, err
    assert _summary(check_file(tmp_path / "i.mesh").plans["train"]) == _summary(check_file(tmp_path / "u.mesh").plans["train"])


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--vocab-size", "256", "--make-vocab-size-divisible-by", "1", "--normalization", "RMSNorm", "--swiglu",
        "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


def test_defaults_one_replica(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _import([*BASE, "--tensor-model-parallel-size", "2"], tmp_path / "d.mesh", None, capsys)
    assert rc == 0, err
    p = check_file(tmp_path / "d.mesh").plans["train"]
    assert (p.mesh.devices, p.microbatches, p.model.family) == (2, 8, "llama")


@pytest.mark.parametrize(("extra", "located", "message"), [
    (["--tensor-model-paralel-size", "2"], "--tensor-model-paralel-size", "is not a Megatron flag meshc imports"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2", "is not a Megatron flag meshc imports"),
    (["--lr", "3e-4"], "--lr", "is not a Megatron flag meshc imports"),
    (["--tensor-model-parallel-size", "two"], "two", "not an integer"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
     "--recompute-method block", "meshllm recomputes each block"),
])
def test_unknown_or_unreadable_argument_is_located(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   extra: list[str], located: str, message: str) -> None:
    rc, err = _import([*BASE, *extra], tmp_path / "x.mesh", None, capsys)
    assert rc == 1
    assert "error[E1207]" in err and message in err and "help:" in err, err
    caret_line = next(line for line in err.splitlines() if "^" in line)
    source_line = err.splitlines()[err.splitlines().index(caret_line) - 1]
    col = caret_line.index("^")
    assert source_line[col:].startswith(located), err  # the caret is under the argument
    assert not (tmp_path / "x.mesh").exists()


def test_values_that_do_not_divide_name_the_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Heads 4 over a tensor group of 3: the checker's own error, on the line from the argument."""
    rc, err = _import([*BASE, "--tensor-model-parallel-size", "3"], tmp_path / "x.mesh", None, capsys)
    assert rc == 1
    assert "error[E" in err and "--tensor-model-parallel-size 3" in err, err
    assert not (tmp_path / "x.mesh").exists()


def test_devices_not_a_multiple(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _import([*BASE, "--tensor-model-parallel-size", "2"], tmp_path / "x.mesh", 3, capsys)
    assert rc == 1 and "error[E1207]" in err and "not a multiple" in err, err


def _llama_config(directory: Path, layers: int = 4) -> Path:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=64)
    cfg.save_pretrained(directory)
    return directory


def test_model_from_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--hf-config: the model's settings are config.json's (as import-hf reads them), the plan the line's."""
    src = ROOT / "examples" / "tiny_llama.mesh"
    args = _export(src, "train", tmp_path / "a.sh")
    hf = _llama_config(tmp_path / "hf")
    rc = main(["import-megatron", "-o", str(tmp_path / "i.mesh"), "--devices", "8", "--hf-config", str(hf), "--", *args])
    assert rc == 0, capsys.readouterr().err
    text = (tmp_path / "i.mesh").read_text()
    assert "layers = 4  # from config.json `num_hidden_layers`" in text
    imported, original = check_file(tmp_path / "i.mesh").plans["train"], check_file(src).plans["train"]
    assert _summary(imported) == _summary(original)
    assert _export(tmp_path / "i.mesh", "train", tmp_path / "b.sh") == args


def test_flags_that_contradict_the_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = _llama_config(tmp_path / "hf", layers=2)
    rc = main(["import-megatron", "-o", str(tmp_path / "i.mesh"), "--hf-config", str(hf), "--",
               *BASE, "--group-query-attention", "--num-query-groups", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and "error[E1207]" in err and "`--num-layers 4` but" in err and "layers = 2" in err, err
    assert not (tmp_path / "i.mesh").exists()


# ---------------------------------------------------------------- torchtitan

TITAN = (("llama2_70b", "train"), ("llama2_70b_train", "train"), ("llama2_70b_train", "train_64"),
         ("llama2_70b_zbv", "train"), ("llama2_70b_zbv", "zbv_64"), ("llama3_8b_128k", "long_context"),
         ("seed_mesh_2d", "seed"), ("tiny_llama_context", "train"), ("tiny_llama_fsdp", "train"))


def _hf_config_of(plan: PlanIR, directory: Path) -> Path:
    """A transformers LlamaConfig with the plan's model (torchtitan's model is code, not flags)."""
    transformers = pytest.importorskip("transformers")
    v = dict(plan.model.values)
    rope = None
    if getattr(v.get("rope_type"), "name", "default") == "llama3":
        rope = {"rope_type": "llama3", "factor": float(v["rope_factor"]),
                "low_freq_factor": float(v["rope_low_freq_factor"]),
                "high_freq_factor": float(v["rope_high_freq_factor"]),
                "original_max_position_embeddings": int(v["rope_original_positions"])}
    transformers.LlamaConfig(
        vocab_size=v["vocab"], hidden_size=v["hidden"], num_hidden_layers=v["layers"], num_attention_heads=v["heads"],
        num_key_value_heads=v["kv_heads"], intermediate_size=v["ffn"], rms_norm_eps=v["norm_eps"],
        rope_theta=v["rope_theta"], tie_word_embeddings=False, rope_scaling=rope,
        max_position_embeddings=16384).save_pretrained(directory)
    return directory


def _titan_args(src: Path, plan: str, out: Path) -> list[str]:
    import shlex

    assert main(["export", str(src), "--plan", plan, "--to", "torchtitan", "-o", str(out)]) == 0
    text = out.read_text()
    line = text[text.index("-m torchtitan.train"):].replace("\\\n", " ")
    return [a for a in shlex.split(line)[2:] if a != "$@"]


def _masked(args: list[str]) -> list[str]:
    """The line without the module / config function names (they follow the output file and plan names)."""
    return [a for i, a in enumerate(args) if i == 0 or args[i - 1] not in ("--module", "--config")]


@pytest.mark.parametrize(("name", "plan"), TITAN)
def test_torchtitan_round_trip(name: str, plan: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = ROOT / "examples" / f"{name}.mesh"
    original = check_file(src).plans[plan]
    args = _titan_args(src, plan, tmp_path / "a.sh")
    hf = _hf_config_of(original, tmp_path / "hf")
    rc = main(["import-torchtitan", "-o", str(tmp_path / "i.mesh"), "--hf-config", str(hf), "--", *args])
    assert rc == 0, capsys.readouterr().err
    result = check_file(tmp_path / "i.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    imported = result.plans["train"]
    assert _summary(imported) == _summary(original)
    assert _masked(_titan_args(tmp_path / "i.mesh", "train", tmp_path / "b.sh")) == _masked(args)


def test_torchtitan_unknown_key_is_located(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = ROOT / "examples" / "tiny_llama_fsdp.mesh"
    args = _titan_args(src, "train", tmp_path / "a.sh")
    hf = _hf_config_of(check_file(src).plans["train"], tmp_path / "hf")
    args = [*args[:-1], "--parallelism.tensor_paralel_degree", "2", "--training.steps", "10", args[-1]]
    rc = main(["import-torchtitan", "-o", str(tmp_path / "i.mesh"), "--hf-config", str(hf), "--", *args])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("error[E1207]") == 2, err
    assert "`--parallelism.tensor_paralel_degree` is not a key meshc imports" in err
    assert "`--training.steps` is not a key meshc imports" in err
    assert not (tmp_path / "i.mesh").exists()


def test_torchtitan_values_that_do_not_divide(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tensor 3 over 4 heads: the checker's own error, on the lines from `--parallelism.tensor_parallel_degree 3`."""
    src = ROOT / "examples" / "tiny_llama_context.mesh"
    args = _titan_args(src, "train", tmp_path / "a.sh")
    hf = _hf_config_of(check_file(src).plans["train"], tmp_path / "hf")
    i = args.index("--parallelism.tensor_parallel_degree")
    args[i + 1] = "3"
    rc = main(["import-torchtitan", "-o", str(tmp_path / "i.mesh"), "--hf-config", str(hf), "--", *args])
    err = capsys.readouterr().err
    assert rc == 1 and "error[E0301]" in err and "# from --parallelism.tensor_parallel_degree 3" in err, err


def test_moe_flag_on_a_dense_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _import([*BASE, "--moe-router-topk", "2"], tmp_path / "x.mesh", None, capsys)
    assert rc == 1 and "`--moe-router-topk` without `--num-experts`" in err, err


def test_megatron_load_balancing_loss_is_not_imported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [*BASE, "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss"]
    rc, err = _import(args, tmp_path / "x.mesh", None, capsys)
    assert rc == 1 and "error[E1207]" in err and "per layer" in err, err


def test_megatron_default_dropout_is_not_imported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the dropout flags Megatron drops out 0.1: not a meshllm model."""
    assert BASE[-4:] == ["--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
    rc, err = _import([*BASE[:-4], "--hidden-dropout", "0.1"], tmp_path / "x.mesh", None, capsys)
    assert rc == 1 and "`--attention-dropout` is missing" in err and "`--hidden-dropout 0.1`" in err, err


@pytest.mark.parametrize(("setting", "flag"), [("attn_bias = true\n    attn_out_bias = false", "--add-qkv-bias"), ("qk_norm = head", "--qk-layernorm"),
                                               ("head_dim = 32", "--kv-channels")])
def test_qwen_style_llama_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: str, flag: str) -> None:
    """Qwen2's q / k / v biases, Qwen3's per-head q / k norms, a head_dim of its own: Megatron switches, both ways."""
    text = (ROOT / "examples" / "tiny_llama.mesh").read_text().replace("    ffn = 128\n", f"    ffn = 128\n    {setting}\n")
    (tmp_path / "q.mesh").write_text(text)
    original = check_file(tmp_path / "q.mesh")
    assert original.ok, [d.message for d in original.diagnostics]
    args = _export(tmp_path / "q.mesh", "train", tmp_path / "a.sh")
    assert flag in args
    rc, err = _import(args, tmp_path / "i.mesh", 8, capsys)
    assert rc == 0, err
    imported = check_file(tmp_path / "i.mesh").plans["train"]
    assert _summary(imported) == _summary(original.plans["train"])
    assert dict(imported.model.values)[setting.split()[0]] == dict(original.plans["train"].model.values)[setting.split()[0]]
    assert _export(tmp_path / "i.mesh", "train", tmp_path / "b.sh") == args


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str) -> None:
    text = (ROOT / "examples" / "tiny_mixtral.mesh").read_text().replace("= mixtral {", f"= {family} {{")
    if family == "qwen2_moe":  # a gated shared expert, its gate replicated like the router
        text = text.replace("    top_k = 2\n", "    top_k = 2\n    shared_ffn = 128\n").replace(
            "    shard blocks.*.mlp.router replicate\n",
            "    shard blocks.*.mlp.router replicate\n    shard blocks.*.mlp.shared_router replicate\n").replace(
            "ffn -> tensor,", "ffn -> tensor, shared_ffn -> tensor,")
    (tmp_path / "q.mesh").write_text(text)
    original = check_file(tmp_path / "q.mesh").plans["train"]
    args = _export(tmp_path / "q.mesh", "train", tmp_path / "a.sh")
    rc, err = _import(args, tmp_path / "i.mesh", 4, capsys)
    assert rc == 0, err
    imported = check_file(tmp_path / "i.mesh").plans["train"]
    assert imported.model.family == family
    assert _summary(imported) == _summary(original)
    assert _export(tmp_path / "i.mesh", "train", tmp_path / "b.sh") == args


def _qwen3_hf_config(plan: PlanIR, directory: Path) -> Path:
    """transformers' Qwen3Config / Qwen3MoeConfig with the plan's model."""
    transformers = pytest.importorskip("transformers")
    v = dict(plan.model.values)
    common = dict(vocab_size=v["vocab"], hidden_size=v["hidden"], num_hidden_layers=v["layers"],
                  num_attention_heads=v["heads"], num_key_value_heads=v["kv_heads"], head_dim=v["head_dim"],
                  rms_norm_eps=v["norm_eps"], rope_theta=v["rope_theta"], max_position_embeddings=4096,
                  tie_word_embeddings=bool(v.get("tie_embeddings", False)))
    if plan.model.family == "qwen3_moe":
        transformers.Qwen3MoeConfig(**common, moe_intermediate_size=v["ffn"], intermediate_size=v["ffn"],
                                    num_experts=v["experts"], num_experts_per_tok=v["top_k"], norm_topk_prob=True,
                                    decoder_sparse_step=1, mlp_only_layers=[]).save_pretrained(directory)
    else:
        transformers.Qwen3Config(**common, intermediate_size=v["ffn"]).save_pretrained(directory)
    return directory


_QWEN3 = """mesh m { axes data = 2, tensor = 2 }
model tiny = llama {
    vocab = 256
    hidden = 64
    layers = 4
    heads = 4
    kv_heads = 2
    head_dim = 32
    ffn = 128
    qk_norm = head
    norm_eps = 1e-6
    rope_theta = 1000000.0
    tie_embeddings = true
    dtype = bf16
}
plan train on m for tiny {
    batch = 8
    seq = 32
    layout { batch -> data, seq -> tensor }
    shard blocks.*.attn.{q,k,v} column(tensor)
    shard blocks.*.attn.o row(tensor)
    shard blocks.*.mlp.{gate,up} column(tensor)
    shard blocks.*.mlp.down row(tensor)
    shard embed vocab_parallel(tensor)
    shard lm_head column(tensor)
    optimizer adamw { zero 3 over data }
}
"""

_QWEN3_MOE = """mesh m { axes data = 4, tensor = 2 }
model tiny = qwen3_moe {
    vocab = 256
    hidden = 64
    layers = 2
    heads = 4
    kv_heads = 2
    ffn = 32
    experts = 4
    top_k = 2
    dtype = bf16
}
plan train on m for tiny {
    batch = 8
    seq = 32
    layout { batch -> data, heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
    shard blocks.*.mlp.router replicate
    optimizer adamw { zero 3 over data }
}
"""


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen3_moe_ep"])
def test_torchtitan_qwen3_round_trip(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torchtitan's qwen3 (dense; MoE with the experts split over TP; MoE with EP over the FSDP ranks, the experts
    whole over TP): export, import with the HF config, same plan."""
    text = _QWEN3 if name == "qwen3" else _QWEN3_MOE
    if name == "qwen3_moe_ep":  # the experts over 2 of the 4 FSDP ranks (torchtitan's EP borrows them), whole over TP
        text = text.replace("data = 4,", "data = 2, expert = 2,").replace(
            "batch -> data,", "batch -> data * expert, experts -> expert,").replace(
            " ffn -> tensor,", "").replace("zero 3 over data", "zero 3 over data * expert")
    src = tmp_path / f"{name}.mesh"
    src.write_text(text)
    result = check_file(src)
    assert result.ok, [d.message for d in result.diagnostics]
    original = result.plans["train"]
    args = _titan_args(src, "train", tmp_path / "a.sh")
    hf = _qwen3_hf_config(original, tmp_path / "hf")
    rc = main(["import-torchtitan", "-o", str(tmp_path / "i.mesh"), "--hf-config", str(hf), "--", *args])
    assert rc == 0, capsys.readouterr().err
    result = check_file(tmp_path / "i.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    imported = result.plans["train"]
    assert imported.model.family == original.model.family
    assert dict(imported.model.values).get("qk_norm") == dict(original.model.values).get("qk_norm")
    assert _summary(imported) == _summary(original)
    assert _masked(_titan_args(tmp_path / "i.mesh", "train", tmp_path / "b.sh")) == _masked(args)


# ---------------------------------------------------------------- DeepSeek-V3-class models, Megatron

_DS_VARIANT = (("rope_original_positions = 16.0", "rope_original_positions = 4096.0"), ("top_k = 2", "top_k = 4"))


def _units(p: PlanIR) -> list[tuple[str, str, dict[str, Any]]]:
    """Every unit of the model with its attributes: the model as the planner and the runtime read it."""
    out = []
    for item in p.model.items:
        for u in getattr(item, "body", (item,)):
            out.append((getattr(item, "name", ""), u.kind, dict(u.attrs)))
    return out


@pytest.mark.parametrize("name", ["tiny_deepseek", "glm45"])
def test_megatron_layered_round_trip(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/tiny_deepseek.mesh (with what Megatron-LM can say: 4096 YaRN positions, top 4 of 2 groups) and a
    tiny GLM-4.5 of the glm4_moe family: export, import, the same plan and every unit's attributes equal."""
    text = (ROOT / "examples" / "tiny_deepseek.mesh").read_text()
    for old, new in _DS_VARIANT:
        text = text.replace(old, new)
    if name == "glm45":  # GQA, q / k / v biases, per-head q / k norms, half the head rotary
        model = ("model tiny_deepseek = glm4_moe {\n    vocab = 256\n    hidden = 64\n    layers = 4\n    first_dense = 2\n"
                 "    heads = 4\n    kv_heads = 2\n    head_dim = 16\n    rotary_dim = 8\n    ffn = 128\n"
                 "    expert_ffn = 32\n    experts = 8\n    top_k = 4\n    groups = 1\n    topk_groups = 1\n"
                 "    routed_scaling = 2.5\n    shared_experts = 1\n    attn_bias = true\n    qk_norm = head\n"
                 "    dtype = fp32\n}\n")
        start, end = text.index("model tiny_deepseek"), text.index("plan train")
        text = text[:start] + model + "\n" + text[end:]
        text = text.replace("heads -> tensor,", "heads -> tensor, kv_heads -> tensor,").replace(
            "    shard {dense,blocks}.*.attn.{q_a,kv_a} replicate\n", "")
    src = tmp_path / "ds.mesh"
    src.write_text(text)
    result = check_file(src)
    assert result.ok, [d.message for d in result.diagnostics]
    original = result.plans["train"]
    args = _export(src, "train", tmp_path / "a.sh")
    rc, err = _import(args, tmp_path / "i.mesh", original.mesh.devices, capsys)
    assert rc == 0, err
    result = check_file(tmp_path / "i.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    imported = result.plans["train"]
    assert imported.model.family == original.model.family
    assert _units(imported) == _units(original)
    assert imported.model.numel == original.model.numel
    assert _summary(imported) == _summary(original)
    assert _export(tmp_path / "i.mesh", "train", tmp_path / "b.sh") == args


def test_torchtitan_deepseek_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/tiny_deepseek.mesh without EP (torchtitan's EP borrows the tensor ranks): export to torchtitan,
    import with a DeepseekV3Config of its model, the same plan and every unit's attributes."""
    transformers = pytest.importorskip("transformers")
    text = (ROOT / "examples" / "tiny_deepseek.mesh").read_text().replace("experts -> data, ", "")
    src = tmp_path / "ds.mesh"
    src.write_text(text)
    original = check_file(src).plans["train"]
    v = dict(original.model.values)
    transformers.DeepseekV3Config(
        vocab_size=v["vocab"], hidden_size=v["hidden"], intermediate_size=v["ffn"], moe_intermediate_size=v["expert_ffn"],
        num_hidden_layers=v["layers"], num_attention_heads=v["heads"], num_key_value_heads=v["heads"],
        n_shared_experts=v["shared_experts"], n_routed_experts=v["experts"], routed_scaling_factor=v["routed_scaling"],
        kv_lora_rank=v["kv_lora_rank"], q_lora_rank=v["q_lora_rank"], qk_rope_head_dim=v["qk_rope_head_dim"],
        v_head_dim=v["v_head_dim"], qk_nope_head_dim=v["qk_nope_head_dim"], n_group=v["groups"],
        topk_group=v["topk_groups"], num_experts_per_tok=v["top_k"], first_k_dense_replace=v["first_dense"],
        norm_topk_prob=True, rms_norm_eps=v["norm_eps"], rope_theta=v["rope_theta"], tie_word_embeddings=False,
        max_position_embeddings=64, rope_scaling={
            "rope_type": "yarn", "factor": v["rope_factor"], "original_max_position_embeddings": 16,
            "mscale": v["rope_mscale"], "mscale_all_dim": v["rope_mscale_all_dim"], "beta_fast": 32.0,
            "beta_slow": 1.0}).save_pretrained(tmp_path / "hf")
    args = _titan_args(src, "train", tmp_path / "a.sh")
    rc = main(["import-torchtitan", "-o", str(tmp_path / "i.mesh"), "--hf-config", str(tmp_path / "hf"), "--", *args])
    assert rc == 0, capsys.readouterr().err
    result = check_file(tmp_path / "i.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    imported = result.plans["train"]
    assert imported.model.family == "deepseek_v3"
    assert _units(imported) == _units(original) and imported.model.numel == original.model.numel
    assert _summary(imported) == _summary(original)
    assert _masked(_titan_args(tmp_path / "i.mesh", "train", tmp_path / "b.sh")) == _masked(args)


def test_megatron_packed_documents_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pack = documents` / `positions = restart` <-> `--reset-attention-mask` / `--reset-position-ids`."""
    text = (ROOT / "examples" / "tiny_llama.mesh").read_text().replace(
        "    microbatches = 2\n", "    microbatches = 2\n    pack = documents\n    positions = restart\n")
    (tmp_path / "p.mesh").write_text(text)
    original = check_file(tmp_path / "p.mesh")
    assert original.ok, [d.message for d in original.diagnostics]
    args = _export(tmp_path / "p.mesh", "train", tmp_path / "a.sh")
    assert "--reset-attention-mask" in args and "--reset-position-ids" in args
    rc, err = _import(args, tmp_path / "i.mesh", 8, capsys)
    assert rc == 0, err
    imported = check_file(tmp_path / "i.mesh").plans["train"]
    assert imported.document_mask and imported.restart_positions
    assert _summary(imported) == _summary(original.plans["train"])
    assert _export(tmp_path / "i.mesh", "train", tmp_path / "b.sh") == args
    alone = [a for a in args if a != "--reset-attention-mask"]
    rc, err = _import(alone, tmp_path / "j.mesh", 8, capsys)
    assert rc == 1 and "positions reset at documents" in err and "--reset-position-ids" in err and "help:" in err, err


def test_torchtitan_imports_its_document_mask_and_balancer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A torchtitan run masks its documents (always, in 0.3): the imported plan says `pack = documents`
    and `positions = restart`, and PTRR over the context ranks is `context_balance = ptrr`."""
    text = (ROOT / "examples" / "tiny_llama_context.mesh").read_text()
    src = tmp_path / "c.mesh"
    src.write_text(text.replace("    layout {", "    pack = documents\n    positions = restart\n    context_balance = ptrr\n"
                                "    layout {", 1))
    original = check_file(src)
    assert original.ok, [d.message for d in original.diagnostics]
    args = _titan_args(src, "train", tmp_path / "a.sh")
    assert "--parallelism.context_parallel_load_balancer" in args
    hf = _hf_config_of(original.plans["train"], tmp_path / "hf")
    rc = main(["import-torchtitan", "-o", str(tmp_path / "i.mesh"), "--hf-config", str(hf), "--", *args])
    assert rc == 0, capsys.readouterr().err
    imported = check_file(tmp_path / "i.mesh").plans["train"]
    assert imported.document_mask and imported.restart_positions and imported.context_balance == "ptrr"
    assert _summary(imported) == _summary(original.plans["train"])
    assert _masked(_titan_args(tmp_path / "i.mesh", "train", tmp_path / "b.sh")) == _masked(args)
