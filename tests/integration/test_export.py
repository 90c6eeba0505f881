"""`meshc export`: a checked plan as torch DTensor code (parallelize_module / fully_shard over
transformers' module names) and as transformers' `tp_plan`, run against the real things.

The exported module is applied to a tiny transformers LlamaForCausalLM on gloo ranks of the shared
pool: its logits must be the unsharded model's, and two AdamW steps on meshc's synthetic batches must
give the losses meshc's own program gives from the same weights (and `meshc run` prints). The
tp_plan is validated by transformers' own plan checks and applied through its style table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, build_hf, spec  # noqa: E402
from processes import run_module  # noqa: E402

from meshllm_dsl.checker import check_declarations  # noqa: E402
from meshllm_dsl.cli.main import main  # noqa: E402
from meshllm_dsl.front.load import load  # noqa: E402
from meshllm_dsl.interop.export import TARGETS, export_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402

GOLDEN = Path(__file__).parent / "golden_export"
STEPS = 2


def _export(text: str, target: str, name: str = "x.mesh") -> tuple[str, tuple[Any, ...]]:
    decls = load(name, text)
    result = check_declarations(decls)
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    return export_plan(plan, decls, target, name, result.text)


def _write(tmp_path: Path, kind: str, plan: str) -> Path:
    path = tmp_path / f"{kind}_{plan}.py"
    path.write_text(_export(spec(kind, plan), "dtensor", f"{kind}_{plan}.mesh")[0])
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: (root / kind, build_hf(kind, root / kind)) for kind in ("llama", "llama3_tied")}


def _tokens() -> Any:
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- jobs on the pool's ranks


def _device_mesh(mesh: Any) -> Any:
    """A DeviceMesh with the plan's axis names over the pool mesh's groups (from_group creates none)."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = [mesh.group(n) for n in mesh.names]
    ranks = torch.tensor(mesh.ranks).reshape([s for _, s in mesh.axes])
    return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], "cpu", ranks, mesh_dim_names=mesh.names)


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def dtensor_job(ctx: Any, module_path: str, hf_dir: str, tokens: Any, data_axis: str | None) -> Any:
    """On every rank: the exported plan applied to transformers' model; (logits, loss per step)."""
    import importlib.util

    import torch.distributed as dist

    from meshllm_dsl.runtime.train.launch import synthetic_batch

    loaded = importlib.util.spec_from_file_location("exported_plan", module_path)
    mod = importlib.util.module_from_spec(loaded)  # type: ignore[arg-type]
    loaded.loader.exec_module(mod)  # type: ignore[union-attr]
    mesh = ctx.mesh(mod.AXES)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = mod.parallelize(model, _device_mesh(mesh))
    with torch.no_grad():
        logits = _full(model(tokens).logits)
    opt = torch.optim.AdamW(model.parameters(), **{"lr": 1e-3, **mod.OPTIMIZER})
    dp = mesh.size(data_axis) if data_axis else 1
    losses = []
    for step in range(STEPS):
        tok, tgt = synthetic_batch(VOCAB, mod.BATCH, mod.SEQ, 0, step)
        if data_axis:  # meshc's split of the global batch over the data axis
            tok, tgt = tok.chunk(dp)[mesh.index(data_axis)], tgt.chunk(dp)[mesh.index(data_axis)]
        opt.zero_grad()
        with mod.loss_context():
            loss = mod.loss(model(tok).logits, tgt)
            loss.backward()
        opt.step()
        value = _full(loss).detach().to(torch.float64).reshape(1)
        if data_axis:
            dist.all_reduce(value, group=mesh.group(data_axis))
        losses.append(float(value) / dp)
    return (logits, losses) if ctx.rank == 0 else None


def meshc_job(ctx: Any, module_path: str, hf_dir: str) -> list[float]:
    """On every rank: what `meshc run --weights DIR --steps 2` computes (its program, its batches)."""
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(module_path).PROGRAM
    built = program.build(ctx.mesh(program.axes), weights=hf_dir)
    return [built.train_step(*synthetic_batch(VOCAB, program.batch, program.seq, 0, step)) for step in range(STEPS)]


