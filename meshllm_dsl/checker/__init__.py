"""The checker: declarations -> checked plans (PlanIR) plus every diagnostic, all at once.

resolve.py gives the names and values of meshes and models; then each plan goes through the passes
of checker/passes.py (`PASSES`, in order: settings, recompute, placements, loss, stages, schedule,
batch, sequence_parallel, optimizer, precision, axis_roles, pitfalls), pure functions over a frozen
`PassContext` that return their results. Their rules live one area per module:
  checker/placements.py shard rules and layout entries -> placements; coverage, divisibility, activation layouts
  checker/paths.py      which layers a path pattern matches (`match_path`, also the LSP's)
  checker/stages.py     the pipeline stage map
  checker/batch.py      batch, microbatches, sequence and schedule
  checker/optimizer.py  optimizer settings and ZeRO
  checker/memory.py     memory techniques (recomputation, sequence parallelism)
  checker/pitfalls.py   axis roles and the warnings of a valid plan
checker/plan.py runs the passes for one plan and builds its PlanIR; checker/context.py is what the
rule modules share.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from meshllm_dsl.codes import E0201, E0202
from meshllm_dsl.diagnostics import Diagnostic, Label, typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.load import Declarations, load
from meshllm_dsl.front.parser import paused_gc
from meshllm_dsl.front.resolve import ModelResolver, Resolver, check_family, resolve_mesh
from meshllm_dsl.ir import MeshIR, ModelIR, PlanIR
from meshllm_dsl.parallel.devices import (
    DEFAULT_PROFILE,
    PROFILES,
    DeviceProfile,
    declared_profiles,
    host_diagnostics,
)


@attrs.frozen
class CheckResult:
    """What `meshc check` and the API return: diagnostics and everything that checked clean."""

    diagnostics: tuple[Diagnostic, ...]
    plans: dict[str, PlanIR]
    meshes: dict[str, MeshIR]
    models: dict[str, ModelIR]
    sources: tuple[str, ...] = ()
    text: str = ""  # the root spec as checked (normalized): what generated code is made from and hashes
    profiles: dict[str, DeviceProfile] = attrs.field(factory=dict)  # the spec's own `device` declarations

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.is_error]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if not d.is_error]


def check_file(path: str | Path) -> CheckResult:
    return check_declarations(load(path))


def check_text(text: str, path: str = "<string>") -> CheckResult:
    return check_declarations(load(path, text))


def check_declarations(decls: Declarations) -> CheckResult:
    with paused_gc():
        return _check_declarations(decls)


def _check_declarations(decls: Declarations) -> CheckResult:
    diags: list[Diagnostic] = list(decls.diagnostics)
    r = Resolver(diags)

    def named(kind: type, what: str) -> dict[str, ast.Item]:
        out: dict[str, ast.Item] = {}
        for item in decls.user(kind):
            name = item.name  # type: ignore[attr-defined]
            if name.value in out:
                first = out[name.value].name  # type: ignore[attr-defined]
                r.error(E0201, f"{what} `{name.value}` is declared twice", name.span, label="second declaration",
                        secondary=(Label(first.span, "first declared here"),), help=f"rename one of the {_plural(what)}")
                continue
            out[name.value] = item
        return out

    devices = named(ast.DeviceDecl, "device")
    profiles, device_diags = declared_profiles(devices.values())  # type: ignore[arg-type]
    diags.extend(device_diags)
    mesh_decls = named(ast.MeshDecl, "mesh")
    families: dict[str, ast.FamilyDecl] = {f.name.value: f for f in decls.prelude if isinstance(f, ast.FamilyDecl)}
    user_families = named(ast.FamilyDecl, "family")
    for fam in user_families.values():
        r.check_identifier(fam.name, "family")  # type: ignore[attr-defined]
        firsts: dict[str, ast.Param] = {}
        for param in fam.params:  # type: ignore[attr-defined]
            if param.name.value in firsts:
                r.repeated(f"family parameter `{param.name.value}`", param.name.span, firsts[param.name.value].name.span)
            firsts.setdefault(param.name.value, param)
    families.update(user_families)  # type: ignore[arg-type]
    model_decls = named(ast.ModelDecl, "model")
    # A family no model uses is never built, so its body is checked on its own (what needs no values).
    used = {m.family.value for m in model_decls.values() if m.family is not None}  # type: ignore[attr-defined]
    for fam in user_families.values():
        if fam.name.value not in used:  # type: ignore[attr-defined]
            check_family(fam, r)  # type: ignore[arg-type]
    plan_decls = named(ast.PlanDecl, "plan")

    meshes: dict[str, MeshIR] = {}
    for name, decl in mesh_decls.items():
        mesh = resolve_mesh(decl, r, list(devices))  # type: ignore[arg-type]
        if mesh is None:
            continue
        host_diags = host_diagnostics(decl, mesh.devices, mesh.hosts,  # type: ignore[arg-type]
                                      {**PROFILES, **profiles}.get(mesh.device or DEFAULT_PROFILE))
        diags.extend(host_diags)
        if not any(d.is_error for d in host_diags):
            meshes[name] = mesh
    models: dict[str, ModelIR] = {}
    mr = ModelResolver(diags, families)
    for name, decl in model_decls.items():
        model = mr.resolve(decl)  # type: ignore[arg-type]
        if model is not None:
            models[name] = model

    plans: dict[str, PlanIR] = {}
    for name, decl in plan_decls.items():
        assert isinstance(decl, ast.PlanDecl)
        name_ok = r.check_identifier(decl.name, "plan")
        mesh = meshes.get(decl.mesh.value)
        model = models.get(decl.model.value)
        if decl.mesh.value not in mesh_decls:
            r.error(E0202, f"unknown mesh `{decl.mesh.value}`", decl.mesh.span, label="no such mesh",
                    **typo(decl.mesh.span, decl.mesh.value, mesh_decls))
        if decl.model.value not in model_decls:
            r.error(E0202, f"unknown model `{decl.model.value}`", decl.model.span, label="no such model",
                    **typo(decl.model.span, decl.model.value, model_decls))
        if mesh is None or model is None:
            continue
        profile = {**PROFILES, **profiles}.get(mesh.device or DEFAULT_PROFILE)
        per_host = profile.per_host if profile is not None else None
        plan = PlanChecker(decl, mesh, model, diags, per_host, profile).check()
        if plan is not None and name_ok:
            plans[name] = plan
    return CheckResult(tuple(diags), plans, meshes, models, tuple(s.path for s in decls.sources),
                       decls.root.text if decls.root is not None else "", profiles)



def _plural(word: str) -> str:
    return word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")


from meshllm_dsl.checker.passes import PASSES, PassContext, PassResult  # noqa: E402 - after CheckResult
from meshllm_dsl.checker.paths import match_path  # noqa: E402
from meshllm_dsl.checker.plan import PlanChecker  # noqa: E402

__all__ = ["PASSES", "CheckResult", "PassContext", "PassResult", "PlanChecker", "check_declarations", "check_file",
           "check_text", "match_path"]
