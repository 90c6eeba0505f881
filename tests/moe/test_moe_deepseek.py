"""DeepSeekMoE routing in the `moe` layer kind (`scoring = sigmoid`, `groups`, `topk_groups`,
`routed_scaling`, `shared_experts`, `balance_rate`): the layer against transformers' DeepseekV3MoE
and Glm4MoeMoE modules in float64; sharded plans (expert parallelism over data, tensor-parallel
experts, pipeline, context) against the unsharded reference on the shared pool of gloo ranks; the
correction bias's move toward balance, the same on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from moe_specs import compile_spec, plan_spec  # noqa: E402

from meshllm_dsl.runtime.jobs.compare import TOLERANCE  # noqa: E402
from meshllm_dsl.runtime.moe import routing  # noqa: E402
from meshllm_dsl.runtime.moe.experts import ReferenceMoE  # noqa: E402

FAMILY = """family tiny_deepseek(vocab, hidden, layers, heads, ffn, shared_ffn, experts = 8, top_k = 2, groups = 4,
                     topk_groups = 2, routed_scaling = 2.5, balance_rate = 0.0, capacity = 0.0, seq_aux_loss = 0.0,
                     dtype = fp32) {
    embed = embedding(vocab, hidden)
    blocks = repeat(layers) {
        attn_norm = rmsnorm(hidden)
        attn = attention(hidden, heads, heads, hidden / heads)
        mlp_norm = rmsnorm(hidden)
        mlp = moe(hidden, ffn, experts, top_k, scoring = sigmoid, groups = groups, topk_groups = topk_groups,
                  routed_scaling = routed_scaling, shared_experts = 2, shared_ffn = shared_ffn,
                  balance_rate = balance_rate, capacity = capacity, seq_aux_loss = seq_aux_loss)
    }
    norm = rmsnorm(hidden)
    lm_head = linear(hidden, vocab)
}
"""


def model_decl(**settings: Any) -> str:
    dims = {"vocab": 64, "hidden": 32, "layers": 2, "heads": 4, "ffn": 12, "shared_ffn": 24, **settings}
    return FAMILY + "model ds = tiny_deepseek { " + ", ".join(f"{k} = {v}" for k, v in dims.items()) + " }"


TP = "heads -> tensor, ffn -> tensor, shared_ffn -> tensor, vocab -> tensor"
PLANS = {  # mesh axes, plan body
    "ep2": ("data = 2", "    layout { batch -> data, experts -> data }\n"),
    "ep2_tensor2": ("data = 2, tensor = 2",
                    f"    layout {{ {TP}, batch -> data, experts -> data }}\n    shard blocks.*.mlp.router replicate\n"),
    "pipeline2_ep2": ("pipeline = 2, data = 2", "    layout { batch -> data, experts -> data }\n    microbatches = 2\n"
                      "    stages over pipeline balanced\n    schedule 1f1b\n"),
    "context2_ep2": ("data = 2, context = 2", "    layout { batch -> data, seq -> context, experts -> data }\n"),
    # the experts over data x tensor, whole (etp = 1): each tensor rank routes half the tokens
    "ep4_over_tensor": ("data = 2, tensor = 2",
                        f"    layout {{ {TP.replace(' ffn -> tensor,', '')}, batch -> data, experts -> data * tensor }}\n"
                        "    shard blocks.*.mlp.router replicate\n"),
    # FSDP2 over data beside the experts, blocks recomputed in backward (whose rerun counts no load)
    "ep2_tensor2_zero3_recompute": ("data = 2, tensor = 2",
                                    f"    layout {{ {TP}, batch -> data, experts -> data }}\n"
                                    "    shard blocks.*.mlp.router replicate\n    recompute = blocks\n"
                                    "    optimizer adamw { zero 3 }\n"),
}


def ds_spec(plan: str, **settings: Any) -> str:
    axes, body = PLANS[plan]
    return plan_spec(axes, model_decl(**settings), body, batch=8).replace("for m {", "for ds {")


# ------------------------------------------------------------------ against transformers


def _hf_moe(kind: str, groups: int, topk_groups: int, norm: bool) -> Any:
    common = dict(hidden_size=16, moe_intermediate_size=6, n_routed_experts=8, num_experts_per_tok=3,
                  n_group=groups, topk_group=topk_groups, n_shared_experts=2, routed_scaling_factor=2.5,
                  norm_topk_prob=norm, hidden_act="silu")
    if kind == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        return DeepseekV3MoE(tf.DeepseekV3Config(**common))
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
    return Glm4MoeMoE(tf.Glm4MoeConfig(**common))


def _redraw_fp32_exact(module: Any, seed: int) -> None:
    """Weights and the correction bias redrawn away from HF's init (zeros / ones), each value
    exactly a float32 so transformers' float32 router sees the same numbers as the float64 layer."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_((0.5 * torch.randn(t.shape, generator=gen, dtype=torch.float64)).float().double())


