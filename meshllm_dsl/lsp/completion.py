"""Completion in context, read off the text before the cursor.

The text being typed rarely parses, so the context comes from a small scan of the tokens before the
cursor (which block we are in, and the statement so far on this line), and the candidates come from
the last analysis that understood the file (axes of the plan's mesh, layer paths of its model,
families and their parameters, devices).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import attrs

from meshllm_dsl.checker.optimizer import MATMUL_KEYS, OPT_SETTINGS, PRECISION_KEYS
from meshllm_dsl.checker.plan import PLAN_SETTINGS
from meshllm_dsl.front import ast
from meshllm_dsl.ir import (
    COMPILES,
    CONTEXT_BALANCES,
    DTYPES,
    MATMULS,
    PACKS,
    PLACEMENTS,
    POSITIONS,
    RECOMPUTE,
    RULES,
    SCHEDULES,
)
from meshllm_dsl.lsp.analysis import DECL_KEYWORDS, leaf_paths

if TYPE_CHECKING:
    from meshllm_dsl.lsp.analysis import Analysis

_TOKEN = re.compile(r'#[^\n]*|"[^"\n]*"?|[A-Za-z_][A-Za-z0-9_]*|\d[\d_]*|->|\n|\S')
_PATH_TAIL = re.compile(r"[A-Za-z0-9_.*{},]*$")
_WORD_TAIL = re.compile(r"[A-Za-z0-9_]*$")

PLAN_KEYWORDS = ("shard", "layout", "stages", "schedule", "optimizer", "loss", "precision")
MESH_WORDS = ("axes", "device", "hosts", "devices")
OPTIMIZERS = ("adamw",)  # the ones the runtime builds: `adam` and `sgd` are E0309


@attrs.frozen
class Item:
    label: str
    kind: str  # keyword | axis | path | family | param | device | rule | schedule | value | snippet | layer
    detail: str = ""
    insert: str | None = None  # text to insert instead of the label
    replace_from: int | None = None  # offset where the replaced text starts (default: the word)


def _scan(prefix: str) -> tuple[list[list[str]], list[str]]:
    """(headers of the open blocks, outermost first; tokens of the current line in the innermost block)."""
    stack: list[list[str]] = []
    recent: list[str] = []
    line: list[str] = []
    for tok in _TOKEN.findall(prefix):
        if tok.startswith("#"):
            continue
        if tok == "\n":
            line = []
            continue
        if tok == "{" and not _in_path(recent):
            stack.append(recent)
            recent, line = [], []
            continue
        if tok == "}" and not _in_path(recent):
            if stack:
                stack.pop()
            recent, line = [], []
            continue
        recent.append(tok)
        line.append(tok)
    return stack, line


def _in_path(recent: list[str]) -> bool:
    """`{` / `}` inside `shard blocks.*.attn.{q,k,v}` are part of a path, not a block."""
    if "shard" not in recent:
        return False
    after = recent[len(recent) - 1 - recent[::-1].index("shard") :]
    if "{" in after:
        return after.count("{") > after.count("}")
    return bool(after) and after[-1] == "."


def complete(a: Analysis, offset: int) -> list[Item]:
    prefix = a.text[:offset]
    word = _WORD_TAIL.search(prefix)
    typed = word.group(0) if word else ""
    stack, line = _scan(prefix[: len(prefix) - len(typed)])
    # the token being typed is not part of the context
    if not stack:
        return _top(a, line)
    header = stack[0]
    kind = header[0] if header else ""
    if kind == "plan":
        return _plan(a, header, stack[1:], line, prefix)
    if kind == "mesh":
        if line[-2:] == ["device", "="]:
            return _devices(a)
        if not line or line[-1] == ",":
            return [Item(w, "keyword") for w in MESH_WORDS] if not line else []
        return []
    if kind == "model" and len(header) >= 4 and header[2] == "=":
        return _family_params(a, header[3], prefix)
    if kind in ("model", "family") and len(line) >= 2 and line[-1] == "=":
        from meshllm_dsl.front.resolve import PRIMITIVES

        return [Item(p, "function", "primitive", f"{p}()") for p in PRIMITIVES] + [Item("repeat", "keyword", "", "repeat()")]
    return []


def _top(a: Analysis, line: list[str]) -> list[Item]:
    if len(line) >= 2 and line[0] == "plan" and line[-1] == "on":
        return [Item(n, "mesh", "mesh") for n in a.index.meshes]
    if len(line) >= 2 and line[0] == "plan" and line[-1] == "for":
        return [Item(n, "model", "model") for n in a.index.models]
    if len(line) >= 2 and line[0] == "model" and line[-1] == "=":
        return [Item(n, "family", "family " + _signature(f)) for n, f in a.index.families.items()]
    if not line:
        return [Item(k, "keyword") for k in DECL_KEYWORDS]
    return []


def _signature(f: ast.FamilyDecl) -> str:
    return "(" + ", ".join(p.name.value + ("?" if p.default is not None else "") for p in f.params) + ")"


def _family_params(a: Analysis, family: str, prefix: str) -> list[Item]:
    fam = a.index.families.get(family)
    if fam is None:
        return []
    block = prefix[prefix.rfind("{") + 1 :]
    given = set(re.findall(r"^\s*(\w+)\s*=", block, re.MULTILINE))
    line = prefix[prefix.rfind("\n") + 1 :]
    if "=" in line:
        if re.search(r"\bdtype\s*=\s*\w*$", line):
            return [Item(d, "value", "dtype") for d in DTYPES]
        return []
    items = []
    for p in fam.params:
        if p.name.value in given:
            continue
        from meshllm_dsl.front.fmt import format_expr

        detail = f"default {format_expr(p.default)}" if p.default is not None else "required"
        items.append(Item(p.name.value, "param", detail, f"{p.name.value} = "))
    if "dtype" not in given:
        items.append(Item("dtype", "param", "bf16, fp16, fp32", "dtype = "))
    return items


def _devices(a: Analysis) -> list[Item]:
    from meshllm_dsl.parallel.devices import PROFILES

    names = list(PROFILES) + [n for n in a.index.devices if n not in PROFILES]
    return [Item(n, "device", "device profile") for n in names]


def _plan_parts(a: Analysis, header: list[str]) -> tuple[str | None, str | None]:
    # header: plan NAME on MESH for MODEL
    mesh = header[3] if len(header) > 3 and header[2] == "on" else None
    model = header[5] if len(header) > 5 and header[4] == "for" else None
    return mesh, model


def _axes(a: Analysis, mesh: str | None) -> list[Item]:
    decl = a.index.meshes.get(mesh or "")
    if decl is None:
        return []
    sizes = {}
    m = a.sem_result.meshes.get(mesh or "")
    if m is not None:
        sizes = {x.name: x.size for x in m.axes}
    return [Item(x.name.value, "axis", f"axis of {mesh}" + (f" (size {sizes[x.name.value]})" if x.name.value in sizes else ""))
            for x in decl.axes]


def _plan(a: Analysis, header: list[str], inner: list[list[str]], line: list[str], prefix: str) -> list[Item]:
    mesh, model_name = _plan_parts(a, header)
    model = a.sem_result.models.get(model_name or "")
    if inner:
        block = inner[0][0] if inner[0] else ""
        if block == "layout":
            if line and line[-1] in ("->", "*"):
                return _axes(a, mesh)
            if not line or line[-1] == ",":
                dims = [k for k, v in model.values if isinstance(v, int)] if model else []
                # `batch` and `seq` are the plan's own dims (data parallelism lays out the batch,
                # sequence or context parallelism the sequence), the others the model's
                return [Item("batch", "dim", "plan dim"),
                        Item("seq", "dim", "plan dim: sequence parallelism over tensor axes, context parallelism "
                                           "over an axis that splits no weight")] + [
                    Item(d, "dim", "model dim") for d in dims if d not in ("batch", "seq")]
            return []
        if block == "stages":
            if line and line[-1] in (":", ","):
                return [Item(i.name, "layer", "repeat" if hasattr(i, "count") else i.kind) for i in (model.items if model else ())]
            return []
        if block == "optimizer":
            if line and line[-1] == "over" or line[-2:-1] == ["over"] and line[-1] == "*":
                return _axes(a, mesh)
            if not line:
                return [Item("zero", "keyword")] + [Item(s, "param", "optimizer setting", f"{s} = ") for s in OPT_SETTINGS]
            return []
        if block == "precision":
            if line and line[-1] == "=" and len(line) >= 2 and line[-2] == "matmul":
                return [Item(m, "value", "float8 recipe (torchao)") for m in MATMULS] + [Item(d, "value", "dtype") for d in DTYPES]
            if line and line[-1] == "=" and len(line) >= 2 and line[-2] == "all_gather":
                return [Item("fp8", "value", "FSDP2 gathers float8 weights")] + [Item(d, "value", "dtype") for d in DTYPES]
            if line and line[-1] == "=":
                return [Item(d, "value", "dtype") for d in DTYPES]
            if not line or line[-1] == ",":
                return [Item(k, "param", "precision setting", f"{k} = ") for k in (*PRECISION_KEYS, *MATMUL_KEYS)]
            return []
        return []
    if not line:
        return ([Item(k, "keyword") for k in PLAN_KEYWORDS]
                + [Item(s, "param", "plan setting", f"{s} = ") for s in PLAN_SETTINGS])
    first = line[0]
    if first in ("shard", "loss"):
        # inside the parentheses of a rule: axes
        if "(" in line and ")" not in line[line.index("(") :]:
            return _axes(a, mesh)
        if first == "shard" and (len(line) == 1 or _PATH_TAIL.search(prefix) and not prefix.endswith((" ", "\t"))
                                 and len(line) >= 2 and not _path_done(prefix)):
            tail = _PATH_TAIL.search(prefix)
            start = tail.start() if tail else len(prefix)
            paths = leaf_paths(model) if model else []
            return [Item(p, "path", "layer path", None, start) for p in paths]
        if first == "loss":
            return [Item("cross_entropy", "rule"), Item("vocab_parallel", "rule", "", "vocab_parallel()")]
        return [Item(r, "rule", "", f"{r}()" if r != "replicate" else r) for r in RULES]
    if first == "stages":
        if line[-1] == "over":
            return _axes(a, mesh)
        if line[-1] == "placement":
            return [Item(p, "value", "placement") for p in PLACEMENTS]
        if len(line) >= 3:
            return [Item("balanced", "keyword"), Item("virtual", "keyword"), Item("placement", "keyword")]
        return [Item("over", "keyword")]
    if first == "schedule" and len(line) == 1:
        return [Item(s, "schedule") for s in SCHEDULES]
    if first == "optimizer" and len(line) == 1:
        return [Item(o, "value", "optimizer") for o in OPTIMIZERS]
    if first == "dtype" and line[-1] == "=":
        return [Item(d, "value", "dtype") for d in DTYPES]
    if first == "compile" and line[-1] == "=":
        return [Item(c, "value", "compile") for c in COMPILES]
    if first == "pack" and line[-1] == "=":
        return [Item(p, "value", "pack") for p in PACKS]
    if first == "positions" and line[-1] == "=":
        return [Item(p, "value", "positions") for p in POSITIONS]
    if first == "context_balance" and line[-1] == "=":
        return [Item(b, "value", "context_balance") for b in CONTEXT_BALANCES]
    if first == "precision" and len(line) >= 2 and line[-1] == "=" and line[-2] == "matmul":
        return [Item(m, "value", "float8 recipe (torchao)") for m in MATMULS] + [Item(d, "value", "dtype") for d in DTYPES]
    if first == "recompute" and line[-1] == "=":
        return [Item(r, "value", "recompute") for r in RECOMPUTE]
    if first == "recompute" and len(line) == 3 and line[2] in ("blocks", "ops") and prefix.endswith((" ", "\t")):
        return [Item("every", "keyword", "recompute every N-th block", "every ")]
    return []


def _path_done(prefix: str) -> bool:
    """Whether the `shard` statement on this line already has a whole path followed by a space."""
    line = prefix[prefix.rfind("\n") + 1 :]
    return bool(re.search(r"shard\s+\S+\s+", line))
