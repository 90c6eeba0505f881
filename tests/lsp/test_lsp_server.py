"""`meshc lsp` driven as an editor drives it: a subprocess speaking JSON-RPC over stdio."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pygls")

from lsp_client import Client, uri  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.mesh"))
# An editor's buffer is text it already decoded: E0104 (a file that is not UTF-8) is about bytes on
# disk, which `meshc check` reports and an editor shows as its own decoding problem.
ERRORS = sorted(p for p in (ROOT / "examples" / "errors").glob("*.mesh") if not p.name.startswith("E0104"))
LLAMA = ROOT / "examples" / "llama2_70b.mesh"


@pytest.fixture(scope="module")
def client():
    c = Client(cwd=ROOT)
    yield c
    c.close()


def _expected() -> dict[str, list[tuple[str, tuple[int, int, int, int]]]]:
    """What `meshc check --format json` reports, per file, as (code, 0-based range)."""
    files = [str(p.relative_to(ROOT)) for p in [*EXAMPLES, *ERRORS]]
    out = subprocess.run([sys.executable, "-m", "meshllm_dsl", "check", "--format", "json", *files],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr
    by_file: dict[str, list[tuple[str, tuple[int, int, int, int]]]] = {str(p): [] for p in [*EXAMPLES, *ERRORS]}
    for d in json.loads(out.stdout):
        s = d["span"]
        if s["file"].startswith("<stdlib>"):  # shown on the file whose model uses the family
            owner = next(x["file"] for x in d["secondary"] if not x["file"].startswith("<"))
            by_file.setdefault("moved:" + str((ROOT / owner).resolve()), []).append((d["code"], (0, 0, 0, 0)))
            continue
        path = str((ROOT / s["file"]).resolve())
        by_file.setdefault(path, []).append(
            (d["code"], (s["line"] - 1, s["column"] - 1, s["end_line"] - 1, s["end_column"] - 1)))
    return by_file


def _got(diags: list[dict]) -> list[tuple[str, tuple[int, int, int, int]]]:
    return sorted((d["code"], (d["range"]["start"]["line"], d["range"]["start"]["character"],
                               d["range"]["end"]["line"], d["range"]["end"]["character"])) for d in diags)


def test_every_example_and_error_file_gets_exactly_meshc_checks_diagnostics(client: Client) -> None:
    expected = _expected()
    for path in [*EXAMPLES, *ERRORS]:
        u = client.open(path)
        diags = client.wait_diagnostics(u)
        # an error inside the prelude's families is shown on this file, where the model uses the family
        moved = [d for d in diags if (d.get("data") or {}).get("moved")]
        assert all(d["relatedInformation"][0]["location"]["uri"].endswith("stdlib/families.mesh") for d in moved)
        got = _got([d for d in diags if d not in moved])
        assert got == sorted(expected[str(path)]), path.name
        assert sorted(d["code"] for d in moved) == sorted(c for c, _ in expected.get(f"moved:{path}", [])), path.name
        got += _got(moved)
        if path.parent.name == "errors":
            code = path.name.split("_")[0]
            assert code in {c for c, _ in got}, path.name


def _errors(diags: list[dict]) -> list[dict]:
    """The errors among `diags` (a mesh of more devices than a host holds also gets a warning)."""
    return [d for d in diags if d["severity"] == 1]


def test_diagnostic_carries_code_help_and_related_information(client: Client) -> None:
    path = ROOT / "examples" / "errors" / "E0301_heads_not_divisible.mesh"
    u = client.open(path)
    [d] = _errors(client.wait_diagnostics(u))
    assert d["code"] == "E0301" and d["severity"] == 1 and d["source"] == "meshc"
    assert "help: tensor must divide 64 heads and 8 kv_heads: use 1, 2, 4 or 8" in d["message"]
    [rel] = d["relatedInformation"]
    assert rel["location"]["uri"] == uri(path)
    assert rel["location"]["range"]["start"] == {"line": 4, "character": 9}
    assert "declared here" in rel["message"]


def _pos(text: str, needle: str, delta: int = 0) -> dict[str, int]:
    off = text.index(needle) + delta
    line = text.count("\n", 0, off)
    return {"line": line, "character": off - (text.rfind("\n", 0, off) + 1)}


def test_hover_axis_shard_rule_model_and_plan(client: Client) -> None:
    text = LLAMA.read_text()
    u = client.open(LLAMA)
    client.wait_diagnostics(u)
    doc = {"uri": u}

    def hover(needle: str, delta: int = 0) -> str:
        got = client.request("textDocument/hover", {"textDocument": doc, "position": _pos(text, needle, delta)})
        assert got is not None, needle
        return got["contents"]["value"]

    axis = hover("tensor = 4")
    assert "size 4" in axis and "rank stride 1" in axis and "[0, 1, 2, 3] [4, 5, 6, 7]" in axis
    shard = hover("blocks.*.attn.{q,k,v}", 15)
    assert "`blocks.{0-79}.attn.q` column(tensor)" in shard
    assert "[8,192, 8,192] -> [2,048, 8,192]" in shard  # global and per-rank local shape
    assert "[1,024, 8,192] -> [256, 8,192]" in shard  # GQA k: 8 kv heads x 128
    assert "reduce_from(tensor)" in shard
    model = hover("model llama2_70b", 8)
    assert "68,976,648,192 parameters" in model and "137.95 GB = 128.48 GiB" in model
    plan = hover("plan train", 6)
    assert "memory per device" in plan and "does NOT fit" in plan


def test_definition_and_references(client: Client) -> None:
    text = LLAMA.read_text()
    u = client.open(LLAMA)
    client.wait_diagnostics(u)
    doc = {"uri": u}
    # an axis inside column(...) goes to its declaration in the mesh
    [loc] = client.request("textDocument/definition", {"textDocument": doc, "position": _pos(text, "column(tensor)", 8)})
    assert loc["uri"] == u and loc["range"]["start"] == _pos(text, "tensor = 4")
    # the family of a model goes into the shipped prelude
    [loc] = client.request("textDocument/definition", {"textDocument": doc, "position": _pos(text, "= llama", 3)})
    assert loc["uri"].endswith("stdlib/families.mesh")
    # every use of the axis, declaration included
    refs = client.request("textDocument/references", {"textDocument": doc, "position": _pos(text, "tensor = 4"),
                                                       "context": {"includeDeclaration": True}})
    assert len(refs) == text.count("(tensor)") + 1
    # a layer in a shard path goes to the family's repeat
    [loc] = client.request("textDocument/definition", {"textDocument": doc, "position": _pos(text, "shard blocks", 7)})
    assert loc["uri"].endswith("stdlib/families.mesh")


def _labels(result: dict) -> list[str]:
    return [i["label"] for i in result["items"]]


def test_completion_in_context(client: Client, tmp_path: Path) -> None:
    text = LLAMA.read_text()
    u = client.open(LLAMA)
    client.wait_diagnostics(u)
    doc = {"uri": u}

    def complete(needle: str, delta: int) -> list[str]:
        return _labels(client.request("textDocument/completion", {"textDocument": doc, "position": _pos(text, needle, delta)}))

    assert complete("column(tensor)", 7) == ["pipeline", "tensor"]  # axes inside column(
    assert "1f1b" in complete("schedule 1f1b", 9)
    assert {"shard", "layout", "stages", "batch"} <= set(complete("    shard embed", 4))
    # mid-edit: a shard rule being typed, the file no longer parses; paths come from the model
    edited = text.replace("    schedule 1f1b", "    shard blocks.*.ml")
    client.notify("textDocument/didChange", {"textDocument": {"uri": u, "version": 2},
                                             "contentChanges": [{"text": edited}]})
    got = client.request("textDocument/completion", {"textDocument": doc, "position": _pos(edited, "blocks.*.ml", 11)})
    labels = _labels(got)
    assert "blocks.*.mlp.down" in labels and "lm_head" in labels
    item = next(i for i in got["items"] if i["label"] == "blocks.*.mlp.down")
    assert item["textEdit"]["range"]["start"] == _pos(edited, "blocks.*.ml")
    # families after `model X =`, device names after `device =`
    src = "mesh m {\n    axes tensor = 2\n    device = \n}\nmodel x = \n"
    p = tmp_path / "c.mesh"
    u2 = client.open(p, src)
    client.wait_diagnostics(u2)
    fams = _labels(client.request("textDocument/completion", {"textDocument": {"uri": u2}, "position": {"line": 4, "character": 10}}))
    assert {"llama", "gpt2"} <= set(fams)
    devs = _labels(client.request("textDocument/completion", {"textDocument": {"uri": u2}, "position": {"line": 2, "character": 13}}))
    assert "h100" in devs


def _apply(text: str, edit: dict) -> str:
    lines = text.split("\n")

    def off(p: dict) -> int:
        return sum(len(x) + 1 for x in lines[: p["line"]]) + p["character"]

    r = edit["range"]
    return text[: off(r["start"])] + edit["newText"] + text[off(r["end"]):]


def test_code_actions_apply_the_help(client: Client, tmp_path: Path) -> None:
    src = (ROOT / "examples" / "errors" / "E0301_heads_not_divisible.mesh").read_text()
    p = tmp_path / "fix.mesh"
    u = client.open(p, src)
    [d] = _errors(client.wait_diagnostics(u))
    actions = client.request("textDocument/codeAction", {"textDocument": {"uri": u}, "range": d["range"],
                                                          "context": {"diagnostics": [d]}})
    titles = [a["title"] for a in actions]
    assert "Set `tensor = 8`" in titles
    act = next(a for a in actions if a["title"] == "Set `tensor = 8`")
    [edit] = act["edit"]["changes"][u]
    fixed = _apply(src, edit)
    assert "axes tensor = 8" in fixed
    n = client.diag_count[u]
    client.notify("textDocument/didChange", {"textDocument": {"uri": u, "version": 2}, "contentChanges": [{"text": fixed}]})
    assert client.wait_diagnostics(u, after=n) == []
    # a typo: "did you mean" becomes a replacement
    src2 = (ROOT / "examples" / "errors" / "E0202_unknown_axis.mesh").read_text()
    u2 = client.open(tmp_path / "typo.mesh", src2)
    [d2] = client.wait_diagnostics(u2)
    actions = client.request("textDocument/codeAction", {"textDocument": {"uri": u2}, "range": d2["range"],
                                                          "context": {"diagnostics": [d2]}})
    [edit] = actions[0]["edit"]["changes"][u2]
    assert edit["newText"] == "tensor" and "column(tensor)" in _apply(src2, edit)
    # the missing brace
    src3 = (ROOT / "examples" / "errors" / "E0101_missing_closing_brace.mesh").read_text()
    u3 = client.open(tmp_path / "brace.mesh", src3)
    [d3] = client.wait_diagnostics(u3)
    actions = client.request("textDocument/codeAction", {"textDocument": {"uri": u3}, "range": d3["range"],
                                                          "context": {"diagnostics": [d3]}})
    fixed3 = _apply(src3, actions[0]["edit"]["changes"][u3][0])
    u4 = client.open(tmp_path / "brace2.mesh", fixed3)
    assert all(x["code"] != "E0101" for x in client.wait_diagnostics(u4))


def test_a_machine_applicable_suggestion_is_the_preferred_action(client: Client, tmp_path: Path) -> None:
    """Code actions are the diagnostics' suggestions: their titles, their edits, and `isPreferred`
    where the checker marks the fix machine-applicable (ZeRO over the batch axes is the only fix)."""
    src = (ROOT / "examples" / "errors" / "E0407_zero_over_tensor_axis.mesh").read_text()
    u = client.open(tmp_path / "zero.mesh", src)
    [d] = [x for x in client.wait_diagnostics(u) if x["code"] == "E0407"]
    actions = client.request("textDocument/codeAction", {"textDocument": {"uri": u}, "range": d["range"],
                                                          "context": {"diagnostics": [d]}})
    [act] = actions
    assert act["title"] == "Write `zero 1 over data`" and act["isPreferred"] is True
    fixed = _apply(src, act["edit"]["changes"][u][0])
    n = client.diag_count[u]
    client.notify("textDocument/didChange", {"textDocument": {"uri": u, "version": 2}, "contentChanges": [{"text": fixed}]})
    assert all(x["code"] != "E0407" for x in client.wait_diagnostics(u, after=n))
    # a guess (a did-you-mean) is offered but not preferred
    u2 = client.open(tmp_path / "typo.mesh", (ROOT / "examples" / "errors" / "E0202_unknown_axis.mesh").read_text())
    [d2] = client.wait_diagnostics(u2)
    [act2] = client.request("textDocument/codeAction", {"textDocument": {"uri": u2}, "range": d2["range"],
                                                         "context": {"diagnostics": [d2]}})
    assert "isPreferred" not in act2 or act2["isPreferred"] is not True


def test_symbols_and_formatting(client: Client, tmp_path: Path) -> None:
    u = client.open(LLAMA)
    client.wait_diagnostics(u)
    syms = client.request("textDocument/documentSymbol", {"textDocument": {"uri": u}})
    assert [(s["name"], s["detail"]) for s in syms] == [("node8", "mesh"), ("llama2_70b", "model"), ("train", "plan")]
    assert [c["name"] for c in syms[0]["children"]] == ["pipeline", "tensor"]
    messy = "mesh  m{axes tensor=2}\n"
    u2 = client.open(tmp_path / "messy.mesh", messy)
    client.wait_diagnostics(u2)
    [edit] = client.request("textDocument/formatting", {"textDocument": {"uri": u2}, "options": {"tabSize": 4, "insertSpaces": True}})
    from meshllm_dsl.front.fmt import format_text

    assert edit["newText"] == format_text(messy)


def test_includes_get_their_diagnostics(client: Client, tmp_path: Path) -> None:
    (tmp_path / "meshes.mesh").write_text("mesh m {\n    axes tensor = 2, tensor = 4\n}\n")
    root = tmp_path / "root.mesh"
    root.write_text('include "meshes.mesh"\ninclude "missing.mesh"\n')
    u = client.open(root)
    got = client.wait_diagnostics(u)
    assert [d["code"] for d in got] == ["E0103"]
    inc = uri(tmp_path / "meshes.mesh")
    assert [d["code"] for d in client.wait_diagnostics(inc)] == ["E0201"]
    # fixing the included file on disk and saving it refreshes the including document too
    (tmp_path / "meshes.mesh").write_text("mesh m {\n    axes tensor = 2\n}\n")
    n_root, n_inc = client.diag_count[u], client.diag_count[inc]
    client.notify("workspace/didChangeWatchedFiles", {"changes": [{"uri": inc, "type": 2}]})
    client.wait_diagnostics(u, after=n_root)
    assert client.wait_diagnostics(inc, after=n_inc) == []
    # go to the included file
    [loc] = client.request("textDocument/definition", {"textDocument": {"uri": u}, "position": {"line": 0, "character": 12}})
    assert loc["uri"] == inc


def test_two_hundred_incremental_edits_end_with_the_right_diagnostics(client: Client, tmp_path: Path) -> None:
    src = LLAMA.read_text()
    p = tmp_path / "edits.mesh"
    u = client.open(p, src)
    assert client.wait_diagnostics(u) == []
    text = src
    # type a setting character by character at the start of the plan body, delete it again from the
    # end (mid-edit states that do not parse), type and delete spaces, then change the tensor size to
    # 16: 200 edits, each a ranged (incremental) change
    anchor = _pos(src, "    batch = 16")
    typed = "    microbatches_x = 3\n"
    version = 1
    edits: list[dict] = []
    for i, ch in enumerate(typed):
        pos = {"line": anchor["line"], "character": i}
        edits.append({"range": {"start": pos, "end": pos}, "text": ch})
    line = anchor["line"]
    for i in range(len(typed) - 2, 3, -1):
        edits.append({"range": {"start": {"line": line, "character": i}, "end": {"line": line, "character": i + 1}}, "text": ""})
    while len(edits) < 199:  # type and delete a space after the plan name
        pos = _pos(src, "plan train", 10)
        edits.append({"range": {"start": pos, "end": pos}, "text": " "})
        edits.append({"range": {"start": pos, "end": {"line": pos["line"], "character": pos["character"] + 1}}, "text": ""})
    edits = edits[:199]
    tensor = _pos(src, "tensor = 4", 9)
    edits.append({"range": {"start": tensor, "end": {"line": tensor["line"], "character": tensor["character"] + 1}}, "text": "16"})
    assert len(edits) == 200
    published_before = client.diag_count.get(u, 0)
    for e in edits:
        version += 1
        client.notify("textDocument/didChange", {"textDocument": {"uri": u, "version": version}, "contentChanges": [e]})
        text = _apply(text, {"range": e["range"], "newText": e["text"]})
    (tmp_path / "final.mesh").write_text(text)
    out = subprocess.run([sys.executable, "-m", "meshllm_dsl", "check", "--format", "json", str(tmp_path / "final.mesh")],
                         capture_output=True, text=True)
    want = sorted((d["code"], d["span"]["line"] - 1, d["span"]["column"] - 1) for d in json.loads(out.stdout))
    assert [c for c, _, _ in want if c.startswith("E")] == ["E0301"]  # 16 does not divide 8 kv heads
    # The debounced analysis publishes once the edits stop; an earlier publication (if the edits took
    # longer than the debounce) may come first, so wait for the one that matches, with a deadline.
    deadline = time.monotonic() + 30
    got = None
    while time.monotonic() < deadline:
        n = client.diag_count.get(u, 0)
        final = client.diagnostics.get(u, [])
        got = sorted((d["code"], d["range"]["start"]["line"], d["range"]["start"]["character"]) for d in final)
        if got == want:
            break
        client.wait_diagnostics(u, after=n, timeout=max(0.1, deadline - time.monotonic()))
    assert got == want
    # debounced: a burst of edits is analysed a few times, not 200 times
    assert client.diag_count[u] - published_before < 50
    # the server's text is the client's text: formatting returns an edit over exactly that text
    from meshllm_dsl.front.fmt import format_text

    edits_back = client.request("textDocument/formatting", {"textDocument": {"uri": u}, "options": {"tabSize": 4, "insertSpaces": True}})
    assert (edits_back[0]["newText"] if edits_back else text) == format_text(text)
    # the server is alive and still answers
    assert client.request("textDocument/documentSymbol", {"textDocument": {"uri": u}})


@pytest.mark.parametrize("kind", ["huge", "oversize", "binary", "nested", "long_line"])
def test_hostile_documents_get_a_diagnostic_not_a_dead_server(client: Client, tmp_path: Path, kind: str) -> None:
    if kind == "huge":
        # 8,000 declarations (a 250 KB spec), one of them wrong at the very end
        text = LLAMA.read_text() + "".join(f"mesh m{i} {{ axes a = {i + 1} }}\n" for i in range(8000)) + "mesh z { axes a = 0 }\n"
    elif kind == "oversize":
        text = "# " + "x" * (9 * 2**20) + "\n"
    elif kind == "binary":
        text = bytes(range(256)).decode("latin-1") * 64
    elif kind == "nested":
        text = "model m { x = " + "(" * 50000 + "1" + ")" * 50000 + " }\n"
    else:
        text = "mesh m { axes a = " + "1" * 200000 + " }\n"
    u = client.open(tmp_path / f"{kind}.mesh", text)
    diags = client.wait_diagnostics(u, timeout=120)
    assert diags, kind
    if kind == "huge":
        assert [d["code"] for d in _errors(diags)] == ["E0303"]
    # still alive
    assert client.request("textDocument/hover", {"textDocument": {"uri": u}, "position": {"line": 0, "character": 1}}) is None or True
    u2 = client.open(tmp_path / f"{kind}-after.mesh", "mesh m { axes a = 0 }\n")
    assert [d["code"] for d in client.wait_diagnostics(u2)] == ["E0303"]


def test_mid_edit_one_syntax_diagnostic_and_the_rest_still_understood(client: Client, tmp_path: Path) -> None:
    text = LLAMA.read_text().replace("    schedule 1f1b", "    schedule 1f1b\n    shard blocks.*.attn.o row(")
    u = client.open(tmp_path / "mid.mesh", text)
    [d] = client.wait_diagnostics(u)
    assert d["code"] == "E0101"
    # the mesh and the model still answer hover and the outline, although the plan does not parse
    got = client.request("textDocument/hover", {"textDocument": {"uri": u}, "position": _pos(text, "tensor = 4")})
    assert "size 4" in got["contents"]["value"]
    syms = client.request("textDocument/documentSymbol", {"textDocument": {"uri": u}})
    assert [s["name"] for s in syms] == ["node8", "llama2_70b"]


def test_columns_are_utf16_code_units(client: Client, tmp_path: Path) -> None:
    # the emoji is one code point (what `meshc check` counts) and two UTF-16 units (what LSP counts)
    text = 'include "\U0001F600.mesh" include "x.mesh"\n'
    u = client.open(tmp_path / "emoji.mesh", text)
    diags = sorted(client.wait_diagnostics(u), key=lambda d: d["range"]["start"]["character"])
    assert [d["range"]["start"]["character"] for d in diags] == [8, text.index('"x.mesh"') + 1]


def test_the_server_imports_nothing_heavy() -> None:
    code = ("import sys, meshllm_dsl.lsp.server, meshllm_dsl.lsp.hover, meshllm_dsl.lsp.completion, "
            "meshllm_dsl.lsp.actions, meshllm_dsl.planner.analyze, meshllm_dsl.views.explain, meshllm_dsl.parallel.devices; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'jinja2')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


BASE = """mesh node4 {
    axes data = 2, tensor = 2
}
model tiny = llama {
    vocab = 256
    hidden = 64
    layers = 4
    heads = 4
    ffn = 128
}
"""


@pytest.mark.parametrize(("snippet", "want", "unwanted"), [
    ("plan p on node4 for tiny {\n    layout { batch -> | }\n}\n", {"data", "tensor"}, {"shard"}),
    ("plan p on node4 for tiny {\n    layout { | }\n}\n", {"batch", "hidden", "vocab"}, {"data"}),
    ("plan p on node4 for tiny {\n    stages over |\n}\n", {"data", "tensor"}, set()),
    ("plan p on node4 for tiny {\n    optimizer adamw { zero 1 over | }\n}\n", {"data", "tensor"}, set()),
    ("plan p on node4 for tiny {\n    precision { | }\n}\n", {"params", "master", "reduce"}, {"data"}),
    ("plan p on node4 for tiny {\n    precision { params = bf16, master = | }\n}\n", {"bf16", "fp32"}, {"params"}),
    ("plan p on node4 for tiny {\n    shard embed vocab_parallel(|\n}\n", {"data", "tensor"}, {"column"}),
    ("plan p on node4 for tiny {\n    shard embed |\n}\n", {"column", "row", "vocab_parallel", "replicate"}, {"data"}),
    ("plan p on node4 for tiny {\n    shard |\n}\n", {"embed", "blocks.*.attn.q", "lm_head"}, {"column"}),
    ("plan p on node4 for tiny {\n    schedule |\n}\n", {"gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"}, set()),
    ("plan p on node4 for tiny {\n    stages over data virtual 2 |\n}\n", {"balanced", "placement"}, {"data"}),
    ("plan p on node4 for tiny {\n    stages over data virtual 2 placement |\n}\n", {"v", "loop"}, {"balanced"}),
    ("plan p on node4 for tiny {\n    recompute = |\n}\n", {"blocks", "attention", "ops"}, {"every"}),
    ("plan p on node4 for tiny {\n    recompute = ops |\n}\n", {"every"}, {"blocks"}),
    ("plan p on node4 for tiny {\n    |\n}\n", {"shard", "layout", "stages", "schedule", "optimizer", "precision", "batch"},
     {"mesh"}),
    ("plan p on |", {"node4"}, {"tiny"}),
    ("plan p on node4 for |", {"tiny"}, {"node4"}),
    ("model t2 = llama {\n    vocab = 8\n    |\n}\n", {"hidden", "layers", "kv_heads", "dtype"}, {"vocab"}),
    ("|", {"mesh", "model", "plan", "family", "include", "device"}, set()),
])
def test_completion_contexts(client: Client, tmp_path: Path, snippet: str, want: set, unwanted: set) -> None:
    text = BASE + snippet
    cursor = text.index("|")
    text = text.replace("|", "")
    u = client.open(tmp_path / "ctx.mesh", text)
    client.wait_diagnostics(u)
    pos = {"line": text.count("\n", 0, cursor), "character": cursor - (text.rfind("\n", 0, cursor) + 1)}
    labels = set(_labels(client.request("textDocument/completion", {"textDocument": {"uri": u}, "position": pos})))
    assert want <= labels, labels
    assert not (unwanted & labels), labels


def test_vscode_jsonrpc_talks_to_the_server() -> None:
    """The JSON-RPC library inside vscode-languageclient, driving `meshc lsp` (skipped unless node and
    editors/vscode/node_modules are installed: CI runs the Python client above only)."""
    import shutil

    from lsp_client import server_command

    vscode = ROOT / "editors" / "vscode"
    node = shutil.which("node")
    if node is None or not (vscode / "node_modules" / "vscode-jsonrpc").is_dir():
        pytest.skip("node or editors/vscode/node_modules not installed")
    path = ROOT / "examples" / "errors" / "E0301_heads_not_divisible.mesh"
    out = subprocess.run([node, str(vscode / "scripts" / "smoke.js"), str(path), "4", "10", *server_command()],
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert [d["code"] for d in got["diagnostics"]] == ["E0301"]
    assert "size 16" in got["hover"]["contents"]["value"]


def test_hover_on_a_rule_of_a_plan_with_errors_still_lists_its_matches(client: Client) -> None:
    path = ROOT / "examples" / "errors" / "E0301_heads_not_divisible.mesh"
    text = path.read_text()
    u = client.open(path)
    client.wait_diagnostics(u)
    got = client.request("textDocument/hover", {"textDocument": {"uri": u}, "position": _pos(text, "blocks.*.attn.o", 3)})
    value = got["contents"]["value"]
    assert "has errors: global shapes only" in value and "[8,192, 8,192]" in value and "split 16 ways" in value


def test_requests_are_answered_while_a_large_document_is_analysed(client: Client, tmp_path: Path) -> None:
    """Analyses run on their own thread: a hover on one file does not wait for another file's check."""
    text = LLAMA.read_text()
    u = client.open(LLAMA)
    client.wait_diagnostics(u)
    big = text + "".join(f"mesh m{i} {{ axes a = {i % 8 + 1} }}\n" for i in range(4000))
    ub = client.open(tmp_path / "big.mesh", big)
    got = client.request("textDocument/hover", {"textDocument": {"uri": u}, "position": _pos(text, "tensor = 4")})
    answered_first = ub not in client.diagnostics
    assert "size 4" in got["contents"]["value"]
    assert client.wait_diagnostics(ub, timeout=120) == []
    assert answered_first