def _meshllm_from_hf(hf: Any, norm: bool, groups: int, topk_groups: int) -> ReferenceMoE:
    spec = {"hidden": 16, "ffn": 6, "experts": 8, "top_k": 3, "norm_topk_prob": norm, "weights_fp32": True,
            "shared_ffn": 12, "shared_experts": 2, "scoring": "sigmoid", "groups": groups, "topk_groups": topk_groups,
            "routed_scaling": 2.5}
    ours = ReferenceMoE(spec).double()
    f = 6
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.router.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        gate_up = hf.experts.gate_up_proj  # [E, 2 F, H]: gate rows, then up rows
        ours.gate.weight.copy_(gate_up[:, :f].transpose(0, 1))  # [F, E, H]
        ours.up.weight.copy_(gate_up[:, f:].transpose(0, 1))
        ours.down.weight.copy_(hf.experts.down_proj.transpose(0, 1))  # [E, H, F] -> [H, E, F]
        ours.shared_gate.weight.copy_(hf.shared_experts.gate_proj.weight)
        ours.shared_up.weight.copy_(hf.shared_experts.up_proj.weight)
        ours.shared_down.weight.copy_(hf.shared_experts.down_proj.weight)
    return ours


def _rel(got: Any, want: Any) -> float:
    """max |got - want| relative to max |want|: transformers' router runs in float32 (its logits,
    scores and their gradients), so agreement is to float32 rounding: measured at most 2.1e-7."""
    return float((got - want).abs().max().detach() / want.abs().max().detach())


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize(("groups", "topk_groups", "norm"), [(4, 2, True), (2, 1, False), (1, 1, True)])
def test_the_layer_computes_what_transformers_computes(kind: str, groups: int, topk_groups: int, norm: bool) -> None:
    hf = _hf_moe(kind, groups, topk_groups, norm).double()
    _redraw_fp32_exact(hf, seed=3)
    ours = _meshllm_from_hf(hf, norm, groups, topk_groups)
    x = torch.randn(2, 24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x = x.float().double()  # float32-exact: transformers' router computes in float32
    x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want, got = hf(x_hf), ours(x_ours)
    # The experts chosen must be the same (the routing), then outputs and every gradient agree to
    # float32 rounding of transformers' router (its logits and scores are float32).
    _, want_w, want_idx = hf.gate(x.view(-1, 16))
    got_w, got_idx = routing.choose_sigmoid(torch.nn.functional.linear(x.view(-1, 16), ours.router.weight), 3, norm,
                                            ours.router.e_score_correction_bias, groups, topk_groups, 2.5)
    assert torch.equal(want_idx.sort(-1).values, got_idx.sort(-1).values)
    assert _rel(got, want) < 1e-6
    upstream = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    assert _rel(x_ours.grad, x_hf.grad) < 1e-6
    pairs = {"router.weight": hf.gate.weight, "shared_gate.weight": hf.shared_experts.gate_proj.weight,
             "shared_down.weight": hf.shared_experts.down_proj.weight}
    for name, theirs in pairs.items():
        mine = ours.get_parameter(name)
        assert _rel(mine.grad, theirs.grad) < 1e-6, name
    gate_up = hf.experts.gate_up_proj.grad
    assert _rel(ours.gate.weight.grad, gate_up[:, :6].transpose(0, 1)) < 1e-6
    assert _rel(ours.up.weight.grad, gate_up[:, 6:].transpose(0, 1)) < 1e-6
    assert _rel(ours.down.weight.grad, hf.experts.down_proj.grad.transpose(0, 1)) < 1e-6
    # The bias chooses: it changed the experts picked here (it is not a no-op in this test).
    unbiased = routing.choose_sigmoid(torch.nn.functional.linear(x.view(-1, 16), ours.router.weight), 3, norm,
                                      torch.zeros(8, dtype=torch.float64), groups, topk_groups, 2.5)[1]
    assert not torch.equal(unbiased.sort(-1).values, got_idx.sort(-1).values)
    assert ours.router.e_score_correction_bias.grad is None and "router.e_score_correction_bias" not in dict(
        ours.named_parameters())


# ------------------------------------------------------------------ sharded against unsharded


def _compare(pool: Any, plan: str, tmp_path: Path, steps: int = 2, **settings: Any) -> list[dict[str, dict[str, float]]]:
    from reference_jobs import compare_job

    path, n, _ = compile_spec(ds_spec(plan, **settings), f"ds_{plan}", tmp_path)
    return pool.run(compare_job, n, path, steps)


@pytest.mark.parametrize(("plan", "capacity"), [("ep2", 0), ("ep2_tensor2", 0), ("pipeline2_ep2", 0), ("context2_ep2", 0),
                                              ("ep2_tensor2_zero3_recompute", 0), ("context2_ep2", 1.0),
                                              ("ep4_over_tensor", 0), ("ep4_over_tensor", 1.0)])
def test_deepseek_routing_sharded_equals_the_reference(plan: str, capacity: float, pool: Any, tmp_path: Path) -> None:
    """With `capacity` the pairs past an expert's capacity are dropped (under context parallelism
    counted over the whole sequences) and the load counts only the kept ones."""
    for rank_errs in _compare(pool, plan, tmp_path, balance_rate=0.05, capacity=capacity):
        for dtype, errs in rank_errs.items():
            worst = max(errs, key=errs.__getitem__)
            assert errs[worst] <= TOLERANCE[dtype], (plan, dtype, worst, errs[worst])
            assert any(k.startswith("buffer ") for k in errs)  # the biases were compared


@pytest.mark.parametrize("plan", ["ep2", "ep2_tensor2", "pipeline2_ep2", "context2_ep2", "ep4_over_tensor"])
def test_the_sequence_wise_loss_sharded_equals_the_reference(plan: str, pool: Any, tmp_path: Path) -> None:
    """DeepSeek-V3's sequence-wise balance loss (alpha 0.3, large enough to move every router's
    gradient): per sequence, so over data ranks and microbatches it averages like the cross-entropy;
    under context parallelism each sequence's pair counts are summed over the context ranks; with
    pipeline stages its terms travel with the other routing statistics."""
    for rank_errs in _compare(pool, plan, tmp_path, balance_rate=0.05, seq_aux_loss=0.3):
        for dtype, errs in rank_errs.items():
            worst = max(errs, key=errs.__getitem__)
            assert errs[worst] <= TOLERANCE[dtype], (plan, dtype, worst, errs[worst])


def _deepseek_v2_seq_aux(logits: Any, chosen: Any, sequences: int, top_k: int, alpha: float) -> Any:
    """DeepSeek-V2's MoEGate `seq_aux` (modeling_deepseek.py), with DeepSeek-V3's normalised sigmoid
    affinities (paper eq. 19) as the scores, written out as they write it."""
    experts = logits.shape[-1]
    scores = torch.sigmoid(logits.double())
    scores = scores / scores.sum(dim=-1, keepdim=True)
    seq_len = logits.shape[0] // sequences
    scores_for_seq_aux = scores.view(sequences, seq_len, -1)
    ce = torch.zeros(sequences, experts, dtype=torch.float64)
    ce.scatter_add_(1, chosen.view(sequences, -1), torch.ones(sequences, seq_len * top_k, dtype=torch.float64))
    ce.div_(seq_len * top_k / experts)
    return (ce * scores_for_seq_aux.mean(dim=1)).sum(dim=1).mean() * alpha


def test_the_sequence_wise_loss_is_deepseeks() -> None:
    """Two layers of 3 sequences of 10 tokens, 8 experts, top 2 by biased sigmoid scores within 2 of
    4 groups: the reference's loss is DeepSeek's, layer by layer summed, and its gradient reaches the
    logits; a balanced count would give 1 per layer, these skewed logits more."""
    gen = torch.Generator().manual_seed(3)
    layers = [torch.randn(30, 8, generator=gen, dtype=torch.float64) * 2 + torch.linspace(-1, 1, 8, dtype=torch.float64)
              for _ in range(2)]
    chosen = [routing.choose_sigmoid(lg, 2, True, torch.zeros(8, dtype=torch.float64), 4, 2)[1] for lg in layers]
    logits = [lg.clone().requires_grad_(True) for lg in layers]
    got = routing.sequence_aux_loss(logits, chosen, 3, 2, "sigmoid") * 0.3
    want = sum(_deepseek_v2_seq_aux(lg, ids, 3, 2, 0.3) for lg, ids in zip(layers, chosen, strict=True))
    assert abs(got.item() - want.item()) <= 1e-12 and got.item() > 2 * 0.3
    got.backward()
    assert all(lg.grad is not None and lg.grad.abs().max() > 0 for lg in logits)


# ------------------------------------------------------------------ the bias's move toward balance


SKEW = [0.1, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # experts 0 and 1 (group 0) take every token at first


def _balance_job(ctx: Any, path: str, steps: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Train ``steps`` steps from biases set to SKEW; each step's expert loads (all layers, summed
    over the ranks) and the final biases, on this rank."""
    import torch.distributed as dist

    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    with torch.no_grad():
        for bias in built.routing_buffers().values():
            bias.copy_(torch.tensor(SKEW))
    seen: list[list[int]] = []
    for step in range(steps):
        with routing.recording(keep_logits=False) as log:
            built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 3, step))
        loads = torch.tensor([n for counts, _ in log.per_layer() for n in counts])
        if built._balance_group is not None:
            dist.all_reduce(loads, group=built._balance_group)
        seen.append(loads.tolist())
    return seen, {k: v.clone() for k, v in built.routing_buffers().items()}


def _imbalance(loads: list[int], experts: int = 8) -> float:
    """The busiest expert's load over the mean, worst layer (1 is balanced; 4 is all on 2 of 8)."""
    layers = [loads[i:i + experts] for i in range(0, len(loads), experts)]
    return max(max(ld) / (sum(ld) / experts) for ld in layers)


def test_the_bias_moves_toward_balance_the_same_on_every_rank(pool: Any, tmp_path: Path) -> None:
    """A skewed toy (the bias starts favouring two experts, which then take every token): with
    balance_rate the skew goes (measured loads), identically on all four ranks; without, it stays."""
    steps = 16
    moved_path, n, _ = compile_spec(ds_spec("ep2_tensor2", balance_rate=0.005), "ds_balance", tmp_path)
    fixed_path, _, _ = compile_spec(ds_spec("ep2_tensor2"), "ds_fixed", tmp_path)
    runs = pool.run(_balance_job, n, moved_path, steps)
    loads, biases = runs[0]
    for other_loads, other_biases in runs[1:]:  # every rank: the same loads and bit-identical biases
        assert other_loads == loads
        assert all(torch.equal(other_biases[k], v) for k, v in biases.items())
    moved = [_imbalance(ld) for ld in loads]
    assert moved[0] == 4.0  # the skew: experts 0 and 1 take everything
    assert sum(moved[-4:]) / 4 < 2.0, moved  # measured: 4.0 at first, 1.72 over the last four steps
    for bias in biases.values():  # the favoured experts' bias went down, the others' up
        assert bias[:2].max() < 0.1 and bias[2:].min() > 0.0
    fixed_loads, fixed_biases = pool.run(_balance_job, n, fixed_path, steps)[0]
    assert [_imbalance(ld) for ld in fixed_loads] == [4.0] * steps  # without balance_rate the skew stays
    assert all(torch.equal(b, torch.tensor(SKEW)) for b in fixed_biases.values())
    print("imbalance per step with balance_rate 0.005:", [round(m, 3) for m in moved])


def _resume_job(ctx: Any, path: str, root: str, save_at: int | None, load: bool) -> tuple[list[float], Any, Any]:
    """Build (from another seed when loading: the load must replace the weights and biases),
    optionally resume from ``root``, train to step 6 (saving at ``save_at``); the losses, the final
    weights and this rank's correction biases."""
    from meshllm_dsl.runtime.train import checkpoint
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=5 if load else 0)
    if load:
        with torch.no_grad():
            for bias in built.routing_buffers().values():
                bias.fill_(7.0)  # nothing of this survives a load
    start = checkpoint.load(built, root, optimizer=True)["state"]["step"] if load else 0
    losses = []
    for step in range(start, 6 if save_at is None else save_at):
        losses.append(built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 3, step)))
    if save_at is not None:
        checkpoint.save(built, root, step=save_at, state={"step": save_at})
    return losses, built.full_state_dict(), {k: v.clone() for k, v in built.routing_buffers().items()}