def _next_token_loss(logits: Any, tokens: Any) -> Any:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def tp_plan_job(ctx: Any, plan_path: str, hf_dir: str, tokens: Any) -> Any:
    """On every rank: transformers' model sharded by the exported tp_plan through transformers' own
    path after loading (`_expand_parallel_plan`, then `apply_tensor_parallelism`); its logits, the
    parameters it sharded (a DTensor with a Shard placement, this rank holding part of it) and every
    parameter's whole gradient of the next-token loss."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    mesh = ctx.mesh((("tensor", ctx.n_ranks),))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.tp_plan = json.loads(Path(plan_path).read_text())  # transformers validates the styles here
    # Its loader shards while reading; here the full weights are on every rank, so each parameter
    # style's shard_param (distribute_tensor with src_data_rank=None: this rank's chunk) is exact.
    # transformers' loader shards the model as built, untied (init.no_tie_weights), and ties it after: a
    # tied head has no parameter of its own in named_parameters, which apply_tensor_parallelism reads.
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    if tied:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    apply_tensor_parallelism(model, _device_mesh(mesh), model._expand_parallel_plan(model.tp_plan))
    if tied:
        model.tie_weights()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.enable_grad():  # the training path (the no-grad one is transformers' inference kernel)
        logits = _full(model(tokens).logits)
        _next_token_loss(logits, tokens).backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    logits = logits.detach()
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)
                     and any(isinstance(x, (Shard, _StridedShard)) for x in p.placements)  # strided: packed_colwise
                     and p.to_local().shape != p.shape)
    return (logits, sharded, grads) if ctx.rank == 0 else None


# ---------------------------------------------------------------- golden and determinism


@pytest.mark.parametrize("target", TARGETS)
def test_export_matches_golden_and_is_deterministic(target: str, request: pytest.FixtureRequest) -> None:
    text = spec("llama", "data2_tensor2_zero3")
    out, warnings = _export(text, target, "llama_data2_tensor2_zero3.mesh")
    assert _export(text, target, "llama_data2_tensor2_zero3.mesh")[0] == out
    golden = GOLDEN / f"llama_data2_tensor2_zero3.{'py' if target == 'dtensor' else 'json'}.txt"
    if request.config.getoption("--update-goldens"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(out)
    assert golden.exists(), f"missing golden {golden}; run pytest --update-goldens"
    assert out == golden.read_text()
    # The DTensor target says all of this plan; a tp_plan warns what it leaves out or changes.
    assert [w.code for w in warnings] == ([] if target == "dtensor" else ["W1202", "W1201"])


def test_cli_targets_are_the_exporters() -> None:
    from meshllm_dsl.cli import export as cli_export
    from meshllm_dsl.interop import hf_ep, megatron, torchtitan

    assert cli_export.TARGETS == (*TARGETS, torchtitan.TARGET, hf_ep.TARGET, megatron.TARGET)


def test_header_names_the_spec_and_its_hash() -> None:
    import hashlib

    text = spec("llama", "tensor2")
    out, _ = _export(text, "dtensor", 'we"ird.mesh')
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    assert out.startswith(f'"""Plan `p` of we\\"ird.mesh (sha256 {digest}), exported by meshc')
    compile(out, "exported", "exec")


