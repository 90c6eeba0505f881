"""Partial rotary (`attention(..., rotary_dim = N)`: GPT-NeoX, Phi-2, GLM-4.5's head_dim x
partial_rotary_factor): the runtime's rotary and the reference attention against transformers'
GLM-4.5 (Glm4MoeRotaryEmbedding, apply_rotary_pos_emb, Glm4MoeAttention) in float64 with every rope
type, outputs and gradients; tensor- and context-parallel plans EQUAL to the unsharded reference;
greedy decoding with the KV cache gives the reference's tokens; the checker's refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from reference_jobs import assert_spec_matches_reference  # noqa: E402
from transformers.models.glm4_moe import modeling_glm4_moe as glm  # noqa: E402

import meshllm_dsl.runtime as rt  # noqa: E402
from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import RankContext, WorkerPool  # noqa: E402
from meshllm_dsl.runtime.model.reference import _Attention, build_reference  # noqa: E402

THETA, HEAD_DIM, ROTARY = 10000.0, 16, 6  # GLM-4.5 rotates half; 6 of 16 also checks a rotary_dim not head_dim / 2
ORIGINAL = 4  # the trained positions of the scaled ropes: the 8 tested are past them
# Each rope type: transformers' rope_parameters and the attention's rope_scaling (HF's names, as generated code passes it).
SHORT, LONG = [1.0, 1.5, 2.0], [3.0, 5.0, 8.0]  # longrope: one per rotary frequency, rotary_dim / 2
ROPES: dict[str, tuple[dict[str, Any], tuple[tuple[str, Any], ...] | None]] = {
    "default": ({"rope_type": "default"}, None),
    "linear": ({"rope_type": "linear", "factor": 2.0}, (("rope_type", "linear"), ("factor", 2.0))),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0},
                (("rope_type", "dynamic"), ("factor", 2.0), ("original_max_position_embeddings", ORIGINAL))),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 8.0},
             (("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", ORIGINAL),
              ("beta_fast", 8.0), ("beta_slow", 1.0), ("truncate", True))),
    "longrope": ({"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                  "short_factor": SHORT, "long_factor": LONG},
                 (("rope_type", "longrope"), ("factor", 4.0), ("original_max_position_embeddings", ORIGINAL),
                  ("short_factor", tuple(SHORT)), ("long_factor", tuple(LONG)))),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL},
               (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", ORIGINAL))),
}


def _config(kind: str, rotary: int = ROTARY) -> Any:
    params = {"rope_theta": THETA, "partial_rotary_factor": rotary / HEAD_DIM, **ROPES[kind][0]}
    return transformers.Glm4MoeConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
        attention_bias=True, use_qk_norm=False, rope_parameters=params,
        # dynamic NTK scales from max_position_embeddings (the attention's original positions)
        max_position_embeddings=ORIGINAL if kind == "dynamic" else 64,
        attn_implementation="sdpa")  # in float64 throughout (eager takes its softmax in float32)


def _hf_rotary(config: Any, q: Any, k: Any, pos: Any) -> tuple[Any, Any]:
    """transformers' GLM-4.5 rotary on q, k [b, s, heads, d]: a fresh embedding (dynamic's keeps state)."""
    cos, sin = glm.Glm4MoeRotaryEmbedding(config)(q, pos.expand(q.shape[0], -1))
    qh, kh = glm.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return qh.transpose(1, 2), kh.transpose(1, 2)


@pytest.mark.parametrize("kind", list(ROPES))
def test_partial_rotary_gives_transformers_values_and_gradients_for_every_rope_type(kind: str) -> None:
    config, scaling = _config(kind), ROPES[kind][1]
    gen = torch.Generator().manual_seed(0)
    q, gq = (torch.randn(2, 8, 4, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    k, gk = (torch.randn(2, 8, 2, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(8)[None]
    results = []
    for rotary in (lambda a, b: _hf_rotary(config, a, b, pos),
                   lambda a, b: rt.apply_rotary(a, b, pos[0], THETA, scaling, rotary_dim=ROTARY)):
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = rotary(qi, ki)
        torch.autograd.backward(out, (gq, gk))
        results.append([*out, qi.grad, ki.grad])
    for got, want in zip(results[1], results[0]):
        assert (got - want).abs().max().item() <= 1e-12
    # the dims past rotary_dim pass unchanged, the first ones do turn
    assert torch.equal(results[1][0][..., ROTARY:], q[..., ROTARY:])
    assert (results[1][0][:, 1:, :, :ROTARY] - q[:, 1:, :, :ROTARY]).abs().max() > 1e-3


def _redrawn(module: Any) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)  # away from HF's init


@pytest.mark.parametrize("kind", ["default", "yarn"])
def test_reference_attention_equals_glm4_moe_attention(kind: str) -> None:
    torch.manual_seed(0)
    config = _config(kind)
    hf = glm.Glm4MoeAttention(config, layer_idx=0).double()
    _redrawn(hf)
    spec = {"kind": "attention", "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": HEAD_DIM, "rope_theta": THETA,
            "qkv_bias": True, "o_bias": False, "rope_scaling": ROPES[kind][1], "rotary_dim": ROTARY}
    ours = _Attention(spec).double()
    with torch.no_grad():
        for mine, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            for field in ("weight", "bias"):
                if getattr(getattr(hf, theirs), field) is not None:
                    getattr(getattr(ours, mine), field).copy_(getattr(getattr(hf, theirs), field))
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    pos = torch.arange(8)[None].expand(2, -1)
    mask = torch.full((8, 8), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    xh, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = hf(xh, glm.Glm4MoeRotaryEmbedding(config)(xh, pos), mask)[0]
    got = ours(xo)
    assert (got - want).abs().max().item() <= 1e-12
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    assert (xo.grad - xh.grad).abs().max().item() <= 1e-12
    for mine, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
        grad = getattr(ours, mine).weight.grad - getattr(hf, theirs).weight.grad
        assert grad.abs().max().item() <= 1e-12, mine


MODEL = """model m {{
    vocab = 64
    hidden = 32
    embed = embedding(vocab, hidden)
    blocks = repeat(2) {{
        attn_norm = rmsnorm(hidden)
        attn = attention(hidden, 4, 2, 8, rope_theta = 10000.0, rotary_dim = {rotary}, bias = true{extra})
        mlp_norm = rmsnorm(hidden)
        mlp = mlp(hidden, 64, act = swiglu)
    }}
    norm = rmsnorm(hidden)
    lm_head = linear(hidden, vocab)
}}
"""
PLANS = {
    "tensor2": ("tensor = 2", "layout { heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }"),
    "context2": ("cp = 2", "layout { seq -> cp }"),
}


def _spec(plan: str, rotary: int = 4, extra: str = "") -> str:
    axes, body = PLANS[plan]
    return (f"mesh m {{ axes {axes} }}\n{MODEL.format(rotary=rotary, extra=extra)}"
            f"plan p on m for m {{\n    batch = 4\n    seq = 8\n    {body}\n}}\n")


@pytest.mark.parametrize("extra", ["", ", rope_type = yarn, rope_factor = 4.0, rope_original_positions = 4",
                                   # q / k norms; windowed blocks with their own rope base, every 2nd global
                                   ", qk_norm = head, window = 4, global_every = 2, local_rope_theta = 100.0"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_partial_rotary_plans_equal_the_unsharded_reference(plan: str, extra: str, pool: WorkerPool,
                                                            tmp_path: Path) -> None:
    text = _spec(plan, extra=extra)
    result = check_text(text, "partial.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    assert "rotary_dim=4" in render_plan(result.plans["p"], "partial.mesh", text)
    assert_spec_matches_reference(pool, text, f"partial_rotary_{plan}", tmp_path)


def _model(text: str, tmp_path: Path, name: str) -> Any:
    """The generated module of `text`'s plan at tmp_path / name.py, and its model description."""
    from meshllm_dsl.verify.equivalence import load_generated

    (plan,) = check_text(text, f"{name}.mesh").plans.values()
    path = tmp_path / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", text))
    return path, load_generated(str(path)).PROGRAM.model


