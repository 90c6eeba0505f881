"""Device profiles the planner knows: memory, dense throughput and link bandwidths.

Figures are vendor datasheet numbers (dense bf16/fp16 tensor-core throughput, no sparsity, memory
bandwidth, SMs); `intra` is the per-direction NVLink bandwidth per device, which NCCL's ring reaches a
fraction of per algorithm (`bus_efficiency`, NCCL-tests), `inter` what NCCL reaches per NIC. The
matmul efficiency of the a100 / h100 / h200 profiles is fitted to published runs (A100_MATMUL,
H100_MATMUL below).
A .mesh file can declare its own profile:

    device h100_pcie { like = h100, memory = 80, tflops = 756, intra = 64 }

Settings: `memory` (GiB), `tflops`, `intra` (GB/s within a host), `inter` (GB/s between hosts, per
device), `per_host` (devices in one host), `fp8_tflops` and `mx_tflops` (dense float8 and MXFP8 peaks;
absent: the device has no such tensor cores), `hbm` (GB/s of device memory: the roofline of a thin
matmul, and what lookups and elementwise work cost), `like` (a known profile whose values the others
default to), and, as `meshc calibrate` writes them, `mfu` (fraction of `tflops` large matmuls reach), `latency`
(microseconds per collective call), and for hosts whose CPU cores are the devices: `kernel`
(microseconds of host time per framework kernel: dispatch, autograd and Python around each operator,
which dominates small models), `collective_cpu` (microseconds of host time each collective call
takes from its rank's core), `stage_cpu` (microseconds of host time the pipeline schedule spends per
stage forward or backward of a microbatch, beyond its kernels), `fsdp_cpu` (the same per FSDP2
all-gather or reduce-scatter of a unit: hooks, DTensor bookkeeping) and `cores` (how many cores' worth
of CPU time the ranks of one host get at once, fractional when other work shares the machine; more
ranks time-share them). `meshc calibrate` measures the host times with its ranks running together,
as in a job: time-sharing makes each kernel dearer (cold caches after every wake-up).
The checker accepts the name in `device = NAME`; `declared_profiles` turns the declaration into a
profile, with diagnostics for settings that are missing or wrong.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from meshllm_dsl.codes import E0201, E0202, E0203, E0205, E0303, E0304, E0307, E0312, W0708
from meshllm_dsl.diagnostics import Diagnostic, Label, replace, typo
from meshllm_dsl.front import ast
from meshllm_dsl.front.limits import MAX_DEVICES
from meshllm_dsl.ir import MeshIR


@attrs.frozen
class DeviceProfile:
    name: str
    memory_gib: float  # usable accelerator memory
    tflops: float  # peak dense bf16/fp16 TFLOP/s
    intra_gbps: float  # GB/s between devices of one host (NVLink), per direction
    inter_gbps: float  # GB/s between hosts (network, per device), per direction
    per_host: int = 8  # devices in one host: where the fast link ends
    # Measured by `meshc calibrate` (None: the planner's assumptions MFU / LATENCY_* apply).
    mfu: float | None = None  # fraction of `tflops` the training matmuls reach
    latency_us: float | None = None  # per-collective latency, microseconds
    # Host-bound execution (CPU ranks; None: not modelled, as for GPUs, whose kernel launches are
    # asynchronous and overlap the device's work).
    kernel_us: float | None = None  # host time per framework kernel (operator), one rank alone
    collective_cpu_us: float | None = None  # host time per collective call, taken from the rank's core
    cores: float | None = None  # ranks of one host that run at full speed at once (fewer when shared)
    # The framework's own host time beyond its kernels and collective calls:
    stage_cpu_us: float | None = None  # per pipeline action (a stage's forward or backward of a microbatch)
    fsdp_cpu_us: float | None = None  # per FSDP2 all-gather or reduce-scatter of a unit (hooks, DTensor, copies)
    # GPUs: memory bandwidth (datasheet GB/s), which bounds a small matmul (the roofline) and prices
    # what is not a matmul (lookups, norms, activations, the optimizer step); None: not charged.
    hbm_gbps: float | None = None
    sms: int | None = None  # streaming multiprocessors (datasheet): a matmul's tiles run in waves over them
    # A collective in a host reaches this fraction of `intra` per algorithm (NCCL-tests bus
    # bandwidth over the line rate); across hosts each member's NIC carries it at `inter` (the
    # rate NCCL reaches, not the line rate), so a group with k members per host moves at most
    # k x `inter` (planner._link). Unlisted: the line rate.
    bus_efficiency: tuple[tuple[str, float], ...] = ()
    # Dense float8 tensor-core peak (TFLOP/s, datasheet): what torchao's float8 matmuls reach a
    # fraction of (`precision { matmul = fp8_tensorwise | fp8_rowwise }`); None: no float8 tensor cores
    # (the checker refuses the recipes, E0313). The CPU profile emulates float8 in its own dtype.
    fp8_tflops: float | None = None
    # Dense MXFP8 peak (block-scaled float8, OCP MX: Blackwell); None: no MX tensor cores (`mxfp8` is E0313).
    mx_tflops: float | None = None

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    def bus_fraction(self, op: str) -> float:
        return dict(self.bus_efficiency).get(op, 1.0)


# The built-in `cpu` profile. Source of each host-time figure: two `meshc calibrate --device cpu`
# runs on the project's build machine (2 cores of an AMD EPYC, Debian 12, torch 2.13 CPU, gloo) on
# 2026-12-01, shared with other jobs (load average 7.5 - 10 on its 2 cores), and the `meshc run
# --profile` runs of examples/tiny_llama.mesh and tiny_gpt2.mesh made then; a value between the two
# (first / second run) where they differ, leaning to the quieter one: a machine of one's own is
# faster, and `meshc calibrate` is the way to its figures. tests/planner/test_calibrated_device.py
# keeps the planned tiny_llama step within 2x of that measurement (CPU_MEASURED there).
CPU_DEFAULTS = DeviceProfile(
    "cpu",
    memory_gib=16.0,  # a laptop's share, as before (calibrate: 11.8 GiB = this machine's memory / 2 ranks)
    tflops=0.045,  # fp32 matmul, one process alone: 36.3 / 52.7 GFLOP/s
    intra_gbps=0.55, inter_gbps=0.55,  # 2-process all-reduce bus bandwidth of 4 MiB: 0.42 / 0.69 GB/s
    per_host=64,
    mfu=1.0,  # `tflops` is what the matmuls reach, not a datasheet peak
    latency_us=500.0,  # 8-byte all-reduce: 759 / 433 us
    kernel_us=40.0,  # host CPU per framework kernel, ranks running together: 52.1 / 35.2 us
    # host CPU per collective call: 1913 / 898 us; the tiny_llama profile's ranks spent 59 - 67 ms
    # of CPU on ~850 - 990 kernels and 22 - 24 calls, ~900 us a call at 40 us a kernel
    collective_cpu_us=900.0,
    # cores' worth of CPU the ranks get at once: 0.58 / 1.00 in calibrate's windows; the tiny_llama
    # profile's 8 ranks used 1.42 (8 x ~60 ms of CPU in a 338 ms step) at load 9; 2 cores in all
    cores=1.6,
    stage_cpu_us=0.0,  # 0.01 / 0.01 us: the schedule's own Python is inside the per-kernel cost
    fsdp_cpu_us=1300.0,  # per FSDP2 unit all-gather / reduce-scatter: 1149 / 1462 us
)


def uncalibrated(profile: DeviceProfile) -> bool:
    """The built-in `cpu` profile as shipped: its host times are another machine's (see CPU_DEFAULTS).
    A `device` declaration (`meshc calibrate` writes one, even named `cpu`) is this machine's."""
    return profile == CPU_DEFAULTS


