"""Packed rows with document masks (`pack = documents`, `positions = restart`) and ignored targets.

In process: attention of packed rows gives every document's outputs and gradients as run alone,
with windows, soft caps, sinks and GQA; the cross-entropies skip IGNORE targets. On the shared gloo
pool (tests/conftest.py): plans compiled by meshc train 3 AdamW steps on packed batches (random
document boundaries, ignored targets) while the unsharded reference runs every document alone
(runtime/jobs/compare.py): logits, losses, every gradient and parameter EQUAL in float64 (and within
float32's tolerance), unsharded, under tensor and sequence parallelism, context parallelism 2 and 4
(head-tail chunks), data x context and pipeline schedules; with ignored targets alone, sharded ==
unsharded under data x context, tensor x data and pipeline.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from mesh_snippets import MEGATRON

from meshllm_dsl.checker import check_text

torch = pytest.importorskip("torch")

from meshllm_dsl.runtime.data.corpus import IGNORE  # noqa: E402
from meshllm_dsl.runtime.jobs.compare import TOLERANCE, packed_batches  # noqa: E402
from meshllm_dsl.runtime.model import documents, layers  # noqa: E402

LLAMA = "model m = llama { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, dtype = fp32 }"
GPT2 = "model m = gpt2 { vocab = 64, hidden = 32, layers = 2, heads = 4, positions = 16 }"
GEMMA2 = ("model m = gemma2 { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, head_dim = 8, "
          "ffn = 64, window = 3, dtype = fp32 }")
GPT_OSS = ("model m = gpt_oss { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, head_dim = 8, ffn = 24,"
           " experts = 4, top_k = 2, window = 4, dtype = fp32 }")
MLA = ("model m {\n    vocab = 64, hidden = 32, layers = 2, heads = 4, ffn = 48, dtype = fp32\n"
       "    embed = embedding(vocab, hidden)\n    blocks = repeat(layers) {\n        attn_norm = rmsnorm(hidden)\n"
       "        attn = mla(hidden, heads, 8, 6, 4, 5, q_lora_rank = 16)\n"
       "        mlp_norm = rmsnorm(hidden)\n        mlp = mlp(hidden, ffn)\n    }\n"
       "    norm = rmsnorm(hidden)\n    lm_head = linear(hidden, vocab)\n}")
MIXTRAL_LOSSES = ("model m = mixtral { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 48, experts = 4, "
                  "top_k = 2, aux_loss_coef = 0.05, z_loss_coef = 0.01, dtype = fp32 }")
# DeepSeek-V3's routing (sigmoid scores in groups, the correction bias, a shared expert) and its
# sequence-wise balance loss, beside mla.
DEEPSEEK_SEQ_AUX = MLA.replace("mlp = mlp(hidden, ffn)", "mlp = moe(hidden, 16, 8, 2, scoring = sigmoid, groups = 4, "
                               "topk_groups = 2, routed_scaling = 2.5, shared_experts = 1, shared_ffn = 32, "
                               "balance_rate = 0.01, seq_aux_loss = 0.001)")
PACK = "    pack = documents\n"
RESTART = PACK + "    positions = restart\n"
PER_DOCUMENT = "    context_balance = per_document\n"
PTRR = "    context_balance = ptrr\n"


def _spec(axes: str, body: str, model: str = LLAMA, seq: int = 16, batch: int = 4) -> str:
    return f"mesh m {{ axes {axes} }}\n{model}\nplan p on m for m {{\n    batch = {batch}\n    seq = {seq}\n{body}}}\n"


# -- in process


def _rows(seed: int, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document numbers [b, s] with random boundaries and their restarting positions."""
    (batch,) = packed_batches(64, b, s, 1, seed, documents=True, restart=True)
    assert batch.documents is not None and batch.positions is not None
    return batch.documents, batch.positions


