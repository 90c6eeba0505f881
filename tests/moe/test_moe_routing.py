"""Routing of the `moe` layer (runtime/moe/routing.py): the load-balancing loss and router z-loss
added to the training loss, capacity dropping, and the checks on both.

Against transformers: a tiny Mixtral with output_router_logits (its own forward's aux_loss and its
router_aux_loss_coef) gives our loss and every gradient. On gloo ranks: tensor, data x microbatches,
ZeRO-3, pipeline and pipeline x context plans with the router losses (and a capacity factor, but
under context parallelism) equal the unsharded reference (which routes densely, and adds the router
losses per forward the plan runs: microbatch x data rank); pipeline stages under `precision` carry
the routing statistics in fp32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from hf_models import error_job  # noqa: E402
from moe_specs import MODELS, compile_spec, layout_lines, plan_spec  # noqa: E402
from reference_jobs import compare_job  # noqa: E402
from test_moe_hf import build_moe  # noqa: E402
from test_moe_plans import PLANS  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.planner.moe import router_statistics_bytes as plan_statistics_bytes  # noqa: E402
from meshllm_dsl.runtime.jobs.compare import TOLERANCE  # noqa: E402
from meshllm_dsl.runtime.moe import routing as moe_routing  # noqa: E402

COEF, Z_COEF = 0.05, 0.01
_PIPE_DATA = "    layout { batch -> data }\n    microbatches = 2\n    stages over pipeline "
_PLANS = {**PLANS, "pipeline2_data2": ("pipeline = 2, data = 2", "", ""),
          "pipeline2": ("pipeline = 2", "", "    microbatches = 2\n    stages over pipeline balanced\n"),
          "data2": ("data = 2", "", ""),
          "pipeline2_cp2": ("pipeline = 2, cp = 2", "", "    layout { seq -> cp }\n    microbatches = 2\n"
                            "    stages over pipeline balanced\n")}


def _spec(model: str, plan: str, routing: str, rest: str = "") -> str:
    axes, layout, plan_rest = _PLANS[plan]
    if layout:
        plan_rest = layout_lines(model, layout, replicate_routers=True) + plan_rest
    text = MODELS[model].replace(" dtype = fp32 }", f" dtype = fp32, {routing} }}")
    return plan_spec(axes, text, rest + plan_rest, batch=8)


def _compiled(text: str, name: str, tmp_path: Path) -> tuple[str, int]:
    return compile_spec(text, name, tmp_path)[:2]


# -- in process: the functions against transformers and their definitions


def test_load_balancing_loss_with_an_attention_mask_matches_transformers() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    gen = torch.Generator().manual_seed(5)
    layers = [torch.randn(3 * 5, 6, generator=gen, requires_grad=True) for _ in range(3)]
    mask = (torch.rand(3, 5, generator=gen) > 0.3).long()
    want = load_balancing_loss_func(tuple(layers), 6, 2, mask)
    got = moe_routing.load_balancing_loss(layers, 6, 2, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(torch.autograd.grad(got, layers), torch.autograd.grad(want, layers)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_z_loss_is_st_moe_summed_over_layers() -> None:
    gen = torch.Generator().manual_seed(6)
    layers = [torch.randn(7, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    want = sum(sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in layer.tolist()) / 7 for layer in layers)
    assert abs(moe_routing.z_loss(layers).item() - want) < 1e-12


def test_capacity_drops_pairs_past_each_expert_in_token_order() -> None:
    gen = torch.Generator().manual_seed(7)
    t, e, k, factor = 13, 4, 2, 0.75
    x, w = torch.randn(t, 8, generator=gen), torch.randn(e, 8, generator=gen)
    full_w, full_idx, _ = moe_routing.route(x, w, k, True, True)
    weights, idx, _ = moe_routing.route(x, w, k, True, True, capacity=factor)
    limit = math.ceil(factor * t * k / e)
    assert limit == moe_routing.capacity_of(factor, t, k, e) == 5
    taken = [0] * e
    for tok in range(t):  # by token position, then choice rank: the documented order
        for c in range(k):
            ex = int(full_idx[tok, c])
            if taken[ex] < limit:
                taken[ex] += 1
                assert int(idx[tok, c]) == ex and weights[tok, c] == full_w[tok, c]
            else:
                assert int(idx[tok, c]) == moe_routing.DROPPED and weights[tok, c] == 0
    assert max(taken) == limit and (idx == moe_routing.DROPPED).any()  # something was dropped
    # dropless by default: the same ids as without a capacity
    assert torch.equal(moe_routing.route(x, w, k, True, True, capacity=0.0)[1], full_idx)


def test_capacity_above_experts_over_top_k_is_refused() -> None:
    result = check_text(_spec("mixtral", "single", "capacity = 2.5"), "cap.mesh")
    (d,) = [d for d in result.diagnostics if d.is_error]
    assert d.code == "E0307" and "capacity = 2.5 is more than experts / top_k = 2" in d.message
    assert check_text(_spec("mixtral", "single", "capacity = 2"), "ok.mesh").ok


# -- transformers' Mixtral with output_router_logits: loss and gradients


def hf_loss_job(ctx: Any, path: str, weights: str, tokens: Any, targets: Any) -> Any:
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), weights=weights)
    loss = built.train_step(tokens, targets)
    return loss, built.full_grads()


def test_mixtral_router_loss_and_gradients_match_transformers(pool: Any, tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    hf = build_moe("mixtral", directory)
    hf.config.output_router_logits, hf.config.router_aux_loss_coef = True, COEF
    hf.router_aux_loss_coef = COEF
    hf.config.save_pretrained(directory)
    gen = torch.Generator().manual_seed(3)
    tokens, targets = torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen)
    hf.train()
    out = hf(tokens, output_router_logits=True)
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 64), targets.reshape(-1)) + COEF * out.aux_loss
    want.backward()
    text = _spec("mixtral", "single", f"aux_loss_coef = {COEF}").replace("vocab = 64, hidden = 32", "vocab = 64, hidden = 32")
    path, n = _compiled(text, "mixtral_hf_aux", tmp_path)
    loss, grads = pool.run(hf_loss_job, n, path, str(directory), tokens, targets)[0]
    assert abs(loss - want.item()) < 1e-5
    assert out.aux_loss.item() > 1.0  # the term is there to be seen (its minimum is 1: balanced)
    hp = dict(hf.named_parameters())
    for i in range(2):
        pre = f"model.layers.{i}.mlp"
        router = hp[f"{pre}.gate.weight"].grad
        torch.testing.assert_close(grads[f"blocks.{i}.mlp.router.weight"], router, rtol=0, atol=1e-5)
        gate, up = hp[f"{pre}.experts.gate_up_proj"].grad.chunk(2, dim=1)  # [E, F, H] each
        torch.testing.assert_close(grads[f"blocks.{i}.mlp.gate.weight"], gate.transpose(0, 1), rtol=0, atol=1e-5)
        torch.testing.assert_close(grads[f"blocks.{i}.mlp.up.weight"], up.transpose(0, 1), rtol=0, atol=1e-5)
        down = hp[f"{pre}.experts.down_proj"].grad  # [E, H, F]
        torch.testing.assert_close(grads[f"blocks.{i}.mlp.down.weight"], down.transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(grads["embed.weight"], hp["model.embed_tokens.weight"].grad, rtol=0, atol=1e-5)
    # Without the aux term the router gradients differ by far more than the tolerance.
    plain = hf(tokens).logits
    hf.zero_grad()
    torch.nn.functional.cross_entropy(plain.reshape(-1, 64), targets.reshape(-1)).backward()
    gap = (grads["blocks.0.mlp.router.weight"] - hp["model.layers.0.mlp.gate.weight"].grad).abs().max().item()
    assert gap > 1e-3
    # Pipeline stages (GPipe, 2 microbatches): transformers' loss per microbatch (each a forward with
    # its own aux_loss over both layers, which sit on different stages), averaged
    hf.zero_grad()
    halves = [hf(tok, output_router_logits=True) for tok in tokens.chunk(2)]
    want = sum(torch.nn.functional.cross_entropy(o.logits.reshape(-1, 64), tgt.reshape(-1)) + COEF * o.aux_loss
               for o, tgt in zip(halves, targets.chunk(2))) / 2
    want.backward()
    path, n = _compiled(_spec("mixtral", "pipeline2", f"aux_loss_coef = {COEF}"), "mixtral_hf_aux_pp", tmp_path)
    loss, grads = pool.run(hf_loss_job, n, path, str(directory), tokens, targets)[1]
    assert abs(loss - want.item()) < 1e-5
    for name, ours in [("blocks.0.mlp.router.weight", "model.layers.0.mlp.gate.weight"),
                       ("blocks.1.mlp.router.weight", "model.layers.1.mlp.gate.weight"),
                       ("embed.weight", "model.embed_tokens.weight")]:
        torch.testing.assert_close(grads[name], hp[ours].grad, rtol=0, atol=1e-5)
    # import-hf reads the coefficient (transformers adds it only with output_router_logits) ...
    from meshllm_dsl.interop.import_hf import model_settings

    cfg = json.loads((directory / "config.json").read_text())
    assert ("aux_loss_coef", COEF) in [(name, v) for name, v, _ in model_settings(cfg, "config.json")[1]]
    cfg["output_router_logits"] = False
    assert "aux_loss_coef" not in [name for name, _, _ in model_settings(cfg, "config.json")[1]]
    # ... and --weights refuses a model whose coefficient differs from the checkpoint's
    other, _ = _compiled(_spec("mixtral", "single", "aux_loss_coef = 0.0"), "mixtral_no_aux", tmp_path)
    (msg,) = set(pool.run(error_job, 1, other, str(directory)))
    assert "router_aux_loss_coef" in msg and "0.05" in msg, msg


# -- gloo ranks against the unsharded reference

CASES = {  # model, plan, extra plan lines
    "mixtral_data2_tensor2_micro2": ("mixtral", "data2_tensor2", "    microbatches = 2\n"),
    # The routing statistics travel between stages: the last stage adds the whole forward's losses.
    "mixtral_pipeline2_tensor2_1f1b": ("mixtral", "pipeline2_tensor2", "    schedule 1f1b\n"),
    # 4 stages on 2 ranks, one moe layer each; FSDP2's stage modules (whose type the schedules test)
    "qwen3_moe_pipeline2_data2_interleaved_zero3": ("qwen3_moe", "pipeline2_data2", _PIPE_DATA
                                                    + "virtual 2 balanced\n    schedule interleaved_1f1b\n"
                                                    "    optimizer adamw { zero 3 }\n"),
    # Every stage's statistics are this context rank's share: the last stage sums them over cp.
    "mixtral_pipeline2_cp2": ("mixtral", "pipeline2_cp2", ""),
    "qwen2_moe_tensor2": ("qwen2_moe", "tensor2", ""),
    "qwen3_moe_zero3_recompute": ("qwen3_moe", "data2_tensor2_zero3_recompute", ""),
}


@pytest.mark.parametrize("case", CASES)
def test_router_losses_and_capacity_equal_the_reference(case: str, pool: Any, tmp_path: Path) -> None:
    model, plan, rest = CASES[case]
    routing = f"aux_loss_coef = {COEF}, z_loss_coef = {Z_COEF}"
    if "cp" not in case:  # a capacity's token order is the whole sequence's: refused with context (E0411)
        routing += ", capacity = 1.0"
    text = _spec(model, plan, routing, rest)
    if "interleaved" in case:
        text = text.replace("layers = 2", "layers = 4")
    path, n = _compiled(text, case, tmp_path)
    for rank_errs in pool.run(compare_job, n, path, 2):
        for dtype, errs in rank_errs.items():
            worst = max(errs, key=errs.__getitem__)
            assert errs[worst] <= TOLERANCE[dtype], (dtype, worst, errs[worst])


# -- pipeline stages under `precision`: the routing statistics cross stages in fp32

# Every form of `precision`: autocast at ZeRO 0, FSDP2's MixedPrecisionPolicy at 1 (Megatron's
# distributed optimizer), 2 (gradients reduced in bf16) and 3 (in fp32).
_PRECISIONS = {
    zero: f"    optimizer adamw {{ zero {zero} }}\n    precision {{ params = bf16, master = fp32{reduce} }}\n"
    for zero, reduce in ((0, ""), (1, ""), (2, ", reduce = bf16"), (3, ", reduce = fp32"))
}


class _Seen:
    """A RouterLosses that keeps every stage's incoming statistics and the whole forwards' ones."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.carried, self.whole = inner, [], []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def statistics(self, logits: Any, carried: Any, dtype: Any, device: Any, **kwargs: Any) -> Any:
        if carried is not None:
            self.carried.append(carried.detach().clone())
        return self.inner.statistics(logits, carried, dtype, device, **kwargs)

    def loss(self, stats: Any, sequence_sum: Any = None) -> Any:
        self.whole.append(stats.detach().clone())
        return self.inner.loss(stats, sequence_sum)


