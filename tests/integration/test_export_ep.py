"""`meshc export --to hf-ep-plan`: a mixture-of-experts plan as transformers' expert parallelism.

The exported file is `DistributedConfig`'s arguments; each rank of the shared gloo pool builds that
config, transformers' two meshes (dense: pp, dp_replicate, fsdp, tp; experts: pp, dp_replicate, efsdp,
ep) over the pool's groups, and hands the loaded model to transformers' own `maybe_distribute_model`
(what from_pretrained runs after building the model: the ep_plan's `grouped_gemm` / `ep_dispatch_experts`
styles, then FSDP2 of the rest). Each rank then runs its own slice of the batch, so the experts' tokens
really travel by all-to-all: the logits and every parameter's gradient must be the unsharded model's,
with each rank holding half the experts. What transformers cannot lay out is a located refusal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from test_export import _full, _next_token_loss  # noqa: E402

from meshllm_dsl.checker import check_declarations  # noqa: E402
from meshllm_dsl.cli.main import main  # noqa: E402
from meshllm_dsl.diagnostics import SpecError  # noqa: E402
from meshllm_dsl.front.load import load  # noqa: E402
from meshllm_dsl.interop.hf_ep import export_ep_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402

GOLDEN = Path(__file__).parent / "golden_export"
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# The families the MoE issue added, their tiny checkpoints built by their own tests (tests/moe)
NEW_FAMILIES = ("deepseek_v3", "glm4_moe", "gpt_oss")
VOCAB = 64
# The .mesh model of each tiny checkpoint `build` writes (the same dimensions).
MODELS = {
    "mixtral": "model m = mixtral { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 48,"
               " experts = 4, top_k = 2, dtype = fp32 }",
    "qwen2_moe": "model m = qwen2_moe { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 24,"
                 " shared_ffn = 40, experts = 6, top_k = 3, dtype = fp32 }",
    "qwen3_moe": "model m = qwen3_moe { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 24,"
                 " experts = 4, top_k = 2, dtype = fp32 }",
}

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))
import test_deepseek_v3  # noqa: E402
import test_glm4_moe  # noqa: E402
import test_gpt_oss  # noqa: E402

MODELS |= {"deepseek_v3": test_deepseek_v3.MODEL, "glm4_moe": test_glm4_moe._model("qk_norm"),
           "gpt_oss": test_gpt_oss.MODEL}
EP2 = "layout { batch -> data, experts -> data }\n    optimizer adamw { zero 3 }"


def spec(model: str, body: str = EP2, axes: str = "data = 2") -> str:
    return f"mesh m {{ axes {axes} }}\n{MODELS[model]}\nplan p on m for m {{\n    batch = 4\n    seq = 8\n    {body}\n}}\n"


def build(model: str, directory: Path) -> Any:
    """A tiny random checkpoint of `model`, weights (router included) redrawn away from HF's init so
    routing is peaked and a wrong expert, order or weighting shows."""
    if model == "deepseek_v3":
        return test_deepseek_v3.build_deepseek_v3(directory).eval()
    if model == "glm4_moe":
        return test_glm4_moe.build_glm4_moe(directory, use_qk_norm=True).eval()
    if model == "gpt_oss":
        return test_gpt_oss.build_gpt_oss(directory).eval()
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False)
    if model == "mixtral":
        hf = tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=48, num_local_experts=4,
                                                    num_experts_per_tok=2))
    elif model == "qwen3_moe":
        hf = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=24, num_experts=4,
                                                      num_experts_per_tok=2, norm_topk_prob=True))
    else:
        hf = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, moe_intermediate_size=24, intermediate_size=40,
                                                      shared_expert_intermediate_size=40, num_experts=6,
                                                      num_experts_per_tok=3, norm_topk_prob=False))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if p.dim() == 1 and "norm" in name else 0.25 * noise)
    hf.save_pretrained(directory)
    return hf.eval()


def _export(text: str) -> str:
    decls = load("x.mesh", text)
    result = check_declarations(decls)
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    return export_ep_plan(plan, decls)[0]


def _refusal(text: str) -> Any:
    decls = load("x.mesh", text)
    result = check_declarations(decls)
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    with pytest.raises(SpecError) as err:
        export_ep_plan(plan, decls)
    (diag,) = err.value.diagnostics
    return diag


# ---------------------------------------------------------------- the job on the pool's ranks


def _device_mesh(ctx: Any, axes: tuple[tuple[str, int], ...]) -> Any:
    """A DeviceMesh with transformers' dim names over the job's ranks; a dim of size 1 over this rank's
    own group (the pool's Mesh makes none for it, and transformers slices every dim by name)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = ctx.mesh(axes)
    alone = mesh.make_groups([(r,) for r in mesh.ranks])
    groups = [mesh.group(n) if mesh.size(n) > 1 else alone[(mesh.rank,)] for n in mesh.names]
    ranks = torch.tensor(mesh.ranks).reshape([s for _, s in mesh.axes])
    return DeviceMesh.from_group(groups, "cpu", ranks, mesh_dim_names=mesh.names)


def ep_job(ctx: Any, config_path: str, hf_dir: str, tokens: Any) -> Any:
    """On every rank: transformers' model laid out by the exported DistributedConfig through its own
    `maybe_distribute_model`, fed this rank's slice of the batch; (logits of the whole batch, the local
    shape of every expert parameter, every parameter's whole gradient of the batch's loss)."""
    import torch.distributed as dist
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.utils import TransformersDeviceMesh

    config = DistributedConfig(**json.loads(Path(config_path).read_text()))
    # transformers' initialize_distributed_mesh takes the whole world; the pool's job is a subset of it,
    # so the same two meshes are built over the job's groups.
    replicas = ("dp_replicate", config.dp_replicate_size)
    dense = _device_mesh(ctx, (("pp", 1), replicas, ("fsdp", config.fsdp_size), ("tp", config.tp_size)))
    experts = _device_mesh(ctx, (("pp", 1), replicas, ("efsdp", config.efsdp_size), ("ep", config.ep_size)))
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    # Its loader shards the model before reading the weights into it; here they are whole on every rank,
    # and each style's distribute_tensor (src_data_rank=None) keeps this rank's chunk of them.
    model = type(model).maybe_distribute_model(model, config, TransformersDeviceMesh(dense, experts))
    n = tokens.shape[0] // ctx.n_ranks
    mine = tokens[ctx.rank * n:(ctx.rank + 1) * n]
    with torch.enable_grad():  # the training path: all-to-all both ways
        logits = model(mine).logits
        # FSDP2 averages the ranks' gradients: the mean of equal slices' mean losses is the batch's
        _next_token_loss(logits, mine).backward()
    every = [torch.empty_like(logits) for _ in range(ctx.n_ranks)]
    dist.all_gather(every, logits.detach().contiguous(), group=ctx.mesh((("job", ctx.n_ranks),)).group("job"))
    logits = torch.cat(every)
    grads = {name: _full(p.grad) for name, p in model.named_parameters()}
    local = {name: tuple(p.to_local().shape) for name, p in model.named_parameters() if "experts" in name}
    return (logits, local, grads) if ctx.rank == 0 else None


# (model, mesh axes, plan body, DistributedConfig sizes (dp_replicate, fsdp, ep)): every family on
# 2 ranks; on 4, HSDP (the dense parameters and the experts replicated over `replica`) and ZeRO 3 over
# both axes (transformers' efsdp: each expert's rank pair shards it over `replica`).
HSDP = ("replica = 2, data = 2", "layout { batch -> replica * data, experts -> data }\n"
        "    optimizer adamw { zero 3 over data }")  # mesh axes, plan body
PROOFS = [
    *((model, "data = 2", EP2, (1, 2, 2)) for model in FAMILIES + NEW_FAMILIES),
    ("mixtral", *HSDP, (2, 2, 2)),
    ("mixtral", "replica = 2, data = 2",
     "layout { batch -> replica * data, experts -> data }\n    optimizer adamw { zero 3 }", (1, 4, 2)),
]


@pytest.mark.parametrize(("model", "axes", "body", "sizes"), PROOFS,
                         ids=[f"{m}-{'hsdp' if s[0] > 1 else 'efsdp' if s[1] > s[2] else 'ep2'}" for m, _, _, s in PROOFS])
def test_ep_plan_gives_unsharded_logits_and_gradients_in_transformers(
        model: str, axes: str, body: str, sizes: tuple[int, int, int], pool: WorkerPool, tmp_path: Path) -> None:
    hf = build(model, tmp_path / model)
    out = _export(spec(model, body, axes))
    config = json.loads(out)
    # transformers' own plan for the class, as its config writes it (relative to the base model)
    assert config["ep_plan"] == {f"model.{k}": v for k, v in type(hf.config).base_model_ep_plan.items()}
    assert (config.get("dp_replicate_size", 1), config["fsdp_size"], config["ep_size"], config["tp_size"]) == (*sizes, 1)
    path = tmp_path / "distributed_config.json"
    path.write_text(out)
    tokens = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    n_ranks = sizes[0] * sizes[1]
    logits, local, grads = pool.run(ep_job, n_ranks, str(path), str(tmp_path / model), tokens)[0]
    with torch.enable_grad():
        want = hf(tokens).logits
        _next_token_loss(want, tokens).backward()
    assert (logits - want.detach()).abs().max().item() <= 1e-4
    n_experts = getattr(hf.config, "num_local_experts", None) or hf.config.num_experts
    # rank 0's experts: experts / ep of them, FSDP-sharded over the ranks holding the same ones (efsdp);
    # the first moe block's and the last's (DeepSeek-V3 / GLM-4.5 start with dense blocks)
    efsdp = sizes[1] // sizes[2]
    stacked = [n for n, _ in hf.named_parameters() if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert stacked
    for name in (stacked[0], stacked[-1]):
        assert local[name][0] == -(-n_experts // sizes[2] // efsdp), (name, local[name])
    for name, p in hf.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


GOLDENS = {  # golden file -> the spec exported
    "qwen2_moe_data2_ep2_zero3": spec("qwen2_moe"),
    "mixtral_replica2_data2_ep2_hsdp": spec("mixtral", HSDP[1], HSDP[0]),
}


@pytest.mark.parametrize("name", GOLDENS)
def test_ep_plan_matches_golden_and_is_deterministic(name: str, request: pytest.FixtureRequest) -> None:
    out = _export(GOLDENS[name])
    assert _export(GOLDENS[name]) == out
    golden = GOLDEN / f"{name}.ep.json.txt"
    if request.config.getoption("--update-goldens"):
        golden.write_text(out)
    assert golden.exists(), f"missing golden {golden}; run pytest --update-goldens"
    assert out == golden.read_text()


def test_the_rule_style_exports_as_the_layout() -> None:
    """`shard blocks.*.mlp expert(D)` places the experts as `experts -> D`: the same file."""
    rule = spec("qwen3_moe", "layout { batch -> data }\n    shard blocks.*.mlp expert(data)\n    optimizer adamw { zero 3 }")
    assert _export(rule) == _export(spec("qwen3_moe"))


def test_cli_writes_the_distributed_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "t.mesh"
    src.write_text(spec("mixtral"))
    out = tmp_path / "ep.json"
    assert main(["export", str(src), "--to", "hf-ep-plan", "-o", str(out)]) == 0
    assert out.read_text() == _export(src.read_text())
    assert main(["export", str(src), "--to", "hf-ep-plan", "-o", str(out)]) == 2  # exists
    # the model's own class names the experts' modules: --weights (a llama's Phi-3 question) is usage
    assert main(["export", str(src), "--to", "hf-ep-plan", "--weights", str(tmp_path), "-o",
                 str(tmp_path / "w.json")]) == 2
    assert "--weights is for --to dtensor / hf-tp-plan" in capsys.readouterr().err
    src.write_text(spec("mixtral", "layout { batch -> data, experts -> data }"))
    assert main(["export", str(src), "--to", "hf-ep-plan", "-o", str(tmp_path / "zero0.json")]) == 1
    err = capsys.readouterr().err
    assert "error[E1206]" in err and "zero 3" in err and "Traceback" not in err
    assert not (tmp_path / "zero0.json").exists()


# (what the plan says, its spec, the code, words of the message, words of the help): every setting
# transformers' expert parallelism cannot lay out as the plan does.
TP = "heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor"
REFUSALS = [
    ("tensor parallelism beside the experts", spec("mixtral", f"layout {{ {TP}, batch -> data, experts -> data }}\n"
                                                   "    shard blocks.*.mlp.router replicate", "data = 2, tensor = 2"),
     "E1205", "vocab_parallel(tensor) beside the experts split over data", "--to hf-tp-plan"),
    ("the experts' ffn split by tensor parallelism", spec(
        "qwen3_moe", "layout { batch -> data, experts -> data, ffn -> tensor }\n    optimizer adamw { zero 3 }\n"
        "    shard embed replicate\n    shard lm_head replicate\n    shard blocks.*.attn.* replicate\n"
        "    shard blocks.*.mlp.router replicate",
        "data = 2, tensor = 2"), "E1205", "the experts split by column(tensor)", "drop the tensor rules"),
    ("precision", spec("mixtral", EP2 + "\n    precision { params = bf16, master = fp32 }"), "E1206",
     "`precision` (master weights in fp32", "fsdp_mixed_precision"),
    ("ZeRO 0", spec("qwen3_moe", "layout { batch -> data, experts -> data }"), "E1206", "ZeRO 0", "zero 3"),
    ("ZeRO 2", spec("qwen3_moe", "layout { batch -> data, experts -> data }\n    optimizer adamw { zero 2 }"),
     "E1206", "ZeRO 2 over data", "zero 3"),
    ("experts not the fastest ZeRO axis", spec(
        "mixtral", "layout { batch -> data * replica, experts -> data }\n    optimizer adamw { zero 3 }",
        "data = 2, replica = 2"), "E1205", "experts over `data`", "`data` last"),
    ("experts outside the ZeRO axes", spec(
        "mixtral", "layout { batch -> replica * data, experts -> data }\n    optimizer adamw { zero 3 over replica }",
        "replica = 2, data = 2"), "E1206", "ZeRO 3 over replica", "zero 3 over ... data"),
    ("experts whole", spec("mixtral", "layout { batch -> data }\n    optimizer adamw { zero 3 }"),
     "E1206", "keeps every expert on every rank", "experts -> data"),
    ("capacity", spec("mixtral").replace("top_k = 2,", "top_k = 2, capacity = 1.5,"), "E1206", "capacity = 1.5",
     "capacity = 0"),
    ("z-loss", spec("mixtral").replace("top_k = 2,", "top_k = 2, z_loss_coef = 0.001,"), "E1206", "z_loss_coef",
     "drop `z_loss_coef`"),
    ("recomputation", spec("mixtral", EP2 + "\n    recompute = blocks"), "E1206", "recompute = blocks",
     "gradient_checkpointing"),
]


@pytest.mark.parametrize(("what", "text", "code", "message", "help_"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_what_transformers_cannot_lay_out_is_refused(what: str, text: str, code: str, message: str,
                                                     help_: str) -> None:
    diag = _refusal(text)
    assert diag.code == code and message in diag.message, diag.message
    assert diag.span is not None and help_ in (diag.help or ""), diag.help


def test_the_experts_of_some_blocks_only_are_refused_with_e1205(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers merges its class's `layers.*` ep_plan into any per-block one, so a plan splitting the
    experts of block 0 only has no DistributedConfig. The checker refuses such a plan today (E0309), so
    the export's own guard is driven directly: block 1's experts placed whole."""
    from meshllm_dsl.interop import hf_ep
    from meshllm_dsl.ir import Placement

    def placements(plan: Any, item: Any, leaf: Any) -> Any:
        for idx, p in real(plan, item, leaf):
            yield from ((("0", p), ("1", Placement("replicate"))) if p.experts else ((idx, p),))

    real = hf_ep._placements
    monkeypatch.setattr(hf_ep, "_placements", placements)
    diag = _refusal(spec("mixtral"))
    assert diag.code == "E1205" and "keeps block 1's whole" in diag.message and "alike" in diag.help, diag.message


def test_a_model_without_experts_is_refused_with_e1204() -> None:
    text = ("mesh m { axes data = 2 }\nmodel m = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, ffn = 64, "
            "dtype = fp32 }\nplan p on m for m {\n    batch = 4\n    seq = 8\n    layout { batch -> data }\n"
            "    optimizer adamw { zero 3 }\n}\n")
    diag = _refusal(text)
    assert diag.code == "E1204" and "no mixture-of-experts layer" in diag.message and "--to hf-tp-plan" in diag.help
