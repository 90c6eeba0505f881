"""The collective registry (meshllm_dsl/parallel/collectives.py): complete, in step with the runtime's export
list, and covering every operator a plan lowers to (a merge once broke `meshc plan` with a KeyError
on sequence-parallel plans: one op table lacked an op the layouts emitted)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import attrs
import pytest
from mesh_snippets import MEGATRON

import meshllm_dsl.runtime as rt
from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.codegen.emit import render_plan
from meshllm_dsl.codegen.lower import _collective_line, _UnitWriter
from meshllm_dsl.ir import Collective, PlanIR, Repeat
from meshllm_dsl.parallel.collectives import (
    _SPECS,
    COLLECTIVES,
    _registry,
    layout_collectives,
    ring_bytes,
    runtime_functions,
    spec,
)
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.report import report_json
from meshllm_dsl.views import explain

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "model m = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }"
GPT2 = "model m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, positions = 16 }"
SP = "layout { seq -> tensor }"


def _spec(body: str, model: str = LLAMA, axes: str = "tensor = 2") -> str:
    return f"mesh m {{ axes {axes} }}\n{model}\nplan p on m for m {{\n    batch = 4\n    seq = 8\n{body}\n}}\n"


# Plans beyond examples/ that reach the operators the examples do not: a row layer fed a replicated
# input (split_to), sequence parallelism with a replicated embedding (split_seq) or head
# (gather_seq_split), and GPT-2's learned positions under sequence parallelism.
SNIPPETS = {
    "split_to": _spec(MEGATRON.replace("mlp.{gate,up} column(tensor)", "mlp.{gate,up} replicate")),
    "sp_embed_replicated": _spec(MEGATRON.replace("embed vocab_parallel(tensor)", "embed replicate") + SP),
    "sp_head_replicated": _spec(MEGATRON.replace("lm_head column(tensor)", "lm_head replicate") + SP),
    "sp_gpt2": _spec("layout { heads -> tensor, ffn -> tensor, vocab -> tensor, seq -> tensor }", GPT2),
    "sp_data_pipeline": _spec(MEGATRON + "layout { batch -> data, seq -> tensor }\n microbatches = 2\n"
                              " stages over pipeline balanced", axes="data = 2, pipeline = 2, tensor = 2"),
}


def _plans() -> list[tuple[str, PlanIR, str]]:
    out = []
    for path in sorted((ROOT / "examples").glob("*.mesh")):
        result = check_file(path)
        out += [(f"{path.name}:{name}", plan, path.read_text()) for name, plan in result.plans.items()]
    for name, text in SNIPPETS.items():
        result = check_text(text, f"{name}.mesh")
        assert result.ok, (name, [(d.code, d.message) for d in result.errors])
        out += [(name, plan, text) for plan in result.plans.values()]
    return out


def _collectives(plan: PlanIR) -> list[Collective]:
    flows = [*plan.top_flows, *(f for cls in plan.block_classes for f in cls.flows)]
    return [c for _, flow in flows for c in flow.collectives]


def _explained_order(plan: PlanIR) -> list[Collective]:
    """The collectives in the order `meshc explain` lists them: the model's items, each block class,
    each unit's layout collectives and then those it issues itself (a moe layer's all-to-alls under
    expert parallelism)."""
    out: list[Collective] = []
    for item in plan.model.items:
        if isinstance(item, Repeat):
            groups, units = [dict(cls.flows) for cls in plan.classes_of(item.name)], item.body
        else:
            groups, units = [dict(plan.top_flows)], (item,)
        for flows in groups:
            for unit in units:
                out += flows[unit.name].collectives if unit.name in flows else ()
                if unit.kind == "moe" and plan.roles.expert:
                    out.append(Collective("expert_all_to_all", plan.roles.expert, "the experts"))
    return out


def _runtime_collectives() -> set[str]:
    """The runtime's own export list of its collective operators (torch-free: runtime/__init__)."""
    return {name for name, module in rt._WHERE.items() if module == "parallel.collectives"}


def test_registry_and_runtime_export_list_agree() -> None:
    assert runtime_functions() == _runtime_collectives()


def test_registered_calls_bind_to_the_runtime_functions() -> None:
    pytest.importorskip("torch")
    from meshllm_dsl.runtime.parallel import collectives as rc

    for s in COLLECTIVES.values():
        if s.issued == "unit":  # the primitive's own runtime function, in its own module
            assert rt._WHERE[s.runtime] != "collectives" and callable(getattr(rt, s.runtime)), s.op
            continue
        fn = getattr(rc, s.runtime)
        assert s.runtime in rc.__all__ and getattr(rt, s.runtime) is fn
        call = ast.parse(s.call("x", "group"), mode="eval").body
        assert isinstance(call, ast.Call)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        inspect.signature(fn).bind("x", "group", **kwargs)  # raises on an argument it does not take
        if s.fused is not None:
            fused = getattr(rc, s.fused.runtime)
            assert s.fused.runtime in rc.__all__ and getattr(rt, s.fused.runtime) is fused
            inspect.signature(fused).bind("x", "group", "layer")


