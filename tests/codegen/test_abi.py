"""A generated module checks the runtime ABI it was written for when it is imported."""

from __future__ import annotations

from pathlib import Path

import pytest

import meshllm_dsl
import meshllm_dsl.runtime as rt

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_llama.mesh"


def test_the_module_prints_the_runtime_abi() -> None:
    source = meshllm_dsl.compile(str(EXAMPLE))["train.py"]
    assert f"\nrt.require_abi({rt.ABI})\n" in source


def test_a_module_for_another_runtime_abi_fails_at_import_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    source = meshllm_dsl.compile(str(EXAMPLE))["train.py"]
    monkeypatch.setattr(rt, "ABI", rt.ABI + 1)
    with pytest.raises(ImportError, match=rf"runtime ABI {rt.ABI - 1}, but the installed meshllm runtime has "
                                          rf"ABI {rt.ABI}: regenerate it with `meshc compile`"):
        exec(compile(source, "train.py", "exec"), {"__name__": "train"})  # noqa: S102 - our own generated code