# Fitted to ../shared/calibration/published.md only (tests/planner/test_published_runs.py prints
# the table, every row within 2.5 %): the fraction of the dense peak a large matmul reaches, per
# device generation, with planner.ELEMENTWISE_PASSES = 5 (the memory traffic of what is not a
# matmul, common to both) fitted beside them.
# A100: Megatron-LM SC21 Table 1 (GPT 1.7B - 18B, fp16, 32 - 256 GPUs; cuBLAS fp16 GEMMs of these
# sizes reach 250 - 270 of the 312 TFLOP/s).
A100_MATMUL = 0.80
# H100: torchtitan's Llama 3.1 8B FSDP 8 and FSDP 128 (bf16, eager). Their H100s are Grand Teton's
# 500 W HBM2e parts, and eager PyTorch leaves gaps between kernels that this model does not
# price: both are in this figure, which a 700 W H100 SXM under torch.compile exceeds. Its
# selective op checkpointing reruns every second matmul in backward (k, o and up of each block:
# about 7 of its 65 GFLOP per token), which `recompute = ops` plans as such (planner_recompute).
H100_MATMUL = 0.46

# `compile = blocks` and `precision { matmul = fp8_* }`, fitted to the torchtitan rows of
# ../shared/calibration/published.md only (Llama 3.1 8B, FSDP 8 and FSDP 128 on H100: eager 5,762 / 5,605,
# compiled 6,667 / 6,514, compiled + Float8 6,667 -> 8,532 / 8,380 tokens/s per GPU), compile first
# (eager -> compiled, with A100_MATMUL, H100_MATMUL and ELEMENTWISE_PASSES left as fitted to the eager
# rows), then Float8 (compiled -> compiled + Float8); tests/planner/test_float8_published.py prints
# the table. A compiled block's elementwise work (norms, rotary, SwiGLU, residual adds, the float8
# casts' own passes) is fused: it moves each tensor it produces the nominal twice (written once, read
# once), not planner.ELEMENTWISE_PASSES times; not fitted.
COMPILED_ELEMENTWISE_PASSES = 2.0
# and its matmuls run closer together (no Python or launch gaps between kernels, which the eager
# figure H100_MATMUL carries): the matmul efficiency of a compiled block's products times this.
COMPILED_MATMUL = 1.04
# torchao's float8 matmuls (torch._scaled_mm) reach this much less of the float8 peak than the params
# dtype's reach of theirs (the same matmul efficiency `mfu` times this), on top of the casts and
# amax reductions priced as memory traffic (planner/float8.py).
FLOAT8_MATMUL = 0.85