@pytest.mark.parametrize("plan", ["ep2_tensor2", "pipeline2_ep2", "ep4_over_tensor"])
def test_the_bias_resumes_bit_for_bit(plan: str, pool: Any, tmp_path: Path) -> None:
    """Killed after step 3 and resumed from its checkpoint, a run gives the same losses, weights
    and correction biases, bit for bit, as one that never stopped; the biases did move."""
    path, n, _ = compile_spec(ds_spec(plan, balance_rate=0.01), f"ds_resume_{plan}", tmp_path)
    root = str(tmp_path / "ckpt")
    whole = pool.run(_resume_job, n, path, root, None, False)
    first = pool.run(_resume_job, n, path, root, 3, False)
    second = pool.run(_resume_job, n, path, root, None, True)
    for (losses, final, biases), (before, _, _), (after, resumed, resumed_biases) in zip(whole, first, second):
        assert before + after == losses
        for name, value in final.items():
            assert torch.equal(resumed[name], value), name
        assert biases and set(resumed_biases) == set(biases)
        assert not [k for k in final if k.endswith("e_score_correction_bias")]  # a buffer, not a parameter
        for name, value in biases.items():
            assert torch.equal(resumed_biases[name], value), name
            assert value.abs().max() > 0  # moved from zero


# ------------------------------------------------------------------ the checker and the planner


