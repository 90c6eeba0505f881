"""Sliding-window attention (Mistral), Gemma 2 and Gemma 3 text checkpoints in and out, against
transformers itself (tiny random models, weights redrawn away from HF's init: tests/hf_models.py).

The tests' sequences (8 prompt tokens, 6 generated) are longer than the window of 3, so a wrong mask,
a cache that keeps too much or too little, or a layer windowed that should not be, changes logits
and tokens. Jobs run on the session's worker pool (tests/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hf_models import build_hf, export_job, logits_job, reference_job, spec  # noqa: E402
from hf_models import compiled_module as _module  # noqa: E402

from meshllm_dsl.interop.import_hf import spec_text  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402

KINDS = ("mistral_window", "phi3_window", "gemma2", "gemma3")
N_NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hf_window")
    return {kind: (root / kind, build_hf(kind, root / kind)) for kind in KINDS}


def _tokens(vocab: int) -> Any:
    return torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("plan", ["single", "tensor2", "pipeline2_tensor2"])
@pytest.mark.parametrize("kind", KINDS)
def test_weights_give_transformers_logits_and_tokens(
    kind: str, plan: str, models: dict[str, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    directory, hf = models[kind]
    tokens = _tokens(hf.config.vocab_size)
    with torch.no_grad():
        want = hf(tokens).logits
        # Gemma's pad_token_id is 0, a token of the prompt: without a mask generate would leave it out
        want_tokens = hf.generate(tokens[:1], attention_mask=torch.ones_like(tokens[:1]), max_new_tokens=N_NEW,
                                  do_sample=False, min_new_tokens=N_NEW)
    path, n = _module(spec(kind, plan), f"{kind}_{plan}", tmp_path)
    logits, generated = pool.run(logits_job, n, path, str(directory), tokens, N_NEW)[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert generated.tolist() == want_tokens.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trip_is_exact_and_loads_in_transformers(
    kind: str, models: dict[str, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    directory, hf = models[kind]
    path, n = _module(spec(kind, "pipeline2_tensor2"), kind, tmp_path)
    out = tmp_path / "exported"
    pool.run(export_job, n, path, str(directory), str(out), 10**9)
    exported = safetensors_torch.load_file(str(out / "model.safetensors"))
    original = safetensors_torch.load_file(str(directory / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, t in original.items():
        assert torch.equal(exported[key], t), key
    config = json.loads((out / "config.json").read_text())
    assert config["sliding_window"] == 3
    back = type(hf).from_pretrained(out).eval()
    assert getattr(back.config, "layer_types", None) == getattr(hf.config, "layer_types", None)
    tokens = _tokens(hf.config.vocab_size)
    with torch.no_grad():
        assert (back(tokens).logits - hf(tokens).logits).abs().max().item() == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_import_hf_spec_loads_the_weights(kind: str, models: dict[str, Any], pool: WorkerPool, tmp_path: Path) -> None:
    directory, hf = models[kind]
    text = spec_text(str(directory), devices=4, batch=4, seq=8)
    assert "window = 3" in text
    path, n = _module(text, f"{kind}_imported", tmp_path)
    tokens = _tokens(hf.config.vocab_size)
    logits, _ = pool.run(logits_job, n, path, str(directory), tokens, 0)[0]
    with torch.no_grad():
        assert (logits - hf(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_plan_trains_like_the_unsharded_reference(kind: str, pool: WorkerPool, tmp_path: Path) -> None:
    """What `meshc verify` checks, on the pool: logits, gradients and parameters after AdamW steps
    of pipeline x tensor equal the unsharded reference (float64), windows and soft-caps included."""
    from meshllm_dsl.runtime.jobs.compare import TOLERANCE

    path, n = _module(spec(kind, "pipeline2_tensor2"), kind, tmp_path)
    for rank, errs in enumerate(pool.run(reference_job, n, path)):
        bad = {k: v for k, v in errs.items() if not v <= TOLERANCE["float64"]}
        assert not bad, f"rank {rank}: {bad}"