def test_the_runtime_does_not_import_the_registry() -> None:
    # Generated code imports meshllm_dsl.runtime: its package and its collectives stay free of the
    # compiler, and no runtime module reads the compiler's collective tables.
    compiler = ("meshllm_dsl.parallel.collectives", "meshllm_dsl.parallel.layouts", "meshllm_dsl.planner.analyze", "meshllm_dsl.ir",
                "meshllm_dsl.codegen", "meshllm_dsl.views.explain")
    for path in sorted((ROOT / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert not name.startswith(compiler), (path.name, name)
                if path.name in ("__init__.py", "collectives.py"):
                    assert not name.startswith("meshllm_dsl") or name.startswith("meshllm_dsl.runtime"), (path.name, name)


def test_every_op_a_plan_lowers_to_is_registered_and_reported() -> None:
    seen: set[str] = set()
    exported = _runtime_collectives()
    for where, plan, text in _plans():
        ops = {c.op for c in _collectives(plan)}
        issued = {c.op for c in _explained_order(plan)} - ops
        assert all(spec(op).issued == "unit" for op in issued), where
        seen |= ops | issued
        for op in ops:
            s = spec(op)
            assert s.wire and s.kernels > 0 and s.forward and s.backward, (where, op)
        code = render_plan(plan, "t.mesh", text)
        called = set(re.findall(r"\brt\.(\w+)\(", code)) & exported
        assert called <= runtime_functions(), where
        for op in ops:  # each op is in the code as its own call or its fused one
            s = spec(op)
            assert s.runtime in called or (s.fused is not None and s.fused.runtime in called), (where, op)
        for op in issued:  # a unit's own: its runtime function
            assert f"rt.{spec(op).runtime}(" in code, (where, op)
        # The readers that once raised KeyError: explain and the planner on two device kinds.
        explained = [c for e in explain.explain_json(plan)["layers"] for u in e["units"] for c in u["collectives"]]
        assert explained == [f"{c.op}({', '.join(c.axes)}) at {c.where}: {spec(c.op).forward} forward, "
                             f"{spec(c.op).backward} backward" for c in _explained_order(plan)], where
        explain.explain_text(plan)
        for device in ("cpu", "h100"):
            report_json(analyze(plan, PROFILES[device]))
    # The plans above reach every operator a layout emits (gather_from: the runtime's, unused by layouts).
    assert seen == set(COLLECTIVES) - {"gather_from"}, sorted(seen)


def test_lowering_prints_a_runtime_call_for_every_op() -> None:
    (plan,) = check_text(_spec(MEGATRON), "t.mesh").plans.values()
    writer = _UnitWriter(plan, {})
    for s in layout_collectives():
        op = s.op
        line = _collective_line(writer, Collective(op, ("tensor",), "input"), 32)
        assert line.code == f"x = rt.{s.runtime}(x, self.g_tensor{s.runtime_args})", op
        ast.parse(line.code)
        assert "{" not in (line.comment or "") and "tensor" in (line.comment or ""), (op, line.comment)
        fields = {"dim": 32, "local": 16, "n": 2, "axes": "tensor", "out": 64, "what": "Replicate"}
        for template in (s.closes_row, *(attrs.astuple(s.fused)[1:3] if s.fused else ())):
            if template is not None:
                assert "{" not in template.format(**fields), (op, template)


def test_wire_bytes_follow_the_ring_algorithm() -> None:
    # 1,000 bytes over 4 ranks: an all-reduce sends 2 x 3/4 of it, a gather or scatter 3/4.
    assert {op: s.wire_bytes(1000, 4) for op, s in COLLECTIVES.items()} == {
        "copy_to": 1500, "reduce_from": 1500, "split_to": 750, "gather_from": 750,
        "gather_seq": 2250, "reduce_scatter_seq": 1500, "split_seq": 750, "gather_seq_split": 750,
        "expert_all_to_all": 3000,  # dispatch and combine, forward and backward: 4 x 3/4
    }
    assert all(s.wire_bytes(1000, 1) == 0 for s in COLLECTIVES.values())
    assert ring_bytes("send_recv", 1000, 2) == 1000


def test_an_op_without_a_record_is_refused_when_the_registry_is_built() -> None:
    with pytest.raises(ValueError, match=r"no record for \['gather_seq_split'\]"):
        _registry(tuple(s for s in _SPECS if s.op != "gather_seq_split"))
    with pytest.raises(ValueError, match=r"named twice \['copy_to'\]"):
        _registry((*_SPECS, _SPECS[0]))
    with pytest.raises(ValueError, match="undeclared ops"):
        _registry((*_SPECS[1:], attrs.evolve(_SPECS[0], op="copy_too")))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unregistered ops under sequence parallelism"):
        _registry((attrs.evolve(_SPECS[0], under_seq="gather_sq"), *_SPECS[1:]))  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="has no record in meshllm_dsl/parallel/collectives.py"):
        spec("copy_too")