@pytest.mark.parametrize("kw", [{}, {"window": 3}, {"softcap": 2.0}, {"scale": 0.3}, {"sinks": True}])
def test_packed_attention_is_each_document_alone(kw: dict[str, Any]) -> None:
    """Outputs and q / k / v gradients of packed rows == each document's attention alone (float64)."""
    gen = torch.Generator().manual_seed(3)
    b, s, h, kvh, d = 3, 12, 4, 2, 8
    q, k, v = (torch.randn(b, s, n, d, generator=gen, dtype=torch.float64, requires_grad=True) for n in (h, kvh, kvh))
    docs, _ = _rows(5, b, s)
    assert (docs.max(1).values > 0).any(), "some row holds several documents"
    extra = dict(kw)
    if extra.pop("sinks", False):
        extra["sinks"] = torch.randn(h, generator=gen, dtype=torch.float64)
    grad = torch.randn(b, s, h * d, generator=gen, dtype=torch.float64)
    with documents.packed(documents.Packing(docs, docs, None)):
        out = layers.attention(q, k, v, **extra)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    for row in range(b):
        for doc in docs[row].unique().tolist():
            sel = (docs[row] == doc).nonzero().flatten()
            qa, ka, va = (t[row : row + 1, sel].detach().requires_grad_() for t in (q, k, v))
            alone = layers.attention(qa, ka, va, **extra)
            ga = torch.autograd.grad(alone, (qa, ka, va), grad[row : row + 1, sel])
            assert torch.allclose(out[row, sel], alone[0], atol=1e-12, rtol=0)
            for packed_grad, alone_grad in zip((dq, dk, dv), ga):
                assert torch.allclose(packed_grad[row, sel], alone_grad[0], atol=1e-12, rtol=0)
    # The mask matters: the same rows attended across documents differ.
    plain = layers.attention(q, k, v, **extra)
    assert (plain - out).abs().max() > 1e-3


def test_rotary_takes_the_rows_positions() -> None:
    _, pos = _rows(7, 2, 10)
    with documents.packed(documents.Packing(None, None, pos)):
        got = layers.positions(10, "cpu")
    assert torch.equal(got, pos) and torch.equal(layers.positions(10, "cpu"), torch.arange(10))


def test_cross_entropy_skips_ignored_targets() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 10, (2, 6), generator=gen)
    targets[0, :4] = IGNORE
    kept = targets != IGNORE
    loss = layers.cross_entropy(logits, targets)
    want = torch.nn.functional.cross_entropy(logits[kept], targets[kept])
    assert torch.allclose(loss, want, atol=1e-15, rtol=0)
    (g,) = torch.autograd.grad(loss, logits)
    assert g[~kept].abs().max() == 0 and g[kept].abs().max() > 0
    # Every target ignored: a loss of 0 with zero gradients, not torch's 0 / 0.
    none = layers.cross_entropy(logits, torch.full_like(targets, IGNORE))
    (g0,) = torch.autograd.grad(none, logits)
    assert float(none.detach()) == 0.0 and g0.abs().max() == 0
    # The vocab-parallel loss without a group: targets shifted by the shard's start, IGNORE kept.
    shard = layers.vocab_parallel_cross_entropy(logits[..., 4:], torch.where(kept, targets.clamp(min=4), targets), None, 4)
    assert torch.allclose(shard, layers.cross_entropy(logits[..., 4:], torch.where(kept, targets.clamp(min=4) - 4, targets)))


# -- the checker and the generated program


def test_the_plan_settings_reach_the_generated_program() -> None:
    from meshllm_dsl.codegen.emit import render_plan

    text = _spec("cp = 2", RESTART + "    layout { seq -> cp }\n")
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    assert plan.document_mask and plan.restart_positions
    code = render_plan(plan, "t.mesh", text)
    assert "    document_mask=True," in code and "    restart_positions=True," in code
    plain = check_text(_spec("cp = 2", "    layout { seq -> cp }\n"), "t.mesh").plans["p"]
    assert not plain.document_mask and not plain.restart_positions
    assert "document_mask" not in render_plan(plain, "t.mesh", text)
    assert plan.context_balance == plain.context_balance == "headtail" and "context_balance" not in code
    balanced = check_text(_spec("cp = 2", PACK + PTRR + "    layout { seq -> cp }\n"), "t.mesh").plans["p"]
    assert balanced.context_balance == "ptrr"
    assert "    context_balance='ptrr'," in render_plan(balanced, "t.mesh", text)