def bf16_step_job(ctx: Any, paths: list[str]) -> Any:
    """Per module: one bf16 training step's loss, every gradient, and the statistics the router losses saw."""
    from meshllm_dsl.runtime.jobs.compare import reference_batches
    from meshllm_dsl.verify.equivalence import load_generated

    out = []
    for path in paths:
        program = load_generated(path).PROGRAM
        built = program.build(ctx.mesh(program.axes), seed=0)
        built.router_losses = seen = _Seen(built.router_losses)
        ((tokens, targets),) = reference_batches(program.vocab, program.batch, program.seq, 1, 0)
        loss = built.train_step(tokens, targets)
        out.append((loss, built.full_grads(), seen.carried, seen.whole))
    return out


def test_router_losses_with_pipeline_stages_under_precision_match_the_plan_without(pool: Any, tmp_path: Path) -> None:
    """bf16 compute with fp32 master weights at ZeRO 0-3: pipeline 2 x data 2 against data 2 alone,
    the same forwards (2 sequences each) in the same precision, whose statistics never leave a rank.
    FSDP2 would cast the statistics a stage receives to bf16; at seq 256 stage 0 hands on more than
    256 top-k pairs per expert, which bf16 cannot count exactly."""
    routing = f"aux_loss_coef = {COEF}, z_loss_coef = {Z_COEF}"
    paths: dict[str, list[str]] = {"piped": [], "flat": []}
    for zero, precision in _PRECISIONS.items():
        piped = _spec("mixtral", "pipeline2_data2", routing, _PIPE_DATA + "balanced\n" + precision)
        flat = _spec("mixtral", "data2", routing, "    layout { batch -> data }\n    microbatches = 2\n" + precision)
        (plan,) = check_text(piped, "p.mesh").plans.values()
        assert plan_statistics_bytes(plan) == (2 * 4 + 3) * 4  # fp32 beside the bf16 activations
        for name, text in (("piped", piped), ("flat", flat)):
            paths[name].append(_compiled(text.replace("seq = 8", "seq = 256"), f"bf16_{name}_zero{zero}", tmp_path)[0])
    want = pool.run(bf16_step_job, 2, paths["flat"])[0]
    rows = 2 * 256  # one forward: 2 sequences
    received = 0
    for rank in pool.run(bf16_step_job, 4, paths["piped"]):
        for zero, (loss, grads, carried, whole), (want_loss, want_grads, _, _) in zip(_PRECISIONS, rank, want):
            # The same bf16 operations on the same rows (measured: losses equal to the last bit); a
            # bf16-rounded statistic would move the aux loss by ~1e-5 relative. Gradients reduced in
            # bf16 add the microbatches in another order: within 2 bf16 ulps (2 x 2^-8).
            assert loss == pytest.approx(want_loss, rel=1e-6), zero
            tol = 8e-3 if "reduce = bf16" in _PRECISIONS[zero] else 1e-5
            for name, g in want_grads.items():
                assert (grads[name] - g).abs().max() <= tol * g.abs().max(), (zero, name)
            for stats, layers in [(s, 1) for s in carried] + [(s, 2) for s in whole]:
                counts = stats[:4]
                assert stats.dtype == torch.float32, zero
                assert stats[8] == layers * rows and counts.sum() == 2 * layers * rows  # top 2 of every row
                assert torch.equal(counts, counts.round())
            # stage 1 received counts no bf16 holds (odd, past 256): they arrived exact
            if carried:
                received += 1
                assert any(((c[:4] > 256) & (c[:4] % 2 == 1)).any() for c in carried), zero
    assert received == 2 * len(_PRECISIONS)  # both stage-1 ranks, every form