def _plan_text(skew: str, **settings: Any) -> str:
    return ds_spec("ep2_tensor2", **settings).replace("    batch = 8", f"    skew = {skew}\n    batch = 8")


def test_skew_of_a_group_limited_router() -> None:
    """The planner's skew model over a group-limited router: its range checked as any router's,
    the busiest expert-parallel rank's pairs as the model says."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.planner import analyze as planner
    from meshllm_dsl.planner import moe as planner_moe

    (d,) = [d for d in check_text(_plan_text("0.1"), "s.mesh").diagnostics if d.is_error]
    assert d.code == "E0307" and "less than 1 / experts = 0.125" in d.message
    (plan,) = check_text(_plan_text("0.5"), "s.mesh").plans.values()
    sk = planner_moe.skew_report(planner.analyze(plan))
    assert sk is not None and sk.degree == 2 and sk.experts == 8
    busiest, others = sk.ranks
    # experts 0-3 on the busiest rank: 0.5 + 3 x 0.5 / 7 of the pairs of both data ranks (32 tokens x 2 each)
    assert busiest.pairs == pytest.approx((0.5 + 3 * 0.5 / 7) * 2 * 32 * 2)


def test_the_plan_counts_the_balance_all_reduce() -> None:
    """One all-reduce after each step over every non-pipeline axis: both layers' int64 [8] loads."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.planner import analyze as planner

    (with_rate,) = check_text(ds_spec("ep2_tensor2", balance_rate=0.001), "b.mesh").plans.values()
    (without,) = check_text(ds_spec("ep2_tensor2"), "f.mesh").plans.values()
    got = [c for c in planner.analyze(with_rate).ranks[0].comms if c.axis == "data x tensor" and c.op == "all_reduce"]
    assert [(c.calls, c.payload_bytes) for c in got] == [(1, 2 * 8 * 8)]
    assert not [c for c in planner.analyze(without).ranks[0].comms if c.axis == "data x tensor"]


