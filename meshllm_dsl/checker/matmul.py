"""Low-precision matmuls and compiled blocks: `precision { matmul = R, all_gather = fp8 }`,
`precision PATH matmul = R` and the plan setting `compile = blocks`.

Which linear layers run in a float8 recipe is decided here, once, into the plan's Float8Plan: the
runtime converts exactly those (runtime/train/float8.py), the planner prices exactly those. A layer
stays in the params dtype when its primitive's matmuls are not torchao's to convert (the output head,
as torchtitan keeps it; a moe layer's router and stacked experts) or when a dim of its local weight
is not a multiple of 16 (W0709 names it: torchao's kernels need 16-byte-aligned float8 operands).
"""

from __future__ import annotations

from collections.abc import Mapping

from meshllm_dsl import primitives
from meshllm_dsl.checker.context import PlanContext, _seg_matches
from meshllm_dsl.checker.optimizer import MATMUL_KEYS
from meshllm_dsl.codes import E0203, E0304, E0309, E0313, E0502, W0709, W0710
from meshllm_dsl.diagnostics import typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.names import did_you_mean, or_list
from meshllm_dsl.ir import (
    COMPILES,
    DTYPES,
    MATMULS,
    REPLICATE,
    BlockClass,
    Float8Plan,
    Leaf,
    Placement,
    Repeat,
    Unit,
    fp8_dim_multiple,
)
from meshllm_dsl.parallel.devices import DeviceProfile

# Compute dtypes torchao's float8 training takes: the recipes cast from them and return them.
FP8_COMPUTE = ("bf16", "fp16")