# -- meshc run --profile: tokens per expert per layer


def profile_counts_job(ctx: Any, path: str, out: str) -> Any:
    """profile_train's routing report, and the unsharded reference's own routing of the warm-up batch."""
    from meshllm_dsl.runtime.model.reference import build_reference
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.runtime.train.profile import profile_train
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    batches = [synthetic_batch(program.vocab, program.batch, program.seq, 0, s) for s in range(4)]
    ref = build_reference(dict(program.model), program.dtype, seed=0)
    with moe_routing.recording(keep_logits=False) as log, torch.no_grad():
        ref(batches[0][0])
    return profile_train(built, batches, out)["routing"], [counts for counts, _ in log.per_layer()]


def test_profile_counts_tokens_per_expert_per_layer(pool: Any, tmp_path: Path) -> None:
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.views.profile_report import compare, read_ranks, report_text

    # recompute = blocks: the blocks' forwards run again in backward; those routings are not counted
    text = _spec("mixtral", "tensor2", "capacity = 1.0", "    recompute = blocks\n")
    path, n = _compiled(text, "profiled", tmp_path)
    runs = pool.run(profile_counts_job, n, path, str(tmp_path / "profile"))
    (routing, want), other = runs
    assert other[0] == routing  # tensor ranks route the same tokens alike
    assert [x["layer"] for x in routing] == ["blocks.0.mlp", "blocks.1.mlp"]
    limit = math.ceil(1.0 * 64 * 2 / 4)  # batch 8 x seq 8 tokens, top 2 of 4 experts
    for x, reference in zip(routing, want):
        assert x["tokens_per_expert"] == reference  # the reference routes with the same drops
        assert sum(x["tokens_per_expert"]) + x["dropped"] == 64 * 2 and max(x["tokens_per_expert"]) <= limit
        assert x["max_over_mean"] == max(reference) / (sum(reference) / 4)
    (plan,) = check_text(text, "profiled.mesh").plans.values()
    report = report_text(compare(plan, read_ranks(tmp_path / "profile")))
    first = routing[0]
    assert (f"blocks.0.mlp  [{', '.join(map(str, first['tokens_per_expert']))}]  max / mean "
            f"{first['max_over_mean']:.2f}, busiest share {first['busiest_share']:.3f}") in report