def test_the_generated_router_holds_the_bias_as_a_buffer(tmp_path: Path) -> None:
    _, _, code = compile_spec(ds_spec("ep2_tensor2", balance_rate=0.001), "ds_code", tmp_path)
    assert ("self.mlp.router.register_buffer('e_score_correction_bias', torch.zeros(8))  # [8] chooses the experts, "
            "not a gradient parameter; the same on every rank") in code
    assert "self.mlp.router.register_buffer('expert_load', torch.zeros(8, dtype=torch.long), persistent=False)" in code
    assert "self.mlp.router.balance_rate = 0.001" in code
    assert ("scoring='sigmoid', bias=self.mlp.router.e_score_correction_bias, groups=4, topk_groups=2, "
            "load=self.mlp.router.expert_load, scaling=2.5)") in code
    assert "e_score_correction_bias" not in "".join(ln for ln in code.splitlines() if "ShardSpec(" in ln)
    # the shared experts ungated, no shared router
    assert "out = out + self.mlp.shared_down(F.silu(self.mlp.shared_gate(xt)) * self.mlp.shared_up(xt))" in code
    assert "shared_router" not in code
    _, _, fixed = compile_spec(ds_spec("ep2_tensor2"), "ds_fixed_code", tmp_path)
    assert "expert_load" not in fixed and "balance_rate" not in fixed