class MatmulRules(PlanContext):
    def compile_setting(self, given: ast.Setting | None) -> str:
        """`compile = none | blocks`."""
        if given is None:
            return "none"
        v = given.value
        if not isinstance(v, ast.Name) or v.value not in COMPILES:
            self.error(E0203, "unknown `compile` mode", v.span, label="not a compile mode",
                       help=f"use {or_list(COMPILES)}: `blocks` compiles each block of the repeat with torch.compile")
            return "none"
        if v.value == "blocks" and not self.model.repeats:
            self.error(E0309, f"`compile = blocks` in a model without a repeat: `{self.model.name}` has no blocks",
                       v.span, label="nothing to compile", help="use `compile = none` (or leave it out)")
            return "none"
        return v.value

    def eager_float8(self, float8: Float8Plan | None, compiled: str, profile: DeviceProfile | None) -> None:
        """W0710: float8 on GPUs without `compile = blocks`, where torchao's casts run as kernels of their own."""
        if float8 is None or compiled != "none" or profile is None or profile.kernel_us is not None:
            return
        self.warn(W0710, f"float8 matmuls (`{float8.recipe}`) without `compile = blocks`", self._matmul_span(),
                  label="torchao's casts and scales run as separate kernels",
                  help="add `compile = blocks` to the plan: measured on one H200 (bench/float8.py, a 4-block Llama "
                  "of hidden 2048), eager fp8_tensorwise ran at 0.48x bf16's tokens/s, compiled at 1.38x")

    def matmul(self, compute: str, master: str | None, zero: int, top: Mapping[str, Placement],
               classes: tuple[BlockClass, ...], profile: DeviceProfile | None) -> Float8Plan | None:
        """The Float8Plan of `precision { matmul, all_gather }` and the `precision PATH matmul = R`
        overrides; None when every matmul computes in the params dtype."""
        stmt = next((s for s in self.decl.body if isinstance(s, ast.PrecisionStmt)), None)
        settings = {s.name.value: s for s in (stmt.settings if stmt is not None else ()) if s.name.value in MATMUL_KEYS}
        rules = [s for s in self.decl.body if isinstance(s, ast.PrecisionRule)]
        recipe = self._recipe(settings.get("matmul"), compute)
        overrides: list[tuple[ast.PrecisionRule, str | None, list[tuple[str, Leaf, Unit]]]] = []
        for rule in rules:
            if rule.setting.name.value != "matmul":
                self.error(E0203, f"`precision PATH` sets `matmul` only, not `{rule.setting.name.value}`",
                           rule.setting.name.span, label="not per layer",
                           help="set the dtypes once for the plan: `precision { params = bf16, master = fp32 }`",
                           **({} if rule.setting.name.value in ("params", "master", "reduce", "all_gather") else
                              typo(rule.setting.name.span, rule.setting.name.value, ["matmul"])))
                continue
            given = self._recipe(rule.setting, compute)
            hits = self._rule_hits(rule.path)
            if not hits:
                names = {n for full, _leaf, _unit in self._linears() for n in full.split(".") if not n.isdigit()}
                wrong = next((n for seg in rule.path.segments for n in seg.names if n not in names), None)
                self.error(E0502, f"`precision {rule.path}` matches no linear layer", rule.path.span,
                           label=f"no layer `{wrong}`" if wrong else "matches nothing",
                           help=(did_you_mean(wrong, names) + "; " if wrong else "") + "name a block (`blocks.0`), a "
                           "layer (`blocks.*.mlp`) or a weight (`blocks.*.attn.q`) of the model's linear layers")
                continue
            overrides.append((rule, given, hits))
        gather = self._all_gather(settings.get("all_gather"), recipe, compute, zero, master,
                                  any(g == "fp8_tensorwise" for _, g, _ in overrides))
        wanted = {recipe, *(g for _, g, _ in overrides)} - {None}
        if not wanted:
            return None
        for r in sorted(wanted, key=MATMULS.index):  # type: ignore[arg-type]
            where = settings["matmul"].value.span if recipe == r else next(
                rule.setting.value.span for rule, g, _ in overrides if g == r)
            self._device_runs(r, compute, profile, where)  # type: ignore[arg-type]
        if master is not None and master != compute and zero == 0:
            # ZeRO 0 keeps fp32 master weights as the parameters and narrows products by torch.autocast
            # (runtime/train/amp.py); torchao's float8 layers read autocast's dtype on CUDA only.
            self.error(E0309, f"float8 matmuls with {master} master weights under ZeRO 0 are not supported yet",
                       self._matmul_span(), label="torch.autocast would feed float8 layers fp32 weights",
                       help="shard with `zero 1`, `zero 2` or `zero 3` in the optimizer (FSDP2 casts the weights to "
                       f"{compute}, as torchtitan runs float8), or compute in {compute} without master weights")
        if self.failed:
            return None
        return self._resolve(recipe, overrides, gather, top, classes, compute)

    # -- the settings

    def _recipe(self, s: ast.Setting | None, compute: str) -> str | None:
        """A `matmul = ...` value: one of MATMULS, or None for the params dtype (written as it)."""
        if s is None:
            return None
        v = s.value
        name = v.value if isinstance(v, ast.Name) else None
        if name in MATMULS:
            return name
        if name in DTYPES:
            if name != compute:
                self.error(E0309, f"`matmul = {name}` with the compute dtype {compute}", v.span,
                           label="matmuls compute in the params dtype or a float8 recipe",
                           help=f"write `matmul = {compute}` (the default), or one of {or_list(MATMULS)}; "
                           f"to compute everything in {name}, set `params = {name}`")
            return None
        fix = typo(v.span, name, MATMULS) if name is not None else {}
        meant = f"{fix['help'].split('?')[0]}? " if "?" in str(fix.get("help", "")) else ""
        self.error(E0203, "unknown `matmul` recipe", v.span, label="not a recipe",
                   **{**fix, "help": f"{meant}use one of {or_list(MATMULS)}, or the params dtype `{compute}`"})
        return None

    def _all_gather(self, s: ast.Setting | None, recipe: str | None, compute: str, zero: int, master: str | None,
                    tensorwise_override: bool) -> bool:
        """`all_gather = fp8`: FSDP2 all-gathers the tensorwise layers' weights in float8."""
        if s is None:
            return False
        v = s.value
        name = v.value if isinstance(v, ast.Name) else None
        if name == compute:
            return False
        if name != "fp8":
            self.error(E0203, "unknown `all_gather` dtype", v.span, label="not fp8 or the params dtype",
                       help=f"use `all_gather = fp8` (FSDP2 gathers the float8 weights) or `{compute}` (the default)")
            return False
        if recipe != "fp8_tensorwise" and not tensorwise_override:
            self.error(E0309, "`all_gather = fp8` needs `matmul = fp8_tensorwise`", v.span,
                       label="float8 all-gathers reuse the tensorwise weight scale",
                       help="set `matmul = fp8_tensorwise` (torchao gathers only tensorwise-scaled weights in "
                       "float8; the rowwise and MX recipes scale after the gather)")
            return False
        if not (zero >= 2 or (zero == 1 and master is not None)):
            self.error(E0309, f"`all_gather = fp8` with ZeRO {zero}: no FSDP2 all-gather of weights to narrow", v.span,
                       label="the weights are whole on every rank",
                       help="shard the parameters with `zero 3` (or `zero 2`, or `zero 1` with master weights) "
                       "in the optimizer, or drop `all_gather`")
            return False
        return True

    def _device_runs(self, recipe: str, compute: str, profile: DeviceProfile | None, where: object) -> None:
        """E0313: a recipe the compute dtype or the mesh's device cannot run."""
        if compute not in FP8_COMPUTE:
            self.error(E0313, f"`matmul = {recipe}` with the compute dtype {compute}", where,  # type: ignore[arg-type]
                       label=f"torchao casts {or_list(FP8_COMPUTE)} activations to float8",
                       help=f"compute in bf16 and keep master weights in {compute}: "
                       f"`precision {{ params = bf16, master = {compute}, matmul = {recipe} }}`")
            return
        if profile is None or profile.name == "cpu" or profile.kernel_us is not None:
            return  # CPU ranks: torchao emulates the float8 matmuls (Float8LinearConfig.emulate)
        if recipe == "mxfp8" and profile.mx_tflops is None:
            self.error(E0313, f"`mxfp8` on `{profile.name}`, which has no MX tensor cores", where,  # type: ignore[arg-type]
                       label="block-scaled float8 needs Blackwell (b200)",
                       help="use `fp8_rowwise` or `fp8_tensorwise` on Hopper, or a device declared with `mx_tflops`")
        elif recipe != "mxfp8" and profile.fp8_tflops is None:
            self.error(E0313, f"`{recipe}` on `{profile.name}`, which has no float8 tensor cores", where,  # type: ignore[arg-type]
                       label="float8 matmuls need Hopper, Ada, Blackwell or MI300",
                       help=f"compute in `{compute}` (drop `matmul`), or run on h100 / h200 / b200; "
                       "a declared device states its float8 peak with `fp8_tflops`")

    # -- which layers

    def _rule_hits(self, path: ast.Path) -> list[tuple[str, Leaf, Unit]]:
        """(full leaf path, leaf) of every linear leaf under `path`: a path names the layers it
        matches and everything inside them (`blocks.0`: every layer of block 0)."""
        segs = path.segments
        hits = []
        for full, leaf, unit in self._linears():
            names = full.split(".")
            if len(segs) <= len(names) and all(
                    _seg_matches(s, n) or (s.kind == "index" and n.isdigit() and s.index == int(n))
                    for s, n in zip(segs, names)):
                hits.append((full, leaf, unit))
        return hits

    def _linears(self) -> list[tuple[str, Leaf, Unit]]:
        """Every linear leaf of the model with its full path, in model order."""
        out = []
        for item in self.model.items:
            if isinstance(item, Repeat):
                for i in range(item.count):
                    for unit in item.body:
                        out += [(f"{item.name}.{i}.{'.'.join(leaf.path)}", leaf, unit)
                                for leaf in unit.leaves if leaf.kind == "linear"]
            else:
                out += [(".".join(leaf.path), leaf, item) for leaf in item.leaves if leaf.kind == "linear"]
        return out

    def _resolve(self, recipe: str | None,
                 overrides: list[tuple[ast.PrecisionRule, str | None, list[tuple[str, Leaf, Unit]]]], gather: bool,
                 top: Mapping[str, Placement], classes: tuple[BlockClass, ...], compute: str) -> Float8Plan | None:
        chosen: dict[str, str | None] = {}
        for _rule, given, hits in overrides:  # the last rule that names a layer decides it
            chosen.update((full, given) for full, _leaf, _unit in hits)
        head = self.model.items[-1]
        for rule, given, hits in overrides:
            whys = [self._kept(leaf, unit, unit is head) for _full, leaf, unit in hits]
            if given is not None and all(w is not None for w in whys):
                self.error(E0309, f"`precision {rule.path}` names no layer that can compute in {given}", rule.path.span,
                           label=whys[0].split(" (")[0], help="the recipes convert the linear layers of attention and "
                           "mlp; name those (`blocks.*.attn`, `blocks.*.mlp`)")
        layers: list[tuple[str, str]] = []
        skipped: list[tuple[str, str]] = []
        unaligned: dict[str, list[tuple[str, int]]] = {}  # template path -> (local shape, the multiple it misses)
        for full, leaf, unit in self._linears():
            want = chosen.get(full, recipe)
            if want is None:
                if full in chosen:  # named by a `precision PATH matmul = <params dtype>` rule
                    skipped.append((full, f"`precision PATH matmul = {compute}` keeps it in {compute}"))
                continue
            why = self._kept(leaf, unit, unit is head)
            if why is None:
                shape = self._local_weight(full, leaf, top, classes)
                multiple = fp8_dim_multiple(want)
                if any(d % multiple for d in shape):
                    why = f"its local weight {shape[0]} x {shape[1]} is not a multiple of {multiple} in each dim"
                    unaligned.setdefault(_template(full), []).append((f"{shape[0]} x {shape[1]}", multiple))
            if why is not None:
                skipped.append((full, why))
                continue
            layers.append((full, want))
        for template, found in unaligned.items():
            multiple = max(m for _, m in found)
            self.warn(W0709, f"`{template}` stays in {compute}: its local weight "
                      f"{' / '.join(dict.fromkeys(s for s, _ in found))} is not a multiple of {multiple} in each dim",
                      self._matmul_span(), label=f"float8 matmuls need dims in multiples of {multiple}",
                      help="torchao's float8 kernels take 16-aligned operands; split this layer over fewer ranks, or "
                      f"keep it in {compute} explicitly: `precision {template} matmul = {compute}`")
        if self.failed:
            return None
        if not layers:
            self.error(E0304, "no linear layer computes in float8", self._matmul_span(),
                       label="every layer the recipe would convert stays in the params dtype",
                       help="the recipes convert the attention and mlp layers of the blocks; drop `matmul`")
            return None
        return Float8Plan(recipe or layers[0][1], tuple(layers), tuple(skipped),
                          gather and any(r == "fp8_tensorwise" for _, r in layers))

    def _kept(self, leaf: Leaf, unit: Unit, head: bool) -> str | None:
        """Why a linear leaf stays in the params dtype whatever the recipe (None: it may convert)."""
        if head:
            return "the output head stays in the params dtype (as torchtitan keeps it)"
        prim = primitives.of(unit)
        if prim.routes_experts:
            return ("a moe layer's router and experts stay in the params dtype (the router as torchtitan's "
                    "filter_fqns keeps it; the experts are stacked tensors, not nn.Linear layers)")
        if not prim.float8_linears:
            return f"the {unit.kind} layer's matmuls are not torchao's to convert"
        return None

    def _local_weight(self, full: str, leaf: Leaf, top: Mapping[str, Placement],
                      classes: tuple[BlockClass, ...]) -> tuple[int, int]:
        weight = leaf.params[0]
        name, _, tail = full.partition(".")
        if tail and any(r.name == name for r in self.model.repeats):
            index = int(tail.split(".")[0])
            cls = next(c for c in classes if c.repeat == name and index in c.indices)
            p = cls.placement(".".join(leaf.path))
        else:
            p = top.get(full, REPLICATE)
        shape = list(weight.shape)
        if p.sharded:
            for dim, axes in p.split_dims(weight):
                shape[dim] //= self.mesh.size(*axes)
        return shape[0], shape[-1]

    def _matmul_span(self):  # type: ignore[no-untyped-def]
        stmt = next((s for s in self.decl.body if isinstance(s, ast.PrecisionStmt)), None)
        if stmt is not None:
            m = next((s for s in stmt.settings if s.name.value == "matmul"), None)
            return m.span if m is not None else stmt.span
        rule = next((s for s in self.decl.body if isinstance(s, ast.PrecisionRule)), None)
        return rule.span if rule is not None else self.decl.span


def _template(full: str) -> str:
    """`blocks.3.attn.q` -> `blocks.*.attn.q`: one warning for a layer skipped in every block."""
    parts = full.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts)