@pytest.mark.parametrize(("axes", "body", "code"), [
    ("data = 1", "    pack = rows\n", "E0203"),
    ("data = 1", "    positions = reset\n", "E0203"),
    ("data = 1", "    positions = restart\n", "E0309"),
    ("data = 1", RESTART + "    pack = documents\n", "E0201"),  # given twice
    ("data = 1", "    context_balance = documents\n", "E0203"),
    ("data = 1", PACK + PTRR, "E0309"),  # no context axes to spread over
    ("cp = 2", PER_DOCUMENT + "    layout { seq -> cp }\n", "E0309"),  # no documents to balance by
])
def test_packing_refusals(axes: str, body: str, code: str) -> None:
    got = [d.code for d in check_text(_spec(axes, body), "t.mesh").diagnostics]
    assert got == [code], got


# -- on gloo ranks against every document run alone

CASES: dict[str, tuple[str, bool]] = {  # name -> (spec, ignored targets in plain batches)
    "single": (_spec("one = 1", PACK), False),
    "single_restart": (_spec("one = 1", RESTART), False),
    "tensor2_restart": (_spec("tensor = 2", RESTART + MEGATRON), False),
    "cp2_restart": (_spec("cp = 2", RESTART + "    layout { seq -> cp }\n"), False),
    "cp2": (_spec("cp = 2", PACK + "    layout { seq -> cp }\n"), False),
    # 8 chunks of 2 tokens, head-tail: rank i holds chunks i and 7 - i; blocks recomputed in backward
    # see the same mask; one kv head for four query heads.
    "cp4_restart_recompute": (_spec("cp = 4", RESTART + "    layout { seq -> cp }\n    recompute = blocks\n",
                                    LLAMA.replace("kv_heads = 2", "kv_heads = 1")), False),
    # The vocab-parallel loss and sequence parallelism inside context parallelism, 2 microbatches.
    "tensor2_cp2_sp_micro2": (_spec("tensor = 2, cp = 2", RESTART + MEGATRON + "    layout { seq -> tensor * cp }\n"
                                    "    microbatches = 2\n"), False),
    "data2_cp2_zero1": (_spec("data = 2, cp = 2", RESTART + "    layout { batch -> data, seq -> cp }\n"
                              "    optimizer adamw { zero 1 over data * cp, clip = 0.01 }\n"), False),
    # Learned positions restart too; windows and soft caps keep their masks; sinks; mla's attention.
    "gpt2_cp2_restart": (_spec("cp = 2", RESTART + "    layout { seq -> cp }\n", GPT2), False),
    # Megatron sequence parallelism: learned positions added to the whole rows before the split.
    "gpt2_tensor2_sp_restart": (_spec("tensor = 2", RESTART + "    layout { heads -> tensor, ffn -> tensor, "
                                      "vocab -> tensor, seq -> tensor }\n", GPT2), False),
    "gemma2_cp2_restart": (_spec("cp = 2", RESTART + "    layout { seq -> cp }\n", GEMMA2), False),
    "gpt_oss_tensor2_recompute_attention": (_spec("tensor = 2", RESTART + "    layout { heads -> tensor, kv_heads -> tensor, "
                                                  "ffn -> tensor, vocab -> tensor }\n    shard blocks.*.mlp.router replicate\n"
                                                  "    recompute = attention\n", GPT_OSS), False),
    "mla_cp2_restart": (_spec("cp = 2", RESTART + "    layout { seq -> cp }\n", MLA), False),
    # mla's recomputed region (from the gathered latents) reruns with its forward's documents
    "mla_cp2_restart_recompute_attention": (_spec("cp = 2", RESTART + "    layout { seq -> cp }\n    recompute = attention\n",
                                                  MLA), False),
    # Pipeline stages: every schedule's forward of microbatch j runs with microbatch j's rows, on
    # every stage (each rank holds the global batch), and recomputed blocks rerun with them.
    "pipeline2_gpipe_micro4_restart": (_spec("pipeline = 2", RESTART + "    microbatches = 4\n"
                                             "    stages over pipeline balanced\n", batch=8), False),
    "pipeline2_tensor2_1f1b_recompute": (_spec("pipeline = 2, tensor = 2", RESTART + MEGATRON + "    microbatches = 4\n"
                                               "    stages over pipeline balanced\n    schedule 1f1b\n"
                                               "    recompute = blocks\n", LLAMA.replace("layers = 2", "layers = 4"),
                                               batch=8), False),
    "pipeline2_cp2_interleaved_zb": (_spec("pipeline = 2, cp = 2", RESTART + "    layout { seq -> cp }\n"
                                           "    microbatches = 4\n    stages over pipeline virtual 2 balanced\n"
                                           "    schedule interleaved_zb\n", LLAMA.replace("layers = 2", "layers = 4"),
                                           batch=8), False),
    "pipeline2_dualpipev": (_spec("pipeline = 2", PACK + "    microbatches = 4\n    stages over pipeline virtual 2 balanced\n"
                                  "    schedule dualpipev\n", LLAMA.replace("layers = 2", "layers = 4"), batch=8), False),
    # Rows spread over the context ranks by their documents (runtime/parallel/context_layout.py):
    # each row its own order, positions continuing over the row or restarting, every schedule.
    "cp2_per_document_restart": (_spec("cp = 2", RESTART + PER_DOCUMENT + "    layout { seq -> cp }\n"), False),
    "cp4_per_document_recompute": (_spec("cp = 4", PACK + PER_DOCUMENT + "    layout { seq -> cp }\n"
                                         "    recompute = blocks\n", LLAMA.replace("kv_heads = 2", "kv_heads = 1")), False),
    "cp4_ptrr": (_spec("cp = 4", PACK + PTRR + "    layout { seq -> cp }\n", seq=32), False),
    "tensor2_cp2_sp_micro2_ptrr": (_spec("tensor = 2, cp = 2", RESTART + PTRR + MEGATRON
                                         + "    layout { seq -> tensor * cp }\n    microbatches = 2\n"), False),
    "data2_cp2_zero1_per_document": (_spec("data = 2, cp = 2", PACK + PER_DOCUMENT + "    layout { batch -> data, seq -> cp }\n"
                                           "    optimizer adamw { zero 1 over data * cp, clip = 0.01 }\n"), False),
    "gemma2_cp2_per_document": (_spec("cp = 2", PACK + PER_DOCUMENT + "    layout { seq -> cp }\n", GEMMA2), False),
    "gpt2_cp2_ptrr": (_spec("cp = 2", PACK + PTRR + "    layout { seq -> cp }\n", GPT2), False),
    "mla_cp2_ptrr_restart": (_spec("cp = 2", RESTART + PTRR + "    layout { seq -> cp }\n", MLA), False),
    "pipeline2_cp2_1f1b_per_document": (_spec("pipeline = 2, cp = 2", RESTART + PER_DOCUMENT + "    layout { seq -> cp }\n"
                                              "    microbatches = 4\n    stages over pipeline balanced\n    schedule 1f1b\n",
                                              LLAMA.replace("layers = 2", "layers = 4"), batch=8), False),
    # Router losses over each forward's tokens (per layer across the documents; the sequence-wise
    # loss per row) with data x microbatch forwards, context ranks, expert parallelism and stages.
    "mixtral_losses_data2_cp2_micro2_ptrr": (_spec("data = 2, cp = 2", RESTART + PTRR + "    layout { batch -> data, seq -> cp }\n"
                                                   "    microbatches = 2\n", MIXTRAL_LOSSES, batch=8), False),
    "mixtral_losses_experts_over_data2": (_spec("data = 2", PACK + "    layout { batch -> data, experts -> data }\n",
                                                MIXTRAL_LOSSES), False),
    "mixtral_losses_pipeline2_1f1b": (_spec("pipeline = 2", RESTART + "    microbatches = 4\n    stages over pipeline balanced\n"
                                            "    schedule 1f1b\n", MIXTRAL_LOSSES.replace("layers = 2", "layers = 4"),
                                            batch=8), False),
    "deepseek_seq_aux_cp2_per_document": (_spec("cp = 2", RESTART + PER_DOCUMENT + "    layout { seq -> cp }\n",
                                                DEEPSEEK_SEQ_AUX), False),
    # Ignored targets without packing: the loss is the mean over the global batch's counted targets,
    # not a mean of per-rank or per-microbatch means.
    "ignored_data2_cp2_micro2": (_spec("data = 2, cp = 2", "    layout { batch -> data, seq -> cp }\n"
                                       "    microbatches = 2\n", batch=8), True),
    "ignored_tensor2_data2": (_spec("tensor = 2, data = 2", MEGATRON + "    layout { batch -> data }\n"), True),
    "ignored_pipeline2_micro2": (_spec("pipeline = 2", "    microbatches = 2\n    stages over pipeline balanced\n"), True),
}


