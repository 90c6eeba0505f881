"""Declarations -> resolved meshes and models: names bound, dims evaluated, primitives expanded.

Expressions are integer arithmetic over named dims; `/` must divide exactly. A bare name that is not
a dim is a symbol (`swiglu`, `bf16`, `embed`), validated by whoever consumes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from meshllm_dsl import primitives
from meshllm_dsl.codes import (
    E0201,
    E0202,
    E0203,
    E0204,
    E0205,
    E0302,
    E0303,
    E0304,
    E0306,
    E0307,
    E0308,
    E0309,
)
from meshllm_dsl.diagnostics import Diagnostic, Label, replace, typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.limits import MAX_BLOCKS, MAX_DEVICES, MAX_INT
from meshllm_dsl.front.names import divisors, identifier_problem, or_list, safe_variant
from meshllm_dsl.front.site import UnitSite
from meshllm_dsl.front.source import Span
from meshllm_dsl.ir import DTYPES, Axis, MeshIR, ModelIR, Repeat, Symbol, Unit, Value
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.primitives.args import Arg
from meshllm_dsl.primitives.embedding import EMBEDDING
from meshllm_dsl.primitives.linear import LINEAR


@attrs.define
class Binding:
    value: Value
    span: Span | None  # where it was defined


Env = dict[str, Binding]


class Resolver:
    """Shared by the model, mesh and plan resolution: evaluates expressions, records diagnostics."""

    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        self.diagnostics = diagnostics
        self._bad_origins: set[Span] = set()
        self._lists: dict[Span, ast.ListLit] = {}  # each list as written, by its span: its items' spans

    def error(self, code: str, message: str, span: Span | None, **kw: Any) -> None:
        self.diagnostics.append(Diagnostic(code, message, span, **kw))

    def check_identifier(self, name: ast.Name, what: str) -> bool:
        flags = {"attribute": what in ("layer", "axis"), "module": what == "plan"}
        problem = identifier_problem(name.value, **flags)
        if problem is None:
            return True
        shown = name.value if len(name.value) <= 40 else name.value[:37] + "..."
        variant = safe_variant(name.value, kind=what, **flags)
        self.error(
            E0204,
            f"{what} name `{shown}` {problem}",
            name.span,
            label="not allowed as a name",
            help=f"names reach generated Python code: use a plain identifier such as `{variant}`",
            suggestions=replace(name.span, variant, f"Rename to `{variant}`"),
        )
        return False

    def repeated(self, what: str, again: Span | None, first: Span | None) -> None:
        """E0201 for a statement given twice, pointing at both: nothing is silently overridden."""
        self.error(E0201, f"{what} is given twice", again, label="given again here",
                   secondary=(Label(first, "first given here"),) if first is not None else (),
                   help="keep one of them: a repeated statement would silently override the other")

    # -- expressions
    def eval(self, expr: ast.Value, env: Env) -> Value | Symbol | None:
        if isinstance(expr, ast.ListLit):
            return self._eval_list(expr, env)
        if isinstance(expr, ast.IntLit):
            return expr.value
        if isinstance(expr, ast.FloatLit):
            return expr.value
        if isinstance(expr, ast.StrLit):
            return expr.value
        if isinstance(expr, ast.Name):
            if expr.value in env:
                return env[expr.value].value
            if expr.value in ("true", "false"):
                return expr.value == "true"
            return Symbol(expr.value)
        if isinstance(expr, ast.Neg):
            v = self.eval(expr.operand, env)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return -v
            return self._not_number(expr.operand, v, env)
        assert isinstance(expr, ast.BinOp)
        left, right = self.eval(expr.left, env), self.eval(expr.right, env)
        if left is None or right is None:
            return None
        for side, v in ((expr.left, left), (expr.right, right)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return self._not_number(side, v, env)
        assert isinstance(left, (int, float)) and isinstance(right, (int, float))
        if expr.op == "+":
            return left + right
        if expr.op == "-":
            return left - right
        if expr.op == "*":
            return left * right
        if right == 0:
            self.error(E0302, "division by zero", expr.span, label=f"`{_text(expr.right)}` is 0")
            return None
        if isinstance(left, int) and isinstance(right, int):
            if left % right:
                self.error(
                    E0302,
                    f"`{_text(expr)}` does not divide exactly: {left} / {right} = {left / right:.4g}",
                    expr.span,
                    label="must divide exactly",
                    help=f"`{_text(expr.right)}` must divide {left}: e.g. {or_list(_near_divisors(left, right))}",
                    note="dims are integers; `/` in a dim expression must leave no remainder",
                )
                return None
            return left // right
        return left / right

    def _eval_list(self, expr: ast.ListLit, env: Env) -> tuple[float, ...] | None:
        """A list of numbers (its items may be expressions), as floats; None after a located error."""
        if expr.span is not None:
            self._lists[expr.span] = expr
        out: list[float] = []
        for item in expr.items:
            v = self.eval(item, env)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                if isinstance(v, Symbol):
                    self.unknown_name(item, "dim", env)
                else:
                    self.error(E0304, f"`{_text(item)}` in a list is not a number", item.span, label=f"is {_kind(v)}",
                               help="a list holds numbers only, such as `[1.0, 1.25, 1.5]`")
                return None
            if not math.isfinite(float(v)):
                self.error(E0307, f"`{_text(item)}` is out of range", item.span, label="not finite",
                           help="numbers in a spec are finite 64-bit floats")
                return None
            out.append(float(v))
        return tuple(out)

    def _origin(self, expr: ast.Value, env: Env, what: str) -> tuple[Span | None, tuple[Label, ...], Binding | None]:
        """Where a value was written: the use itself, or (through a name, such as a family
        parameter) its definition, with the use as a secondary label."""
        origin = env.get(expr.value) if isinstance(expr, ast.Name) else None
        if origin is not None and origin.span is not None and expr.span is not None:
            return origin.span, (Label(expr.span, f"`{expr.value}` used as {what} here"),), origin
        return expr.span, (), None

    def eval_floats(self, expr: ast.Value, env: Env, what: str, length: int | None, length_why: str
                    ) -> tuple[float, ...] | None:
        """A list of positive numbers, `length` long when not empty (`length_why` says why); or a
        located error: at the list as written, or at the item that is wrong."""
        v = self.eval(expr, env)
        if v is None:
            return None
        span, secondary, origin = self._origin(expr, env, what)
        if origin is not None:
            if span in self._bad_origins:
                return None  # reported at its first use: one error per mistake
        if not isinstance(v, tuple):
            self.error(E0304, f"{what} must be a list of numbers", span, label=f"is {_kind(v)}", secondary=secondary,
                       help="write the numbers in brackets, such as `[1.0, 1.25]`")
            self._bad_origins.add(span)  # type: ignore[arg-type]
            return None
        written = self._lists.get(span) if span is not None else None
        for i, x in enumerate(v):
            if x <= 0:
                at = written.items[i].span if written is not None and i < len(written.items) else span
                self.error(E0307, f"{what}: item {i + 1} is out of range: {x:g}", at, label="must be > 0",
                           secondary=secondary, help="every factor is a positive number")
                self._bad_origins.add(span)  # type: ignore[arg-type]
                return None
        if v and length is not None and len(v) != length:
            self.error(E0304, f"{what} has {len(v)} numbers; expected {length} ({length_why})", span,
                       label=f"{len(v)} numbers", secondary=secondary,
                       help=f"give {length} numbers, one per rotary frequency" if "rotary_dim" in length_why
                       else f"give {length} numbers")
            self._bad_origins.add(span)  # type: ignore[arg-type]
            return None
        return v

    def _not_number(self, expr: ast.Expr, v: object, env: Env) -> None:
        if isinstance(v, Symbol):
            self.unknown_name(expr, "dim", env)
        elif v is not None:
            self.error(E0304, f"`{_text(expr)}` is not a number", expr.span, label=f"is {_kind(v)}")
        return None

    def unknown_name(self, expr: ast.Expr, what: str, env: Env) -> None:
        name = expr.value if isinstance(expr, ast.Name) else _text(expr)
        self.error(
            E0202,
            f"unknown {what} `{name}`",
            expr.span,
            label="not declared",
            **typo(expr.span, name, [k for k, b in env.items() if isinstance(b.value, int)]),
        )

    def eval_int(self, expr: ast.Expr, env: Env, what: str, minimum: int = 1, maximum: int = MAX_INT) -> int | None:
        v = self.eval(expr, env)
        if v is None:
            return None
        if isinstance(v, Symbol):
            self.unknown_name(expr, "dim", env)
            return None
        # A bad value that came through a name (`repeat(layers)` inside a family) is reported where
        # the user wrote it (`layers = 2.5`), with the use as a secondary label.
        span, secondary = expr.span, ()
        origin = env.get(expr.value) if isinstance(expr, ast.Name) else None
        if origin is not None and origin.span is not None and expr.span is not None:
            span, secondary = origin.span, (Label(expr.span, f"`{expr.value}` used as {what} here"),)
            if (isinstance(v, bool) or not isinstance(v, int) or v < minimum) and span in self._bad_origins:
                return None  # this value is already reported (at its first use); one error per mistake
            self._bad_origins.add(span)
        if isinstance(v, bool) or not isinstance(v, int):
            whole = max(minimum, round(v)) if isinstance(v, float) else None
            self.error(E0304, f"{what} must be an integer", span, label=f"is {_kind(v)}", secondary=secondary,
                       help=f"use a whole number{f' such as {whole}' if whole is not None else ''}",
                       suggestions=replace(span, str(whole), f"Use {whole}") if whole is not None and _is_number(span) else ())
            return None
        if v < minimum:
            self.error(
                E0303,
                f"{what} must be at least {minimum}, got {v}",
                span,
                label="too small",
                secondary=secondary,
                help=f"use a value >= {minimum}",
            )
            return None
        if v > maximum:
            self.error(E0307, f"{what} is out of range: {_short(v)} is above {_short(maximum)}", span,
                       label="too large", secondary=secondary,
                       help=f"use a value <= {_short(maximum)}")
            return None
        return v

    def eval_float(self, expr: ast.Expr, env: Env, what: str, low: float, high: float = 1e300,
                   low_open: bool = True, high_open: bool = False) -> float | None:
        """A number in a range (`low < v <= high` by default), or a located error."""
        v = self.eval(expr, env)
        if v is None:
            return None
        # A bad value that came through a name (a family parameter) is reported where it was written.
        span, secondary = expr.span, ()
        origin = env.get(expr.value) if isinstance(expr, ast.Name) else None
        if origin is not None and origin.span is not None and expr.span is not None:
            span, secondary = origin.span, (Label(expr.span, f"`{expr.value}` used as {what} here"),)
        bad = isinstance(v, bool) or not isinstance(v, (int, float))
        if not bad:
            f = float(v)
            bad = not math.isfinite(f) or (f <= low if low_open else f < low) or (f >= high if high_open else f > high)
        if bad and origin is not None and span is origin.span:
            if span in self._bad_origins:
                return None  # reported at its first use: one error per mistake
            self._bad_origins.add(span)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            words = str(v).lower() in ("nan", "inf", "infinity")
            self.error(E0304, f"{what} must be a number", span, label=f"is {_kind(v)}", secondary=secondary,
                       help="write a decimal number such as `1e-5`" + ("; `nan` and `inf` are not numbers in a spec" if words else ""))
            return None
        f = float(v)
        too_low = f <= low if low_open else f < low
        too_high = f >= high if high_open else f > high
        if not math.isfinite(f) or too_low or too_high:
            lo = f"{'>' if low_open else '>='} {low:g}"
            hi = f"{'<' if high_open else '<='} {high:g}"
            self.error(E0307, f"{what} is out of range: {f:g}", span, label=f"must be {lo} and {hi}",
                       secondary=secondary, help=f"use a value {lo} and {hi}")
            return None
        return f


def _text(expr: ast.Expr) -> str:
    from meshllm_dsl.front.fmt import format_expr

    return format_expr(expr)


def _short(n: int) -> str:
    """A large integer as a power of 2 or 10 when it is one, else its digits (at most 30 shown)."""
    if n > 1 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    text = str(n)
    return text if len(text) <= 30 else f"a {len(text)}-digit number"


def _kind(v: object) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, Symbol):
        return f"the name `{v}`"
    if isinstance(v, tuple):
        return f"a list of {len(v)} number{'' if len(v) == 1 else 's'}"
    return "a string"


def _near_divisors(n: int, near: int) -> list[int]:
    ds = divisors(n)
    ds.sort(key=lambda d: (abs(d - near), d))
    return sorted(ds[:6])


# ---------------------------------------------------------------- meshes

_MESH_SETTINGS = ("hosts", "devices", "device")


def resolve_mesh(decl: ast.MeshDecl, r: Resolver, devices: Sequence[str]) -> MeshIR | None:
    ok = r.check_identifier(decl.name, "mesh")
    axes: list[Axis] = []
    seen: dict[str, ast.AxisDecl] = {}
    env: Env = {}
    for a in decl.axes:
        ok &= r.check_identifier(a.name, "axis")
        if a.name.value in _MESH_SETTINGS:
            # `axes a = 2, b = 4,` then `hosts = 2` on the next line: the trailing comma continues the
            # axis list, so the setting silently became a third axis. Never let that pass.
            r.error(E0204, f"`{a.name.value}` is a mesh setting, but here it is an axis", a.name.span,
                    label="parsed as an axis", help=f"remove the comma before `{a.name.value}`: "
                    "a comma after the last axis continues the axis list")
            ok = False
        if a.name.value in seen:
            r.error(
                E0201,
                f"axis `{a.name.value}` is declared twice",
                a.name.span,
                label="second declaration",
                secondary=(Label(seen[a.name.value].name.span, "first declared here"),),  # type: ignore[arg-type]
                help="give every mesh axis a distinct name",
            )
            ok = False
            continue
        seen[a.name.value] = a
        size = r.eval_int(a.size, env, f"size of axis `{a.name.value}`", maximum=MAX_DEVICES)
        if size is None:
            ok = False
            continue
        axes.append(Axis(a.name.value, size, a.span))
    if not decl.axes:
        r.error(E0303, f"mesh `{decl.name.value}` has no axes", decl.name.span,
                label="needs `axes NAME = SIZE, ...`", help="e.g. `axes data = 2, tensor = 4`")
        return None
    hosts, device = 1, None
    total = 1
    for a in axes:
        total *= a.size
    if total > MAX_DEVICES:
        r.error(E0307, f"mesh `{decl.name.value}` has {_short(total)} devices, more than {_short(MAX_DEVICES)}",
                decl.name.span, label=f"{_short(total)} devices: the product of its axis sizes",
                secondary=tuple(Label(a.span, f"{a.name} = {a.size}") for a in axes if a.span is not None),
                help=f"a mesh has at most {_short(MAX_DEVICES)} devices: shrink the axes")
        return None
    seen_settings: dict[str, ast.Setting] = {}
    for s in decl.settings:
        key = s.name.value
        if key in seen_settings:
            r.repeated(f"mesh setting `{key}`", s.name.span, seen_settings[key].name.span)
            ok = False
            continue
        seen_settings[key] = s
        if key == "hosts":
            h = r.eval_int(s.value, env, "hosts")
            if h is not None and total % h:
                r.error(
                    E0306,
                    f"{total} devices cannot be spread evenly over {h} hosts",
                    s.value.span,
                    label="does not divide the device count",
                    help=f"hosts must divide {total}: use {or_list(divisors(total))}",
                )
                ok = False
            elif h is not None:
                hosts = h
        elif key == "devices":
            n = r.eval_int(s.value, env, "devices")
            if n is not None and n != total:
                sizes = " x ".join(f"{a.name} {a.size}" for a in axes)
                r.error(
                    E0306,
                    f"mesh has {total} devices ({sizes}) but `devices = {n}`",
                    s.value.span,
                    label=f"expected {total}",
                    help=f"the product of the axis sizes must equal the device count: write `devices = {total}`, or resize the axes",
                )
                ok = False
        elif key == "device":
            v = s.value
            if not isinstance(v, ast.Name):
                r.error(E0304, "device must be a profile name", v.span, help=f"known: {', '.join(sorted(set(PROFILES) | set(devices)))}")
            elif v.value not in PROFILES and v.value not in devices:
                r.error(E0202, f"unknown device profile `{v.value}`", v.span, label="not a known device",
                        **typo(v.span, v.value, [*PROFILES, *devices]))
            else:
                device = v.value
        else:
            r.error(E0203, f"unknown mesh setting `{key}`", s.name.span, label="not a mesh setting",
                    **typo(s.name.span, key, _MESH_SETTINGS))
    if not ok or len(axes) != len(decl.axes):
        return None
    return MeshIR(decl.name.value, tuple(axes), hosts, device, decl.span)


# ---------------------------------------------------------------- models


# Each layer kind's argument table (its record's, meshllm_dsl/primitives), in the registry's order.
PRIMITIVES: dict[str, tuple[Arg, ...]] = {kind: p.args for kind, p in primitives.REGISTRY.items()}

_MODEL_SETTINGS_NOT_DIMS = ("dtype",)
# (low, high) of float arguments, exclusive below: a norm's eps inside the rsqrt, rotary's base.
_FLOAT_RANGES = {"eps": (0.0, 1.0), "rope_theta": (0.0, 1e12)}
# 0: the value transformers computes; a moe layer's routing (runtime/moe/routing.py): no loss term, dropless,
# a correction bias that stays as loaded; mla's yarn mscale / mscale_all_dim: absent from the config (the
# deepseek_v3 family passes them on whatever the rope).
_FLOAT_ZERO_MEANS_DEFAULT = frozenset({"rope_attention_factor", "aux_loss_coef", "z_loss_coef", "capacity",
                                       "balance_rate", "rope_mscale", "rope_mscale_all_dim", "seq_aux_loss"})


class ModelResolver(Resolver):
    def __init__(self, diagnostics: list[Diagnostic], families: dict[str, ast.FamilyDecl]) -> None:
        super().__init__(diagnostics)
        self.families = families
        # Layers declared but not built (their own error is reported): a reference to one is not
        # a second mistake, so it is not reported again (`tie = embed` after `embed` failed).
        self.unbuilt: set[str] = set()

    def resolve(self, decl: ast.ModelDecl) -> ModelIR | None:
        start = len(self.diagnostics)
        self.unbuilt = set()  # layer names are per model
        self.check_identifier(decl.name, "model")
        env: Env = {}
        firsts: dict[str, ast.Setting] = {}
        for s in decl.settings:
            if not self.check_identifier(s.name, "dim"):
                continue
            if s.name.value in firsts:
                self.repeated(f"`{s.name.value}`", s.name.span, firsts[s.name.value].name.span)
                continue
            firsts[s.name.value] = s
            # A setting whose value failed (already reported) is bound to None, so its uses stay quiet
            # instead of each reporting a second, misleading "unknown dim".
            env[s.name.value] = Binding(self.eval(s.value, env), s.value.span)  # type: ignore[arg-type]
        body: tuple[ast.LayerStmt, ...] = decl.body
        if decl.family is not None:
            family = self.families.get(decl.family.value)
            if family is None:
                self.error(E0202, f"unknown model family `{decl.family.value}`", decl.family.span,
                           label="no such family", **typo(decl.family.span, decl.family.value, self.families))
                return None
            family_start = len(self.diagnostics)
            env = self._bind_family(decl, family, env)
            body = family.body
        dtype = env.get("dtype")
        dtype_name = "bf16"
        if dtype is not None and dtype.value is not None:
            if isinstance(dtype.value, tuple) or str(dtype.value) not in DTYPES:
                shown = _kind(dtype.value) if isinstance(dtype.value, tuple) else f"`{dtype.value}`"
                self.error(E0203, f"unknown dtype {shown}", dtype.span, label="not a dtype",
                           help=f"use one of {or_list(DTYPES)}")
            else:
                dtype_name = str(dtype.value)
        items = self._layers(body, env, top=True)
        if decl.family is not None:
            self._point_into_model(decl, family_start)
        if len(self.diagnostics) > start and any(d.is_error for d in self.diagnostics[start:]):
            return None
        if not items:
            self.error(E0202, f"model `{decl.name.value}` has no layers", decl.name.span,
                       label="empty model", help="declare layers, or instantiate a family: `model m = llama { ... }`")
            return None
        if not self._chain(decl, items):
            return None
        values = tuple((k, b.value) for k, b in env.items())
        family_name = decl.family.value if decl.family is not None else None
        return ModelIR(decl.name.value, values, tuple(items), dtype_name, decl.span, family_name)

    def _chain(self, decl: ast.ModelDecl, items: list[Unit | Repeat]) -> bool:
        """Layer shapes chain: embedding, width-keeping layers and blocks, then the head (E0308), in
        the shapes generated code and the runtime build (E0309 for the others)."""
        start = self.error_count_all()
        model = f"model `{decl.name.value}`"
        first = items[0]
        if not (isinstance(first, Unit) and primitives.of(first) is EMBEDDING):
            self.error(E0308, f"{model} does not start with a token embedding", first.span or decl.name.span,
                       label=f"`{first.name}` is the first layer", secondary=_model_label(decl),
                       help="a model starts with `embed = embedding(vocab, hidden)`: it turns token ids into the residual stream")
            return False
        width, vocab = first.attr("dim"), first.attr("num")
        last = items[-1]
        head = last if isinstance(last, Unit) and primitives.of(last) is LINEAR else None
        if head is None:
            after = next((i for i in items if isinstance(i, Unit) and primitives.of(i) is LINEAR), None)
            if after is not None:
                self.error(E0308, f"`{last.name}` comes after the head `{after.name}`", last.span or decl.name.span,
                           label="after the head", secondary=(Label(after.span, "the head (the last layer must be it)"),) if after.span else (),
                           help=f"move `{last.name}` before `{after.name}`: the head produces the logits, nothing follows it")
            else:
                self.error(E0308, f"{model} has no head", last.span or decl.name.span, label="the last layer",
                           secondary=_model_label(decl),
                           help=f"end the model with `lm_head = linear({width}, {vocab})`: it produces one logit per token")
        reps = [k for k, item in enumerate(items) if isinstance(item, Repeat)]
        for k in range(len(reps) - 1):
            if reps[k + 1] != reps[k] + 1:  # blocks of several kinds follow one another (stage balancing, checkpoints)
                between = items[reps[k] + 1]
                self.error(E0309, f"`{between.name}` between the repeats `{items[reps[k]].name}` and "
                           f"`{items[reps[k + 1]].name}` is not supported yet", between.span or decl.name.span,
                           label="between two repeats",
                           help=f"move `{between.name}` before `{items[reps[0]].name}` or after `{items[reps[-1]].name}`: "
                           "a model's repeats follow one another")
        for item in items[1:]:
            if isinstance(item, Repeat):
                self._chain_block(item, width)
                continue
            a, prim = dict(item.attrs), primitives.of(item)
            if prim is EMBEDDING:
                self.error(E0309, f"a second token embedding `{item.name}` is not supported yet", item.span,
                           label="second embedding", help=f"the model's embedding is `{first.name}`")
            elif prim.sublayer:
                self.error(E0309, f"{item.kind} `{item.name}` outside the `repeat` is not supported yet", item.span,
                           label="top-level sublayer", help="put it in the repeated block, after a norm")
            elif prim is not LINEAR and a[prim.width_arg] != width:
                self.error(E0308, f"`{item.name}` is {a['dim']} wide but the residual stream is {width} wide",
                           item.span, label=f"{item.kind} of width {a['dim']}",
                           secondary=(Label(first.span, f"width {width} set here"),) if first.span else (),
                           help=f"use `{item.kind}({'..., ' if prim.args[0].name != prim.width_arg else ''}{width})`")
            elif prim is LINEAR and item is not last and head is not None:
                self.error(E0309, f"linear layer `{item.name}` before the head is not supported yet", item.span,
                           label="only the head may be a top-level linear",
                           help="a model has one top-level linear layer: the head, last")
            elif prim is LINEAR and item is head:
                if a["in"] != width:
                    self.error(E0308, f"head `{item.name}` takes {a['in']} inputs but the residual stream is {width} wide",
                               item.span, label=f"linear({a['in']}, {a['out']})",
                               help=f"use `linear({width}, {vocab})`")
                elif a["out"] != vocab:
                    self.error(E0308, f"head `{item.name}` has {a['out']} outputs but the vocabulary has {vocab} tokens",
                               item.span, label=f"linear({a['in']}, {a['out']})",
                               secondary=(Label(first.span, f"{vocab} tokens here"),) if first.span else (),
                               help=f"use `linear({width}, {vocab})`: one logit per vocabulary entry")
        return self.error_count_all() == start

    def _chain_block(self, rep: Repeat, width: Any) -> None:
        body = rep.body
        if not body:
            self.error(E0308, f"repeat `{rep.name}` has no layers", rep.span, label="empty block",
                       help="a block alternates a norm and a sublayer: `n = rmsnorm(hidden)  attn = attention(hidden, heads)`")
            return
        # Each sublayer follows its own norm (pre) and may be followed by a `post` norm (
        # x = x + post(sublayer(pre(x)))); a sublayer with a post norm may go without a pre norm.
        want_norm = True  # the next unit must be a norm (or a sublayer with a post norm after it)
        for k, unit in enumerate(body):
            a, prim = dict(unit.attrs), primitives.of(unit)
            if not (prim.norm or prim.sublayer):
                self.error(E0309, f"{unit.kind} `{unit.name}` inside a repeat is not supported yet", unit.span,
                           label="not a block layer", help="a block alternates norms (rmsnorm, layernorm) and sublayers (attention, mlp)")
                return
            post = prim.norm and bool(a.get("post"))
            after_sublayer = k > 0 and primitives.of(body[k - 1]).sublayer
            then = body[k + 1] if k + 1 < len(body) else None
            if post and not after_sublayer:
                self.error(E0308, f"post norm `{unit.name}` follows no sublayer in `{rep.name}`", unit.span,
                           label="`post = true` normalises the output of the sublayer before it",
                           help=f"move `{unit.name}` after an attention or mlp, or drop `post = true`")
                return
            if prim.sublayer and want_norm and then is not None and primitives.of(then).norm and dict(then.attrs).get("post"):
                want_norm = False  # its post norm stands in for the pre norm (post norms only)
            if not post and prim.norm != want_norm:
                prev = body[k - 1].name if k else None
                self.error(E0308, f"`{unit.name}` ({unit.kind}) is out of place in `{rep.name}`: a block alternates norm and sublayer",
                           unit.span, label="expected a norm here" if want_norm else "expected attention or mlp here",
                           help=("every sublayer follows its own norm: x = x + sublayer(norm(x))"
                                 + (f"; add a norm before `{unit.name}`" if want_norm else f"; remove `{unit.name}` or add a sublayer after `{prev}`")))
                return
            if not post:
                want_norm = not prim.norm
            got = a[prim.width_arg]
            if got != width:
                self.error(E0308, f"`{unit.name}` is {got} wide but the residual stream is {width} wide", unit.span,
                           label=f"{unit.kind} of width {got}", help=f"use {width} (the embedding's dim)")
        if not want_norm:
            self.error(E0308, f"norm `{body[-1].name}` ends block `{rep.name}` without a sublayer", body[-1].span,
                       label="a norm with nothing after it",
                       help=f"add a sublayer after `{body[-1].name}` or remove it; a final norm belongs after the repeat")

    def error_count_all(self) -> int:
        return sum(d.is_error for d in self.diagnostics)

    def _point_into_model(self, decl: ast.ModelDecl, start: int) -> None:
        """Errors found inside a family (its defaults, its layers) caused by this model's values
        also point at the model, so a user whose spec uses a shipped family sees their own line."""
        def inside(span: Span | None) -> bool:
            return (span is not None and decl.span is not None and span.source is decl.span.source
                    and decl.span.start <= span.start < decl.span.end)

        for i in range(start, len(self.diagnostics)):
            d = self.diagnostics[i]
            if inside(d.span) or any(inside(lab.span) for lab in d.secondary) or decl.name.span is None:
                continue
            label = Label(decl.name.span, f"while building model `{decl.name.value}` from family `{decl.family.value}`")  # type: ignore[union-attr]
            self.diagnostics[i] = attrs.evolve(d, secondary=(*d.secondary, label))

    def _bind_family(self, decl: ast.ModelDecl, family: ast.FamilyDecl, given: Env) -> Env:
        params = {p.name.value for p in family.params}
        for s in decl.settings:
            if s.name.value not in params and s.name.value in given:
                self.error(E0203, f"family `{family.name.value}` has no parameter `{s.name.value}`", s.name.span,
                           label="unknown parameter", **typo(s.name.span, s.name.value, params))
        env: Env = dict(given)
        for p in family.params:
            if p.name.value in given:
                continue
            if p.default is None:
                self.error(
                    E0205,
                    f"model `{decl.name.value}` does not set `{p.name.value}`, which family `{family.name.value}` requires",
                    decl.name.span,
                    label=f"missing `{p.name.value}`",
                    secondary=(Label(p.span, "parameter declared here"),) if p.span else (),  # type: ignore[arg-type]
                    help=f"add `{p.name.value} = ...` to the model",
                )
                env[p.name.value] = Binding(None, None)  # type: ignore[arg-type]  # reported: keep uses quiet
                continue
            env[p.name.value] = Binding(self.eval(p.default, env), p.default.span)  # type: ignore[arg-type]
        return env

    def _layers(self, body: Sequence[ast.LayerStmt], env: Env, top: bool) -> list[Unit | Repeat]:
        out: list[Unit | Repeat] = []
        seen: dict[str, ast.Name] = {}
        for stmt in body:
            if not self.check_identifier(stmt.name, "layer"):
                continue
            if stmt.name.value in seen:
                self.error(E0201, f"layer `{stmt.name.value}` is declared twice", stmt.name.span,
                           label="second declaration",
                           secondary=(Label(seen[stmt.name.value].span, "first declared here"),),  # type: ignore[arg-type]
                           help="give every layer in a block a distinct name")
                continue
            seen[stmt.name.value] = stmt.name
            if isinstance(stmt, ast.RepeatDecl):
                if not top:
                    self.error(E0203, "`repeat` cannot be nested", stmt.name.span, label="inside another repeat",
                               help="a model has one stack of repeated blocks")
                    continue
                count = self.eval_int(stmt.count, env, f"`{stmt.name.value}` repeat count", maximum=MAX_BLOCKS)
                inner = self._layers(stmt.body, env, top=False)
                if count is not None:
                    name = stmt.name.value
                    body = tuple(attrs.evolve(u, leaves=tuple(attrs.evolve(lf, repeat=name) for lf in u.leaves))
                                 for u in inner if isinstance(u, Unit))
                    out.append(Repeat(name, count, body, stmt.span))
                continue
            unit = self._unit(stmt, env, out)
            if unit is not None:
                out.append(unit)
            else:
                self.unbuilt.add(stmt.name.value)
        return out

    def _unit(self, decl: ast.LayerDecl, env: Env, earlier: list[Unit | Repeat]) -> Unit | None:
        call = decl.call
        spec = PRIMITIVES.get(call.func.value)
        if spec is None:
            self.error(E0202, f"unknown layer primitive `{call.func.value}`", call.func.span,
                       label="not a primitive", **typo(call.func.span, call.func.value, PRIMITIVES))
            return None
        given = self._given(call, spec)
        if given is None:
            return None
        bound: dict[str, Any] = {}
        logical: dict[str, str] = {}
        spans: dict[str, Span | None] = {}
        ok = True
        pending: list[tuple[Arg, ast.Value]] = []
        for arg, expr in given:
            spans[arg.name] = self._origin(expr, env, "")[0]  # where the value was written
            if arg.kind == "floats":
                pending.append((arg, expr))  # its length depends on arguments bound after it (head_dim)
            elif not self._bind(arg, expr, decl, env, earlier, bound, logical):
                ok = False
        if not ok or not self._defaults(call, spec, pending, bound, logical):
            return None
        for arg, expr in pending:
            v5 = self.eval_floats(expr, env, f"`{arg.name}` of `{decl.name.value}`",
                                  arg.length(bound) if arg.length is not None else None, arg.length_why)
            if v5 is None:
                return None
            bound[arg.name] = v5
        return _build_unit(decl, call.func.value, bound, logical, self, spans)

    def _given(self, call: ast.Call, spec: tuple[Arg, ...]) -> list[tuple[Arg, ast.Value]] | None:
        """The call's arguments against its kind's table, positional then by name; None after an
        error (too many, an unknown name, one given twice)."""
        if len(call.args) > len(spec):
            self.error(E0203, f"`{call.func.value}` takes at most {len(spec)} arguments", call.args[len(spec)].span,
                       label="extra argument", help=f"`{call.func.value}({', '.join(a.name for a in spec)})`")
            return None
        given: list[tuple[Arg, ast.Value]] = list(zip(spec, call.args))
        names = [a.name for a in spec]
        for kw in call.kwargs:
            arg = next((a for a in spec if a.name == kw.name.value), None)
            if arg is None:
                self.error(E0203, f"`{call.func.value}` has no argument `{kw.name.value}`", kw.name.span,
                           label="unknown argument", **typo(kw.name.span, kw.name.value, names))
                return None
            if any(a.name == arg.name for a, _ in given):
                self.error(E0201, f"argument `{arg.name}` is given twice", kw.name.span, label="again here",
                           help="give each argument once")
                return None
            given.append((arg, kw.value))
        return given

    def _bind(self, arg: Arg, expr: ast.Value, decl: ast.LayerDecl, env: Env, earlier: list[Unit | Repeat],
              bound: dict[str, Any], logical: dict[str, str]) -> bool:
        """Argument `arg` (of any kind but `floats`) evaluated into `bound`; False after an error."""
        if arg.kind == "dim":
            v = self.eval_int(expr, env, f"`{arg.name}` of `{decl.name.value}`", arg.minimum)
            if v is None:
                return False
            bound[arg.name] = v
            logical[arg.name] = expr.value if isinstance(expr, ast.Name) else arg.name
        elif arg.kind == "float":
            low, high = _FLOAT_RANGES.get(arg.name, (0.0, 1e300))
            v2 = self.eval_float(expr, env, f"`{arg.name}` of `{decl.name.value}`", low, high,
                                 low_open=arg.name not in _FLOAT_ZERO_MEANS_DEFAULT)
            if v2 is None:
                return False
            bound[arg.name] = v2
        elif arg.kind == "bool":
            v3 = self.eval(expr, env)
            if not isinstance(v3, bool):
                self.error(E0304, f"`{arg.name}` must be true or false", expr.span, label=f"is {_kind(v3)}",
                           help=f"write `{arg.name} = true` or `{arg.name} = false`")
                return False
            bound[arg.name] = v3
        elif arg.kind == "choice":
            v4 = self.eval(expr, env)
            if isinstance(v4, tuple):
                self.error(E0304, f"`{arg.name}` takes one of its choices, not a list", expr.span,
                           label=f"is {_kind(v4)}", help=f"use one of {or_list(arg.choices)}")
                return False
            if str(v4) not in arg.choices:
                self.error(E0203, f"unknown {arg.name} `{v4}`", expr.span, label=f"not a known {arg.name}",
                           help=f"use one of {or_list(arg.choices)}")
                return False
            bound[arg.name] = str(v4)
        else:  # layer reference
            target = self._layer_arg(arg, expr, earlier)
            if target is None:
                return False
            bound[arg.name] = target
        return True

    def _layer_arg(self, arg: Arg, expr: ast.Value, earlier: list[Unit | Repeat]) -> Unit | None:
        """The earlier layer an argument of kind `layer` names; None after an error (or where that
        layer failed to build, and said why)."""
        if not isinstance(expr, ast.Name):
            self.error(E0304, f"`{arg.name}` must name a layer", expr.span)
            return None
        target = next((u for u in earlier if isinstance(u, Unit) and u.name == expr.value), None)
        if target is None and expr.value in self.unbuilt:
            return None
        if target is None:
            self.error(E0202, f"unknown layer `{expr.value}`", expr.span, label="not declared before this layer",
                       **typo(expr.span, expr.value, [u.name for u in earlier if isinstance(u, Unit)]))
        return target

    def _defaults(self, call: ast.Call, spec: tuple[Arg, ...], pending: list[tuple[Arg, ast.Value]],
                  bound: dict[str, Any], logical: dict[str, str]) -> bool:
        """The arguments the call leaves out, from their defaults; False after an error (one without
        a default, a head_dim that cannot be derived)."""
        for arg in spec:
            if arg.name in bound or any(a is arg for a, _ in pending):
                continue
            if arg.default is None:
                self.error(E0205, f"`{call.func.value}` needs `{arg.name}`", call.span, label=f"missing `{arg.name}`",
                           help=f"`{call.func.value}({', '.join(a.name for a in spec)})`")
                return False
            value = arg.default(bound)
            if value is None and arg.name == "head_dim":
                self.error(E0302, f"hidden ({bound['hidden']}) is not divisible by heads ({bound['heads']})",
                           call.span, label="head_dim cannot be derived",
                           help=f"give head_dim explicitly or use heads in {or_list(divisors(bound['hidden'])[-8:])}")
                return False
            bound[arg.name] = value
            logical.setdefault(arg.name, _default_logical(arg.name, logical))
        return True


def _model_label(decl: ast.ModelDecl) -> tuple[Label, ...]:
    return (Label(decl.name.span, f"model `{decl.name.value}`"),) if decl.name.span is not None else ()


def _default_logical(arg: str, logical: dict[str, str]) -> str:
    if arg == "kv_heads":
        return logical.get("heads", "heads")
    return arg


def _build_unit(decl: ast.LayerDecl, kind: str, b: dict[str, Any], lg: dict[str, str], r: Resolver,
                spans: dict[str, Span | None] | None = None) -> Unit | None:
    built = primitives.REGISTRY[kind].build(UnitSite(decl, b, lg, r, spans))  # type: ignore[index]  # kind: a PRIMITIVES key
    if built is None:
        return None
    attrs_, leaves = built
    return Unit(decl.name.value, kind, tuple(attrs_.items()), tuple(leaves), decl.span)  # type: ignore[arg-type]


# ---------------------------------------------------------------- families on their own


def check_family(family: ast.FamilyDecl, r: Resolver) -> None:
    """A family's body checked without a model: what needs no values (primitives, their arguments
    and choices, names of dims and layers, the one repeat), so a family no model uses yet is checked
    too. Values (divisibility, shapes) are checked for each model built from it."""
    params = {p.name.value for p in family.params}
    where = f"family `{family.name.value}`"

    def dims(expr: ast.Value) -> None:
        for n in ast.names_in(expr):
            if n.value not in params:
                r.error(E0202, f"unknown dim `{n.value}` in {where}", n.span, label="not a parameter of the family",
                        **typo(n.span, n.value, params))

    def layers(body: Sequence[ast.LayerStmt], top: bool, seen_repeat: list[bool]) -> None:
        earlier: dict[str, ast.Name] = {}
        units: set[str] = set()  # what `tie = NAME` may name: layers declared before, not the repeat
        for stmt in body:
            if not r.check_identifier(stmt.name, "layer"):
                continue
            if stmt.name.value in earlier:
                r.error(E0201, f"layer `{stmt.name.value}` is declared twice", stmt.name.span, label="second declaration",
                        secondary=(Label(earlier[stmt.name.value].span, "first declared here"),),  # type: ignore[arg-type]
                        help="give every layer in a block a distinct name")
                continue
            if isinstance(stmt, ast.RepeatDecl):
                if not top:
                    r.error(E0203, "`repeat` cannot be nested", stmt.name.span, label="inside another repeat",
                            help="a model has one stack of repeated blocks")
                else:
                    seen_repeat.append(True)
                    dims(stmt.count)
                    layers(stmt.body, False, seen_repeat)
                earlier[stmt.name.value] = stmt.name
                continue
            call(stmt, units)
            earlier[stmt.name.value] = stmt.name
            units.add(stmt.name.value)

    def call(decl: ast.LayerDecl, earlier: set[str]) -> None:
        c = decl.call
        spec = PRIMITIVES.get(c.func.value)
        if spec is None:
            r.error(E0202, f"unknown layer primitive `{c.func.value}`", c.func.span, label="not a primitive",
                    **typo(c.func.span, c.func.value, PRIMITIVES))
            return
        if len(c.args) > len(spec):
            r.error(E0203, f"`{c.func.value}` takes at most {len(spec)} arguments", c.args[len(spec)].span,
                    label="extra argument", help=f"`{c.func.value}({', '.join(a.name for a in spec)})`")
            return
        given: list[tuple[Arg, ast.Value]] = list(zip(spec, c.args))
        for kw in c.kwargs:
            arg = next((a for a in spec if a.name == kw.name.value), None)
            if arg is None:
                r.error(E0203, f"`{c.func.value}` has no argument `{kw.name.value}`", kw.name.span,
                        label="unknown argument", **typo(kw.name.span, kw.name.value, [a.name for a in spec]))
                continue
            if any(a.name == arg.name for a, _ in given):
                r.error(E0201, f"argument `{arg.name}` is given twice", kw.name.span, label="again here",
                        help="give each argument once")
                continue
            given.append((arg, kw.value))
        for arg, expr in given:
            symbolic = isinstance(expr, ast.Name) and expr.value in params  # the model's value decides
            if arg.kind in ("dim", "float", "floats"):
                dims(expr)
            elif arg.kind == "choice" and not symbolic and isinstance(expr, ast.Name | ast.StrLit) \
                    and expr.value not in arg.choices:
                r.error(E0203, f"unknown {arg.name} `{expr.value}`", expr.span, label=f"not a known {arg.name}",
                        help=f"use one of {or_list(arg.choices)}")
            elif arg.kind == "bool" and not symbolic and not (isinstance(expr, ast.Name) and expr.value in ("true", "false")):
                r.error(E0304, f"`{arg.name}` must be true or false", expr.span, label="not true or false",
                        help=f"`{arg.name} = true`, or a family parameter")
            elif arg.kind == "layer" and isinstance(expr, ast.Name) and expr.value not in earlier:
                r.error(E0202, f"unknown layer `{expr.value}`", expr.span, label="not declared before this layer",
                        **typo(expr.span, expr.value, earlier))
        named = {a.name for a, _ in given}
        missing = [a.name for a in spec if a.default is None and a.name not in named]
        if missing:
            r.error(E0205, f"`{c.func.value}` needs `{missing[0]}`", c.span, label=f"missing `{missing[0]}`",
                    help=f"`{c.func.value}({', '.join(a.name for a in spec)})`")

    layers(family.body, True, [])


def _is_number(span: Span | None) -> bool:
    """`span` is a number literal as written (not a name bound to one, nor a whole setting)."""
    try:
        return span is not None and float(span.text) is not None
    except ValueError:
        return False
