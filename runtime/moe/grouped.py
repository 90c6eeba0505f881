"""Grouped expert matmuls: every local expert's projection in one ``torch._grouped_mm`` call.

``experts_swiglu`` (runtime/moe/experts.py) sorts the (token, choice) pairs by expert; here the
gathered rows [N, H], expert by expert, go through each projection (gate, up, down) in one
``_grouped_mm(rows, weights, offs=cumulative counts)`` instead of a Python loop of ``F.linear``
per expert. It computes what the loop computes: the same per-expert matrix products (torch 2.13's
CPU kernel is a loop of ``mm`` over the groups in C++; CUDA's runs them in one kernel), the same
bias and activation, weighted and added per token in the same order.

Where it runs: torch must have ``_grouped_mm`` and it must run forward and backward for the
device and compute dtype; that is probed once per (device, dtype) (``grouped_mm_works``): torch
2.13 takes float32, bfloat16 and float16, on CPU too, and refuses float64. Per call, every operand
must be in a layout the op reads as it is (``grouped_layout``: row- or column-major with the other
stride a multiple of 16 bytes). Elsewhere the loop runs.

No copy of the parameters: ``StackedLinear`` keeps gate / up as [F, E, H] and down as [H, E, F]
(the layout checkpoints and the column / row rules use); their [E, in, out] operands are permuted
views, column-major in the last two dims with leading stride E * in, which ``_grouped_mm`` reads as
transposed matrices (as ``F.linear`` reads an ``nn.Linear`` weight). A local shard whose E * in
is not a multiple of 16 bytes gets the loop, not a copy: a contiguous copy would cost E * in * out
elements per projection and call, and as much again for its gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Activation", "grouped_experts_ffn", "grouped_layout", "grouped_mm_works", "grouped_runs", "loop_only", "swiglu"]

Activation = Callable[[Tensor, Tensor], Tensor]
"""``act(gate_out, up_out) -> hidden``, elementwise over [rows, F_local]."""

_ALIGN_BYTES = 16  # aten's check_valid_strides_and_return_transposed (GroupedMMUtils.h)
_WORKS: dict[tuple[str, int | None, torch.dtype], bool] = {}


def swiglu(gate_out: Tensor, up_out: Tensor) -> Tensor:
    """The experts' default activation, SwiGLU: silu(gate) * up."""
    return F.silu(gate_out) * up_out


def matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts' matmuls compute in: autocast's where it is on for x's device (as
    ``F.linear`` casts to it; ``_grouped_mm`` is not on autocast's list, so the cast is ours), else x's."""
    dev = x.device.type
    # Autocast casts every floating operand but float64.
    if x.is_floating_point() and x.dtype != torch.float64 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def grouped_layout(mat: Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether ``_grouped_mm`` reads ``mat`` (as ``dtype``, default its own) as it is: column- or
    row-major in its last two dims with the other stride a multiple of 16 bytes and, off the CPU,
    a 16-byte-aligned start; aten's own check, in its order."""
    align = _ALIGN_BYTES // (dtype or mat.dtype).itemsize
    rows, cols = mat.shape[-2:]
    s_rows, s_cols = mat.stride()[-2:]
    if s_rows == 1 and s_cols >= max(1, rows):
        lead = s_cols
    elif s_cols == 1 and s_rows >= max(1, cols):
        lead = s_rows
    else:
        return False
    aligned_start = mat.device.type == "cpu" or mat.data_ptr() % _ALIGN_BYTES == 0
    return lead % align == 0 and aligned_start


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``_grouped_mm`` runs forward and backward on ``device`` in ``dtype`` and agrees with
    per-group matmuls: rows in 3 groups (one empty), the weights a transposed view as ours are."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # A probe made under inference mode, no_grad or autocast would answer for those alone.
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            gen = torch.Generator().manual_seed(0)
            a0, b0 = torch.randn(6, 8, generator=gen), torch.randn(3, 16, 8, generator=gen)
            grad0 = torch.randn(6, 16, generator=gen)
            a = a0.to(device, dtype).requires_grad_()
            b = b0.to(device, dtype).requires_grad_()
            offs = torch.tensor([2, 2, 6], dtype=torch.int32, device=device)
            out = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
            grad = grad0.to(device, dtype)
            out.backward(grad)
            want = torch.cat([a0[:2] @ b0[0].T, a0[2:6] @ b0[2].T])
            want_a = torch.cat([grad0[:2] @ b0[0], grad0[2:6] @ b0[2]])
            want_b = torch.stack([grad0[:2].T @ a0[:2], torch.zeros(16, 8), grad0[2:6].T @ a0[2:6]])
            tol = {"rtol": 2e-2, "atol": 1e-1} if torch.finfo(dtype).bits < 32 else {"rtol": 1e-4, "atol": 1e-4}
            return (a.grad is not None and b.grad is not None
                    and torch.allclose(out.float().cpu(), want, **tol)
                    and torch.allclose(a.grad.float().cpu(), want_a, **tol)
                    and torch.allclose(b.grad.float().cpu(), want_b, **tol))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        # The op refuses this device or dtype (float64: "Expected mat_a to be Float32, BFloat16 or
        # Float16 matrix"), or has no kernel or no backward for it here.
        return False


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """``_probe`` once per (device, dtype) of the process, then its answer."""
    key = (device.type, device.index, dtype)
    if key not in _WORKS:
        _WORKS[key] = _probe(device, dtype)
    return _WORKS[key]


