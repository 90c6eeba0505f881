"""The equivalence comparison catches known sharding bugs (the suite tests itself).

Each fault is planted inside the worker processes (equiv.FAULTS: patched attributes of
`meshllm_dsl.runtime` and runtime/train/program.py, undone after the job) and run on a plan that exercises
it. The same plan without the fault must compare equal (so a difference is the fault's doing), and
with it the comparison must report differences above tolerance, in the place the bug shows:

(i)   naive `torch.distributed.nn.functional.all_reduce` as g: forward right, gradients x tensor size
(ii)  missing all-reduce (reduce_from = identity): the forward already differs
(iii) a shard slice off by one block (the first rank loads its neighbour's chunk): forward differs
(iv)  rotary positions shifted on odd tensor ranks: forward differs
(v)   loss divided by the microbatch count twice: gradients differ (with and without a pipeline)
(vi)  data-parallel gradients summed instead of averaged: forward and loss right, gradients differ
(vii) recomputation that also keeps the first forward's graph: forward right, gradients doubled
      (`recompute = blocks` with tensor-parallel collectives inside, under a 1F1B pipeline)
(viii) gradient clipping whose norm counts copies (replicated over tensor, data replicas) on every
      rank: forward right, clipped gradients differ (data x pipeline x tensor)
(ix)  sequence parallelism without summing the norms' partial gradients over the tensor axis:
      forward right, gradients differ (data x tensor, with recomputation)
(x)   sequence parallelism whose reduce-scatter only splits (the sum is missing): forward differs
(xi)  ZeRO-3 (FSDP2) that sums the data replicas' gradients instead of averaging: gradients differ
(xii) ZeRO-3 sharded over the tensor axis instead of data: parameters gathered from the wrong shards
(xiii) expert parallelism whose combine skips the inverse permutation: tokens get other tokens'
      expert outputs, forward differs (2 experts per rank, so the permutation is not the identity)
(xiv) expert parallelism averaging the experts' gradients over data like the dense ones': forward
      right, gradients differ
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from equiv import TOLERANCE, compare, over_tolerance, worst, write_module
from mesh_snippets import MEGATRON

from meshllm_dsl.checker import check_text
from meshllm_dsl.runtime.jobs.pool import WorkerPool

LLAMA = "model m = llama { vocab = 32, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 32, dtype = fp32 }"
MIXTRAL = ("model m = mixtral { vocab = 32, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 24, experts = 4,"
           " top_k = 2, dtype = fp32 }")


def _plan(axes: str, body: str, model: str = LLAMA) -> str:
    return f"mesh m {{ axes {axes} }}\n{model}\nplan p on m for m {{\n    batch = 4\n    seq = 6\n{body}\n}}\n"


PLANS = {
    "tensor2": _plan("tensor = 2", MEGATRON),
    "pipeline2": _plan("pipeline = 2", "    microbatches = 2\n    stages over pipeline balanced\n    schedule gpipe"),
    "microbatches2": _plan("tensor = 2", MEGATRON + "    microbatches = 2"),
    "data2": _plan("data = 2", "    layout { batch -> data }\n    optimizer adamw { zero 1 }"),
    "recompute": _plan("pipeline = 2, tensor = 2", MEGATRON + "    microbatches = 2\n    recompute = blocks\n"
                       "    stages over pipeline balanced\n    schedule 1f1b"),
    "clip": _plan("data = 2, pipeline = 2, tensor = 2", MEGATRON + "    microbatches = 2\n    layout { batch -> data }\n"
                  "    stages over pipeline balanced\n    schedule 1f1b\n"
                  "    optimizer adamw { clip = 0.01, warmup = 2, decay_steps = 3 }"),
    "seqpar": _plan("data = 2, tensor = 2", MEGATRON + "    layout { batch -> data, seq -> tensor }\n    recompute = blocks"),
    "zero3": _plan("data = 2, tensor = 2", MEGATRON + "    layout { batch -> data }\n    optimizer adamw { zero 3 }"),
    "experts": _plan("data = 2", "    layout { batch -> data, experts -> data }", MIXTRAL),
}

# fault -> (plan, where the difference must show, where it must not)
CASES = {
    "naive_all_reduce": ("tensor2", "grad", "logits"),
    "missing_all_reduce": ("tensor2", "logits", None),
    "off_by_one_slice": ("tensor2", "logits", None),
    "rotary_offset": ("tensor2", "logits", None),
    "loss_scaled_twice": ("pipeline2", "grad", "logits"),
    "loss_scaled_twice_no_pipeline": ("microbatches2", "grad", "logits"),
    "dp_grads_summed": ("data2", "grad", "loss"),
    "recompute_double_grad": ("recompute", "grad", "logits"),
    "clip_norm_counts_copies": ("clip", "grad", "logits"),
    "sp_norm_grad_not_summed": ("seqpar", "grad", "logits"),
    "sp_missing_reduce_scatter": ("seqpar", "logits", None),
    "zero3_grads_summed": ("zero3", "grad", "loss"),
    "zero3_over_tensor": ("zero3", "logits", None),
    "ep_combine_unpermuted": ("experts", "logits", None),
    "ep_expert_grads_averaged": ("experts", "grad", "logits"),
}


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(world_size=8, timeout=180.0) as p:
        yield p


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, int]]:
    out = {}
    directory = tmp_path_factory.mktemp("fault_plans")
    for name, text in PLANS.items():
        result = check_text(text, f"{name}.mesh")
        assert result.ok, [d.message for d in result.errors]
        (plan,) = result.plans.values()
        out[name] = (write_module(plan, text, directory), plan.mesh.devices)
    return out


@pytest.mark.parametrize("plan", list(PLANS))
def test_plans_without_faults_compare_equal(plan: str, pool: WorkerPool, modules: dict[str, tuple[str, int]]) -> None:
    path, n = modules[plan]
    per_rank = pool.run(compare, n, path, ("float64",), 0, None, "tensor")
    assert not over_tolerance(per_rank)


@pytest.mark.parametrize("case", list(CASES))
def test_planted_fault_is_caught(case: str, pool: WorkerPool, modules: dict[str, tuple[str, int]]) -> None:
    plan, shows_in, clean_in = CASES[case]
    fault = case.removesuffix("_no_pipeline")
    path, n = modules[plan]
    per_rank = pool.run(compare, n, path, ("float64",), 0, fault, "tensor")
    tol = TOLERANCE["float64"]
    # The comparison reports the fault ...
    assert over_tolerance(per_rank), f"{fault} went unnoticed"
    # ... in the place this bug shows (far above rounding), and not where it cannot.
    assert worst(per_rank, "float64", shows_in) > 1e3 * tol, f"{fault}: {shows_in} error {worst(per_rank, 'float64', shows_in)}"
    if clean_in is not None:
        assert worst(per_rank, "float64", clean_in) <= tol, f"{fault} should leave {clean_in} exact"


def test_faults_are_undone_after_the_job(pool: WorkerPool, modules: dict[str, tuple[str, int]]) -> None:
    # Workers are long-lived: a fault planted in one job must not leak into the next.
    path, n = modules["tensor2"]
    pool.run(compare, n, path, ("float64",), 0, "missing_all_reduce", "tensor")
    assert not over_tolerance(pool.run(compare, n, path, ("float64",), 0, None, "tensor"))