# NCCL-tests bus bandwidths (GitHub NVIDIA/nccl-tests and NVIDIA/nccl issues, NCCL's maintainers):
# A100 (NVLink 3, 300 GB/s per direction): ~200 - 210 GB/s all-reduce on 8 GPUs (nccl-tests #149,
# #178); 24 GB/s per HDR 200 Gb/s NIC, 192 GB/s all-reduce over 8 of them per DGX A100 (nccl #412,
# #812). H100 (NVLink 4, 450 GB/s): ~370 GB/s for ring algorithms (all-gather, reduce-scatter),
# ~480 GB/s all-reduce with NVLink SHARP (nccl-tests #212; 475 GB/s measured on 8 H200, #272);
# 48 GB/s per NDR / 400 Gb/s RDMA NIC (nccl-tests #267).
A100_BUS = (("all_reduce", 0.70), ("all_gather", 0.70), ("reduce_scatter", 0.70))
H100_BUS = (("all_reduce", 1.07), ("all_gather", 0.82), ("reduce_scatter", 0.82))

PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        # A100 SXM: 312 TFLOP/s bf16 / fp16, 108 SMs, NVLink 3 600 GB/s bidirectional = 300 per direction,
        # HDR 200 Gb/s NIC per GPU (24 GB/s reached); HBM2 1,555 GB/s (40 GB), HBM2e 2,039 GB/s (80 GB).
        DeviceProfile("a100_40gb", 40.0, 312.0, 300.0, 24.0, mfu=A100_MATMUL, hbm_gbps=1555.0, sms=108, bus_efficiency=A100_BUS),
        DeviceProfile("a100", 80.0, 312.0, 300.0, 24.0, mfu=A100_MATMUL, hbm_gbps=2039.0, sms=108, bus_efficiency=A100_BUS),
        DeviceProfile("a100_80gb", 80.0, 312.0, 300.0, 24.0, mfu=A100_MATMUL, hbm_gbps=2039.0, sms=108, bus_efficiency=A100_BUS),
        # H100 SXM: 989 TFLOP/s bf16 dense, 132 SMs, NVLink 4 900 GB/s bidirectional, NDR 400 Gb/s NIC per
        # GPU (48 GB/s reached), HBM3 3,350 GB/s.
        # Float8: 1,979 TFLOP/s dense (H100 / H800 / H200 datasheets).
        DeviceProfile("h100", 80.0, 989.0, 450.0, 48.0, mfu=H100_MATMUL, hbm_gbps=3350.0, sms=132, bus_efficiency=H100_BUS,
                      fp8_tflops=1979.0),
        # H800 SXM: H100's compute and memory with NVLink cut to 400 GB/s bidirectional (200 per
        # direction); DeepSeek-V3 was trained on 2,048 of them, 8 per node, InfiniBand 50 GB/s per GPU.
        DeviceProfile("h800", 80.0, 989.0, 200.0, 48.0, mfu=H100_MATMUL, hbm_gbps=3350.0, sms=132, bus_efficiency=H100_BUS,
                      fp8_tflops=1979.0),
        # no NVLink switch: PCIe 5 x16; float8 1,513 TFLOP/s dense
        DeviceProfile("h100_pcie", 80.0, 756.0, 64.0, 48.0, hbm_gbps=2000.0, sms=114, fp8_tflops=1513.0),
        # H200 SXM: H100's compute and NVLink, 141 GB HBM3e at 4,800 GB/s (datasheet).
        DeviceProfile("h200", 141.0, 989.0, 450.0, 48.0, mfu=H100_MATMUL, hbm_gbps=4800.0, sms=132, bus_efficiency=H100_BUS,
                      fp8_tflops=1979.0),
        # B200: 2.25 PFLOP/s bf16 dense, 4.5 PFLOP/s FP8 and MXFP8 dense, NVLink 5 1.8 TB/s bidirectional, HBM3e 8 TB/s.
        DeviceProfile("b200", 180.0, 2250.0, 900.0, 48.0, hbm_gbps=8000.0, fp8_tflops=4500.0, mx_tflops=4500.0),
        # MI300X: 1307 TFLOP/s bf16 dense, 2,615 FP8 dense, Infinity Fabric 7 x 64 GB/s per direction, HBM3 5.3 TB/s.
        DeviceProfile("mi300x", 192.0, 1307.0, 448.0, 48.0, hbm_gbps=5300.0, fp8_tflops=2615.0),
        # L40S (Ada): 733 TFLOP/s FP8 dense.
        DeviceProfile("l40s", 48.0, 362.0, 32.0, 25.0, per_host=4, hbm_gbps=864.0, fp8_tflops=733.0),
        DeviceProfile("a10g", 24.0, 125.0, 32.0, 12.5, per_host=4, hbm_gbps=600.0),
        # CPU ranks on gloo, out of the box: host-time defaults so `meshc run --profile` on the
        # bundled examples lands within 2x before `meshc calibrate` measures the machine at hand.
        CPU_DEFAULTS,
    )
}