_LOOP_ONLY = [0]  # > 0: inside loop_only(), the grouped path is off


@contextlib.contextmanager
def loop_only() -> Iterator[None]:
    """Run the experts' loop, not ``_grouped_mm``, for the forwards inside (and so their backwards):
    torch.distributed.pipelining's split backward (interleaved_zb, zbv, dualpipev: input gradients,
    then weight gradients from the saved graph) gets the experts' weight gradients wrong through
    ``_grouped_mm`` (tests/integration/test_zero_bubble.py)."""
    _LOOP_ONLY[0] += 1
    try:
        yield
    finally:
        _LOOP_ONLY[0] -= 1


def grouped_runs(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> bool:
    """Whether ``experts_swiglu`` takes the grouped path for x [T, H] and expert-major gate / up
    [E_local, F_local, H], down [E_local, H, F_local]: same dtype (or autocast over them), a
    working ``_grouped_mm`` there, and every operand in a layout it reads without a copy (rows of
    H and of F_local values each a multiple of 16 bytes; the weights' views as the module says)."""
    if _LOOP_ONLY[0]:
        return False
    dtype = matmul_dtype(x)
    if not (x.dtype == gate.dtype == up.dtype == down.dtype or dtype != x.dtype):
        return False
    if not grouped_mm_works(x.device, dtype):
        return False
    rows_aligned = all(n * dtype.itemsize % _ALIGN_BYTES == 0 for n in (x.shape[-1], gate.shape[1]))
    return rows_aligned and all(grouped_layout(w.transpose(1, 2), dtype) for w in (gate, up, down))


def _dense(grad: Tensor) -> Tensor:
    return grad.contiguous()


def _grouped(rows: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """rows [N, in] @ weight [E, in, out] group by group (``offs`` the groups' ends) -> [N, out]."""
    out = torch._grouped_mm(rows, weight, offs=offs)
    if out.requires_grad:
        # Its backward refuses a broadcast (stride 0) gradient, such as an act summing its gate
        # over a row hands the gate projection ("Invalid strides/sizes").
        out.register_hook(_dense)
    return out


class _ExpertBias(torch.autograd.Function):
    """out [N, n] + bias [E, n] of each row's expert (rows sorted by expert, ``expert`` [N] their
    ids). Its bias gradient sums each expert's rows in float32 (or wider) and rounds once, as the
    loop's broadcast add does; autograd's own for ``bias[expert]`` would add row after row in
    bfloat16."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, out: Tensor, bias: Tensor, expert: Tensor) -> Tensor:
        ctx.save_for_backward(expert)
        ctx.dtypes = (out.dtype, bias.dtype)  # type: ignore[attr-defined]
        ctx.n_experts = bias.shape[0]  # type: ignore[attr-defined]
        return out + bias[expert]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (expert,) = ctx.saved_tensors  # type: ignore[attr-defined]
        out_dtype, bias_dtype = ctx.dtypes  # type: ignore[attr-defined]
        acc = torch.promote_types(grad.dtype, torch.float32)
        summed = torch.zeros(ctx.n_experts, grad.shape[1], dtype=acc, device=grad.device)  # type: ignore[attr-defined]
        summed.index_add_(0, expert, grad.to(acc))
        return grad.to(out_dtype), summed.to(bias_dtype), None


def _add_bias(out: Tensor, bias: Tensor | None, expert: Tensor) -> Tensor:
    return out if bias is None else _ExpertBias.apply(out, bias, expert)


def grouped_experts_ffn(h: Tensor, counts: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                        gate_bias: Tensor | None = None, up_bias: Tensor | None = None,
                        down_bias: Tensor | None = None, act: Activation = swiglu) -> Tensor:
    """h [N, H] rows sorted by expert, ``counts`` [E_local] rows per local expert (summing to N) ->
    [N, H], each row through its expert: ``down(act(gate(h) + gate_bias, up(h) + up_bias)) + down_bias``.

    Weights expert-major as ``experts_swiglu`` takes them (gate / up [E_local, F_local, H], down
    [E_local, H, F_local]), biases [E_local, F_local] / [E_local, H]; ``grouped_runs`` must hold.
    A bias is added after the matmul (``_grouped_mm`` takes none on CPU), as the loop adds it."""
    dtype = matmul_dtype(h)
    offs = counts.cumsum(0).to(torch.int32)
    gate_w, up_w, down_w = (w.to(dtype).transpose(1, 2) for w in (gate, up, down))  # [E, in, out] views
    # One cast of h per projection, as autocast's F.linear makes: the two gradients then reach h
    # in its own dtype and add there, not in the matmuls' (a no-op without autocast).
    g = _grouped(h.to(dtype), gate_w, offs)
    u = _grouped(h.to(dtype), up_w, offs)
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=h.device), counts, output_size=h.shape[0])
    g, u = _add_bias(g, gate_bias, expert), _add_bias(u, up_bias, expert)
    hidden = act(g, u).to(dtype).contiguous()  # a no-op for an elementwise act without autocast
    return _add_bias(_grouped(hidden, down_w, offs), down_bias, expert)