def _module(name: str, tmp_path: Path) -> tuple[str, int]:
    from meshllm_dsl.codegen.emit import render_plan

    text = CASES[name][0]
    result = check_text(text, f"{name}.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    path = tmp_path / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", text))
    return str(path), plan.mesh.devices


@pytest.mark.parametrize("name", list(CASES))
def test_packed_plan_matches_each_document_alone(name: str, pool: Any, tmp_path: Path) -> None:
    from reference_jobs import compare_job

    path, n = _module(name, tmp_path)
    for rank, errs in enumerate(pool.run(compare_job, n, path, 3, CASES[name][1])):
        for dtype, by_key in errs.items():
            assert any(k.startswith("grad ") for k in by_key), by_key
            bad = {k: v for k, v in by_key.items() if not v <= TOLERANCE[dtype]}
            assert not bad, f"rank {rank}, {dtype}: {bad}"


def _unmasked_job(ctx: Any, path: str) -> float:
    """max |logits with the document mask - logits of the same packed rows without it|."""
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    (batch,) = packed_batches(program.vocab, program.batch, program.seq, 1, 0, documents=True, restart=True)
    masked = built.forward(batch.tokens, batch.documents, batch.positions)
    return float((masked - built.forward(batch.tokens)).abs().max())


def test_the_comparison_sees_the_mask(pool: Any, tmp_path: Path) -> None:
    """The packed batches' rows hold several documents, so leaving the mask out would be caught."""
    path, n = _module("cp2_restart", tmp_path)
    assert min(pool.run(_unmasked_job, n, path)) > 1e-3


