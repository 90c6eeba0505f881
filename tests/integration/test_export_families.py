"""`meshc export --to hf-tp-plan` and `--to dtensor` for every family meshllm imports, run by the real engines.

Per family: a tiny random transformers checkpoint (weights redrawn away from HF's init), `meshc import-hf`
of it, that model under a tensor-2 plan, exported to both targets. One job on 2 gloo ranks of the shared
pool loads the checkpoint twice: once sharded by transformers' own `apply_tensor_parallelism` with the
exported tp_plan, once by the exported DTensor module's `parallelize` (torch's parallelize_module). Both
must give the unsharded model's logits (<= 1e-4) and every parameter's gradient of the next-token loss,
with parameters really sharded. What a target cannot express is a located refusal instead (GPT-2's Conv1D,
DeepSeek-V3's latent and GPT-OSS's sinks in DTensor, routed experts split by tensor parallelism).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))  # the MoE families' tiny checkpoints

import test_export_ep  # noqa: E402
from hf_models import build_hf  # noqa: E402
from test_deepseek_v3 import build_deepseek_v3  # noqa: E402
from test_export import _device_mesh, _full, _next_token_loss, _tokens, tp_plan_job  # noqa: E402
from test_glm4_moe import build_glm4_moe  # noqa: E402
from test_gpt_oss import build_gpt_oss  # noqa: E402

from meshllm_dsl.checker import check_declarations  # noqa: E402
from meshllm_dsl.diagnostics import SpecError  # noqa: E402
from meshllm_dsl.front.load import load  # noqa: E402
from meshllm_dsl.interop.export import export_plan  # noqa: E402
from meshllm_dsl.interop.import_hf import spec_text  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402


def _build(kind: str, directory: Path) -> Any:
    """The tiny checkpoint of `kind` (a family, or `family-plan`) in `directory` (each family's own
    builder; weights redrawn)."""
    kind = kind.split("-")[0]
    if kind in test_export_ep.FAMILIES:
        return test_export_ep.build(kind, directory)
    if kind == "deepseek_v3":
        return build_deepseek_v3(directory)
    if kind == "glm4_moe":
        return build_glm4_moe(directory, use_qk_norm=True)
    if kind == "gpt_oss":
        return build_gpt_oss(directory)
    return build_hf(kind, directory)


_ATTN = "heads -> tensor, kv_heads -> tensor, vocab -> tensor"
_DENSE = "heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor"
# The routed experts (and the routers, and a shared expert added to their replicated output) whole: a
# tp_plan cannot split transformers' stacked experts module (test_split_experts_are_refused).
_WHOLE_EXPERTS = "    shard blocks.*.mlp.{router,gate,up,down} replicate\n"
_WHOLE_SHARED = "    shard blocks.*.mlp.{shared_gate,shared_up,shared_down} replicate\n"
# kind -> (layout, other plan lines, the targets that refuse it: target -> the refusal's code)
PLANS: dict[str, tuple[str, str, dict[str, str]]] = {
    "llama": (_DENSE, "", {}),
    "llama3_tied": (_DENSE, "", {}),  # the head tied to the vocab-parallel embedding (re-tied after sharding)
    "mistral_window": (_DENSE, "", {}),
    "qwen2": (_DENSE, "", {}),
    "qwen3": (_DENSE, "", {}),
    "phi3": (_DENSE, "", {}),
    "olmo2": (_DENSE, "", {}),
    "gemma2": (_DENSE, "", {}),
    "gemma3": (_DENSE, "", {}),
    "mixtral": (_ATTN, _WHOLE_EXPERTS, {}),
    "qwen2_moe": (_ATTN, _WHOLE_EXPERTS + _WHOLE_SHARED + "    shard blocks.*.mlp.shared_router replicate\n", {}),
    "qwen3_moe": (_ATTN, _WHOLE_EXPERTS, {}),
    "glm4_moe": (_DENSE, _WHOLE_EXPERTS + _WHOLE_SHARED, {}),
    # MLA: the heads split, the latents' down-projections whole (their rotary key's gradient summed by
    # transformers' mla_kv_a_proj, which torch's styles have no counterpart of)
    "deepseek_v3": ("heads -> tensor, ffn -> tensor, vocab -> tensor",
                    _WHOLE_EXPERTS + _WHOLE_SHARED + "    shard {dense,blocks}.*.attn.{q_a,kv_a} replicate\n",
                    {"dtensor": "E1205"}),
    # the sinks split with the heads by transformers' local_params; parallelize_module shards no bare parameter
    "gpt_oss": (_ATTN, _WHOLE_EXPERTS, {"dtensor": "E1205"}),
    # The routed experts split by their ffn too (expert tensor parallelism): transformers' packed_colwise /
    # rowwise on its stacked experts and moe_tp_experts on their module; torch's styles have none (E1205).
    "mixtral-experts_tp": (_DENSE, "    shard blocks.*.mlp.router replicate\n", {"dtensor": "E1205"}),
    "qwen2_moe-experts_tp": (_DENSE + ", shared_ffn -> tensor", "    shard blocks.*.mlp.{router,shared_router} replicate\n",
                             {"dtensor": "E1205"}),
    "qwen3_moe-experts_tp": (_DENSE, "    shard blocks.*.mlp.router replicate\n", {"dtensor": "E1205"}),
    "glm4_moe-experts_tp": (_DENSE + ", expert_ffn -> tensor, shared_ffn -> tensor",
                            "    shard blocks.*.mlp.router replicate\n", {"dtensor": "E1205"}),
    "deepseek_v3-experts_tp": ("heads -> tensor, ffn -> tensor, expert_ffn -> tensor, shared_ffn -> tensor, vocab -> tensor",
                               "    shard blocks.*.mlp.router replicate\n"
                               "    shard {dense,blocks}.*.attn.{q_a,kv_a} replicate\n", {"dtensor": "E1205"}),
}


def _spec(kind: str, directory: Path, axes: str = "tensor = 2", layout: str = "", rest: str = "") -> str:
    """`meshc import-hf DIR`'s model, under the family's tensor-2 plan (with `axes`, and `layout` / `rest` added)."""
    imported = spec_text(str(directory), batch=4, seq=8)
    model = imported[:imported.index("\nmesh ")]  # its model declaration, without its one-device plan
    name = re.search(r"^model (\w+) =", model, re.M).group(1)  # type: ignore[union-attr]
    tensor, lines, _ = PLANS[kind]
    return (f"{model}\nmesh m {{ axes {axes} }}\nplan p on m for {name} {{\n    batch = 4\n    seq = 8\n"
            f"    layout {{ {tensor}{layout} }}\n{lines}{rest}}}\n")


def _valid_tp_plan(hf: Any, out: str, tmp_path: Path) -> Path:
    """The exported tp_plan JSON `out`, written to a file for the ranks to load, after checking as
    transformers' `_validate_parallel_plan` does (every key names a module or parameter of `hf` in its
    wildcard form, every style in its table), but failing where it only warns."""
    from transformers.distributed.parallel_utils import (
        ALL_PARALLEL_STYLES,
        replace_layer_number_by_wildcard,
    )

    mapping = json.loads(out)
    names = {replace_layer_number_by_wildcard(n) for n, _ in (*hf.named_modules(), *hf.named_parameters())}
    assert set(mapping) <= names, set(mapping) - names
    assert all(style in ALL_PARALLEL_STYLES for style in mapping.values())
    plan_path = tmp_path / "tp_plan.json"
    plan_path.write_text(out)
    return plan_path


def _export(text: str, target: str, weights: Path) -> str:
    decls = load("x.mesh", text)
    result = check_declarations(decls)
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    return export_plan(plan, decls, target, "x.mesh", result.text, str(weights))[0]


def _norms_split_by_heads(hf: Any, out: str) -> None:
    """The dim a per-head q / k norm's SequenceParallel splits is the heads' in its input as transformers'
    model code gives it ([b, s, heads, d] for Qwen3, [b, heads, s, d] for Gemma 3): measured on `hf`."""
    written = dict(re.findall(r"'([\w.*]+_norm)': SequenceParallel\(sequence_dim=(\d+)", out))
    if not written:
        return
    shapes: dict[str, tuple[int, ...]] = {}

    def record(name: str) -> Any:
        def hook(_module: Any, args: tuple[Any, ...]) -> None:
            shapes.setdefault(name, tuple(args[0].shape))
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in hf.named_modules() if n.endswith(("q_norm", "k_norm"))]
    with torch.no_grad():
        hf(_tokens())
    for h in hooks:
        h.remove()
    for pattern, dim in written.items():
        name = pattern.replace("*", next(n.split(".")[2] for n in shapes if re.fullmatch(pattern.replace(".", r"\.")
                                                                                          .replace("*", r"\d+"), n)))
        heads = hf.config.num_attention_heads if "q_norm" in name else hf.config.num_key_value_heads
        assert shapes[name][int(dim)] == heads, (name, shapes[name], dim)


def dtensor_grads_job(ctx: Any, module_path: str, hf_dir: str, tokens: Any) -> Any:
    """On every rank: the exported DTensor module's `parallelize` on transformers' model; its logits, the
    parameters it sharded and every parameter's whole gradient of the next-token loss."""
    import importlib.util

    from torch.distributed.tensor import DTensor, Shard

    loaded = importlib.util.spec_from_file_location("exported_plan", module_path)
    mod = importlib.util.module_from_spec(loaded)  # type: ignore[arg-type]
    loaded.loader.exec_module(mod)  # type: ignore[union-attr]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = mod.parallelize(model, _device_mesh(ctx.mesh(mod.AXES)))
    with torch.enable_grad(), mod.loss_context():
        logits = _full(model(tokens).logits)
        _next_token_loss(logits, tokens).backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)
                     and any(isinstance(x, Shard) for x in p.placements) and p.to_local().shape != p.shape)
    return (logits.detach(), sharded, grads) if ctx.rank == 0 else None


