"""`meshc export --to torchtitan`: the written torchrun line, parsed by torchtitan 0.3's own ConfigManager.

Each plan is exported with the CLI; the flags of the written shell file (and the config_registry module
it names) go through `ConfigManager().parse_args`, which loads the module, applies tyro's parser (an
unknown key is exit 2) and torchtitan's own rules (`Trainer.Config.__post_init__`). The parsed config's
fields must be the plan's degrees, batch, sequence, schedule, activation checkpointing, float8 converter
and compile setting. torchtitan's model config registries import triton, hence both in the test extra.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("triton")

from meshllm_dsl.cli.main import main  # noqa: E402

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


# Qwen3 (a llama with per-head q / k norms, its own head_dim, tied embeddings): torchtitan's qwen3 module
QWEN3 = """model tiny = llama {
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
"""

# Qwen3-MoE: torchtitan's qwen3 MoE (softmax router, renormalised top-k)
QWEN3_MOE = """model tiny = qwen3_moe {
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
"""


def _spec(axes: str, body: str, batch: int = 8, seq: int = 32, model: str = MODEL) -> str:
    return (f"mesh m {{ axes {axes} }}\n{model}\nplan train on m for tiny {{\n    batch = {batch}\n"
            f"    seq = {seq}\n{body}}}\n")


def _export(tmp_path: Path, name: str, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    src = tmp_path / f"{name}.mesh"
    src.write_text(text)
    rc = main(["export", str(src), "--to", "torchtitan", "-o", str(tmp_path / f"{name}.sh")])
    return rc, capsys.readouterr().err


def _args(script: Path) -> list[str]:
    """The arguments after `-m torchtitan.train` in the written script, without the launcher's "$@"."""
    text = script.read_text()
    line = text[text.index("-m torchtitan.train"):].replace("\\\n", " ")
    return [a for a in shlex.split(line)[2:] if a != "$@"]


def _parse(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, extra: tuple[str, ...] = ()) -> Any:
    from torchtitan.config import ConfigManager

    monkeypatch.syspath_prepend(str(tmp_path))  # what the script's PYTHONPATH does
    args = _args(tmp_path / f"{name}.sh")
    return ConfigManager().parse_args([*args[:-1], *extra, args[-1]])


def _check(tmp_path: Path, name: str, text: str, capsys: pytest.CaptureFixture[str],
           monkeypatch: pytest.MonkeyPatch) -> Any:
    rc, err = _export(tmp_path, name, text, capsys)
    assert rc == 0, err
    assert (tmp_path / f"{name}_config.py").exists()
    return _parse(tmp_path, name, monkeypatch)


def _meta_numel(cfg: Any) -> int:
    """The parameters of torchtitan's model built from the parsed config (on the meta device), tied ones once."""
    import torch

    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    return sum(p.numel() for p in model.parameters())


def _planned_numel(text: str, tmp_path: Path) -> int:
    from meshllm_dsl.checker import check_file

    (tmp_path / "planned.mesh").write_text(text)
    return check_file(tmp_path / "planned.mesh").plans["train"].model.numel


def _degrees(cfg: Any) -> tuple[int, ...]:
    p = cfg.parallelism
    return (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree,
            p.pipeline_parallel_degree, p.context_parallel_degree, p.expert_parallel_degree)


def test_fsdp(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = _spec("data = 4", "    layout { batch -> data }\n    optimizer adamw { zero 3 over data }\n")
    cfg = _check(tmp_path, "fsdp", text, capsys, monkeypatch)
    assert cfg.model_spec.name == "llama3"
    assert _meta_numel(cfg) == _planned_numel(text, tmp_path)  # torchtitan's model is the plan's, exactly
    assert _degrees(cfg) == (1, 4, 1, 1, 1, 1)
    assert cfg.parallelism.fsdp_reshard_after_forward == "always"
    assert (cfg.training.local_batch_size, cfg.training.global_batch_size, cfg.training.seq_len) == (2, 8, 32)
    assert cfg.activation_checkpoint is None
    assert (cfg.training.dtype, cfg.training.mixed_precision_param) == ("bfloat16", "bfloat16")
    assert cfg.compile.enable is False
    m = cfg.model_spec.model
    assert (m.dim, m.vocab_size, len(m.layers)) == (64, 256, 4)
    assert cfg.model_spec.model.layers[0].feed_forward.w1.out_features == 128


def test_hsdp_zero2(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _check(tmp_path, "hsdp", _spec("rep = 2, data = 2", "    layout { batch -> rep * data }\n"
                                          "    microbatches = 2\n"
                                          "    precision { params = bf16, master = fp32, reduce = fp32 }\n"
                                          "    optimizer adamw { zero 2 over data }\n"), capsys, monkeypatch)
    assert _degrees(cfg) == (2, 2, 1, 1, 1, 1)
    assert cfg.parallelism.fsdp_reshard_after_forward == "never"
    # microbatches without stages: torchtitan's gradient accumulation (global / (local x dp) = 2)
    assert (cfg.training.local_batch_size, cfg.training.global_batch_size) == (1, 8)
    # fp32 master weights, bf16 compute: torchtitan's mixed precision
    assert (cfg.training.dtype, cfg.training.mixed_precision_param) == ("float32", "bfloat16")


def test_tensor_fsdp_recompute_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC

    cfg = _check(tmp_path, "tp", _spec("data = 2, tensor = 2", "    layout { batch -> data }\n" + TP +
                                        "    recompute = blocks\n    optimizer adamw { zero 3 over data }\n"),
                 capsys, monkeypatch)
    assert _degrees(cfg) == (1, 2, 2, 1, 1, 1)
    assert cfg.parallelism.enable_sequence_parallel is False  # no `seq -> tensor` in the plan
    assert isinstance(cfg.activation_checkpoint, FullAC.Config)


def test_pipeline_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _check(tmp_path, "pp", _spec("data = 2, pipeline = 2", "    microbatches = 2\n"
                                        "    layout { batch -> data }\n    stages over pipeline balanced\n"
                                        "    schedule gpipe\n    optimizer adamw { zero 3 over data }\n"),
                 capsys, monkeypatch)
    p = cfg.parallelism
    assert _degrees(cfg) == (1, 2, 1, 2, 1, 1)
    assert (p.pipeline_parallel_schedule, p.pipeline_parallel_layers_per_stage) == ("GPipe", 2)
    assert (p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers) == (0, 0)
    # local batch 4 per data rank, split into 2 microbatches of 2
    assert (cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size) == (4, 2)
    assert cfg.training.disable_cuda_graphs is True  # torchtitan refuses PP with CUDA graphs


def test_context_parallel(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _check(tmp_path, "cp", _spec("tensor = 2, cp = 2", "    layout { seq -> tensor * cp }\n" + TP +
                                        "    optimizer adamw { zero 3 over cp }\n", batch=4, seq=64),
                 capsys, monkeypatch)
    assert _degrees(cfg) == (1, 1, 2, 1, 2, 1)
    assert cfg.parallelism.enable_sequence_parallel is True
    assert (cfg.training.local_batch_size, cfg.training.seq_len) == (4, 64)


def test_packed_documents_are_torchtitans_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan 0.3 always masks attention at its dataloader's document boundaries and restarts
    positions there: `pack = documents, positions = restart` exports silently (PTRR as its load
    balancer), a plan attending across documents with W1203."""
    packed = _spec("cp = 2", "    layout { seq -> cp }\n    pack = documents\n    positions = restart\n"
                   "    context_balance = ptrr\n    optimizer adamw { zero 3 over cp }\n", batch=4, seq=64)
    rc, err = _export(tmp_path, "packed", packed, capsys)
    assert rc == 0 and "warning" not in err, err
    cfg = _parse(tmp_path, "packed", monkeypatch)
    assert cfg.parallelism.context_parallel_load_balancer == "ptrr"
    plain = packed.replace("    pack = documents\n    positions = restart\n    context_balance = ptrr\n", "")
    rc, err = _export(tmp_path, "plain", plain, capsys)
    assert rc == 0 and "warning[W1203]" in err and "help: add `pack = documents` and `positions = restart`" in err, err
    assert _parse(tmp_path, "plain", monkeypatch).parallelism.context_parallel_load_balancer == "headtail"


def test_float8_compile_selective(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import torchtitan.components.quantization.float8 as f8
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    # torchtitan builds the float8 model config only on SM89+ GPUs (or emulated in eager mode): say
    # this machine is one, as the config is what is checked here, not a float8 matmul.
    monkeypatch.setattr(f8, "has_cuda_capability", lambda *_: True)
    cfg = _check(tmp_path, "fp8", _spec("data = 2", "    layout { batch -> data }\n"
                                         "    precision { params = bf16, matmul = fp8_rowwise }\n"
                                         "    precision blocks.0 matmul = bf16\n"
                                         "    compile = blocks\n    recompute = ops\n"
                                         "    optimizer adamw { zero 3 over data }\n"), capsys, monkeypatch)
    assert isinstance(cfg.activation_checkpoint, SelectiveAC.Config)
    assert cfg.compile.enable is True and cfg.compile.components == ["model"]
    text = (tmp_path / "fp8_config.py").read_text()
    assert ("Float8LinearConverter.Config(recipe_name='rowwise', filter_fqns=['layers.0', 'lm_head'], "
            "model_compile_enabled=True)") in text
    layers = cfg.model_spec.model.layers
    assert type(layers[1].attention.wo).__qualname__.startswith("Float8")
    assert not type(layers[0].attention.wo).__qualname__.startswith("Float8")
    assert not type(cfg.model_spec.model.lm_head).__qualname__.startswith("Float8")


def test_qwen3_dense(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A llama with per-head q / k norms is torchtitan's qwen3: its own head_dim, tied embeddings, eps 1e-6."""
    text = _spec("data = 2, tensor = 2", "    layout { batch -> data, seq -> tensor }\n" + TP +
                 "    optimizer adamw { zero 3 over data }\n", model=QWEN3)
    cfg = _check(tmp_path, "qwen3", text, capsys, monkeypatch)
    assert cfg.model_spec.name == "qwen3"
    assert _degrees(cfg) == (1, 2, 2, 1, 1, 1)
    assert cfg.parallelism.enable_sequence_parallel is True
    m = cfg.model_spec.model
    assert (m.dim, m.vocab_size, len(m.layers), m.enable_weight_tying) == (64, 256, 4, True)
    attn = m.layers[0].attention
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim) == (4, 2, 32)
    assert m.layers[0].attention_norm.eps == 1e-6
    assert _meta_numel(cfg) == _planned_numel(text, tmp_path)


def test_qwen3_moe_expert_parallel(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-MoE: torchtitan's qwen3 MoE with the experts split over the FSDP ranks (its EP), whole over TP
    (EP borrows the tensor ranks)."""
    text = _spec("data = 2, tensor = 2", "    layout { batch -> data, experts -> data, heads -> tensor, "
                 "kv_heads -> tensor, vocab -> tensor }\n    shard blocks.*.mlp.router replicate\n"
                 "    optimizer adamw { zero 3 over data }\n", model=QWEN3_MOE)
    cfg = _check(tmp_path, "qwen3_moe", text, capsys, monkeypatch)
    assert cfg.model_spec.name == "qwen3"
    assert _degrees(cfg) == (1, 2, 2, 1, 1, 2)
    assert cfg.training.disable_cuda_graphs is True  # torchtitan refuses its all-to-all EP with CUDA graphs
    for layer in cfg.model_spec.model.layers:
        moe = layer.moe
        assert (moe.num_experts, moe.router.top_k, moe.router.score_func, moe.router.route_norm) == (
            4, 2, "softmax", True)
        assert moe.load_balance_coeff is None  # meshllm's qwen3_moe has no expert-bias balancing
        assert moe.routed_experts.inner_experts.hidden_dim == 32
    assert _meta_numel(cfg) == _planned_numel(text, tmp_path)


def test_qwen3_moe_experts_over_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Without EP, torchtitan splits the experts' ffn over TP like a dense MLP: `ffn -> tensor`."""
    text = _spec("data = 2, tensor = 2", "    layout { batch -> data, heads -> tensor, kv_heads -> tensor, "
                 "ffn -> tensor, vocab -> tensor }\n    shard blocks.*.mlp.router replicate\n"
                 "    optimizer adamw { zero 3 over data }\n", model=QWEN3_MOE)
    cfg = _check(tmp_path, "qwen3_moe_tp", text, capsys, monkeypatch)
    assert _degrees(cfg) == (1, 2, 2, 1, 1, 1)
    assert _meta_numel(cfg) == _planned_numel(text, tmp_path)


ROOT = Path(__file__).resolve().parents[2]


def _example(name: str, changes: tuple[tuple[str, str], ...]) -> str:
    text = (ROOT / "examples" / f"{name}.mesh").read_text()
    for old, new in changes:
        assert old in text, old
        text = text.replace(old, new)
    return text


# examples/tiny_deepseek.mesh without expert parallelism (torchtitan's EP borrows the tensor ranks, so its
# routed experts would be whole over TP while it splits the shared experts there: a plan meshllm refuses,
# E0402); examples/deepseek_v3_671b.mesh without its pipeline (61 blocks over 16 stages are uneven),
# with ZeRO 3 for its ZeRO 1 and without the expert-bias update (torchtitan centres it on zero)
_DEEPSEEK = {
    "tiny_deepseek": (("experts -> data, ", ""),),
    "deepseek_v3_671b": (("axes pipeline = 16, replica = 2, data = 64\n    hosts = 256", "axes replica = 2, data = 64\n    hosts = 16"),
                         ("    stages over pipeline balanced\n    schedule 1f1b\n", ""),
                         ("zero 1 over replica * data", "zero 3 over data"), ("balance_rate = 0.001", "balance_rate = 0.0")),
}


@pytest.mark.parametrize("name", sorted(_DEEPSEEK))
def test_deepseek_v3(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's deepseek_v3 built from the written config function: its MLA, dense first blocks, sigmoid
    routing over groups, shared experts and norms are the plan's, and its parameters (on the meta device)
    are as many as meshllm's planner counts."""
    from meshllm_dsl.checker import check_file

    text = _example(name, _DEEPSEEK[name])
    cfg = _check(tmp_path, name, text, capsys, monkeypatch)
    p = check_file(tmp_path / f"{name}.mesh").plans["train"]
    body = {r.name: {u.name: u for u in r.body} for r in p.model.items if hasattr(r, "body")}
    a, e = dict(body["blocks"]["attn"].attrs), dict(body["blocks"]["mlp"].attrs)
    rope = dict(a["rope_scaling"])
    m = cfg.model_spec.model
    assert cfg.model_spec.name == "deepseek_v3" and len(m.mtp_layers) == 0
    n_dense = sum(1 for layer in m.layers if layer.moe is None)
    assert (len(m.layers), n_dense) == (sum(r.count for r in p.model.items if hasattr(r, "body")),
                                        next(r.count for r in p.model.items if getattr(r, "name", "") == "dense"))
    attn = m.layers[-1].attention
    assert (attn.n_heads, attn.q_lora_rank, attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
            attn.v_head_dim) == (a["heads"], a["q_lora_rank"], a["kv_lora_rank"], a["qk_nope_head_dim"],
                                 a["qk_rope_head_dim"], a["v_head_dim"])
    assert (attn.rope.scaling, attn.rope.rope_factor, attn.rope.original_seq_len, attn.mscale) == (
        "yarn", rope["factor"], rope["original_max_position_embeddings"], rope["mscale_all_dim"])
    router = m.layers[-1].moe.router
    assert (router.top_k, router.score_func, router.route_norm, router.route_scale) == (
        e["top_k"], "sigmoid", True, e["routed_scaling"])
    assert (router.num_expert_groups, router.num_limited_groups) == (e["groups"], e["topk_groups"])
    assert m.layers[-1].moe.load_balance_coeff is None
    assert {layer.attention_norm.eps for layer in m.layers} | {m.norm.eps, attn.kv_norm.eps} == {1e-6}
    assert _degrees(cfg)[5] == (p.mesh.size(*p.roles.expert) if p.roles.expert else 1)
    assert _meta_numel(cfg) == p.model.numel  # torchtitan's model is the plan's, exactly


def test_misspelled_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rc, err = _export(tmp_path, "typo", _spec("data = 2", "    layout { batch -> data }\n"
                                              "    optimizer adamw { zero 3 over data }\n"), capsys)
    assert rc == 0, err
    with pytest.raises(SystemExit) as exc:
        _parse(tmp_path, "typo", monkeypatch, ("--parallelism.tensor_paralel_degree", "2"))
    assert exc.value.code == 2


@pytest.mark.parametrize(("name", "changes", "code", "words"), [
    ("tiny_deepseek", (), "E1205", "splits the experts' ffn over `tensor` beside expert parallelism"),
    ("tiny_deepseek", (("experts -> data, ", ""), ("rope_mscale = 1.0", "rope_mscale = 0.5")), "E1204",
     "YaRN mscale 0.5 != mscale_all_dim 1.0"),
    ("deepseek_v3_671b", _DEEPSEEK["deepseek_v3_671b"][:3], "E1204", "an expert-bias update of 0.001"),
])
def test_deepseek_refusals_are_located(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                                       changes: tuple[tuple[str, str], ...], code: str, words: str) -> None:
    """tiny_deepseek as it is (EP with the experts split over TP); transformers' cos / sin scaled by
    mscale / mscale_all_dim (torchtitan's rope is a pure rotation); DeepSeek's sign update of the expert bias
    (torchtitan's is centred on zero)."""
    rc, err = _export(tmp_path, f"{name}_refused", _example(name, changes), capsys)
    assert rc == 1 and f"error[{code}]" in err and words in err and "help:" in err and "^" in err, err


@pytest.mark.parametrize(("name", "axes", "body", "code", "line"), [
    ("zero1", "data = 2", "    layout { batch -> data }\n    optimizer adamw { zero 1 over data }\n", "E1202",
     "zero 1 over data"),
    ("tensorwise", "data = 2", "    layout { batch -> data }\n    precision { params = bf16, matmul = fp8_tensorwise }\n"
     "    optimizer adamw { zero 3 over data }\n", "E1206", "matmul = fp8_tensorwise"),
    ("attention", "data = 2", "    layout { batch -> data }\n    recompute = attention\n"
     "    optimizer adamw { zero 3 over data }\n", "E1206", "recompute = attention"),
    ("pack", "data = 2", "    layout { batch -> data }\n    pack = documents\n"
     "    optimizer adamw { zero 3 over data }\n", "E1206", "pack = documents"),
    ("per_document", "cp = 2", "    layout { seq -> cp }\n    pack = documents\n    positions = restart\n"
     "    context_balance = per_document\n    optimizer adamw { zero 3 over cp }\n", "E1206",
     "context_balance = per_document"),
    ("tp_partial", "tensor = 2", TP.replace("    shard blocks.*.mlp.{gate,up} column(tensor)\n", "")
     .replace("shard blocks.*.mlp.down row(tensor)", "shard blocks.*.mlp.{gate,up,down} replicate"), "E1205",
     "shard blocks.*.mlp.{gate,up,down} replicate"),
    ("gpt2", "data = 2", "    layout { batch -> data }\n    optimizer adamw { zero 3 over data }\n",
     "E1204", "model tiny = gpt2"),
    ("qwen3_moe_etp", "data = 2, tensor = 2", "    layout { batch -> data, experts -> data, heads -> tensor, "
     "kv_heads -> tensor, ffn -> tensor, vocab -> tensor }\n    shard blocks.*.mlp.router replicate\n"
     "    optimizer adamw { zero 3 over data }\n", "E1205", "ffn -> tensor"),
    ("qwen3_moe_aux", "data = 2", "    layout { batch -> data }\n    optimizer adamw { zero 3 over data }\n",
     "E1204", "model tiny = qwen3_moe"),
    ("qwen3_moe_tp_whole", "data = 2, tensor = 2", "    layout { batch -> data, heads -> tensor, kv_heads -> tensor, "
     "vocab -> tensor }\n    shard blocks.*.mlp.router replicate\n    shard blocks.*.mlp.{gate,up,down} replicate\n"
     "    optimizer adamw { zero 3 over data }\n", "E1205", "shard blocks.*.mlp.{gate,up,down} replicate"),
    ("qwen3_moe_ep_replicas", "data = 2", "    layout { batch -> data, experts -> data }\n", "E1203",
     "layout { batch -> data, experts -> data }"),
])
def test_refusals_are_located(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, axes: str,
                              body: str, code: str, line: str) -> None:
    text = _spec(axes, body)
    if name == "gpt2":  # a family torchtitan has no module for
        text = text.replace(MODEL, "model tiny = gpt2 {\n    vocab = 256\n    hidden = 64\n    layers = 2\n"
                            "    heads = 4\n    positions = 64\n}\n")
    if name.startswith("qwen3_moe"):  # experts torchtitan's qwen3 MoE cannot run so
        text = text.replace(MODEL, QWEN3_MOE.replace("    top_k = 2\n", "    top_k = 2\n    aux_loss_coef = 0.01\n")
                            if name == "qwen3_moe_aux" else QWEN3_MOE)
    rc, err = _export(tmp_path, name, text, capsys)
    assert rc == 1
    assert f"error[{code}]" in err
    assert line in err and "^" in err and "help:" in err
    assert not (tmp_path / f"{name}.sh").exists()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
