"""Jobs the distributed tests run on the shared pool of gloo ranks (tests/conftest.py `pool`)."""

from __future__ import annotations

from typing import Any


def compare_job(ctx: Any, path: str, steps: int = 3, ignored: bool = False) -> dict[str, dict[str, float]]:
    """On each rank: {dtype: {entry: max |sharded - reference|}} for the generated module at `path`.

    float32 as the plans run; float64 as well, because float32 skips the few elements whose
    gradient is rounding noise (see runtime/jobs/compare.py) and float64 checks those too.
    ``ignored``: batches with some targets IGNORE (a plan with `pack = documents` always has some).
    """
    import torch

    from meshllm_dsl.runtime.jobs.compare import compare_to_reference
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    mesh = ctx.mesh(program.axes)
    return {name: compare_to_reference(program, mesh, dtype=getattr(torch, name), seed=0, steps=steps, ignored=ignored)
            for name in ("float32", "float64")}


def assert_spec_matches_reference(pool: Any, text: str, name: str, tmp_path: Any) -> None:
    """Check `text` (one plan), compile it, train it on the pool's gloo ranks with compare_job and
    assert every rank's outputs, gradients, losses and parameters are within the dtype's tolerance."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.emit import render_plan
    from meshllm_dsl.runtime.jobs.compare import TOLERANCE

    result = check_text(text, f"{name}.mesh")
    assert result.ok, [str(d.message) for d in result.errors]
    (plan,) = result.plans.values()
    path = tmp_path / f"{name}.py"
    path.write_text(render_plan(plan, f"{name}.mesh", text))
    for rank, errs in enumerate(pool.run(compare_job, plan.mesh.devices, str(path))):
        for dtype, by_key in errs.items():
            bad = {k: v for k, v in by_key.items() if not v <= TOLERANCE[dtype]}
            assert not bad, f"rank {rank}, {dtype}: {bad}"


def profile_job(ctx: Any, path: str, out: str) -> dict[str, Any]:
    """On each rank: `meshc run --profile`'s report (runtime.profile.profile_train) for the generated
    module at `path`, over 4 synthetic batches: warm-up, memory step, kernel count, one timed step."""
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.runtime.train.profile import profile_train
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    batches = [synthetic_batch(program.vocab, program.batch, program.seq, 0, s) for s in range(4)]
    return profile_train(built, batches, out)


def memory_job(ctx: Any, path: str) -> dict[str, int]:
    """On each rank: the memory part of `meshc run --profile`'s report (runtime.profile.profile_memory,
    the same warm-up and measured step as profile_job) without the kernel-count and timed steps
    that follow it there, for tests that read only the bytes."""
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.runtime.train.profile import profile_memory
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=0)
    batches = [synthetic_batch(program.vocab, program.batch, program.seq, 0, s) for s in range(2)]
    return profile_memory(built, batches)[1]


def float8_job(ctx: Any, path: str, steps: int, recipe_off: bool) -> dict[str, Any]:
    """On each rank: the losses of `steps` AdamW steps of the generated module at `path` on seeded
    synthetic batches, with its float8 layers (or, ``recipe_off``, with float8 switched off), and
    the bytes FSDP2 all-gathered to this rank in the last step (counted at torch.distributed's
    all_gather_single, which FSDP2 2.13 calls, and all_gather_into_tensor)."""
    import dataclasses

    import torch.distributed as dist

    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    if recipe_off:
        program = dataclasses.replace(program, float8={}, float8_gather=False)
    built = program.build(ctx.mesh(program.axes), seed=0)
    gathered = [0]
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def counting(name: str) -> Any:
        def call(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
            gathered[0] += output.numel() * output.element_size()  # what the gather brings to this rank
            return originals[name](output, input, *args, **kwargs)
        return call

    losses = []
    for step in range(steps):
        tokens, targets = synthetic_batch(program.vocab, program.batch, program.seq, 0, step)
        if step == steps - 1:
            gathered[0] = 0
            for n in names:
                setattr(dist, n, counting(n))
        try:
            losses.append(built.train_step(tokens, targets))
        finally:
            for n, f in originals.items():
                setattr(dist, n, f)
    return {"losses": losses, "gathered": gathered[0], "float8_layers": len(built.float8_layers)}


def compiled_job(ctx: Any, path: str, steps: int, compile_mode: str) -> dict[str, Any]:
    """On each rank: losses of `steps` AdamW steps of the module at `path` with `compile` set to
    ``compile_mode``, and its parameters after them (full, as rank 0 gathers them). A plan with
    `pack = documents` trains on packed batches (compare.packed_batches); ``graphs``: the graphs
    Dynamo compiled after each step (counted in this process)."""
    import dataclasses

    from torch._dynamo.utils import counters

    from meshllm_dsl.runtime.jobs.compare import packed_batches
    from meshllm_dsl.runtime.train.launch import synthetic_batch
    from meshllm_dsl.verify.equivalence import load_generated

    program = dataclasses.replace(load_generated(path).PROGRAM, compile=compile_mode)
    built = program.build(ctx.mesh(program.axes), seed=0)
    losses, graphs = [], []
    if program.document_mask:
        batches = packed_batches(program.vocab, program.batch, program.seq, steps, 0, documents=True,
                                 restart=program.restart_positions)
        for b in batches:
            losses.append(built.train_step(b.tokens, b.targets, b.documents, b.positions))
            graphs.append(counters["stats"]["unique_graphs"])
    else:
        for step in range(steps):
            losses.append(built.train_step(*synthetic_batch(program.vocab, program.batch, program.seq, 0, step)))
            graphs.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "graphs": graphs, "params": {k: v.float() for k, v in built.full_state_dict().items()}}
