"""OLMo 2 (Olmo2ForCausalLM) checkpoints in and out, against transformers itself (a tiny random
model, weights redrawn away from HF's init: tests/hf_models.py).

OLMo 2's block has no norm before a sublayer and one after each (before the residual add), and
normalises q and k over the whole projection before the head reshape: redrawn norm scales make a
swapped post_attention / post_feedforward norm, a per-head q / k norm or a sum of squares not
all-reduced over the tensor axis change the logits. Jobs run on the session's worker pool
(tests/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hf_models import build_hf, error_job, export_job, logits_job, reference_job, spec  # noqa: E402
from hf_models import compiled_module as _module  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.interop.import_hf import ImportError_, model_settings, spec_text  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402

N_NEW = 6


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("hf_olmo2") / "olmo2"
    return directory, build_hf("olmo2", directory)


def _tokens() -> Any:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("plan", ["single", "tensor2", "pipeline2_tensor2"])
def test_weights_give_transformers_logits_and_tokens(
    plan: str, olmo2: tuple[Path, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    directory, hf = olmo2
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        want_tokens = hf.generate(tokens[:1], attention_mask=torch.ones_like(tokens[:1]), max_new_tokens=N_NEW,
                                  do_sample=False, min_new_tokens=N_NEW)
    path, n = _module(spec("olmo2", plan), f"olmo2_{plan}", tmp_path)
    logits, generated = pool.run(logits_job, n, path, str(directory), tokens, N_NEW)[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert generated.tolist() == want_tokens.tolist()


def test_export_round_trip_is_exact_and_loads_in_transformers(
    olmo2: tuple[Path, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    """From pipeline x tensor slices back to one directory: every tensor bit-equal, and meshllm's
    own config.json (no source directory given) loads as Olmo2ForCausalLM with equal logits."""
    directory, hf = olmo2
    path, n = _module(spec("olmo2", "pipeline2_tensor2"), "olmo2", tmp_path)
    original = safetensors_torch.load_file(str(directory / "model.safetensors"))
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
    for source in (True, False):
        out = tmp_path / f"exported_{source}"
        if source:
            pool.run(export_job, n, path, str(directory), str(out), 10**9)
        else:
            from hf_models import own_config_export_job

            pool.run(own_config_export_job, n, path, str(directory), str(out))
        exported = safetensors_torch.load_file(str(out / "model.safetensors"))
        assert sorted(exported) == sorted(original)
        for key, t in original.items():
            assert torch.equal(exported[key], t), key
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["Olmo2ForCausalLM"] and config["model_type"] == "olmo2"
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(back) is type(hf)
        with torch.no_grad():
            assert (back(tokens).logits - want).abs().max().item() == 0.0


def test_import_hf_spec_loads_the_weights(olmo2: tuple[Path, Any], pool: WorkerPool, tmp_path: Path) -> None:
    directory, hf = olmo2
    text = spec_text(str(directory), devices=4, batch=4, seq=8)
    assert "= olmo2 {" in text and "norm_eps = 1e-06" in text
    path, n = _module(text, "olmo2_imported", tmp_path)
    tokens = _tokens()
    logits, _ = pool.run(logits_job, n, path, str(directory), tokens, 0)[0]
    with torch.no_grad():
        assert (logits - hf(tokens).logits).abs().max().item() <= 1e-4


def test_sharded_plan_trains_like_the_unsharded_reference(pool: WorkerPool, tmp_path: Path) -> None:
    """What `meshc verify` checks, on the pool: logits, gradients and parameters after AdamW steps
    of pipeline x tensor equal the unsharded reference (float64), post norms and whole-projection
    q / k norms included."""
    from meshllm_dsl.runtime.jobs.compare import TOLERANCE

    path, n = _module(spec("olmo2", "pipeline2_tensor2"), "olmo2", tmp_path)
    for rank, errs in enumerate(pool.run(reference_job, n, path)):
        bad = {k: v for k, v in errs.items() if not v <= TOLERANCE["float64"]}
        assert not bad, f"rank {rank}: {bad}"


def test_a_llama_spec_refuses_an_olmo2_checkpoint_naming_model_type(
    olmo2: tuple[Path, Any], pool: WorkerPool, tmp_path: Path
) -> None:
    """The same shapes with norms before the sublayers would load q / k norms nowhere and compute
    another model: refused on every rank with one line naming the field."""
    directory, _ = olmo2
    path, n = _module(spec("llama_qk_full", "tensor2"), "llama_qk_full", tmp_path)
    errors = pool.run(error_job, n, path, str(directory))
    assert len(set(errors)) == 1
    (message,) = set(errors)
    assert "`model_type` is 'olmo2'" in message and "not OLMo 2 shaped" in message and "\n" not in message


@pytest.mark.parametrize(("field", "value", "named"), [
    ("hidden_act", "gelu", "`hidden_act` = 'gelu'"),
    ("attn_logit_softcapping", 30.0, "`attn_logit_softcapping` = 30.0"),
    ("rope_parameters", {"rope_type": "mrope", "rope_theta": 10000.0}, "'mrope' is not supported"),
])
def test_import_hf_refuses_what_the_olmo2_family_cannot_honour(field: str, value: Any, named: str) -> None:
    cfg = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "vocab_size": 64, "hidden_size": 32,
           "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 64, field: value}
    with pytest.raises(ImportError_) as err:
        model_settings(cfg, "config.json")
    assert named in str(err.value) and "\n" not in str(err.value)


def test_import_hf_reads_olmo2_defaults_as_transformers_does() -> None:
    """A config that leaves fields out gets transformers' Olmo2Config defaults (eps 1e-5, not
    Llama's 1e-6; rope base 10000), and attention_bias biases q, k, v and o alike."""
    cfg = {"architectures": ["Olmo2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
           "num_attention_heads": 4, "intermediate_size": 64, "attention_bias": True}
    family, settings, positions = model_settings(cfg, "config.json")
    got = {k: v for k, v, _ in settings}
    assert family == "olmo2" and positions == 2048
    assert got["norm_eps"] == 1e-5 and got["rope_theta"] == 10000.0 and got["attn_bias"] is True
    assert "qk_norm" not in got  # the family's block itself


def test_norms_scale_in_fp32_before_the_cast_as_olmo2_does() -> None:
    """Olmo2RMSNorm applies its weight in fp32 and then casts; Llama's casts first. In bf16 the two
    differ by a rounding, so the runtime's norm, the reference's and transformers' are compared
    bit for bit there (the fp32 tests above cannot tell them apart)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from meshllm_dsl.runtime.model.layers import RMSNorm
    from meshllm_dsl.runtime.model.reference import _RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 8, 32, generator=gen)).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(32, generator=gen)).to(torch.bfloat16)
    theirs, ours, ref, llama = Olmo2RMSNorm(32, eps=1e-6), RMSNorm(32, 1e-6, scale_fp32=True), \
        _RMSNorm(32, 1e-6, scale_fp32=True), RMSNorm(32, 1e-6)
    with torch.no_grad():
        for norm in (theirs, ours, ref, llama):
            norm.to(torch.bfloat16).weight.copy_(weight)
        want = theirs(x)
        assert torch.equal(ours(x), want) and torch.equal(ref(x), want)
        assert not torch.equal(llama(x), want)  # the test can tell the conventions apart


def test_tp_plan_export_gathers_the_whole_projection_norms_input() -> None:
    """transformers' Olmo2RMSNorm on a column-split q would normalise each rank's part alone: the export
    (once refused with E1205) gathers q, k and v and splits o's input, as Olmo2Config.base_model_tp_plan
    does (tests/integration/test_export.py runs it in transformers)."""
    import json

    from meshllm_dsl.checker import check_declarations
    from meshllm_dsl.front.load import load
    from meshllm_dsl.interop.export import export_plan

    text = spec("olmo2", "tensor2")
    decls = load("olmo2.mesh", text)
    (plan,) = check_declarations(decls).plans.values()
    mapping = json.loads(export_plan(plan, decls, "hf-tp-plan", "olmo2.mesh", text)[0])
    assert {k: mapping[f"model.layers.*.self_attn.{k}"] for k in ("q_proj", "k_proj", "v_proj", "o_proj")} == {
        "q_proj": "colwise_gather_output", "k_proj": "colwise_gather_output", "v_proj": "colwise_gather_output",
        "o_proj": "rowwise_split_input"}


def test_planner_counts_transformers_parameters(olmo2: tuple[Path, Any]) -> None:
    """The post norms and the whole-projection q / k norm scales ([heads x head_dim], [kv_heads x
    head_dim]) are counted as transformers holds them."""
    _, hf = olmo2
    (plan,) = check_text(spec("olmo2", "tensor2"), "olmo2.mesh").plans.values()
    assert plan.model.numel == sum(p.numel() for p in hf.parameters())


def test_a_whole_projection_qk_norm_before_the_sublayers_has_no_config_json() -> None:
    """A llama block with qk_norm = full is no transformers architecture: exporting it is refused in
    one line pointing to the olmo2 family, never written as a LlamaForCausalLM that drops the norms."""
    from meshllm_dsl.codegen.lower import model_description
    from meshllm_dsl.runtime.hf.weights import WeightsError, hf_config

    (plan,) = check_text(spec("llama_qk_full", "single"), "m.mesh").plans.values()
    with pytest.raises(WeightsError, match=r"qk_norm = full .* \(family olmo2\)"):
        hf_config(model_description(plan), torch.float32)