def test_expert_parallel_with_capacity_and_router_losses_equals_the_reference(pool: Any, tmp_path: Path) -> None:
    """Dropped pairs (id -1) travel to no expert rank; capacity counts each source rank's tokens."""
    from test_moe_expert_parallel import ep_spec

    text = ep_spec("mixtral", "ep2_tensor2").replace(
        " dtype = fp32 }", f" dtype = fp32, aux_loss_coef = {COEF}, z_loss_coef = {Z_COEF}, capacity = 0.75 }}")
    path, n = _compiled(text, "ep_capacity", tmp_path)
    for rank_errs in pool.run(compare_job, n, path, 2):
        for dtype, errs in rank_errs.items():
            worst = max(errs, key=errs.__getitem__)
            assert errs[worst] <= TOLERANCE[dtype], (dtype, worst, errs[worst])


def test_export_config_carries_the_aux_coefficient_and_refuses_a_capacity(tmp_path: Path) -> None:
    """--export-hf's config.json: transformers' fields for the load-balancing loss; a capacity factor
    (transformers' MoE models are dropless) is refused in one line."""
    from meshllm_dsl.runtime.hf.weights import WeightsError, hf_config
    from meshllm_dsl.verify.equivalence import load_generated

    path, _ = _compiled(_spec("mixtral", "single", f"aux_loss_coef = {COEF}"), "export_aux", tmp_path)
    cfg = hf_config(load_generated(path).PROGRAM.model, torch.float32)
    assert cfg["output_router_logits"] is True and cfg["router_aux_loss_coef"] == COEF
    path, _ = _compiled(_spec("mixtral", "single", "capacity = 1.0"), "export_cap", tmp_path)
    with pytest.raises(WeightsError, match=r"drops tokens past capacity = 1; transformers' MixtralForCausalLM is "
                                           r"dropless .* expected capacity = 0"):
        hf_config(load_generated(path).PROGRAM.model, torch.float32)
