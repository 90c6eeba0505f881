"""Context parallelism (`layout { seq -> C }` over axes C that split no weight) end to end.

The checker's reading of a `seq` entry (context vs sequence parallelism) and its refusals run in
process. Every plan kind is compiled by meshc and trained for 3 AdamW steps on the shared gloo
pool (tests/conftest.py), in float32 and float64: logits, every gradient, the loss at each step and
every parameter afterwards equal the unsharded reference trained in one process. Decoding (the
prompt's prefill split over C, then a gathered cache) gives the reference's greedy tokens, and a
tiny random transformers Llama's logits and tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mesh_snippets import MEGATRON

from meshllm_dsl.checker import check_text

LLAMA = "model m = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }"
# GPT-2: learned positions (each rank adds the rows of its tokens' global positions), a tied head.
GPT2 = "model m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, positions = 16 }"
# Gemma 2: a sliding window on every other block and soft-capped logits, masked by global positions.
# Mixtral with both router losses: the load-balancing loss is a product of statistics of each
# whole sequence, the z-loss a mean over its tokens.
MIXTRAL = ("model m = mixtral { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 48, experts = 4, "
           "top_k = 2, aux_loss_coef = 0.05, z_loss_coef = 0.01, dtype = fp32 }")
GEMMA2 = ("model m = gemma2 { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, head_dim = 8, "
          "ffn = 64, window = 3, dtype = fp32 }")


def _spec(axes: str, body: str, model: str = LLAMA, seq: int = 8, batch: int = 4) -> str:
    return f"mesh m {{ axes {axes} }}\n{model}\nplan p on m for m {{\n    batch = {batch}\n    seq = {seq}\n{body}\n}}\n"


def _codes(text: str) -> list[str]:
    return [d.code for d in check_text(text, "t.mesh").diagnostics]


# -- the checker


def test_seq_over_an_axis_splitting_no_weight_is_context_parallelism() -> None:
    result = check_text(_spec("tensor = 2, cp = 2", MEGATRON + "    layout { seq -> cp }"), "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    roles = result.plans["p"].roles
    assert roles.context == ("cp",) and roles.sequence == () and roles.tensor == ("tensor",)
    # Over the tensor axis it stays Megatron sequence parallelism.
    sp = check_text(_spec("tensor = 2", MEGATRON + "    layout { seq -> tensor }"), "t.mesh").plans["p"].roles
    assert sp.sequence == ("tensor",) and sp.context == ()
    # Over both, Megatron's --context-parallel-size with --sequence-parallel: each its own part.
    both = check_text(_spec("tensor = 2, cp = 2", MEGATRON + "    layout { seq -> tensor * cp }"), "t.mesh")
    assert both.ok, [d.message for d in both.diagnostics]
    assert both.plans["p"].roles.sequence == ("tensor",) and both.plans["p"].roles.context == ("cp",)


@pytest.mark.parametrize(("axes", "body", "code"), [
    # seq into 2 x |cp| equal chunks: 12 tokens into 8 do not go.
    ("cp = 4", "    layout { seq -> cp }", "E0301"),
    ("data = 2", "    layout { batch -> data, seq -> data }", "E0411"),
    ("pipeline = 2, cp = 2", "    layout { seq -> pipeline }\n    microbatches = 2\n    stages over pipeline balanced", "E0411"),
    # Sequence inside context parallelism: 12 = 2 x 6 tokens per cp rank, 3 per tensor rank.
    ("tensor = 2, cp = 2", MEGATRON + "    layout { seq -> tensor * cp }", None),
    # (12 tokens in 2 x cp chunks whose s / cp do not split over tensor 4: the E0301 golden in examples/errors.)
    ("tensor = 2, data = 2", MEGATRON + "    layout { batch -> data, seq -> tensor * data }", "E0411"),
    # ZeRO over an axis that holds no replica (tensor) is still refused; over data x cp it is not.
    ("data = 2, cp = 2, tensor = 2", MEGATRON + "    layout { batch -> data, seq -> cp }\n"
     "    optimizer adamw { zero 1 over data * tensor }", "E0407"),
    ("data = 2, cp = 2", "    layout { batch -> data, seq -> cp }\n    optimizer adamw { zero 3 over data * cp }", None),
    ("cp = 2", "    layout { seq -> cp }\n    optimizer adamw { zero 1 }", None),
])
def test_context_parallel_checks(axes: str, body: str, code: str | None) -> None:
    got = _codes(_spec(axes, body, seq=12))
    assert got == ([code] if code else []), got


def test_a_capacity_dropping_router_counts_the_whole_sequence_under_context_parallelism() -> None:
    from meshllm_dsl.codegen.emit import render_plan

    text = _spec("data = 2, cp = 2", "    layout { batch -> data, experts -> data, seq -> cp }",
                 MIXTRAL.replace("dtype", "capacity = 0.75, dtype"))
    (plan,) = check_text(text, "t.mesh").plans.values()
    code = render_plan(plan, "t.mesh", text)
    assert "capacity=0.75, keep=self.ctx.capacity_keep(h.shape[0]))" in code
    assert "ids all-gathered over cp (2) to [b, 2 s, 2] in position order" in code


def test_zero_over_data_and_context_shards_over_both() -> None:
    text = _spec("data = 2, cp = 2", "    layout { batch -> data, seq -> cp }\n    optimizer adamw { zero 3 over data * cp }")
    roles = check_text(text, "t.mesh").plans["p"].roles
    assert roles.batch_shard == ("data", "cp") and roles.batch_replicate == ()
    hsdp = check_text(text.replace("over data * cp", "over data"), "t.mesh").plans["p"].roles
    assert hsdp.batch_shard == ("data",) and hsdp.batch_replicate == ("cp",)


def test_the_generated_attention_gathers_keys_and_values_with_a_shape_comment() -> None:
    from meshllm_dsl.codegen.emit import render_plan

    text = _spec("cp = 2", "    layout { seq -> cp }")
    (plan,) = check_text(text, "t.mesh").plans.values()
    code = render_plan(plan, "t.mesh", text)
    assert "self.ctx = rt.ContextShard(mesh, ('cp',))" in code
    assert "self.ctx.positions(s, q.device)" in code and "rt.positions(" not in code
    assert ("a = self.ctx.attention(q, k, v)  # [b, s, 32] causal over the whole sequence: k, v [b, s, 2, 8] "
            "all-gathered over cp (2) to [b, 2 s, 2, 8] (backward reduce-scatters them)") in code
    assert "context_axes=('cp',)," in code


# -- on gloo ranks against the unsharded reference

CASES: dict[str, str] = {
    "cp2": _spec("cp = 2", "    layout { seq -> cp }"),
    # The loss is averaged over data x cp; clipping's global norm counts each replica once.
    "data2_cp2_zero1_clip": _spec("data = 2, cp = 2", "    layout { batch -> data, seq -> cp }\n"
                                  "    optimizer adamw { zero 1 over data * cp, clip = 0.01 }"),
    "tensor2_cp2": _spec("tensor = 2, cp = 2", MEGATRON + "    layout { seq -> cp }"),
    # Megatron sequence parallelism inside context parallelism: the residual stream is
    # [b, s / (cp x tensor), hidden]; one kv head per tensor rank serves two query heads; FSDP2
    # over cp shards what tensor parallelism left whole.
    "tensor2_cp2_zero3_sp": _spec("tensor = 2, cp = 2", MEGATRON + "    layout { seq -> tensor * cp }\n"
                                  "    optimizer adamw { zero 3 over cp }"),
    # Between stages the residual stream is [mb, s / cp, hidden]; every stage reads global positions.
    "pipeline2_cp2_1f1b": _spec("pipeline = 2, cp = 2", "    layout { seq -> cp }\n    microbatches = 2\n"
                                "    stages over pipeline balanced\n    schedule 1f1b"),
    # FSDP2 over data x cp (torchtitan), and HSDP: sharded over data, replicated over cp.
    "data2_cp2_zero3": _spec("data = 2, cp = 2", "    layout { batch -> data, seq -> cp }\n"
                             "    optimizer adamw { zero 3 over data * cp }"),
    "data2_cp2_zero2_over_data": _spec("data = 2, cp = 2", "    layout { batch -> data, seq -> cp }\n"
                                       "    optimizer adamw { zero 2 over data }"),
    # 8 chunks of 2 tokens; one kv head for four query heads; a window across the chunks; the
    # gathers run again when backward recomputes the blocks.
    "cp4_gqa_window_recompute": _spec("cp = 4", "    layout { seq -> cp }\n    recompute = blocks",
                                      LLAMA.replace("kv_heads = 2", "kv_heads = 1").replace("}", ", window = 5 }"),
                                      seq=16),
    "gpt2_cp2_recompute_attention": _spec("cp = 2", "    layout { seq -> cp }\n    recompute = attention", GPT2),
    "gemma2_cp2": _spec("cp = 2", "    layout { seq -> cp }", GEMMA2),
    # Routing per token on each context rank, the router statistics summed over cp; the experts
    # split over data (all-to-all within each cp coordinate's data group), 2 microbatches; each
    # expert takes 6 of a forward's 32 (token, choice) pairs, counted in the whole sequence's order.
    "mixtral_data2_cp2_ep2_capacity": _spec("data = 2, cp = 2", "    layout { batch -> data, experts -> data, seq -> cp }\n"
                                            "    microbatches = 2", MIXTRAL.replace("dtype", "capacity = 0.75, dtype"), batch=8),
}


def _module(name: str, tmp_path: Path) -> tuple[str, int]:
    from meshllm_dsl.codegen.emit import render_plan

    result = check_text(CASES[name], f"{name}.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    assert plan.roles.context and bool(plan.roles.sequence) == name.endswith("_sp")
    path = tmp_path / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", CASES[name]))
    return str(path), plan.mesh.devices


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_plan_matches_unsharded_reference(name: str, pool: Any, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from reference_jobs import compare_job

    from meshllm_dsl.runtime.jobs.compare import TOLERANCE

    path, n = _module(name, tmp_path)
    for rank, errs in enumerate(pool.run(compare_job, n, path)):
        for dtype, by_key in errs.items():
            assert any(k.startswith("grad ") and ("attn.k" in k or "attn.qkv" in k) for k in by_key), by_key
            bad = {k: v for k, v in by_key.items() if not v <= TOLERANCE[dtype]}
            assert not bad, f"rank {rank}, {dtype}: {bad}"


def _generate_job(ctx: Any, path: str, prompt_len: int) -> list[list[int]]:
    import torch

    from meshllm_dsl.runtime.model.generate import greedy_generate
    from meshllm_dsl.runtime.model.reference import build_reference
    from meshllm_dsl.runtime.parallel import context
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=5)
    prompt = torch.randint(0, 64, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    split = []
    entered = context.split_prefill

    def spy() -> Any:  # records that the prefill ran split over the context axis
        split.append(True)
        return entered()

    context.split_prefill = spy
    try:
        out = greedy_generate(built, prompt, 6)
    finally:
        context.split_prefill = entered
    assert split == ([True] if prompt_len % (2 * built.context.size) == 0 else []), split
    ref = build_reference(program.model, torch.float32, seed=5)
    tokens = prompt
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.cat([tokens, ref(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens), (out.tolist(), tokens.tolist())
    return out.tolist()


@pytest.mark.parametrize(("name", "prompt_len"), [("tensor2_cp2_zero3_sp", 8), ("pipeline2_cp2_1f1b", 8), ("cp2", 5)])
def test_context_parallel_plan_decodes_like_the_reference(name: str, prompt_len: int, pool: Any, tmp_path: Path) -> None:
    """A prompt of 8 is prefilled split over cp (chunks of 2); one of 5 does not split and is
    prefilled whole on every rank. Either way the next tokens decode against whole caches."""
    pytest.importorskip("torch")
    path, n = _module(name, tmp_path)
    outs = pool.run(_generate_job, n, path, prompt_len)
    assert all(o == outs[0] for o in outs)


def test_context_parallel_plan_gives_transformers_logits_and_tokens(pool: Any, tmp_path: Path) -> None:
    """A tiny random Llama (weights redrawn away from HF's init) loaded into tensor 2 x context 2:
    the full logits and greedy tokens (prefill split over cp) equal LlamaForCausalLM's."""
    torch = pytest.importorskip("torch")
    from hf_models import _TP, SPEC_MODELS, build_hf, compiled_module, logits_job

    hf = build_hf("llama", tmp_path / "hf")
    text = (f"mesh m {{ axes tensor = 2, cp = 2 }}\n{SPEC_MODELS['llama']}\nplan p on m for m {{\n    batch = 4\n"
            f"    seq = 8\n    layout {{ {_TP}, seq -> cp }}\n}}\n")
    path, n = compiled_module(text, "llama_cp", tmp_path)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(tokens).logits
        want_tokens = hf.generate(tokens[:1], attention_mask=torch.ones_like(tokens[:1]), max_new_tokens=6,
                                  do_sample=False, min_new_tokens=6)
    logits, generated = pool.run(logits_job, n, path, str(tmp_path / "hf"), tokens, 6)[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert generated.tolist() == want_tokens.tolist()


# -- the planner


def _report(axes: str, body: str, seq: int = 64, model: str = LLAMA) -> Any:
    from meshllm_dsl.planner.analyze import analyze

    result = check_text(_spec(axes, body, model=model, seq=seq), "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    return analyze(result.plans["p"])


def test_planner_divides_activations_by_the_context_size_and_counts_the_kv_gathers() -> None:
    from meshllm_dsl.planner.formulas import kv_gather_bytes_per_layer
    from meshllm_dsl.planner.report import report_text

    one = _report("cp = 1", "    layout { seq -> cp }")
    four = _report("cp = 4", "    layout { seq -> cp }")
    a1, a4 = one.ranks[0].activation_bytes_per_microbatch, four.ranks[0].activation_bytes_per_microbatch
    # Everything per token divides by 4; each layer keeps the gathered k, v ([b, s, 2, 8] each, fp32)
    # and its [s / 4, s] mask beyond that (measured on gloo: bench/context_parallel.py).
    assert a4 < a1 / 3, (a1, a4)
    kv = 2 * 4 * 64 * 2 * 8 * 4  # k and v, batch 4 x seq 64 x 2 kv heads x head_dim 8, fp32
    assert kv_gather_bytes_per_layer(four.plan) == kv and kv_gather_bytes_per_layer(one.plan) == 0
    context = {c.op: c for c in four.ranks[0].comms if c.kind == "context"}
    assert context["all_gather"].calls == 2 * 2 and context["all_gather"].payload_bytes == 2 * kv  # 2 layers, k and v
    assert context["reduce_scatter"].calls == 2 * 2
    assert not [c for c in one.ranks[0].comms if c.kind == "context"]
    assert four.step.context_s > 0 and one.step.context_s == 0
    assert "context comm" in report_text(four) and "context comm" not in report_text(one)
    # The gradients are averaged over the context ranks like data replicas.
    assert any(c.kind == "data" and c.axis == "cp" for c in four.ranks[0].comms)
    # Recomputing the blocks gathers K / V again in backward.
    again = _report("cp = 4", "    layout { seq -> cp }\n    recompute = blocks")
    assert {c.op: c.calls for c in again.ranks[0].comms if c.kind == "context"} == {"all_gather": 8, "reduce_scatter": 4}


def test_planner_splits_the_sequence_parallel_regions_over_context_and_tensor() -> None:
    """Inside context parallelism, sequence parallelism saves half what it saves alone (each cp
    rank's s / 2 tokens split over tensor), and its gathers over tensor move half the bytes."""
    sp_alone = MEGATRON + "    layout { seq -> tensor }"
    tp = _report("tensor = 2", MEGATRON).ranks[0]
    sp = _report("tensor = 2", sp_alone).ranks[0]
    cp = _report("tensor = 2, cp = 2", MEGATRON + "    layout { seq -> cp }").ranks[0]
    both = _report("tensor = 2, cp = 2", MEGATRON + "    layout { seq -> tensor * cp }").ranks[0]
    saved = tp.activation_bytes_per_microbatch - sp.activation_bytes_per_microbatch
    assert saved > 0 and cp.activation_bytes_per_microbatch - both.activation_bytes_per_microbatch == saved // 2

    def payload(r: Any, kind: str, op: str) -> int:
        return sum(c.payload_bytes for c in r.comms if c.kind == kind and c.op == op)

    assert payload(both, "tensor", "all_gather") == payload(sp, "tensor", "all_gather") // 2 > 0
    assert payload(both, "tensor", "reduce_scatter") == payload(sp, "tensor", "reduce_scatter") // 2 > 0
    assert payload(both, "context", "all_gather") == payload(cp, "context", "all_gather") > 0


def test_planner_splits_the_expert_all_to_all_over_the_context_ranks() -> None:
    """Each context rank routes its s / cp tokens: the all-to-all over data moves half the bytes at
    cp 2, and the experts (replicated over cp) get their gradients reduced over it."""
    ep = "    layout { batch -> data, experts -> data }\n    microbatches = 2"
    alone = _report("data = 2", ep, model=MIXTRAL).ranks[0]
    cp = _report("data = 2, cp = 2", ep.replace("experts -> data", "experts -> data, seq -> cp"), model=MIXTRAL).ranks[0]
    a2a = {r: sum(c.payload_bytes for c in r.comms if c.kind == "expert" and c.op == "all_to_all") for r in (alone, cp)}
    assert a2a[cp] == a2a[alone] // 2 > 0
    assert any(c.kind == "data" and c.axis == "cp" for c in cp.comms)
    assert cp.activation_bytes_per_microbatch < alone.activation_bytes_per_microbatch * 0.6
    # The load-balancing loss sums [4 experts] fp32 twice forward and once backward per microbatch;
    # a capacity factor gathers each router's ids, [1, 64, 2] int64 per layer and microbatch.
    sums = [(c.calls, c.payload_bytes) for c in cp.comms if c.kind == "context" and c.op == "all_reduce"]
    assert sums == [(3 * 2, 3 * 2 * 4 * 4)]
    capped = _report("data = 2, cp = 2", ep.replace("experts -> data", "experts -> data, seq -> cp"),
                     model=MIXTRAL.replace("dtype", "capacity = 0.75, dtype")).ranks[0]
    gathers = {(c.calls, c.payload_bytes) for c in capped.comms if c.kind == "context" and c.op == "all_gather"}
    kv_only = {(c.calls, c.payload_bytes) for c in cp.comms if c.kind == "context" and c.op == "all_gather"}
    assert gathers - kv_only == {(2 * 2, 2 * 2 * 8 * 64 * 2)}


# -- the language server


def test_hover_on_the_seq_entry_says_which_parallelism_it_is() -> None:
    from meshllm_dsl.lsp.analysis import Analysis
    from meshllm_dsl.lsp.hover import hover

    root = Path(__file__).resolve().parents[2]
    path = root / "examples" / "llama3_8b_128k.mesh"
    text = path.read_text()
    got = hover(Analysis(str(path), text), text.index("seq -> cp") + 2)
    assert got is not None
    assert "**context parallelism** over cp (8)" in got[0] and "16,384 of 131,072 tokens" in got[0]
    assert "512.00 MiB per layer" in got[0]
    tiny = _spec("tensor = 2", MEGATRON + "    layout { seq -> tensor }")
    sp = hover(Analysis("t.mesh", tiny), tiny.index("seq -> tensor") + 1)
    assert sp is not None and "**sequence parallelism** over tensor (2)" in sp[0]
    tiny = _spec("tensor = 2, cp = 2", MEGATRON + "    layout { seq -> tensor * cp }")
    both = hover(Analysis("t.mesh", tiny), tiny.index("seq -> tensor") + 1)
    assert both is not None and "**context parallelism** over cp (2)" in both[0]
    assert "**sequence parallelism** over tensor (2): norms and the residual stream hold [b, s / 4, hidden]" in both[0]


def test_suggest_searches_context_sizes_for_long_sequences() -> None:
    """Llama 3 8B on 8 H100s with one sequence of 131,072 tokens: no batch to split, so the fastest
    plan that fits splits the sequence (context 4 x tensor 2, `recompute = ops`; with compiled
    blocks, sequence parallelism inside saves 4.5 GiB but is priced 15 ms slower a step, so it is
    not the fastest); at 4,096 tokens no context-parallel plan is searched."""
    from meshllm_dsl.parallel.devices import PROFILES
    from meshllm_dsl.planner.suggest import candidates, suggest

    path = str(Path(__file__).resolve().parents[2] / "examples" / "llama3_8b_128k.mesh")
    res = suggest(path, "llama3_8b", devices=8, device=PROFILES["h100"], batch=1, seq=131072, top=1)
    best = res.ranked[0]
    assert best.candidate.context == 4 and best.candidate.tensor == 2
    assert "seq -> cp }" in best.text and "zero 3 over cp" in best.text
    model = check_text(Path(path).read_text(), path).models["llama3_8b"]
    assert all(c.context == 1 for c in candidates(model, 8, 8, 8, 4096))
    # seq into 2 x cp chunks: 131,072 = 2^17 splits over every divisor of 8.
    assert {c.context for c in candidates(model, 8, 1, 8, 131072)} == {1, 2, 4, 8}


def test_suggest_writes_sequence_parallelism_inside_context_parallelism_as_one_entry() -> None:
    import attrs

    from meshllm_dsl.planner.suggest import candidates, plan_text

    path = Path(__file__).resolve().parents[2] / "examples" / "llama3_8b_128k.mesh"
    src = path.read_text()
    model = check_text(src, str(path)).models["llama3_8b"]
    both = attrs.evolve(next(c for c in candidates(model, 8, 1, 8, 131072) if c.context > 1 and c.tensor > 1),
                        seq_parallel=True)
    text = plan_text(both, model, "h100", 1, 131072)
    assert "seq -> tensor * cp }" in text and text.count("seq ->") == 1
    result = check_text(src[: src.index("plan ")] + "\n" + text, str(path))
    assert result.ok, [d.message for d in result.diagnostics]
    roles = result.plans["suggested"].roles
    assert roles.sequence == ("tensor",) and roles.context == ("cp",)


def test_explain_shows_the_sequence_split_over_the_context_axis() -> None:
    from meshllm_dsl.views.explain import explain_text

    text = _spec("data = 2, cp = 2", "    layout { batch -> data, seq -> cp }")
    (plan,) = check_text(text, "t.mesh").plans.values()
    out = explain_text(plan)
    assert "placements=(Shard(dim=0), Shard(dim=1))  # Shard(batch) over data, Shard(seq) over cp" in out
    assert "rank i holds chunks i and 3 - i of 4" in out
    # Sequence parallelism inside: the norms' activations split over both, cp first.
    both = _spec("tensor = 2, cp = 2", MEGATRON + "    layout { seq -> tensor * cp }")
    out = explain_text(check_text(both, "t.mesh").plans["p"])
    assert "input   placements=(_StridedShard(dim=1, sf=2), Shard(dim=1))  # Shard(seq) over cp x tensor" in out
