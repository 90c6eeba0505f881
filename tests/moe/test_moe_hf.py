"""Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints in (--weights) and out (--export-hf), against transformers.

Tiny random transformers models are built offline with weights redrawn away from HF's init (router
included, so routing is peaked and a wrong expert order or weighting shows), loaded into sharded
plans on the shared worker pool: logits within 1e-4, greedy tokens equal, and the export read back by
transformers' own from_pretrained gives the same logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from hf_models import error_job, export_job, logits_job  # noqa: E402
from test_moe_plans import compiled  # noqa: E402

N_NEW = 5
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _config(model: str) -> Any:
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if model == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)
    if model == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                 norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    return tf.Qwen2MoeConfig(**common, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                             intermediate_size=40, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                             rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)


def build_moe(model: str, directory: Path, seed: int = 0) -> Any:
    cls = {"mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM}[model]
    torch.manual_seed(seed)
    hf = cls(_config(model)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.25 * noise)
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("moe_hf")
    return {m: (root / m, build_moe(m, root / m)) for m in FAMILIES}


def _tokens() -> Any:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("plan", ["single", "tensor2"])
@pytest.mark.parametrize("model", FAMILIES)
def test_weights_give_transformers_logits_and_tokens(model: str, plan: str, models: Any, pool: Any,
                                                      tmp_path: Path) -> None:
    directory, hf = models[model]
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        want_tokens = hf.generate(tokens[:1], max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW)
    path, n, _ = compiled(model, plan, tmp_path)
    logits, generated = pool.run(logits_job, n, path, str(directory), tokens, N_NEW)[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert generated.tolist() == want_tokens.tolist()


@pytest.mark.parametrize("model", FAMILIES)
def test_export_round_trips_through_transformers(model: str, models: Any, pool: Any, tmp_path: Path) -> None:
    directory, hf = models[model]
    path, n, _ = compiled(model, "tensor2", tmp_path)
    out = tmp_path / "export"
    pool.run(export_job, n, path, str(directory), str(out), 5 * 10**9)
    back = type(hf).from_pretrained(out).eval()
    tokens = _tokens()
    with torch.no_grad():
        assert (back(tokens).logits - hf(tokens).logits).abs().max().item() == 0.0
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    expert = ("model.layers.1.block_sparse_moe.experts.3.w2.weight" if model == "mixtral"
              else "model.layers.1.mlp.experts.3.down_proj.weight")
    assert expert in names  # the hub's per-expert layout, as transformers saves it


def test_a_checkpoint_with_other_experts_is_refused_in_one_line(models: Any, pool: Any, tmp_path: Path) -> None:
    directory, _ = models["mixtral"]
    text_path, n, _ = compiled("mixtral", "single", tmp_path)
    import json

    other = tmp_path / "other"
    other.mkdir()
    for f in directory.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_experts_per_tok"] = 1
    (other / "config.json").write_text(json.dumps(cfg))
    (msg,) = set(pool.run(error_job, n, text_path, str(other)))
    assert "`num_experts_per_tok` is 1, but model `m` has top_k = 2" in msg, msg


@pytest.mark.parametrize("model", FAMILIES)
def test_import_hf_writes_a_spec_whose_weights_give_transformers_logits(model: str, models: Any, pool: Any,
                                                                        tmp_path: Path) -> None:
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.cli.main import main
    from meshllm_dsl.codegen.emit import render_plan

    directory, hf = models[model]
    out = tmp_path / "imported.mesh"
    assert main(["import-hf", str(directory), "-o", str(out)]) == 0
    text = out.read_text()
    assert f"= {model} {{" in text and "top_k = " in text
    result = check_file(str(out))
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    path = tmp_path / "imported.py"
    path.write_text(render_plan(plan, out.name, text))
    tokens = _tokens()
    logits, _ = pool.run(logits_job, 1, str(path), str(directory), tokens, 0)[0]
    with torch.no_grad():
        assert (logits - hf(tokens).logits).abs().max().item() <= 1e-4


def test_import_hf_refuses_dense_qwen2_moe_layers_by_name(models: Any, tmp_path: Path) -> None:
    import json

    from meshllm_dsl.interop.import_hf import ImportError_, model_settings

    cfg = json.loads((models["qwen2_moe"][0] / "config.json").read_text())
    cfg["mlp_only_layers"] = [0]
    with pytest.raises(ImportError_, match=r"`mlp_only_layers` = \[0\]: some layers are dense"):
        model_settings(cfg, "config.json")