def test_the_planner_says_the_plan_masks_documents_and_prices_attention_over_seq() -> None:
    from meshllm_dsl.parallel.devices import PROFILES
    from meshllm_dsl.planner.analyze import analyze
    from meshllm_dsl.planner.report import report_json, report_text

    plan = check_text(_spec("cp = 2", RESTART + "    layout { seq -> cp }\n"), "t.mesh").plans["p"]
    rep = analyze(plan, PROFILES["h100"])
    assert "documents masked apart in every row (`pack = documents`, positions restart)" in report_text(rep)
    data = report_json(rep)
    assert data["document_mask"] and data["restart_positions"]
    # No document lengths, no guess: the step is priced as the unmasked plan's.
    plain = analyze(check_text(_spec("cp = 2", "    layout { seq -> cp }\n"), "t.mesh").plans["p"], PROFILES["h100"])
    assert report_json(plain)["step"] == data["step"] and "documents masked" not in report_text(plain)


def test_a_capacity_factor_is_refused_with_document_masks() -> None:
    """A capacity drops (token, expert) pairs by the whole forward's token order: not what each document
    alone computes, which is what `meshc verify` compares with (E0309 until it compares otherwise).
    Router losses are over the forward's tokens on both sides and pass."""
    mixtral = ("model m = mixtral { vocab = 64, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 48, experts = 4, "
               "top_k = 2, capacity = 1.5, dtype = fp32 }")
    got = [d.code for d in check_text(_spec("data = 1", PACK, mixtral), "t.mesh").diagnostics]
    assert got == ["E0309"], got
    assert check_text(_spec("data = 1", PACK, MIXTRAL_LOSSES), "t.mesh").ok
    assert check_text(_spec("data = 1", PACK, DEEPSEEK_SEQ_AUX), "t.mesh").ok