def test_the_reference_rotates_only_rotary_dim(tmp_path: Path) -> None:
    """The EQUAL plans above are not equal by accident: rotary_dim changes the reference's logits."""
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        partial, whole = (build_reference(_model(_spec("tensor2", r), tmp_path, f"r{r}")[1], torch.float64)(tokens)
                          for r in (4, 8))
    assert (partial - whole).abs().max() > 1e-3


def _generate_job(ctx: RankContext, path: str) -> list[list[int]]:
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=5)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    out = rt.greedy_generate(built, prompt, 8)
    ref = build_reference(program.model, torch.float32, seed=5)
    tokens = prompt
    with torch.no_grad():  # no cache: the whole sequence every step
        for _ in range(8):
            tokens = torch.cat([tokens, ref(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens), (out.tolist(), tokens.tolist())
    return out.tolist()


def test_kv_cache_decoding_with_partial_rotary_gives_the_reference_tokens(pool: WorkerPool, tmp_path: Path) -> None:
    path, _ = _model(_spec("tensor2"), tmp_path, "g")
    outs = pool.run(_generate_job, 2, str(path))
    assert outs[0] == outs[1] and len(outs[0][0]) == 13


@pytest.mark.parametrize(("value", "why"), [(3, "is odd"), (0, "rotates nothing"), (10, "exceeds head_dim (8)")])
def test_a_rotary_dim_that_cannot_turn_pairs_is_refused_with_help(value: int, why: str) -> None:
    (d,) = check_text(_spec("tensor2", value), "bad.mesh").errors
    assert d.code == "E0304" and why in d.message and d.help and "rotary_dim" in d.help
    assert d.span is not None and d.span.text == str(value)  # the value given


@pytest.mark.parametrize("target", ["dtensor", "hf-tp-plan"])
def test_export_refuses_partial_rotary_naming_the_layer(target: str) -> None:
    """transformers' modules would rotate every dim: the export says so rather than write them."""
    from meshllm_dsl.diagnostics import SpecError
    from meshllm_dsl.front.load import load
    from meshllm_dsl.interop.export import export_plan

    text = _spec("tensor2")
    decls = load("x.mesh", text)
    (plan,) = check_text(text, "x.mesh").plans.values()
    with pytest.raises(SpecError) as err:
        export_plan(plan, decls, target, "x.mesh", text)
    (d,) = err.value.diagnostics
    assert d.code == "E1204" and "`attn` rotates part of each head" in d.message and d.help
    # the same model rotating every dim gets past this refusal
    (whole,) = check_text(_spec("tensor2", 8), "x.mesh").plans.values()
    try:
        export_plan(whole, load("x.mesh", _spec("tensor2", 8)), target, "x.mesh", _spec("tensor2", 8))
    except SpecError as other:
        assert all("rotates part" not in e.message for e in other.diagnostics)


@pytest.mark.parametrize("flag", ["--weights", "--export-hf"])
def test_hf_checkpoints_of_partial_rotary_are_refused_before_launch(flag: str, tmp_path: Path) -> None:
    from meshllm_dsl.runtime.train import launch

    _, model = _model(_spec("tensor2"), tmp_path, "w")
    (tmp_path / "hf").mkdir()
    args = launch.parse_args([flag, str(tmp_path / ("hf" if flag == "--weights" else "out"))])
    with pytest.raises(launch.InputError, match=f"{flag}: `attn` rotates part of each head"):
        launch.check_inputs(args, model, 8)


def test_rotary_dim_without_rope_theta_is_refused() -> None:
    text = _spec("tensor2").replace("rope_theta = 10000.0, ", "")
    (d,) = check_text(text, "bad.mesh").errors
    assert d.code == "E0304" and "without rope_theta" in d.message and d.help and "rope_theta" in d.help


TWIN = """mesh m {{ axes tensor = 2 }}
model m {{
    vocab = 64
    hidden = 64
    heads = 4
    head_dim = 16
    rotary_dim = 10
    embed = embedding(vocab, hidden)
    blocks = repeat(2) {{
        attn_norm = rmsnorm(hidden)
        attn = attention(hidden, heads, 2, head_dim, rope_theta = 10000.0, rotary_dim = rotary_dim{extra})
        mlp_norm = rmsnorm(hidden)
        mlp = mlp(hidden, 64, act = swiglu)
    }}
    norm = rmsnorm(hidden)
    lm_head = linear(hidden, vocab)
}}
plan p on m for m {{
    batch = 4
    seq = 8
    layout {{ heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }}
}}
"""


def test_the_tiny_twin_keeps_the_rotary_partial_and_cuts_longrope_to_it(tmp_path: Path) -> None:
    """`meshc verify`'s twin has heads of HEAD_DIM: rotary_dim shrinks with them (10 of 16 -> 4 of 8),
    still partial and even, and longrope's factors (rotary_dim / 2) are cut to the twin's."""
    from meshllm_dsl.checker import check_file
    from meshllm_dsl.verify.twin import HEAD_DIM, make_twin

    longrope = (", rope_type = longrope, rope_factor = 4.0, rope_original_positions = 4,"
                " rope_short_factor = [1.0, 2.0, 3.0, 4.0, 5.0], rope_long_factor = [6.0, 7.0, 8.0, 9.0, 10.0]")
    for extra, short in (("", None), (longrope, (1.0, 5.0))):
        path = tmp_path / "t.mesh"
        path.write_text(TWIN.format(extra=extra))
        assert check_file(path).ok
        _, twin = make_twin(check_file(path), "p", str(path))
        assert twin.ok, [d.message for d in twin.diagnostics]
        attn = next(u for item in twin.plans["p"].model.items for u in getattr(item, "body", ()) if u.kind == "attention")
        a = dict(attn.attrs)
        assert (a["head_dim"], a["rotary_dim"]) == (HEAD_DIM, 4)
        if short is not None:
            assert dict(a["rope_scaling"])["short_factor"] == short


def test_the_planner_keeps_cos_and_sin_of_rotary_dim_only() -> None:
    from meshllm_dsl.ir import DTYPES
    from meshllm_dsl.planner.analyze import analyze

    def act(rotary: int) -> tuple[int, ...]:
        (plan,) = check_text(_spec("tensor2", rotary), "a.mesh").plans.values()
        return tuple(r.activation_bytes for r in analyze(plan).ranks), DTYPES[plan.dtype]

    (partial, e), (whole, _) = act(4), act(8)
    # cos and sin [s, 1, rotary_dim] per block (one for the batch): 2 blocks x 2 x 8 positions x 4 fewer dims
    assert [w - p for w, p in zip(whole, partial)] == [2 * 2 * e * 8 * 4] * len(whole)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_partial_rotary_is_transformers_bit_for_bit_in_training_dtypes(dtype: str) -> None:
    """cos / sin in float32, cast to the activations' dtype, as transformers: the same bits."""
    dt, config = getattr(torch, dtype), _config("default", 8)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 8, 4, HEAD_DIM, generator=gen).to(dt), torch.randn(2, 8, 2, HEAD_DIM, generator=gen).to(dt)
    pos = torch.arange(8)[None]
    want = _hf_rotary(config, q, k, pos)
    got = rt.apply_rotary(q, k, pos[0], THETA, rotary_dim=8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