def _load_other_job(ctx: Any, saved_path: str, loading_path: str, root: str) -> str:
    """Save ``saved_path``'s program untrained, load it into ``loading_path``'s: the error, or ''."""
    from meshllm_dsl.runtime.train import checkpoint
    from meshllm_dsl.verify.equivalence import load_generated

    saved = load_generated(saved_path).PROGRAM
    checkpoint.save(saved.build(ctx.mesh(saved.axes), seed=0), root, step=0, state={"step": 0})
    loading = load_generated(loading_path).PROGRAM
    try:
        checkpoint.load(loading.build(ctx.mesh(loading.axes), seed=0), root)
    except checkpoint.CheckpointError as err:
        return str(err)
    return ""


def test_a_checkpoint_without_the_bias_is_refused(pool: Any, tmp_path: Path) -> None:
    """The same parameters routed by softmax (no bias) do not resume a sigmoid model: refused on
    every rank, naming the bias, never loaded with the bias left as it was."""
    softmax = ds_spec("ep2").replace("scoring = sigmoid, groups = groups, topk_groups = topk_groups,",
                                     "groups = groups, topk_groups = topk_groups,").replace(
                                         "topk_groups = 2, routed_scaling", "topk_groups = 1, routed_scaling").replace(
                                         "top_k = 2, groups = 4,", "top_k = 2, groups = 1,")
    saved, n, _ = compile_spec(softmax, "ds_softmax", tmp_path)
    loading, _, _ = compile_spec(ds_spec("ep2"), "ds_sigmoid", tmp_path)
    for err in pool.run(_load_other_job, n, saved, loading, str(tmp_path / "ckpt")):
        assert "no router correction bias blocks.0.mlp.router.e_score_correction_bias" in err, err