DEFAULT_PROFILE = "h100"

_SETTINGS = {"memory": "memory_gib", "tflops": "tflops", "intra": "intra_gbps", "inter": "inter_gbps",
             "per_host": "per_host", "mfu": "mfu", "latency": "latency_us", "kernel": "kernel_us",
             "collective_cpu": "collective_cpu_us", "cores": "cores", "stage_cpu": "stage_cpu_us",
             "fsdp_cpu": "fsdp_cpu_us", "hbm": "hbm_gbps", "fp8_tflops": "fp8_tflops", "mx_tflops": "mx_tflops"}
_OPTIONAL = {"per_host", "mfu", "latency", "kernel", "collective_cpu", "cores", "stage_cpu", "fsdp_cpu", "hbm",
             "fp8_tflops", "mx_tflops"}
_WHOLE = {"per_host"}  # a count of devices
_EXAMPLE = {"mfu": 0.5, "latency": 10, "kernel": 8, "collective_cpu": 200, "cores": 2, "stage_cpu": 500,
            "fsdp_cpu": 500, "mx_tflops": 4500}


def _number(expr: ast.Expr) -> float | None:
    """Literal numbers and simple arithmetic over them (`80 * 1`); device settings name no dims."""
    if isinstance(expr, ast.IntLit):
        return float(expr.value)
    if isinstance(expr, ast.FloatLit):
        return expr.value
    if isinstance(expr, ast.Neg):
        v = _number(expr.operand)
        return None if v is None else -v
    if isinstance(expr, ast.BinOp):
        a, b = _number(expr.left), _number(expr.right)
        if a is None or b is None:
            return None
        if expr.op == "/":
            return None if b == 0 else a / b
        return {"+": a + b, "-": a - b, "*": a * b}[expr.op]
    return None


