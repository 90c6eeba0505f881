"""The planner on HSDP (issue 23): state bytes per rank sharded over the ZeRO axes only, and the
traffic FSDP2's 2-D mesh moves (reduce-scatter within a shard group, all-reduce across replicas)."""

from __future__ import annotations

from meshllm_dsl.checker import check_text
from meshllm_dsl.planner.analyze import analyze

MODEL = ("model m = llama { vocab = 32000, hidden = 4096, layers = 8, heads = 32, kv_heads = 8, ffn = 11008,"
         " dtype = bf16 }")


def _plan(axes: str, body: str):  # type: ignore[no-untyped-def]
    text = f"mesh g {{ axes {axes}\n device = h100 }}\n{MODEL}\nplan p on g for m {{ batch = 32, seq = 2048\n{body}\n}}\n"
    result = check_text(text, "hsdp.mesh")
    assert result.ok, [d.message for d in result.errors]
    return result.plans["p"]


def test_hsdp_shards_states_over_the_zero_axes_and_all_reduces_across_replicas() -> None:
    full = _plan("replica = 2, data = 4", "layout { batch -> replica * data }\n optimizer adamw { zero 3 }")
    hsdp = _plan("replica = 2, data = 4", "layout { batch -> replica * data }\n optimizer adamw { zero 3 over data }")
    assert hsdp.roles.batch_shard == ("data",) and hsdp.roles.batch_replicate == ("replica",)
    (f,), (h,) = analyze(full).ranks, analyze(hsdp).ranks
    numel = hsdp.model.numel
    # fp32 at rest under FSDP2 without `precision`: 2-byte weights, gradients and 2 moments.
    assert h.weight_bytes == -(-numel // 4) * 2 and f.weight_bytes == -(-numel // 8) * 2
    assert h.optimizer_bytes == 2 * f.optimizer_bytes
    by = {(c.axis, c.op): c for c in h.comms if c.kind == "data"}
    assert set(by) == {("data", "all_gather"), ("data", "reduce_scatter"), ("replica", "all_reduce")}
    scatter, across = by[("data", "reduce_scatter")], by[("replica", "all_reduce")]
    # Every reduce-scattered unit's shard (a quarter) is all-reduced across the 2 replicas.
    assert across.calls == scatter.calls
    assert abs(across.payload_bytes - scatter.payload_bytes / 4) <= across.calls
    assert {c.axis for c in f.comms if c.kind == "data"} == {"replica x data"}


def test_hsdp_zero1_reduces_within_the_shard_group_and_across_replicas() -> None:
    plan = _plan("replica = 2, data = 2", "layout { batch -> replica * data }\n optimizer adamw { zero 1 over data }")
    (r,) = analyze(plan).ranks
    ops = {(c.axis, c.op): c.payload_bytes for c in r.comms if c.kind == "data"}
    grads = 2 * plan.model.numel
    assert ops == {("data", "reduce_scatter"): grads, ("replica", "all_reduce"): grads // 2, ("data", "all_gather"): grads}


def test_master_weights_at_zero_1_are_sharded_as_megatrons_distributed_optimizer() -> None:
    body = "layout { batch -> data }\n precision { params = bf16, master = fp32 }\n optimizer adamw { zero 1 }"
    plan = _plan("data = 4", body)
    assert (plan.dtype, plan.master_dtype, plan.reduce_dtype) == ("bf16", "fp32", "fp32")
    (r,) = analyze(plan).ranks
    numel, part = plan.model.numel, -(-plan.model.numel // 4)
    # runtime/parallel/fsdp.py: fp32 master weights, their gradients and moments sharded over 4 ranks; the
    # bf16 compute copy whole from the step's first forward to its last backward; without
    # microbatches no gradient is accumulated whole.
    assert (r.weight_bytes, r.grad_bytes, r.optimizer_bytes) == (4 * part, 4 * part, 8 * part)
    assert (r.gather_buffer_bytes, r.grad_accum_bytes) == (2 * numel, 0)

    def data_comms(rc) -> dict[str, int]:  # type: ignore[no-untyped-def]
        # (payloads are per-call means in whole bytes: within a byte a call of the exact sums)
        by_op = {c.op: c for c in rc.comms if c.kind == "data"}
        return {op: c.payload_bytes + c.calls for op, c in by_op.items()}

    def near(got: dict[str, int], want: dict[str, int]) -> bool:
        return got.keys() == want.keys() and all(0 <= got[k] - want[k] <= 1000 for k in got)

    # Gradients reduce-scattered in fp32, the bf16 copy all-gathered: once a unit.
    assert near(data_comms(r), {"reduce_scatter": 4 * numel, "all_gather": 2 * numel}), data_comms(r)
    # With 4 microbatches: still one gather and one reduce-scatter a step (ZeRO 2 makes 4 of each), and
    # the whole fp32 gradients accumulated between them (Megatron's grad buffer).
    (r4,) = analyze(_plan("data = 4", "microbatches = 4\n" + body)).ranks
    assert r4.grad_accum_bytes == 4 * numel
    assert near(data_comms(r4), {"reduce_scatter": 4 * numel, "all_gather": 2 * numel}), data_comms(r4)
    # (`reduce` defaults to the compute dtype at ZeRO 2, as torchtitan's; to the master's at ZeRO 1, Megatron's)
    (z2,) = analyze(_plan("data = 4", "microbatches = 4\n" + body.replace("zero 1", "zero 2")
                          .replace("fp32 }", "fp32, reduce = fp32 }"))).ranks
    assert near(data_comms(z2), {"reduce_scatter": 16 * numel, "all_gather": 8 * numel}), data_comms(z2)
    assert z2.grad_accum_bytes == 0
    (bf16,) = analyze(_plan("data = 4", "layout { batch -> data }\n optimizer adamw { zero 1 }")).ranks
    assert (bf16.weight_bytes, bf16.grad_bytes, bf16.gather_buffer_bytes) == (2 * numel, 2 * numel, 0)


def test_suggest_writes_fp32_master_weights_at_zero_0_and_1() -> None:
    from meshllm_dsl.planner.suggest import Candidate, candidates, plan_text

    model = check_text(MODEL + "\n", "m.mesh").models["m"]
    # Both are searched at ZeRO 0 / 1: pure bf16 (half the state) and bf16 with fp32 master weights.
    found = {(c.zero, c.master) for c in candidates(model, 2, 32, 8)}
    assert {(0, False), (0, True), (1, False), (1, True), (2, False), (3, False)} <= found
    for zero in (0, 1):
        c = Candidate(data=2, pipeline=1, tensor=1, microbatches=1, schedule="none", virtual=1, zero=zero, hosts=1,
                      master=True)
        text = plan_text(c, model, "h100", 32, 2048)
        result = check_text(MODEL + "\n" + text, "s.mesh")
        assert result.ok, [d.message for d in result.errors]
        plan = result.plans["suggested"]
        assert (plan.zero, plan.dtype, plan.master_dtype, plan.reduce_dtype) == (zero, "bf16", "fp32", "fp32")


def test_suggest_searches_hsdp_sharded_within_a_host() -> None:
    from meshllm_dsl.planner.suggest import candidates, plan_text

    model = check_text(MODEL + "\n", "m.mesh").models["m"]
    hsdp = [c for c in candidates(model, 16, 64, 8) if c.zero_shard]
    # Data 16 over 2 hosts of 8: ZeRO 1 / 2 / 3 sharded over the 8 ranks of a host, 2 replicas; at
    # ZeRO 1 also with fp32 master weights (the distributed optimizer within a host).
    assert hsdp and {(c.data, c.zero_shard, c.zero, c.master) for c in hsdp if c.tensor == c.pipeline == 1} == {
        (16, 8, 1, False), (16, 8, 1, True), (16, 8, 2, False), (16, 8, 3, False)}
    assert all(c.zero_shard * c.pipeline * c.tensor <= 8 and c.zero in (1, 2, 3) for c in hsdp)
    c = next(c for c in hsdp if c.tensor == c.pipeline == 1)
    result = check_text(MODEL + "\n" + plan_text(c, model, "h100", 64, 2048), "s.mesh")
    assert result.ok, [d.message for d in result.errors]
    plan = result.plans["suggested"]
    assert (plan.roles.batch_shard, plan.roles.batch_replicate, plan.zero_size) == (("data",), ("replica",), 8)


def test_suggest_estimates_each_variant_as_its_checked_text() -> None:
    """suggest checks one candidate's text per structure and estimates the others from that plan
    with their own fields (planner_suggest.variant): HSDP ZeRO 1 with fp32 master weights and
    `recompute = blocks every 2` / `ops` must be estimated as checking their own text gives."""
    import attrs

    from meshllm_dsl.planner.suggest import Candidate, plan_text, variant

    model = check_text(MODEL + "\n", "m.mesh").models["m"]
    first = Candidate(data=16, pipeline=1, tensor=1, microbatches=1, schedule="none", virtual=1, zero=0, hosts=2,
                      zero_shard=8)
    (structure,) = check_text(MODEL + "\n" + plan_text(first, model, "h100", 64, 2048), "s.mesh").plans.values()
    for c in (attrs.evolve(first, zero=1, master=True, microbatches=4, recompute="blocks every 2"),
              attrs.evolve(first, zero=1, recompute="ops"), attrs.evolve(first, zero=3, recompute="blocks")):
        result = check_text(MODEL + "\n" + plan_text(c, model, "h100", 64, 2048), "s.mesh")
        assert result.ok, [d.message for d in result.errors]
        (checked,) = result.plans.values()
        assert (checked.zero, checked.roles.batch_shard, checked.recompute, checked.recompute_every) == (
            c.zero, ("data",), c.recompute.split()[0], 2 if "every" in c.recompute else 1)
        assert checked.master_dtype == ("fp32" if c.master or c.zero >= 2 else None)
        want, got = analyze(checked), analyze(variant(structure, c, model))
        assert got.step.total_s == want.step.total_s and got.peak_training_bytes == want.peak_training_bytes, c.key()
