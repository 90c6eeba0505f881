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

from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402

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
    from meshllm_dsl.runtime.model import rope

    plain, _ = rope.inv_freq(8, 10000.0, None, 8)
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 6}
    assert torch.equal(rope.inv_freq(8, 10000.0, scaling, 6)[0], plain)
    assert not torch.allclose(rope.inv_freq(8, 10000.0, scaling, 8)[0], plain)


@pytest.mark.parametrize("kind", ROPE_KINDS)
def test_import_hf_writes_the_rope_scaling_and_exports_it_back(
    kind: str, models: dict[str, Path], pool: WorkerPool, tmp_path: Path
) -> None:
    from meshllm_dsl.cli.main import main

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

    from meshllm_dsl.cli.main import main

    d = tmp_path / "model"
    d.mkdir()
    cfg = json.loads((models["llama_yarn"] / "config.json").read_text())
    cfg["rope_parameters"]["mscale"] = 0.7
    (d / "config.json").write_text(json.dumps(cfg))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["import-hf", str(d), "-o", str(tmp_path / "x.mesh")]) == 1
    assert "`rope_parameters.mscale` = 0.7" in err.getvalue()


# ---------------------------------------------------------------- Phi-3's longrope

LONGROPE = "phi3_longrope"


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf_longrope") / LONGROPE
    build_hf(LONGROPE, directory)
    return directory


def _longrope_tokens() -> tuple[Any, Any]:
    """4 x 5 tokens (within the 6 trained positions: short factors) and 4 x 8 (past them: long)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (4, 5), generator=gen), torch.randint(0, 64, (4, 8), generator=gen)


def longrope_job(ctx: Any, path: str, weights: str, short: Any, long: Any, n_new: int) -> Any:
    """On every rank: the plan built once from ``weights``; logits of both lengths, and greedy tokens
    from the short prompt's first row, whose decoding crosses the trained positions."""
    from meshllm_dsl.runtime import greedy_generate
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), weights=weights)
    out = (built.forward(short), built.forward(long), greedy_generate(built, short[:1], n_new))
    return out if ctx.rank == 0 else None


def test_longrope_switches_factors_where_transformers_does(phi3_longrope: Path) -> None:
    """The cases below are not passing by accident: transformers' logits past the 6 trained positions
    use the long factors (a prefix of a long sequence is not the short sequence's logits), and the
    runtime's frequencies switch between 6 and 7 positions."""
    from hf_models import LONGROPE_LONG, LONGROPE_SHORT

    from meshllm_dsl.runtime.model import rope

    _, long = _longrope_tokens()
    with torch.no_grad():
        hf = _fresh(phi3_longrope)
        assert (hf(long).logits[:, :5] - hf(long[:, :5]).logits).abs().max().item() > 1e-2
    scaling = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 6,
               "short_factor": LONGROPE_SHORT, "long_factor": LONGROPE_LONG}
    at6, at7 = rope.inv_freq(16, 10000.0, scaling, 6), rope.inv_freq(16, 10000.0, scaling, 7)
    assert not torch.equal(at6[0], at7[0]) and at6[1] == at7[1] > 1.0  # sqrt(1 + ln 4 / ln 6)


@pytest.fixture(scope="module")
def longrope_want(phi3_longrope: Path) -> tuple[Any, Any, Any]:
    """transformers' logits for both lengths and its greedy tokens, each from a fresh model."""
    short, long = _longrope_tokens()
    with torch.no_grad():
        want_short, want_long = _fresh(phi3_longrope)(short).logits, _fresh(phi3_longrope)(long).logits
        model = _fresh(phi3_longrope)
        model.generation_config.eos_token_id = None
        # 5 prompt tokens and 6 new: the step to position 6 is past the trained positions, where
        # transformers' Phi-3 drops its cache and recomputes the whole sequence with the long factors
        want_tokens = model.generate(short[:1], max_new_tokens=N_NEW, do_sample=False)
    return want_short, want_long, want_tokens