def declared_profiles(decls: Iterable[ast.DeviceDecl]) -> tuple[dict[str, DeviceProfile], list[Diagnostic]]:
    """Profiles from `device NAME { ... }` declarations, plus diagnostics for bad settings."""
    out: dict[str, DeviceProfile] = {}
    diags: list[Diagnostic] = []
    for decl in decls:
        values: dict[str, float] = {}
        base: DeviceProfile | None = None
        ok = True
        seen: dict[str, ast.Setting] = {}
        for s in decl.settings:
            key = s.name.value
            if key in seen:
                first = seen[key].name.span
                diags.append(Diagnostic(E0201, f"device setting `{key}` is given twice", s.name.span,
                                        label="given again here",
                                        secondary=(Label(first, "first given here"),) if first is not None else (),
                                        help="keep one of them: a repeated setting would silently override the other"))
                ok = False
                continue
            seen[key] = s
            if key == "like":
                target = s.value.value if isinstance(s.value, ast.Name) else None
                base = PROFILES.get(target or "") or out.get(target or "")
                if base is None:
                    diags.append(Diagnostic(E0202, f"unknown device profile `{target}`", s.value.span,
                                            label="not a known device",
                                            **typo(s.value.span, str(target), [*PROFILES, *out])))
                    ok = False
                continue
            if key not in _SETTINGS:
                diags.append(Diagnostic(E0203, f"unknown device setting `{key}`", s.name.span,
                                        label="not a device setting",
                                        **typo(s.name.span, key, [*_SETTINGS, "like"])))
                ok = False
                continue
            v = _number(s.value)
            if v is None or v <= 0:
                diags.append(Diagnostic(E0303 if v is not None else E0304, f"`{key}` must be a positive number",
                                        s.value.span, label="not a positive number",
                                        help=f"e.g. `{key} = {_EXAMPLE.get(key) or getattr(PROFILES[DEFAULT_PROFILE], _SETTINGS[key])}`"))
                ok = False
                continue
            if key in _WHOLE and (v != int(v) or v > MAX_DEVICES):
                diags.append(Diagnostic(E0304 if v != int(v) else E0307, f"`{key}` must be a whole number of devices"
                                        + ("" if v != int(v) else f" up to {MAX_DEVICES}"),
                                        s.value.span, label=f"is {v:g}",
                                        help=f"e.g. `{key} = {max(1, min(int(v), MAX_DEVICES))}`"))
                ok = False
                continue
            if key == "cores" and v > MAX_DEVICES:
                diags.append(Diagnostic(E0307, f"`cores` is out of range: {v:g}", s.value.span, label=f"more than {MAX_DEVICES}",
                                        help="e.g. `cores = 2`: the CPU cores the ranks of one host share"))
                ok = False
                continue
            if key == "mfu" and v > 1:
                diags.append(Diagnostic(E0307, f"`mfu` is a fraction of peak throughput, at most 1: {v:g}", s.value.span,
                                        label="more than the peak", help="e.g. `mfu = 0.5`"))
                ok = False
                continue
            if not math.isfinite(v) or v > 1e9:
                diags.append(Diagnostic(E0307, f"`{key}` is out of range: {v:g}", s.value.span, label="too large",
                                        help=f"e.g. `{key} = {getattr(PROFILES[DEFAULT_PROFILE], _SETTINGS[key])}`"))
                ok = False
                continue
            values[_SETTINGS[key]] = v
        if not ok:
            continue
        missing = [k for k, field in _SETTINGS.items() if field not in values and k not in _OPTIONAL]
        if base is None and missing:
            diags.append(Diagnostic(E0205, f"device `{decl.name.value}` does not set {', '.join(f'`{m}`' for m in missing)}",
                                    decl.name.span, label="incomplete profile",
                                    help=f"set them, or start from a known profile with `like = {DEFAULT_PROFILE}`"))
            continue
        start = base if base is not None else DeviceProfile(decl.name.value, 0.0, 0.0, 0.0, 0.0)
        out[decl.name.value] = attrs.evolve(
            start, name=decl.name.value,
            **{k: (int(v) if k == "per_host" else v) for k, v in values.items()})  # type: ignore[arg-type]
    return out, diags


