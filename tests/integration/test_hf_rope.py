"""Rope scalings (linear, dynamic NTK, yarn) in and out of Hugging Face, against transformers itself.

One tiny Llama per rope type (tests/hf_models.py ROPE_KINDS, weights redrawn away from HF's init),
loaded on the shared worker pool into single, tensor-2 and pipeline x tensor plans: logits within
1e-4 of transformers' and greedy tokens equal.  Dynamic's model has 6 positions and the tests run 8
tokens and generate 6 more, so its frequencies grow with the sequence in the forward and at every
decoding step.  transformers' dynamic rope keeps state between calls (a model that has seen a longer
sequence keeps those frequencies), so every reference comes from a freshly loaded model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hf_models import ROPE_KINDS, build_hf, logits_job, own_config_export_job, spec  # noqa: E402
from hf_models import compiled_module as _module  # noqa: E402

from meshllm_dsl.runtime.pool import WorkerPool  # noqa: E402

N_NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_rope")
    for kind in ROPE_KINDS:
        build_hf(kind, root / kind)
    return {kind: root / kind for kind in ROPE_KINDS}


def _fresh(directory: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def _tokens() -> Any:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


def _want(directory: Path, tokens: Any) -> tuple[Any, Any]:
    with torch.no_grad():
        logits = _fresh(directory)(tokens).logits
        model = _fresh(directory)
        # meshllm's greedy decoding knows no end token; transformers' min_new_tokens would ban it
        model.generation_config.eos_token_id = None
        generated = model.generate(tokens[:1], max_new_tokens=N_NEW, do_sample=False)
    return logits, generated


@pytest.mark.parametrize("plan", ["single", "tensor2", "pipeline2_tensor2"])
@pytest.mark.parametrize("kind", ROPE_KINDS)
def test_rope_scaling_gives_transformers_logits_and_tokens(
    kind: str, plan: str, models: dict[str, Path], pool: WorkerPool, tmp_path: Path
) -> None:
    tokens = _tokens()
    want, want_tokens = _want(models[kind], tokens)
    path, n = _module(spec(kind, plan), f"{kind}_{plan}", tmp_path)
    logits, generated = pool.run(logits_job, n, path, str(models[kind]), tokens, N_NEW)[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert generated.tolist() == want_tokens.tolist()


def test_dynamic_rope_differs_from_plain_rope_past_the_trained_positions(models: dict[str, Path]) -> None:
    """The dynamic model's case above is not passing by accident: its 8 tokens are past its 6
    positions, where transformers' frequencies differ from unscaled rope's."""
    from meshllm_dsl.runtime import rope

    plain, _ = rope.inv_freq(8, 10000.0, None, 8)
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 6}
    assert torch.equal(rope.inv_freq(8, 10000.0, scaling, 6)[0], plain)
    assert not torch.allclose(rope.inv_freq(8, 10000.0, scaling, 8)[0], plain)


@pytest.mark.parametrize("kind", ROPE_KINDS)
def test_import_hf_writes_the_rope_scaling_and_exports_it_back(
    kind: str, models: dict[str, Path], pool: WorkerPool, tmp_path: Path
) -> None:
    from meshllm_dsl.cli import main

    out = tmp_path / f"{kind}.mesh"
    assert main(["import-hf", str(models[kind]), "-o", str(out), "--devices", "2", "--batch", "4", "--seq", "8"]) == 0
    text = out.read_text()
    assert f"rope_type = {kind.removeprefix('llama_')}" in text
    path, n = _module(text, kind, tmp_path)
    tokens = _tokens()
    want, _ = _want(models[kind], tokens)
    logits, _ = pool.run(logits_job, n, path, str(models[kind]), tokens, 0)[0]
    assert (logits - want).abs().max().item() <= 1e-4
    # Exported without the source config: the rope scaling in config.json is meshllm's own.
    exported = tmp_path / "exported"
    pool.run(own_config_export_job, n, path, str(models[kind]), str(exported))
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == kind.removeprefix("llama_")
    with torch.no_grad():
        assert (_fresh(exported)(tokens).logits - want).abs().max().item() <= 1e-5


def test_a_rope_type_meshllm_lacks_is_refused_naming_it(models: dict[str, Path], tmp_path: Path) -> None:
    import contextlib
    import io

    from meshllm_dsl.cli import main

    d = tmp_path / "model"
    d.mkdir()
    cfg = json.loads((models["llama_yarn"] / "config.json").read_text())
    cfg["rope_parameters"]["mscale"] = 0.7
    (d / "config.json").write_text(json.dumps(cfg))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["import-hf", str(d), "-o", str(tmp_path / "x.mesh")]) == 1
    assert "`rope_parameters.mscale` = 0.7" in err.getvalue()
