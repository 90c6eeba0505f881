"""`meshc plan`'s report of an analysed plan: report_text (REPORT_SECTIONS, one function a section,
in the order printed) and report_json, with the notes they share (expert parallelism's all-to-all per
moe layer, FSDP2's overlap, the training state's bytes per parameter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from meshllm_dsl.front.names import ranges
from meshllm_dsl.ir import DTYPES, PlanIR
from meshllm_dsl.parallel.costs import MFU
from meshllm_dsl.parallel.placements import gather_stage, runs_fsdp
from meshllm_dsl.planner.comm import EXPERT_WIRE, comm_over, expert_all_to_all
from meshllm_dsl.planner.float8 import float8_flops, kept_in_params_dtype
from meshllm_dsl.planner.formatting import GB, GIB, fmt_bytes, fmt_count, fmt_seconds, table_text
from meshllm_dsl.planner.formulas import bubble_formula, kv_cache_bytes, kv_gather_bytes_per_layer
from meshllm_dsl.planner.held import held_units
from meshllm_dsl.planner.recompute import recomputed_text
from meshllm_dsl.planner.records import PlanReport
from meshllm_dsl.planner.time import fsdp_overlaps_compute


def expert_layer_comm(rep: PlanReport) -> dict[str, Any] | None:
    """Per moe layer and microbatch on one device: the all-to-all's input bytes, what it sends, and
    its time, for one call and for the four of a training step (dispatch + combine, forward +
    backward); None without expert parallelism."""
    plan = rep.plan
    if not plan.roles.expert:
        return None
    for stage in plan.stages:
        for hu in held_units(plan, stage):
            a2a = expert_all_to_all(plan, hu, plan.batch // plan.data_size // plan.microbatches * plan.seq)
            if a2a is None:
                continue
            axes, size = a2a
            (op, *_), calls = EXPERT_WIRE, len(EXPERT_WIRE)
            one = comm_over(plan, rep.device, axes, "expert", op, 1, size)
            return {"axes": list(axes), "ranks": plan.mesh.size(*axes), "payload_bytes": size,
                    "wire_bytes": one.wire_bytes, "seconds": one.seconds, "calls_per_step": calls,
                    "step_wire_bytes": calls * one.wire_bytes, "step_seconds": calls * one.seconds}
    return None


def _expert_note(rep: PlanReport) -> str:
    per = expert_layer_comm(rep)
    if per is None:
        return ""
    return (f"per moe layer and microbatch: {per['calls_per_step']} all-to-alls over {' x '.join(per['axes'])} (dispatch + combine, "
            f"forward + backward) of {fmt_bytes(per['payload_bytes'])}, each sending {fmt_bytes(per['wire_bytes'])} "
            f"in {fmt_seconds(per['seconds'])}")


def _overlap_note(rep: PlanReport) -> str:
    if not fsdp_overlaps_compute(rep.plan, rep.device):
        return ""
    total = max(rc.comm_seconds(("data",)) for rc in rep.ranks)
    return f"   exposed of FSDP2's {fmt_seconds(total)}, which overlap the compute unit by unit" if total else ""


def _training_state_line(plan: PlanIR, k: int, numel: int) -> str:
    w = DTYPES[plan.dtype]
    if not runs_fsdp(plan):
        # At ZeRO 0 with `precision` the parameters are the master weights (runtime/train/amp.py).
        held = DTYPES[plan.master_dtype or plan.dtype]
        cast = f", + {w} per parameter of {plan.dtype} casts while a stage runs" if held > w else ""
        return (f"  training state  {k + 2 * held} bytes per parameter ({held} weight + {held} gradient + {k} optimizer{cast})"
                f" = {fmt_bytes(numel * (k + 2 * held))} unsharded")
    m = DTYPES[plan.master_dtype or plan.dtype]
    total = w + 2 * m + k
    return (f"  training state  {total} bytes per parameter ({w} {plan.dtype} compute copy + {m} master weight + {m} gradient"
            f" + {k} optimizer) = {fmt_bytes(numel * total)} before ZeRO-{plan.zero} shards all but the compute copy")


# ---------------------------------------------------------------- rendering


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return ranges(list(ranks)) if ranks else "-"


def _heading_lines(rep: PlanReport) -> list[str]:
    """The plan, its mesh and device, and the shape of its step."""
    plan, dev, mesh = rep.plan, rep.device, rep.plan.mesh
    axes = " x ".join(f"{a.name} {a.size}" for a in mesh.axes)
    hosts = f", {mesh.hosts} hosts{' assumed' if rep.hosts_assumed else ''}" if mesh.hosts > 1 else ""
    return [
        f"plan {plan.name}: {plan.model.name} on {mesh.name} ({mesh.devices} x {dev.name}{' (assumed)' if rep.device_assumed else ''}: {axes}{hosts})",
        (f"  batch {plan.batch} x seq {plan.seq}; {plan.data_size} data replica{'s' if plan.data_size != 1 else ''} x "
        f"{plan.microbatches} microbatch{'es' if plan.microbatches != 1 else ''} of {rep.micro_batch} sequence{'s' if rep.micro_batch != 1 else ''}; "
        f"{f'schedule {plan.schedule}' if plan.pipeline_size > 1 else 'no pipeline'}{f' (virtual {plan.virtual})' if plan.virtual > 1 else ''}; "
        f"{plan.optimizer}, ZeRO {plan.zero}{' over ' + ' x '.join(plan.roles.batch_shard) if plan.zero else ''}"
        + (f"; context {plan.context_size} over {' x '.join(plan.roles.context)} ({plan.seq // plan.context_size:,} tokens "
           "of each sequence per rank)" if plan.roles.context else "")),
        *_documents_lines(plan),
    ]


def _documents_lines(plan: PlanIR) -> list[str]:
    """`pack = documents`: the rows' documents are masked apart. The attention core is still priced
    over all `seq` keys of each query (an upper bound: a token attends only within its document).
    Pricing it by the documents' lengths (the sum of their squares, not seq squared) needs their
    histogram from the data (`plan --data`, issue 41's item 3), which the plan alone does not have:
    the lengths are not guessed here."""
    if not plan.document_mask:
        return []
    spread = (f", rows spread over the context ranks by their documents (`{plan.context_balance}`)"
              if plan.context_balance != "headtail" else "")
    return [f"  documents masked apart in every row (`pack = documents`{', positions restart' if plan.restart_positions else ''}"
            f"{spread}); attention priced over all seq keys, an upper bound without the documents' lengths"]


def _model_lines(rep: PlanReport) -> list[str]:
    """The whole model: parameters, weights, training state and KV cache, before any sharding."""
    plan, model = rep.plan, rep.plan.model
    w = DTYPES[plan.dtype]
    return [
        "",
        "model",
        f"  parameters      {model.numel:,} ({fmt_count(model.numel)})",
        *_active_lines(plan),
        f"  weights         {model.numel * w / GB:.2f} GB = {model.numel * w / GIB:.2f} GiB in {plan.dtype}",
        _training_state_line(plan, rep.optimizer_k, model.numel),
        (f"  KV cache        {rep.kv_bytes_per_token:,} bytes per token in {plan.dtype}; "
        f"{fmt_bytes(kv_cache_bytes(plan, plan.seq) * plan.batch)} at batch {plan.batch} x seq {plan.seq}"
        + (" (sliding-window layers hold their window only)" if kv_cache_bytes(plan, plan.seq) < rep.kv_bytes_per_token * plan.seq else "")
        + (f"; decoding keeps it gathered: each of the {plan.context_size} context ranks holds all of it"
           if plan.roles.context else "")),
    ]


def _memory_lines(rep: PlanReport) -> list[str]:
    """Memory per device: a row per pipeline rank, then what the fullest one holds by dtype."""
    dev = rep.device
    rows = []
    for rc in rep.ranks:
        rows.append([str(rc.coord), _ranks_text(rc.ranks), rc.label, fmt_count(rc.params_global), fmt_count(rc.params_local),
                     fmt_bytes(rc.weight_bytes), fmt_bytes(rc.grad_bytes), fmt_bytes(rc.optimizer_bytes),
                     f"{fmt_bytes(rc.activation_bytes)} ({rc.in_flight} mb)", fmt_bytes(rc.training_bytes),
                     "yes" if rc.training_bytes <= dev.memory_bytes else "NO"])
    return [
        "",
        "memory per device (a row per pipeline rank; the tensor and data ranks at it hold the same)",
        *("  " + x for x in table_text(
            ["pp", "ranks", "layers", "params", "on device", "weights", "grads", "optimizer", "activations", "total", "fits"],
            rows, right={3, 4, 5, 6, 7, 8, 9})),
        *_fullest_rank_lines(rep),
        "  activations per microbatch: " + ", ".join(f"pp {rc.coord} {fmt_bytes(rc.activation_bytes_per_microbatch)}" for rc in rep.ranks),
        f"  inference (weights + KV cache at batch {rep.plan.batch} x seq {rep.plan.seq}): "
        + ", ".join(f"pp {rc.coord} {fmt_bytes(rc.inference_bytes)}" for rc in rep.ranks)
        + f" -> {'fits' if rep.fits_inference else 'does NOT fit'}",
    ]


def _fullest_rank_lines(rep: PlanReport) -> list[str]:
    """The rank needing the most memory: its bytes by dtype, and the FSDP2 buffers it holds."""
    plan = rep.plan
    worst = max(rep.ranks, key=lambda r: r.training_bytes)
    # Weights, gradients and moments are the stored parameters' dtype: the master one with `precision`
    # (FSDP2's sharded parameters, or autocast's fp32 ones at ZeRO 0), else the plan's.
    by_dtype = {plan.dtype: worst.activation_bytes + worst.gather_buffer_bytes}
    held = plan.master_dtype or plan.dtype
    by_dtype[held] = by_dtype.get(held, 0) + worst.weight_bytes + worst.grad_bytes + worst.optimizer_bytes
    if worst.grad_accum_bytes:
        accum_dtype = plan.reduce_dtype or plan.dtype
        by_dtype[accum_dtype] = by_dtype.get(accum_dtype, 0) + worst.grad_accum_bytes
    lines = [
        f"  by dtype on pipeline rank {worst.coord}: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in by_dtype.items())
        + (f"; {fmt_count(worst.params_replicated)} parameters are whole copies on every device (norms, biases, unsharded layers)"
           if not runs_fsdp(plan) or not plan.roles.batch_shard else
           f"; {fmt_count(worst.params_replicated)} parameters are not split by the layout (norms, biases, unsharded layers), "
           f"ZeRO-{plan.zero} shards them over {' x '.join(plan.roles.batch_shard)} like the rest"),
    ]
    if worst.gather_buffer_bytes:
        what = ("every unit, kept from its forward to its backward" if gather_stage(plan) in (1, 2)
                else "every unit: the pipeline schedule keeps them gathered between backwards"
                if plan.roles.pipeline and worst.gather_buffer_bytes == worst.params_local * worst.dtype_bytes
                else "the stage root and two blocks, gathered for their forward and backward")
        lines.append(f"  ZeRO-{plan.zero} gather buffer ({what}): {fmt_bytes(worst.gather_buffer_bytes)}")
    if worst.grad_accum_bytes:
        by = "the pipeline schedule" if plan.roles.pipeline else "ZeRO-1 until its one reduce-scatter a step"
        lines.append(f"  gradient accumulators (FSDP2's unsharded gradients in {plan.reduce_dtype or plan.dtype}, kept between"
                     f" microbatches by {by}): {fmt_bytes(worst.grad_accum_bytes)}")
    return lines


def _communication_lines(rep: PlanReport) -> list[str]:
    """Communication per step: a row per axis, kind and op, on the busiest pipeline rank."""
    lines = ["", "communication per step (busiest pipeline rank per row; ring algorithm)"]
    comm_rows = [[c["axis"], c["kind"], c["op"], f"{c['calls']:,}", fmt_bytes(c["payload_bytes"]), fmt_bytes(c["wire_bytes"]),
                  fmt_seconds(c["seconds"]), "network" if c["crosses_hosts"] else "in host"] for c in rep.comm_by_axis()]
    if comm_rows:
        lines += ["  " + x for x in table_text(["axis", "kind", "op", "calls", "payload", "sent", "time", "link"], comm_rows,
                                           right={3, 4, 5, 6})]
    else:
        lines.append("  none (a single device)")
    return lines


def _bubble_lines(rep: PlanReport) -> list[str]:
    """The pipeline bubble, with the formula it comes from."""
    plan = rep.plan
    return ["", f"pipeline bubble: {rep.bubble:.1%}" + (bubble_formula(plan, rep.bubble) if plan.pipeline_size > 1 else " (no pipeline)")]


def _step_time_lines(rep: PlanReport) -> list[str]:
    """The step's time by part on the slowest pipeline rank, and its throughput and MFU."""
    plan, dev, st = rep.plan, rep.device, rep.step
    slow = next((rc for rc in rep.ranks if rc.compute_s == st.compute_s), rep.ranks[0])
    return [
        "",
        f"step time (estimate; {dev.name} {dev.tflops:g} TFLOP/s, large matmuls at {(dev.mfu or MFU):.0%} of it"
        + (f", memory {dev.hbm_gbps:g} GB/s" if dev.hbm_gbps else "") + f", links {dev.intra_gbps:g} / {dev.inter_gbps:g} GB/s)",
        f"  compute          {fmt_seconds(st.compute_s)}   matmuls" + (" (roofline) and memory traffic" if dev.hbm_gbps else "")
        + " on the slowest pipeline rank"
        + (f" + {slow.kernels:,} kernels x {dev.kernel_us:g} us" if dev.kernel_us else "")
        + (f", of which {fmt_seconds(slow.recompute_s)} recomputes {recomputed_text(plan)} in backward"
           if plan.recompute != "none" else ""),
        f"  tensor comm      {fmt_seconds(st.tensor_s)}",
        *([f"  expert comm      {fmt_seconds(st.expert_s)}   " + _expert_note(rep)] if plan.roles.expert else []),
        f"  pipeline comm    {fmt_seconds(st.pipeline_s)}",
        f"  bubble           {fmt_seconds(st.bubble_s)}",
        f"  data-parallel    {fmt_seconds(st.data_s)}" + _overlap_note(rep),
        *([f"  context comm     {fmt_seconds(st.context_s)}   {_context_text(rep)}"] if plan.context_size > 1 else []),
        *_shared_cores_lines(rep),
        f"  total            {fmt_seconds(st.total_s)}   {st.tokens / st.total_s:,.0f} tokens/s, model flops utilisation {rep.mfu:.0%}"
        f" ({st.model_flops / st.tokens / 1e9:,.3g} GFLOP per token: 6 (N - N_embedding) + 12 l h q t)",
        *_precision_lines(rep),
    ]


def without_float8_s(rep: PlanReport) -> float | None:
    """The step of the same plan with every matmul in the params dtype (None without float8)."""
    from meshllm_dsl.planner.analyze import analyze

    if rep.plan.float8 is None:
        return None
    return analyze(attrs.evolve(rep.plan, float8=None), rep.device, flash_attention=rep.flash_attention).step.total_s


def _precision_lines(rep: PlanReport) -> list[str]:
    """What `precision { matmul }` and `compile = blocks` do to the step (nothing without them)."""
    plan, out = rep.plan, []
    if plan.compile == "blocks":
        out.append("  compiled         each block of the repeat with torch.compile (`compile = blocks`): "
                   + ("its matmuls and elementwise work priced as fused" if rep.device.kernel_us is None
                      else "not priced on host-bound ranks"))
    if plan.float8 is not None:
        converted, total = float8_flops(plan)
        kept = kept_in_params_dtype(plan)
        off = without_float8_s(rep)
        assert off is not None
        out.append(f"  float8           {converted / total:.0%} of matmul FLOPs in {plan.float8.recipe}"
                   + (f" ({', '.join(kept[:-1]) + ' and ' + kept[-1] if len(kept) > 1 else kept[0]} in {plan.dtype})"
                      if kept else "")
                   + (", weights all-gathered in float8" if plan.float8.gather else "")
                   + f"; without float8 the step takes {fmt_seconds(off)} ({off / rep.step.total_s:.2f}x)")
    return out


def _shared_cores_lines(rep: PlanReport) -> list[str]:
    """Ranks time-sharing a host's cores: the step their host time sets (none when each has a device)."""
    dev, st = rep.device, rep.step
    if not st.shared_s:
        return []
    framework = ", ".join(f"{v:g} us per {what}" for v, what in (
        (dev.collective_cpu_us, "collective call"), (dev.stage_cpu_us, "pipeline action"),
        (dev.fsdp_cpu_us, "FSDP2 collective")) if v)
    return [f"  shared cores     {fmt_seconds(st.shared_s)}   {rep.plan.mesh.devices_per_host} ranks per host on {dev.cores:g} cores: their host time "
            f"(compute{', ' + framework if framework else ''}) / cores"
            + (", then the pipeline's fill and drain" if rep.bubble else "")
            + f"; a device per rank would take {fmt_seconds(st.critical_s)}"]


def _peak_lines(rep: PlanReport) -> list[str]:
    """The step's peak against the device's memory."""
    return ["", f"peak memory {fmt_bytes(rep.peak_training_bytes)} of {fmt_bytes(rep.device.memory_bytes)} per device"
            " (tensors allocated, as torch.cuda.max_memory_allocated counts them): "
            + ("fits" if rep.fits else "does NOT fit")]


def _skew_lines(rep: PlanReport) -> list[str]:
    """What the plan's routing skew does to each expert-parallel rank (nothing without `skew`)."""
    from meshllm_dsl.planner import moe as planner_moe

    return planner_moe.skew_lines(rep)


# `meshc plan`'s report, section by section in the order printed; each but the first opens with the
# blank line that separates it, and a section with nothing to say (the skew without `skew`) prints nothing.
REPORT_SECTIONS: tuple[Callable[[PlanReport], list[str]], ...] = (
    _heading_lines, _model_lines, _memory_lines, _communication_lines, _bubble_lines, _step_time_lines, _peak_lines,
    _skew_lines,
)


def report_text(rep: PlanReport) -> str:
    """`meshc plan`'s report of one plan: REPORT_SECTIONS in order."""
    return "\n".join(line for section in REPORT_SECTIONS for line in section(rep)) + "\n"


def _active_lines(plan: PlanIR) -> list[str]:
    """A moe model's parameters one token uses (planner_moe.active_parameters)."""
    from meshllm_dsl.planner import moe as planner_moe

    if not any(planner_moe.moe_units(plan)):
        return []
    active = planner_moe.active_parameters(plan)
    return [f"  active          {active:,} ({fmt_count(active)}) per token: top_k of the experts, router and shared experts"]


def _context_text(rep: PlanReport) -> str:
    plan = rep.plan
    n = plan.context_size
    per_layer = kv_gather_bytes_per_layer(plan)
    # mla gathers what its keys and values are up-projected from (runtime ContextShard.gather_latent)
    latent = any(u.kind == "mla" for r in plan.model.repeats for u in r.body)
    what, grads = ("the latents and rotary keys", "their gradients") if latent else ("K / V", "dK / dV")
    return (f"{what} all-gathered over {' x '.join(plan.roles.context)} ({n}): {fmt_bytes(per_layer)} per layer and "
            f"microbatch ({fmt_bytes(per_layer * (n - 1) // n)} sent per rank), {grads} reduce-scattered back; not "
            "overlapped with the compute (each attention waits for its gather)")


def report_json(rep: PlanReport) -> dict[str, Any]:
    plan, model = rep.plan, rep.plan.model
    w = DTYPES[plan.dtype]
    st = rep.step
    return {
        "plan": plan.name,
        "model": model.name,
        "mesh": {"name": plan.mesh.name, "axes": {a.name: a.size for a in plan.mesh.axes}, "hosts": plan.mesh.hosts,
                 "hosts_assumed": rep.hosts_assumed, "devices": plan.mesh.devices},
        "device": {**attrs.asdict(rep.device), "assumed": rep.device_assumed},
        "dtype": plan.dtype,
        "batch": plan.batch, "seq": plan.seq, "microbatches": plan.microbatches, "micro_batch": rep.micro_batch, "recompute": plan.recompute,
        "schedule": plan.schedule, "virtual": plan.virtual, "optimizer": plan.optimizer, "zero": plan.zero,
        "zero_axes": list(plan.roles.batch_shard),
        "context_axes": list(plan.roles.context),
        "document_mask": plan.document_mask,
        "restart_positions": plan.restart_positions,
        "context_balance": plan.context_balance,
        "kv_gather_bytes_per_layer": kv_gather_bytes_per_layer(plan),
        "parameters": model.numel,
        "weight_bytes": model.numel * w,
        "optimizer_bytes_per_param": rep.optimizer_k,
        "kv_cache_bytes_per_token": rep.kv_bytes_per_token,
        "kv_cache_bytes": kv_cache_bytes(plan, plan.seq) * plan.batch,
        "bubble": rep.bubble,
        "ranks": [
            {"pipeline_coord": rc.coord, "stages": list(rc.stages), "layers": rc.label, "ranks": list(rc.ranks),
             "params": rc.params_global, "params_per_device": rc.params_local, "params_replicated": rc.params_replicated,
             "weight_bytes": rc.weight_bytes, "grad_bytes": rc.grad_bytes, "optimizer_bytes": rc.optimizer_bytes,
             "gather_buffer_bytes": rc.gather_buffer_bytes,
             "activation_bytes_per_microbatch": rc.activation_bytes_per_microbatch, "in_flight": rc.in_flight,
             "activation_bytes": rc.activation_bytes, "transient_bytes": rc.transient_bytes, "kv_cache_bytes": rc.kv_cache_bytes,
             "grad_accum_bytes": rc.grad_accum_bytes,
             "training_bytes": rc.training_bytes, "inference_bytes": rc.inference_bytes, "compute_s": rc.compute_s,
             "recompute_s": rc.recompute_s, "kernels": rc.kernels, "kernel_s": rc.kernel_s, "host_s": rc.host_s,
             "comms": [attrs.asdict(c) for c in rc.comms]}
            for rc in rep.ranks
        ],
        "communication": rep.comm_by_axis(),
        "expert_all_to_all": expert_layer_comm(rep),
        "step": {"compute_s": st.compute_s, "tensor_s": st.tensor_s, "expert_s": st.expert_s, "pipeline_s": st.pipeline_s, "bubble_s": st.bubble_s,
                 "data_s": st.data_s, "context_s": st.context_s, "shared_s": st.shared_s, "critical_s": st.critical_s, "total_s": st.total_s, "model_flops": st.model_flops, "tokens": st.tokens,
                 "tokens_per_s": st.tokens / st.total_s if st.total_s else None, "mfu": rep.mfu, "assumed_matmul_mfu": rep.device.mfu or MFU},
        "peak_training_bytes": rep.peak_training_bytes,
        "peak_inference_bytes": rep.peak_inference_bytes,
        "fits": rep.fits,
        "fits_inference": rep.fits_inference,
        "compile": plan.compile,
        "float8": _float8_json(rep),
        **_moe_json(rep),
    }


def _float8_json(rep: PlanReport) -> dict[str, Any] | None:
    """The plan's float8 matmuls: recipe, layers, share of the matmul flops, and the step without them."""
    f8 = rep.plan.float8
    if f8 is None:
        return None
    converted, total = float8_flops(rep.plan)
    return {"recipe": f8.recipe, "layers": len(f8.layers), "skipped": [list(s) for s in f8.skipped],
            "all_gather_float8": f8.gather, "matmul_flops_share": converted / total,
            "kept_in_params_dtype": kept_in_params_dtype(rep.plan), "step_s_without_float8": without_float8_s(rep)}


def _moe_json(rep: PlanReport) -> dict[str, Any]:
    """A moe model's active parameters and, with `skew`, its per expert-parallel rank figures."""
    from meshllm_dsl.planner import moe as planner_moe

    if not any(planner_moe.moe_units(rep.plan)):
        return {}
    sk = planner_moe.skew_report(rep)
    return {"active_parameters": planner_moe.active_parameters(rep.plan),
            "skew": None if sk is None else {**attrs.asdict(sk, recurse=True), "wait_share": sk.wait_share}}