def family_job(ctx: Any, tp_plan: str, dtensor: str | None, hf_dir: str, tokens: Any) -> Any:
    """Both engines on the same ranks, one after the other (one pool job per family)."""
    out = tp_plan_job(ctx, tp_plan, hf_dir, tokens)
    other = dtensor_grads_job(ctx, dtensor, hf_dir, tokens) if dtensor is not None else None
    return (out, other) if ctx.rank == 0 else None


def _same(got: Any, hf: Any, want: Any, what: str) -> None:
    logits, sharded, grads = got
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4, msg=lambda m: f"{what} logits: {m}")
    assert sharded, f"{what} sharded no parameter"
    for name, p in hf.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{what} gradient of {n}: {m}")


@pytest.mark.parametrize("kind", list(PLANS))
def test_every_family_exports_to_both_engines_with_unsharded_logits_and_gradients(
    kind: str, pool: WorkerPool, tmp_path: Path
) -> None:
    directory = tmp_path / kind
    hf = _build(kind, directory)
    text = _spec(kind, directory)
    refused = PLANS[kind][2]
    paths: dict[str, Path | None] = {}
    for target in ("hf-tp-plan", "dtensor"):
        if target in refused:
            decls = load("x.mesh", text)
            (plan,) = check_declarations(decls).plans.values()
            with pytest.raises(SpecError) as err:
                export_plan(plan, decls, target, "x.mesh", text, str(directory))
            assert {d.code for d in err.value.diagnostics} == {refused[target]}, err.value.diagnostics
            assert all(d.span is not None and d.help for d in err.value.diagnostics)
            paths[target] = None
            continue
        out = _export(text, target, directory)
        if target == "hf-tp-plan":
            paths[target] = _valid_tp_plan(hf, out, tmp_path)
            # where transformers' own plan for the class names a module, the export gives it the same style
            theirs = {f"{hf.base_model_prefix}.{k}": v for k, v in hf.config.base_model_tp_plan.items()}
            ours = json.loads(out)
            assert ours.keys() & theirs.keys(), (ours, theirs)
            assert {k: ours[k] for k in ours.keys() & theirs.keys()} == {k: theirs[k] for k in ours.keys() & theirs.keys()}
        else:
            paths[target] = tmp_path / f"{kind}.py"
            paths[target].write_text(out)  # type: ignore[union-attr]
            _norms_split_by_heads(hf, out)
    tokens = _tokens()
    got_tp, got_dt = pool.run(family_job, 2, str(paths["hf-tp-plan"]),
                              str(paths["dtensor"]) if paths["dtensor"] else None, str(directory), tokens)[0]
    hf.train(False)
    with torch.enable_grad():
        want = hf(tokens).logits
        _next_token_loss(want, tokens).backward()
    _same(got_tp, hf, want.detach(), "tp_plan")
    if kind.endswith("-experts_tp"):  # every moe block's stacked experts split, not only the attention
        moe = {n for n, _ in hf.named_parameters() if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
        assert moe and moe <= set(got_tp[1]), (moe, got_tp[1])
    if got_dt is not None:
        _same(got_dt, hf, want.detach(), "dtensor")


@pytest.mark.parametrize(("kind", "target", "says"), [
    ("mixtral", "dtensor", "torch's parallel styles shard modules' 2-D weights"),
    ("gpt_oss", "dtensor", "torch's parallel styles shard modules' 2-D weights"),
    ("gpt_oss", "hf-tp-plan", "stores gate and up interleaved"),
])
def test_split_experts_without_a_style_are_refused_naming_the_placement(
    kind: str, target: str, says: str, tmp_path: Path
) -> None:
    """The routed experts split by ffn where the target has no style for transformers' stacked experts
    module: a located E1205, never a plan that drops the split."""
    text = _declared(kind).replace(_WHOLE_EXPERTS, "    shard blocks.*.mlp.router replicate\n").replace(_ATTN, _DENSE)
    decls = load("x.mesh", text)
    result = check_declarations(decls)
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    with pytest.raises(SpecError) as err:
        export_plan(plan, decls, target, "x.mesh", result.text)
    assert {d.code for d in err.value.diagnostics} == {"E1205"}, err.value.diagnostics
    assert all("routed experts" in d.message and says in d.message and d.span is not None and d.help
               for d in err.value.diagnostics if "mlp." in d.message), err.value.diagnostics


def zero_job(ctx: Any, module_path: str, hf_dir: str, tokens: Any) -> Any:
    """On every rank of data 2 x tensor 2: the exported module (parallelize_module, then fully_shard over
    `data`) fed this data rank's half of the batch; rank 0's logits (data rank 0's half) and every
    parameter's whole gradient (FSDP2 averages the data ranks': the mean of equal halves' mean losses is
    the batch's)."""
    import importlib.util

    loaded = importlib.util.spec_from_file_location("exported_plan", module_path)
    mod = importlib.util.module_from_spec(loaded)  # type: ignore[arg-type]
    loaded.loader.exec_module(mod)  # type: ignore[union-attr]
    mesh = ctx.mesh(mod.AXES)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = mod.parallelize(model, _device_mesh(mesh))
    mine = tokens.chunk(mesh.size("data"))[mesh.index("data")]
    with torch.enable_grad(), mod.loss_context():
        logits = _full(model(mine).logits)
        _next_token_loss(logits, mine).backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    return (logits.detach(), grads) if ctx.rank == 0 else None


@pytest.mark.parametrize(("kind", "zero"), [("qwen3_moe", 3), ("gemma3", 3), ("llama", 2)])
def test_dtensor_export_with_zero_over_data_x_tensor2_gives_unsharded_gradients(
    kind: str, zero: int, pool: WorkerPool, tmp_path: Path
) -> None:
    """fully_shard over `data` on top of the tensor-parallel styles (2-D parameters), the per-head q / k
    norms' SequenceParallel (Qwen3-MoE, Gemma 3) and the whole experts included; Llama's ZeRO 3 losses
    after AdamW steps are test_export.py's."""
    directory = tmp_path / kind
    hf = _build(kind, directory)
    text = _spec(kind, directory, "data = 2, tensor = 2", ", batch -> data", f"    optimizer adamw {{ zero {zero} }}\n")
    out = _export(text, "dtensor", directory)
    # ZeRO 3 reshards the parameters after forward, ZeRO 2 keeps them gathered
    assert f"fully_shard(model, mesh=mesh['data'], reshard_after_forward={zero == 3})" in out
    path = tmp_path / f"{kind}.py"
    path.write_text(out)
    tokens = _tokens()
    logits, grads = pool.run(zero_job, 4, str(path), str(directory), tokens)[0]
    hf.train(False)
    with torch.enable_grad():
        want = hf(tokens).logits
        _next_token_loss(want, tokens).backward()
    torch.testing.assert_close(logits, want.detach()[: tokens.shape[0] // 2], rtol=0, atol=1e-4)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# GLM-4.5's dense block (transformers' layer 0) and its first moe block (layer 1) split by heads, its second
# moe block's (layer 2) attention whole: blocks placed apart within a repeat and across the two repeats.
_APART = ("    shard dense.*.attn.{q,k,v} column(tensor)\n    shard dense.*.attn.o row(tensor)\n"
          "    shard blocks.0.attn.{q,k,v} column(tensor)\n    shard blocks.0.attn.o row(tensor)\n"
          "    shard blocks.1.attn.{q,k,v,o} replicate\n")


def test_blocks_placed_apart_name_their_layers_in_dtensor_and_are_refused_in_a_tp_plan(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """transformers looks a tp_plan's rules up with the layer numbers replaced by `*`, so per-block
    placements have no tp_plan (E1205, located); DTensor names transformers' layers (the moe repeat's
    block 0 is layer 1, after the dense one), and the sharded model still gives the unsharded gradients."""
    directory = tmp_path / "glm4_moe"
    hf = _build("glm4_moe", directory)
    text = _spec("glm4_moe", directory).replace("heads -> tensor, kv_heads -> tensor, ", "").replace(
        "    shard blocks.*.mlp.{router", _APART + "    shard blocks.*.mlp.{router")
    decls = load("x.mesh", text)
    result = check_declarations(decls)
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    with pytest.raises(SpecError) as err:
        export_plan(plan, decls, "hf-tp-plan", "x.mesh", result.text, str(directory))
    diags = err.value.diagnostics
    assert {d.code for d in diags} == {"E1205"} and all(d.span is not None and d.help for d in diags)
    assert any("in block 0 alone" in d.message for d in diags)
    assert any("in the blocks of dense but not in those of blocks" in d.message for d in diags)
    out = _export(text, "dtensor", directory)
    assert "'model.layers.1.self_attn.q_proj': ColwiseParallel()" in out
    assert "model.layers.2.self_attn" not in out and "model.layers.*.self_attn" not in out
    path = tmp_path / "apart.py"
    path.write_text(out)
    tokens = _tokens()
    got = pool.run(dtensor_grads_job, 2, str(path), str(directory), tokens)[0]
    hf.train(False)
    with torch.enable_grad():
        want = hf(tokens).logits
        _next_token_loss(want, tokens).backward()
    _same(got, hf, want.detach(), "dtensor")
    assert "model.layers.1.self_attn.q_proj.weight" in got[1] and "model.layers.2.self_attn.q_proj.weight" not in got[1]


def _declared(kind: str, rest: str = "") -> str:
    """The family's tensor-2 plan over its `.mesh` model as declared by hand (no checkpoint needed)."""
    tensor, lines, _ = PLANS[kind]
    return (f"mesh m {{ axes tensor = 2 }}\n{test_export_ep.MODELS[kind]}\nplan p on m for m {{\n    batch = 4\n"
            f"    seq = 8\n    layout {{ {tensor} }}\n{lines}{rest}}}\n")


# golden name -> (spec, target): each refusal this file's families meet, as `meshc export` prints it
REFUSAL_GOLDENS = {
    "mixtral_split_experts.dtensor": (_declared("mixtral").replace(_WHOLE_EXPERTS, "    shard blocks.*.mlp.router "
                                                                   "replicate\n").replace(_ATTN, _DENSE), "dtensor"),
    "gpt_oss_split_experts.hf-tp-plan": (_declared("gpt_oss").replace(_WHOLE_EXPERTS, "    shard blocks.*.mlp.router "
                                                                      "replicate\n").replace(_ATTN, _DENSE), "hf-tp-plan"),
    "deepseek_v3_mla.dtensor": (_declared("deepseek_v3"), "dtensor"),
    "gpt_oss_sinks.dtensor": (_declared("gpt_oss"), "dtensor"),
    "glm4_moe_blocks_apart.hf-tp-plan": (_declared("glm4_moe").replace("heads -> tensor, kv_heads -> tensor, ", "")
                                         .replace("    shard blocks.*.mlp.{router", _APART + "    shard blocks.*.mlp.{router"),
                                         "hf-tp-plan"),
}


@pytest.mark.parametrize("name", REFUSAL_GOLDENS)
def test_refusals_match_their_goldens(name: str, request: pytest.FixtureRequest) -> None:
    from meshllm_dsl.diagnostics import render_all

    text, target = REFUSAL_GOLDENS[name]
    decls = load("x.mesh", text)
    result = check_declarations(decls)
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    with pytest.raises(SpecError) as err:
        export_plan(plan, decls, target, "x.mesh", result.text)
    out = render_all(err.value.diagnostics)
    assert "E1205" in out and "help:" in out and "^" in out
    golden = Path(__file__).parent / "golden_export" / f"{name}.err.txt"
    if request.config.getoption("--update-goldens"):
        golden.write_text(out)
    assert golden.exists(), f"missing golden {golden}; run pytest --update-goldens"
    assert out == golden.read_text()