def test_cli_writes_once_and_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "t.mesh"
    src.write_text(spec("llama", "tensor2"))
    out = tmp_path / "plan.py"
    assert main(["export", str(src), "--to", "dtensor", "-o", str(out)]) == 0
    assert out.read_text() == _export(src.read_text(), "dtensor", str(src))[0]
    assert main(["export", str(src), "--to", "dtensor", "-o", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["export", str(src), "--to", "hf-tp-plan", "-o", str(tmp_path / "tp.json")]) == 0
    assert json.loads((tmp_path / "tp.json").read_text())["model.layers.*.mlp.down_proj"] == "rowwise"
    assert main(["export", str(src), "--to", "deepspeed", "-o", str(tmp_path / "x")]) == 2  # not a target
    assert main(["export", str(tmp_path / "missing.mesh"), "--to", "dtensor", "-o", str(tmp_path / "y")]) == 2
    assert "no such file" in capsys.readouterr().err


# ---------------------------------------------------------------- refusals


def _edit(kind: str, plan: str, old: str = "", new: str = "") -> str:
    text = spec(kind, plan)
    assert old in text
    return text.replace(old, new, 1)


REFUSALS = [
    # (spec text, target, code, the construct the caret is under)
    (_edit("llama", "pipeline2_tensor2"), "dtensor", "E1201", "stages over pipeline balanced"),
    (_edit("llama", "pipeline2_tensor2"), "hf-tp-plan", "E1201", "stages over pipeline balanced"),
    (_edit("llama", "data2_tensor2_zero3", "zero 3", "zero 1"), "dtensor", "E1202", "zero 1"),
    (_edit("llama", "tensor2", "vocab -> tensor", "vocab -> tensor, seq -> tensor"), "dtensor", "E1203",
     "seq -> tensor"),
    (_edit("llama", "tensor2", "vocab -> tensor", "vocab -> tensor, seq -> tensor"), "hf-tp-plan", "E1203",
     "seq -> tensor"),
    # Context parallelism: every sequence split over `cp`, which splits no weight.
    (_edit("llama", "tensor2", "axes tensor = 2", "axes tensor = 2, cp = 2").replace(
        "vocab -> tensor", "vocab -> tensor, seq -> cp"), "dtensor", "E1203", "seq -> cp"),
    (_edit("llama", "tensor2", "axes tensor = 2", "axes tensor = 2, cp = 2").replace(
        "vocab -> tensor", "vocab -> tensor, seq -> cp"), "hf-tp-plan", "E1203", "seq -> cp"),
    (spec("gpt2", "tensor2"), "dtensor", "E1204", "heads -> tensor"),
    (spec("gpt2", "tensor2"), "hf-tp-plan", "E1204", "heads -> tensor"),
    (_edit("llama", "tensor2", "axes tensor = 2", "axes data = 2, tensor = 2").replace(
        "ffn -> tensor", "ffn -> data * tensor"), "dtensor", "E1205", "ffn -> data * tensor"),
    (_edit("llama", "tensor2", "axes tensor = 2", "axes other = 2, tensor = 2").replace(
        "ffn -> tensor", "ffn -> other"), "hf-tp-plan", "E1205", "ffn -> other"),
    (spec("llama", "data2_tensor2"), "dtensor", "E1206", "plan p on m for m"),
    (_edit("llama", "tensor2", "seq = 8", "seq = 8\n    recompute = blocks"), "dtensor", "E1206", "recompute = blocks"),
    # A document mask the exported model would not apply.
    (_edit("llama", "tensor2", "seq = 8", "seq = 8\n    pack = documents"), "hf-tp-plan", "E1206", "pack = documents"),
    # ZeRO 0 / 1 mixed precision is autocast over fp32 parameters: no fully_shard policy to write.
    (_edit("llama", "tensor2", "seq = 8", "seq = 8\n    precision { params = bf16, master = fp32 }"), "hf-tp-plan",
     "E1206", "precision {"),
]


@pytest.mark.parametrize(("text", "target", "code", "construct"), REFUSALS,
                         ids=[f"{c}-{t}-{i}" for i, (_, t, c, _) in enumerate(REFUSALS)])
def test_what_the_target_cannot_express_is_a_located_diagnostic(
    text: str, target: str, code: str, construct: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "r.mesh"
    src.write_text(text)
    assert check_declarations(load(str(src))).ok  # the checker accepts it: only the export refuses
    assert main(["export", str(src), "--to", target, "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert f"error[{code}]" in err and "Traceback" not in err
    line = next(n for n, x in enumerate(text.splitlines(), 1) if construct in x)
    col = text.splitlines()[line - 1].index(construct) + 1
    assert f"--> {src}:{line}:{col}" in err, err
    assert re.search(rf"^\s*{line} \| .*{re.escape(construct)}", err, re.M), err
    assert "^" in err and "= help: " in err


# ---------------------------------------------------------------- on gloo ranks


@pytest.mark.parametrize("kind", ["llama", "llama3_tied"])
def test_dtensor_export_gives_unsharded_logits_and_meshc_losses_tensor2(
    kind: str, models: dict[str, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    directory, hf = models[kind]
    exported = _write(tmp_path, kind, "tensor2")
    tokens = _tokens()
    logits, losses = pool.run(dtensor_job, 2, str(exported), str(directory), tokens, None)[0]
    with torch.no_grad():
        want = hf(tokens).logits
    # fp32: the sharded matmuls only sum in another order (measured max diff ~1e-6 on logits ~|5|)
    torch.testing.assert_close(logits, want, rtol=0, atol=2e-5)
    program = tmp_path / "meshc.py"
    from meshllm_dsl.codegen.emit import render_plan

    decls = load(f"{kind}.mesh", spec(kind, "tensor2"))
    result = check_declarations(decls)
    program.write_text(render_plan(result.plans["p"], f"{kind}.mesh", result.text))
    ours = pool.run(meshc_job, 2, str(program), str(directory))[0]
    # Same weights, batches and AdamW on both sides; the two runtimes differ only in fp32 rounding
    # (collective order, fused vs for-each AdamW), ~1e-7 on a loss of ~4 after 2 steps.
    assert losses == pytest.approx(ours, abs=1e-5, rel=0)
    assert losses[1] != losses[0]  # the step changed the weights: the second loss tests the update


def test_dtensor_export_zero3_over_data_x_tensor2(models: dict[str, Any], pool: WorkerPool, tmp_path: Path) -> None:
    directory, hf = models["llama"]
    exported = _write(tmp_path, "llama", "data2_tensor2_zero3")
    tokens = _tokens()
    logits, losses = pool.run(dtensor_job, 4, str(exported), str(directory), tokens, "data")[0]
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(tokens).logits, rtol=0, atol=2e-5)
    from meshllm_dsl.codegen.emit import render_plan

    decls = load("z.mesh", spec("llama", "data2_tensor2_zero3"))
    result = check_declarations(decls)
    program = tmp_path / "meshc.py"
    program.write_text(render_plan(result.plans["p"], "z.mesh", result.text))
    ours = pool.run(meshc_job, 4, str(program), str(directory))[0]
    assert losses == pytest.approx(ours, abs=1e-5, rel=0)


def test_meshc_run_prints_the_losses_of_the_exported_plan(
    models: dict[str, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    """The user's comparison: `meshc run --weights DIR --steps 2` against the DTensor export."""
    directory, _ = models["llama"]
    src = tmp_path / "t.mesh"
    src.write_text(spec("llama", "tensor2"))
    exported = tmp_path / "plan.py"
    assert main(["export", str(src), "--to", "dtensor", "-o", str(exported)]) == 0
    _, losses = pool.run(dtensor_job, 2, str(exported), str(directory), _tokens(), None)[0]
    proc = run_module("meshllm_dsl", "run", str(src), "--weights", str(directory), "--steps", str(STEPS),
                      timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [float(x) for x in re.findall(r"step \d+/\d+  loss (\d+\.\d+)", proc.stderr)]
    assert len(printed) == STEPS, proc.stderr[-2000:]
    # meshc run prints 4 decimals: half a unit of the last one, plus the 1e-5 the runtimes may differ by.
    assert losses == pytest.approx(printed, abs=6e-5, rel=0)


def _valid_tp_plan(hf: Any, out: str, tmp_path: Path) -> Path:
    """The exported tp_plan JSON `out`, written to a file for the ranks to load, after checking that
    every key names modules of `hf` (transformers' wildcard form) and every style is in its table."""
    from transformers.distributed.parallel_utils import (
        ALL_PARALLEL_STYLES,
        replace_layer_number_by_wildcard,
    )

    mapping = json.loads(out)
    names = {replace_layer_number_by_wildcard(n) for n, _ in hf.named_modules()}
    assert set(mapping) <= names, set(mapping) - names
    assert all(style in ALL_PARALLEL_STYLES for style in mapping.values())
    plan_path = tmp_path / "tp_plan.json"
    plan_path.write_text(out)
    return plan_path


def test_tp_plan_is_accepted_and_applied_by_transformers(
    models: dict[str, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    directory, hf = models["llama"]
    out, _ = _export(spec("llama", "tensor2"), "hf-tp-plan")
    plan_path = _valid_tp_plan(hf, out, tmp_path)
    tokens = _tokens()
    logits, sharded, _ = pool.run(tp_plan_job, 2, str(plan_path), str(directory), tokens)[0]
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(tokens).logits, rtol=0, atol=2e-5)
    assert "model.layers.0.mlp.down_proj.weight" in sharded


# (kind, whether the class comes from the checkpoint (`--weights`), entries the plan must hold): each as
# transformers' own config for the class writes it (its base_model_tp_plan), where the model code
# needs whole projections (Phi-3 slices its fused qkv_proj / gate_up_proj; OLMo 2 normalises q / k over
# the whole projection) gathered, and the row split after them taking the replicated input.
FAMILY_PLANS = [
    ("phi3", True, {"model.layers.*.self_attn.qkv_proj": "colwise_gather_output",
                    "model.layers.*.self_attn.o_proj": "rowwise_split_input",
                    "model.layers.*.mlp.gate_up_proj": "colwise_gather_output",
                    "model.layers.*.mlp.down_proj": "rowwise_split_input"}),
    ("olmo2", False, {"model.layers.*.self_attn.q_proj": "colwise_gather_output",
                      "model.layers.*.self_attn.k_proj": "colwise_gather_output",
                      "model.layers.*.self_attn.v_proj": "colwise_gather_output",
                      "model.layers.*.self_attn.o_proj": "rowwise_split_input",
                      "model.layers.*.mlp.down_proj": "rowwise"}),
    ("gemma2", False, {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                       "model.layers.*.mlp.down_proj": "rowwise"}),
    ("gemma3", False, {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                       "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                       "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
                       "model.layers.*.mlp.down_proj": "rowwise"}),
    # per-head q / k norms as Gemma 3's (its logits were proven; the norms' gradients were partial)
    ("qwen3", False, {"model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                      "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"}),
]


@pytest.mark.parametrize(("kind", "from_weights", "entries"), FAMILY_PLANS, ids=[k for k, _, _ in FAMILY_PLANS])
def test_tp_plan_of_each_family_gives_unsharded_logits_in_transformers(
    kind: str, from_weights: bool, entries: dict[str, str], pool: WorkerPool, tmp_path: Path
) -> None:
    directory = tmp_path / kind
    hf = build_hf(kind, directory)  # weights redrawn away from HF's init
    decls = load(f"{kind}.mesh", spec(kind, "tensor2"))
    result = check_declarations(decls)
    (plan,) = result.plans.values()
    out, _ = export_plan(plan, decls, "hf-tp-plan", f"{kind}.mesh", result.text,
                         str(directory) if from_weights else None)
    mapping = json.loads(out)
    assert entries.items() <= mapping.items(), mapping
    plan_path = _valid_tp_plan(hf, out, tmp_path)
    tokens = _tokens()
    logits, sharded, grads = pool.run(tp_plan_job, 2, str(plan_path), str(directory), tokens)[0]
    with torch.enable_grad():
        want = hf(tokens).logits
        _next_token_loss(want, tokens).backward()
    torch.testing.assert_close(logits, want.detach(), rtol=0, atol=1e-4)
    assert "model.layers.0.self_attn.o_proj.weight" in sharded, sharded
    # The training step sees the unsharded gradients too: a per-head q / k norm (Gemma 3) sums its
    # ranks' partial ones (replicated_with_grad_allreduce), the gathered and fused layers are whole.
    for name, p in hf.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


_GEMMA2 = """
mesh m {
    axes tensor = 2
    device = cpu
}
model g = gemma2 {
    vocab = 64
    hidden = 32
    layers = 2
    heads = 4
    kv_heads = 2
    ffn = 64
    dtype = fp32
}
plan p on m for g {
    batch = 2
    seq = 8
    layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
}
"""


@pytest.mark.parametrize("target", TARGETS)
def test_gemma_exports_as_its_class(target: str, tmp_path: Path) -> None:
    # Gemma's layout was refused with E1204 (once a KeyError): its modules are Llama's, its plan
    # transformers' own (test_tp_plan_of_each_family_gives_unsharded_logits_in_transformers).
    path = tmp_path / "g.mesh"
    path.write_text(_GEMMA2)
    out = tmp_path / "out"
    assert main(["export", str(path), "--to", target, "-o", str(out)]) == 0
    text = out.read_text()
    if target == "dtensor":
        assert "parallelize(Gemma2ForCausalLM.from_pretrained(DIR), mesh)" in text
    else:
        assert json.loads(text)["model.layers.*.self_attn.q_proj"] == "colwise"


def test_weights_of_another_model_are_refused_with_e1204(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--weights DIR` names the class of DIR's config.json, checked against the model first."""
    build_hf("olmo2", tmp_path / "olmo2")
    path = tmp_path / "phi3.mesh"
    path.write_text(spec("phi3", "tensor2"))
    assert main(["export", str(path), "--to", "hf-tp-plan", "--weights", str(tmp_path / "olmo2"),
                 "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "error[E1204]" in err and "is not the model of" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_fused_projections_placed_apart_are_refused_with_e1205() -> None:
    """Phi-3 holds q, k, v in one qkv_proj that one style shards: q split by heads beside a whole k has
    no tp_plan. The checker already refuses such a plan (E0402: attention combines them), so the
    export's own guard is driven directly here."""
    from meshllm_dsl.families import phi3
    from meshllm_dsl.interop.export import _Findings, _fused_alike, _Modules
    from meshllm_dsl.ir import Placement

    decls = load("phi3.mesh", spec("phi3", "tensor2"))
    (plan,) = check_declarations(decls).plans.values()
    found = _Findings(plan, None, "hf-tp-plan", pack=phi3.PACK)
    out = _Modules(fused={"model.layers.*.self_attn.qkv_proj": [
        ("attn.q", Placement("column", ("tensor",))), ("attn.k", Placement("replicate")),
        ("attn.v", Placement("replicate"))]})
    _fused_alike(found, out)
    (diag,) = found.errors
    assert diag.code == "E1205" and "qkv_proj" in diag.message and "`attn.k`" in diag.message, diag.message


@pytest.mark.parametrize(("kind", "hf_class"), [("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                                ("llama", "LlamaForCausalLM")])
def test_dtensor_export_names_the_class_of_the_models_checkpoint(kind: str, hf_class: str, tmp_path: Path) -> None:
    """The llama layout is several transformers classes: loading a Qwen3 checkpoint as
    LlamaForCausalLM (as the export once told its user to) would drop its q / k norms."""
    from hf_models import spec

    path = tmp_path / f"{kind}.mesh"
    path.write_text(spec(kind, "tensor2"))
    out = tmp_path / f"{kind}.py"
    assert main(["export", str(path), "--to", "dtensor", "-o", str(out)]) == 0
    text = out.read_text()
    assert f"parallelize({hf_class}.from_pretrained(DIR), mesh)" in text
    assert f"as transformers' {hf_class} names its modules" in text