@pytest.mark.parametrize("kw", [{}, {"window": 5}, {"softcap": 2.0}, {"scale": 0.3}])
@pytest.mark.parametrize("context", [False, True, "per_document"])
def test_the_flex_block_mask_holds_the_same_pairs_as_the_boolean_mask(kw: dict[str, Any], context: bool | str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's mask_mod, run here through flex_attention's eager forward (torch 2.13 has no CPU
    backward; tests/gpu compares gradients on CUDA): the pairs the BlockMask admits are the boolean
    mask's, also for a context rank's head-tail queries against keys gathered in rank order, and for
    rows each spread by their documents (each row's own positions [b, s])."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from meshllm_dsl.runtime.parallel import context_layout

    monkeypatch.setattr(layers, "_FLEX", flex_attention)
    b, s, h, kvh, d = 2, 64, 4, 2, 16
    docs, _ = _rows(0, b, s)
    gen = torch.Generator().manual_seed(0)
    k_pos = torch.arange(s)
    if context:  # rank 1 of 2: chunks 1 and 2 of 4; keys in rank order, rank 0's chunks 0 and 3 first
        k_pos = torch.cat([torch.arange(0, 16), torch.arange(48, 64), torch.arange(16, 48)])
    q_pos = k_pos[32:] if context else k_pos
    if context == "per_document":  # rank 1 of 2, each row its own order
        k_pos = context_layout.layout(docs, 2, "per_document")
        q_pos = k_pos[:, 32:]
    packing = documents.Packing(docs.gather(1, q_pos.expand(b, -1)), docs.gather(1, k_pos.expand(b, -1)), None)
    q = torch.randn(b, h, q_pos.shape[-1], d, generator=gen)
    k, v = (torch.randn(b, kvh, s, d, generator=gen) for _ in range(2))
    with warnings.catch_warnings():  # flex_attention's eager forward warns (once) that it is slow
        warnings.simplefilter("ignore", UserWarning)
        out = layers.flex_masked_attention(q, k, v, q_pos, k_pos, packing, **kw)
        again = layers.flex_masked_attention(q, k, v, q_pos, k_pos, packing, **kw)
    # Every layer of a forward reads the one BlockMask built for its rows.
    assert len(packing.block_masks) == 1 and torch.equal(out, again)
    allowed = documents.same_document(layers._allowed(q_pos, k_pos, kw.get("window", 0)), packing)
    if "softcap" in kw:
        want = layers._softcapped_attention(q, k, v, allowed, d ** -0.5, kw["softcap"])
    else:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True, scale=kw.get("scale"))
    assert (out - want).abs().max() < 1e-5


@pytest.mark.parametrize("balance", ["", PER_DOCUMENT])
def test_meshc_verify_compares_on_packed_batches(tmp_path: Path, capsys: pytest.CaptureFixture[str], balance: str) -> None:
    """`meshc verify` of a plan with `pack = documents`: its tiny twin trains on packed batches while the
    unsharded model runs each document alone, and says so."""
    from meshllm_dsl.cli.main import main

    spec = tmp_path / "packed.mesh"
    spec.write_text(_spec("tensor = 2, cp = 2", RESTART + balance + MEGATRON + "    layout { seq -> cp }\n"))
    assert main(["verify", str(spec)]) == 0
    out = capsys.readouterr().out
    spread = ", each row spread over the context ranks by its documents (`per_document`)" if balance else ""
    assert ("on packed batches: random document boundaries in every row, attention masked at them, positions "
            f"restarting at each{spread}, some targets ignored; the unsharded model runs each document alone") in out, out
    assert "verdict: EQUAL" in out, out


def test_a_recomputed_region_reruns_with_its_forwards_rows() -> None:
    """Backward outside the packed scope (as a pipeline schedule would run it) still reruns the region
    with the document mask its forward had."""
    from meshllm_dsl.runtime.train.remat import recompute

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 12, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    docs, _ = _rows(5, 2, 12)
    with documents.packed(documents.Packing(docs, docs, None)):
        kept = layers.attention(q, k, v)
        rerun = recompute(layers.attention, q, k, v)
    want = torch.autograd.grad(kept.square().sum(), (q, k, v))
    got = torch.autograd.grad(rerun.square().sum(), (q, k, v))  # the rerun happens here, unscoped
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_meshc_fmt_keeps_the_settings() -> None:
    from meshllm_dsl.front.fmt import format_text

    text = _spec("cp = 2", RESTART + "    layout { seq -> cp }\n")
    once = format_text(text, "t.mesh")
    assert "    pack = documents\n    positions = restart\n" in once and format_text(once, "t.mesh") == once
    assert check_text(once, "t.mesh").plans["p"].restart_positions