@pytest.mark.parametrize("plan", ["single", "tensor2", "pipeline2_tensor2"])
def test_longrope_gives_transformers_logits_and_tokens(
    plan: str, phi3_longrope: Path, longrope_want: tuple[Any, Any, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    short, long = _longrope_tokens()
    want_short, want_long, want_tokens = longrope_want
    path, n = _module(spec(LONGROPE, plan), f"longrope_{plan}", tmp_path)
    got_short, got_long, generated = pool.run(longrope_job, n, path, str(phi3_longrope), short, long, N_NEW)[0]
    assert (got_short - want_short).abs().max().item() <= 1e-4
    assert (got_long - want_long).abs().max().item() <= 1e-4
    assert generated.tolist() == want_tokens.tolist()


def test_import_hf_writes_longrope_and_exports_it_back(
    phi3_longrope: Path, longrope_want: tuple[Any, Any, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    """import-hf writes the factor lists (and the factor transformers derives); the spec loads the
    checkpoint (its config compared with the spec's longrope), its tiny twin is what `meshc verify`
    finds EQUAL, and exported with meshllm's own config.json it gives the same logits."""
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.cli.main import main
    from meshllm_dsl.codegen.emit import render_plan
    from meshllm_dsl.runtime.jobs.compare import TOLERANCE
    from meshllm_dsl.verify.equivalence import compare_job
    from meshllm_dsl.verify.twin import make_twin

    out = tmp_path / "phi3.mesh"
    assert main(["import-hf", str(phi3_longrope), "-o", str(out), "--devices", "4", "--batch", "4", "--seq", "8"]) == 0
    text = out.read_text()
    assert "rope_type = longrope" in text and "rope_factor = 4.0" in text and "rope_original_positions = 6" in text
    assert "rope_short_factor = [1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]" in text
    assert "rope_long_factor = [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0]" in text
    result = check_file(out)
    (plan,) = result.plans.values()
    assert plan.mesh.devices == 4  # the plan import-hf suggests shards the model over 4 ranks
    path, n = _module(text, "phi3_imported", tmp_path)
    short, long = _longrope_tokens()
    got_short, got_long, _ = pool.run(longrope_job, n, path, str(phi3_longrope), short, long, 1)[0]
    want_short, want_long, _ = longrope_want
    assert (got_short - want_short).abs().max().item() <= 1e-4
    assert (got_long - want_long).abs().max().item() <= 1e-4
    # `meshc verify`'s comparison of the plan's tiny twin (head_dim 8: 4 factors each), on the pool
    twin_text, twin = make_twin(result, plan.name, str(out))
    assert twin.ok and "rope_short_factor = [1.0, 1.1, 1.4, 1.6]" in twin_text
    module = tmp_path / "phi3_twin.py"
    module.write_text(render_plan(twin.plans[plan.name], f"{out} (tiny twin)", twin_text))
    for errs, tol, _timings in pool.run(compare_job, n, str(module), "float64", 0):
        assert not {k: v for k, v in errs.items() if not v <= tol}
        assert tol == TOLERANCE["float64"]
    # Exported without the source config: the longrope in config.json is meshllm's own.
    exported = tmp_path / "exported"
    pool.run(own_config_export_job, n, path, str(phi3_longrope), str(exported))
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "longrope"
    assert cfg["rope_parameters"]["short_factor"] == [1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    with torch.no_grad():
        back = _fresh(exported)
        assert (back(short).logits - want_short).abs().max().item() <= 1e-5
        assert (back(long).logits - want_long).abs().max().item() <= 1e-5


def test_weights_whose_longrope_differs_from_the_spec_are_refused_naming_the_field(phi3_longrope: Path) -> None:
    """--weights compares config.json's longrope (as transformers reads it: Phi-3's top-level
    trained length, the derived factor) with the spec's, and refuses bad factor lists in one line."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.lower import model_description
    from meshllm_dsl.runtime.hf.weights import WeightsError, check_config

    (plan,) = check_text(spec(LONGROPE, "single"), "phi3.mesh").plans.values()
    model = model_description(plan)
    cfg = json.loads((phi3_longrope / "config.json").read_text())
    check_config(model, cfg, "config.json")  # as saved by transformers: equal
    changes = {
        "long factors": ({"long_factor": [1.0] * 8}, "`rope_scaling` is"),
        "the trained length": ({}, "`rope_scaling` is"),
        "a factor list of strings": ({"short_factor": ["1.0"] * 8}, "expected a list of positive numbers"),
        "no long factors": ({"long_factor": None}, "has no `long_factor`; expected a list of positive numbers"),
    }
    for what, (rope, says) in changes.items():
        bad = json.loads(json.dumps(cfg))
        bad["rope_parameters"].update(rope)
        if what == "the trained length":
            bad["original_max_position_embeddings"] = 7
        with pytest.raises(WeightsError) as err:
            check_config(model, bad, "config.json")
        assert says in str(err.value) and "\n" not in str(err.value), (what, str(err.value))
