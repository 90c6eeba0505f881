"""One pool job for the moe families' tests (gpt_oss, deepseek_v3, glm4_moe): a compiled plan and the
unsharded reference compared (float64, `compare_to_reference`) when both start from an HF checkpoint's
redrawn weights and correction-bias buffers instead of the seeded init."""

from __future__ import annotations

from typing import Any

import torch


def _read(ckpt: Any, key: str) -> Any:
    with ckpt.open(key) as sl:
        return sl[:]


def _ours(ckpt: Any, key: str, shape: tuple[int, ...]) -> Any:
    """Our full tensor of checkpoint name `key`: one stored tensor per expert (`{e}`: ours is [out,
    experts, in]), a slice of a fused 3-D experts tensor (GPT-OSS), or the tensor itself."""
    from meshllm_dsl.runtime.hf import fused_experts

    if "{e}" in key:
        return torch.stack([_read(ckpt, key.replace("{e}", str(e))) for e in range(shape[1])], dim=1)
    if fused_experts.is_fused(key):
        return fused_experts.to_ours(key, _read(ckpt, fused_experts.base(key)))
    return _read(ckpt, key)


def redrawn_compare_job(ctx: Any, path: str, weights: str, steps: int = 2, buffers: bool = False) -> dict[str, float]:
    """On each rank: compare_job's comparison (float64) started from the checkpoint's weights and
    buffers (the sigmoid routers' correction biases; `buffers`: the model has some, all nonzero) for
    both the plan and the reference."""
    import meshllm_dsl.runtime.jobs.compare as compare
    import meshllm_dsl.runtime.model.reference as reference
    from meshllm_dsl.runtime.hf.weights import HFCheckpoint, hf_buffer_map, hf_key_map
    from meshllm_dsl.runtime.train import program as program_mod
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    ckpt = HFCheckpoint(weights)
    names: dict[str, tuple[int, ...]] = {n: s.shape for st in program.build(ctx.mesh(program.axes), seed=0).specs.values()
                                        for n, s in st.items()}
    full = {name: _ours(ckpt, key, names[name]) for name, (key, _) in hf_key_map(program.model, sorted(names)).items()}
    biases = {name: _read(ckpt, key) for name, (key, _) in hf_buffer_map(program.model).items()}
    assert bool(biases) == buffers and all(b.abs().max() > 0 for b in biases.values())

    drawn: set[str] = set()

    def init(name: str, shape: Any, seed: int, dtype: Any = torch.float32) -> Any:
        drawn.add(name)
        return full[name].to(dtype).reshape(shape).clone()

    def with_biases(named: dict[str, Any]) -> None:
        with torch.no_grad():
            for name in biases.keys() & named.keys():
                named[name].copy_(biases[name].to(named[name].dtype))

    build_plan, build_ref = type(program).build, compare.build_reference

    def plan_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        built = build_plan(self, *args, **kwargs)
        assert built.routing_buffers().keys() <= biases.keys()  # every router's bias from the checkpoint
        with_biases(built.routing_buffers())
        return built

    def ref_build(*args: Any, **kwargs: Any) -> Any:
        ref = build_ref(*args, **kwargs)
        assert biases.keys() <= dict(ref.named_buffers()).keys()
        with_biases(dict(ref.named_buffers()))
        return ref

    saved = program_mod.full_init, reference.full_init
    program_mod.full_init = reference.full_init = init
    type(program).build, compare.build_reference = plan_build, ref_build  # type: ignore[method-assign]
    try:
        errs = compare.compare_to_reference(program, ctx.mesh(program.axes), dtype=torch.float64, seed=0, steps=steps)
    finally:
        program_mod.full_init, reference.full_init = saved
        type(program).build, compare.build_reference = build_plan, build_ref  # type: ignore[method-assign]
    assert drawn == set(full), sorted(set(full) ^ drawn)  # both models started from the checkpoint, wholly
    return errs