def hosts_needed(devices: int, per_host: int) -> int:
    """The fewest hosts of at most `per_host` devices that hold `devices` evenly (every host the same)."""
    return next(h for h in range(-(-devices // per_host), devices + 1) if devices % h == 0)


def host_diagnostics(decl: ast.MeshDecl, devices: int, hosts: int, profile: DeviceProfile | None) -> list[Diagnostic]:
    """A mesh's devices per host against its profile's `per_host`: an error where `hosts` puts more on
    one host than it holds (E0312), a warning where `hosts` is omitted for more than one host holds
    (W0708: the planner then assumes `hosts_needed` hosts, see `assumed_hosts`)."""
    if profile is None or devices <= profile.per_host:
        return []
    name, per = profile.name, profile.per_host
    setting = next((s for s in decl.settings if s.name.value == "hosts"), None)
    if setting is None:
        need = hosts_needed(devices, per)
        return [Diagnostic(
            W0708, f"mesh `{decl.name.value}` has {devices} `{name}` devices, more than one host holds ({per}), "
            "and no `hosts`", decl.name.span, label=f"assumed: {need} hosts of {devices // need}",
            note=f"`meshc plan` and `meshc compile --slurm` take the mesh as {need} hosts of {devices // need} (ranks "
            f"0-{devices // need - 1} on the first, {devices // need}-{2 * (devices // need) - 1} on the next, ...), "
            f"never as one host of {devices}",
            help=f"declare the hosts: `hosts = {need}`")]
    if devices // hosts <= per:
        return []
    need = hosts_needed(devices, per)
    return [Diagnostic(
        E0312, f"{devices // hosts} devices per host, but a `{name}` host holds {per}", setting.value.span,
        label=f"{devices} devices over {hosts} host{'s' * (hosts > 1)}",
        help=f"use `hosts = {need}` or more ({devices // need} per host), or a device profile with "
        f"`per_host = {devices // hosts}`: `device {name}_{devices // hosts} {{ like = {name}, per_host = {devices // hosts} }}`",
        suggestions=replace(setting.value.span, str(need), f"Use `hosts = {need}`"))]


def assumed_hosts(mesh: MeshIR, device: DeviceProfile) -> MeshIR:
    """The mesh the planner prices: one without `hosts` but more devices than a host of `device`
    holds is taken as the fewest hosts that hold it (W0708 says so), never as one host, which
    would price its cross-host collectives at in-host bandwidth."""
    if mesh.hosts > 1 or mesh.devices <= device.per_host:
        return mesh
    return attrs.evolve(mesh, hosts=hosts_needed(mesh.devices, device.per_host))


def group_crosses_hosts(mesh: MeshIR, axes: tuple[str, ...]) -> bool:
    """MeshIR.crosses_hosts without listing every rank (an assumed 16,384 hosts must stay cheap).

    Hosts hold consecutive ranks, so a group is inside one host exactly when its lowest rank (the
    group's base: every axis of `axes` at 0) and its highest (base + the span of `axes`) share a host.
    """
    if mesh.hosts <= 1:
        return False
    per_host = mesh.devices_per_host
    span = sum((a.size - 1) * mesh.stride(a.name) for a in mesh.axes if a.name in axes)
    if span >= per_host:
        return True
    bases = [0]
    for a in mesh.axes:
        if a.name not in axes:
            stride = mesh.stride(a.name)
            bases = [b + c * stride for b in bases for c in range(a.size)]
    return any(b % per_host + span >= per_host for b in bases)
