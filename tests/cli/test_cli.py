"""`meshc` as users and tools call it: exit codes, JSON output, help, explain-error, fmt --check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ERRORS, EXAMPLES, ROOT, meshc

from meshllm_dsl.codes import CODES


def run(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False, **kw)  # type: ignore[call-overload]


def test_exit_codes_in_process() -> None:
    assert meshc("check", "examples/tiny_llama.mesh")[0] == 0
    assert meshc("check", "examples/errors/E0301_heads_not_divisible.mesh")[0] == 1
    assert meshc("check", "examples/errors/W0704_unused_axis.mesh")[0] == 0
    assert meshc("check", "--deny-warnings", "examples/errors/W0704_unused_axis.mesh")[0] == 1
    code, _, err = meshc("check", "no/such/file.mesh")
    assert code == 2 and "no such file" in err
    code, _, err = meshc("check")  # missing FILE: argparse usage error
    assert code == 2 and "usage" in err
    assert meshc("frobnicate")[0] == 2


def test_several_files_report_everything() -> None:
    code, _, err = meshc("check", "examples/tiny_llama.mesh", "examples/errors/E0305_batch_not_divisible.mesh",
                           "examples/errors/E0304_float_dim.mesh")
    assert code == 1
    assert "E0305" in err and "E0304" in err and "2 errors found" in err


def test_exit_codes_and_entry_point_in_subprocess() -> None:
    ok = run("-m", "meshllm_dsl", "check", "examples/llama2_70b.mesh")
    assert ok.returncode == 0 and ok.stdout == "ok: 1 file checked\n" and ok.stderr == ""
    bad = run("-m", "meshllm_dsl", "check", "examples/errors/E0404_row_parallel_lm_head.mesh")
    assert bad.returncode == 1 and "error[E0404]" in bad.stderr and "Traceback" not in bad.stderr
    usage = run("-m", "meshllm_dsl", "check", "--format", "yaml", "x.mesh")
    assert usage.returncode == 2


def test_module_help() -> None:
    r = run("-m", "meshllm_dsl", "--help")
    assert r.returncode == 0
    for command in ("check", "fmt", "explain-error", "compile", "run"):  # later stages too
        assert command in r.stdout


def test_json_format_has_code_span_and_help() -> None:
    code, out, _ = meshc("check", "--format", "json", "examples/errors/E0301_heads_not_divisible.mesh")
    assert code == 1
    (d,) = [x for x in json.loads(out) if x["severity"] == "error"]  # and W0708: 16 h100 are 2 hosts
    assert d["code"] == "E0301"
    assert d["span"] == {"file": "examples/errors/E0301_heads_not_divisible.mesh", "line": 19, "column": 33,
                         "end_line": 19, "end_column": 47}
    assert d["help"] == "tensor must divide 64 heads and 8 kv_heads: use 1, 2, 4 or 8"
    assert d["secondary"][0]["line"] == 5
    code, out, _ = meshc("check", "--format", "json", "examples/tiny_llama.mesh")
    assert code == 0 and json.loads(out) == []


@pytest.mark.parametrize("path", sorted(ERRORS.glob("*.mesh")), ids=lambda p: p.stem)
def test_json_for_every_error_file(path) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = meshc("check", "--format", "json", str(path.relative_to(ROOT)))
    diags = json.loads(out)
    assert diags and all(d["code"] in CODES and d["span"] and d["help"] for d in diags)
    assert code == (1 if any(d["severity"] == "error" for d in diags) else 0)


def test_explain_error() -> None:
    code, out, _ = meshc("explain-error", "E0301")
    assert code == 0 and out.startswith("E0301: not divisible\n")
    code, out, _ = meshc("explain-error", "w0701")  # case-insensitive
    assert code == 0 and out.startswith("W0701: stage imbalance")
    code, _, err = meshc("explain-error", "E9999")
    assert code == 2 and "unknown code" in err


def test_fmt_check(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for path in sorted(EXAMPLES.glob("*.mesh")):
        code, out, err = meshc("fmt", "--check", str(path.relative_to(ROOT)))
        assert code == 0, f"{path.name} is not in canonical format: {out}{err}"
    messy = tmp_path / "messy.mesh"
    messy.write_text("mesh   m{\naxes a=2,b = 4   # axes\n}\n")
    code, out, _ = meshc("fmt", "--check", str(messy))
    assert code == 1 and "would reformat" in out
    code, out, _ = meshc("fmt", str(messy))
    assert code == 0 and out == "mesh m {\n    axes a = 2, b = 4  # axes\n}\n"
    assert meshc("fmt", "--write", str(messy))[0] == 0
    assert meshc("fmt", "--check", str(messy))[0] == 0
    broken = tmp_path / "broken.mesh"
    broken.write_text("mesh m {")
    code, _, err = meshc("fmt", str(broken))
    assert code == 1 and "E0101" in err


def test_check_does_not_import_torch() -> None:
    # `meshc check` must run on a laptop without torch: it must never import it, even when torch
    # is installed (it would also add ~2 s of start-up).
    code = (
        "import sys; from meshllm_dsl.cli.main import main; rc = main(['check', 'examples/llama2_70b.mesh']); "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy', 'jinja2'))); "
        "print('BAD', bad); sys.exit(rc)"
    )
    r = run("-c", code)
    assert r.returncode == 0, r.stderr
    assert "BAD []" in r.stdout
    r = run("-X", "importtime", "-m", "meshllm_dsl", "check", "examples/tiny_gpt2.mesh")
    assert r.returncode == 0
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "meshllm_dsl.checker" in imported  # the probe works: it sees the checker being imported
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}


def test_internal_error_exits_2_without_raw_traceback(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import meshllm_dsl.checker as check

    def boom(path):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    monkeypatch.setattr(check, "check_file", boom)
    code, _, err = meshc("check", "examples/tiny_llama.mesh")
    assert code == 2 and "internal error" in err
