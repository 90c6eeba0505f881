"""runtime/moe/grouped.py: the experts' projections by ``torch._grouped_mm`` give what the
``F.linear`` loop of runtime/moe/experts.py gives, outputs and gradients (w.r.t. the tokens, the
stacked weights, the routing weights and the biases) to the dtype's tightest tolerance, in every dtype the grouped path
takes; the probe sends everything else to the loop; biases and a custom activation mean what a
dense computation of the same experts says; a tensor-parallel down bias is added once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from meshllm_dsl.runtime.moe import experts as moe  # noqa: E402
from meshllm_dsl.runtime.moe import grouped  # noqa: E402

T, H, FFN, E, K = 40, 16, 24, 8, 2
GROUPED_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
Tensor = torch.Tensor


def clamped_glu(g: Tensor, u: Tensor) -> Tensor:
    """A custom activation of the kind GPT-OSS uses (clamped, sigmoid-gated, up + 1)."""
    g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    return (u + 1) * g * torch.sigmoid(1.702 * g)


@contextmanager
def loop_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(moe, "grouped_runs", lambda *args: False)
        yield


@contextmanager
def counting_grouped(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the calls of the grouped path (so a test knows it ran, not the loop)."""
    calls: list[int] = []
    real = moe.grouped_experts_ffn

    def spy(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(moe, "grouped_experts_ffn", spy)
        yield calls


def _problem(dtype: torch.dtype, seed: int, *, f: int = FFN, experts: int = E, idx: Tensor | None = None,
             biases: bool = False) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = {
        "x": torch.randn(T, H, generator=gen),
        # StackedLinear's layout: gate / up [F, E, H], down [H, E, F]
        "gate": 0.5 * torch.randn(f, experts, H, generator=gen),
        "up": 0.5 * torch.randn(f, experts, H, generator=gen),
        "down": 0.5 * torch.randn(H, experts, f, generator=gen),
        "weights": torch.rand(T, K, generator=gen),  # float32, as with weights_fp32
        "idx": torch.randint(0, experts, (T, K), generator=gen) if idx is None else idx,
    }
    if biases:
        p |= {"gate_bias": 0.5 * torch.randn(experts, f, generator=gen),
              "up_bias": 0.5 * torch.randn(experts, f, generator=gen),
              "down_bias": 0.5 * torch.randn(experts, H, generator=gen)}
    return {k: v if k in ("idx", "weights") else v.to(dtype) for k, v in p.items()}


def _run(p: dict[str, Tensor], *, first: int = 0, local: slice = slice(None), ffn: slice = slice(None),
         act: Callable[[Tensor, Tensor], Tensor] = grouped.swiglu, cotangent_seed: int = 9
         ) -> tuple[Tensor, dict[str, Tensor]]:
    """``moe_experts`` on the local experts ``local`` and ffn slice ``ffn`` of the problem, and
    the gradients of <out, random cotangent> w.r.t. every float input (leaves of their own)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in p.items() if k != "idx"}
    gate, up = leaves["gate"][ffn, local], leaves["up"][ffn, local]
    down = leaves["down"][:, local, ffn]
    # moe_experts takes the biases as StackedLinear holds them: gate / up [F, E], down [H, E]
    kw = {name: leaves[name][local, ffn].t() for name in ("gate_bias", "up_bias") if name in leaves}
    if "down_bias" in leaves:
        kw["down_bias"] = leaves["down_bias"][local].t()
    out = moe.moe_experts(leaves["x"], p["idx"], leaves["weights"], gate, up, down, first, act=act, **kw)
    if not out.requires_grad:  # no local pairs: the output is zeros, on nothing
        return out, {}
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(cotangent_seed)).to(out.dtype)
    (out * cot).sum().backward()
    return out.detach(), {k: v.grad for k, v in leaves.items() if v.grad is not None}


def _both(monkeypatch: pytest.MonkeyPatch, p: dict[str, Tensor], **kw: Any
          ) -> tuple[tuple[Tensor, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]:
    with counting_grouped(monkeypatch) as calls:
        got = _run(p, **kw)
    assert calls, "the grouped path did not run"
    with loop_only(monkeypatch):
        want = _run(p, **kw)
    return got, want


def _assert_equal(got: tuple[Tensor, dict[str, Tensor]], want: tuple[Tensor, dict[str, Tensor]]) -> None:
    """Equal to the dtype's tightest default tolerance (float32: rtol 1.3e-6, atol 1e-5; bfloat16:
    rtol 1.6e-2; float16: rtol 1e-3). Not bit for bit: the matmuls are (the same ``mm`` per
    expert), but SiLU's vectorised loop and its scalar tail round ``exp`` differently, and where
    a tail falls differs between one [N, F] activation and a loop's [n, F] pieces."""
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for k in want[1]:
        torch.testing.assert_close(got[1][k], want[1][k], msg=lambda m, k=k: f"d/d{k}: {m}")


def _dense(p: dict[str, Tensor], act: Callable[[Tensor, Tensor], Tensor] = grouped.swiglu) -> Tensor:
    """Every expert on every token in float64, combined by the routing weights: a computation
    other than both paths, for what biases and act must mean."""
    d = {k: v.double() if v.is_floating_point() else v for k, v in p.items()}
    g = torch.einsum("th,feh->tef", d["x"], d["gate"]) + d.get("gate_bias", torch.zeros(()))
    u = torch.einsum("th,feh->tef", d["x"], d["up"]) + d.get("up_bias", torch.zeros(()))
    y = torch.einsum("tef,hef->teh", act(g, u), d["down"]) + d.get("down_bias", torch.zeros(()))
    combine = torch.zeros(T, d["gate"].shape[1], dtype=torch.float64).scatter_add(1, d["idx"], d["weights"])
    return (y * combine[..., None]).sum(1)


@pytest.mark.parametrize("dtype", GROUPED_DTYPES, ids=str)
def test_grouped_equals_loop(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    p = _problem(dtype, 0)
    got, want = _both(monkeypatch, p)
    _assert_equal(got, want)
    assert set(got[1]) == {"x", "gate", "up", "down", "weights"}
    # and both are the experts: against float64 every-expert-on-every-token
    tol = 1e-4 if dtype == torch.float32 else 0.2
    torch.testing.assert_close(got[0].double(), _dense(p), rtol=0, atol=tol * 10)


@pytest.mark.parametrize("dtype", GROUPED_DTYPES, ids=str)
@pytest.mark.parametrize("case", ["empty_experts", "one_expert", "no_local_pairs"])
def test_grouped_equals_loop_on_skewed_routing(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                               case: str) -> None:
    gen = torch.Generator().manual_seed(1)
    if case == "empty_experts":  # experts 0, 3, 4 and 7 get nothing, among them the first and the last
        idx = torch.tensor([1, 2, 5, 6])[torch.randint(0, 4, (T, K), generator=gen)]
        idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % E, idx[:, 1])
        idx[idx == 0], idx[idx == 7] = 1, 6
    elif case == "one_expert":  # every token's first choice is expert 3
        idx = torch.stack([torch.full((T,), 3), torch.randint(0, E, (T,), generator=gen)], 1)
        idx[:, 1] = torch.where(idx[:, 1] == 3, 4, idx[:, 1])
    else:  # every pair routed to another rank's experts: this rank adds nothing
        idx = torch.randint(4, E, (T, K), generator=gen)
    p = _problem(dtype, 2, idx=idx)
    local = slice(0, 4) if case == "no_local_pairs" else slice(None)
    if case == "no_local_pairs":
        with counting_grouped(monkeypatch):
            got = _run(p, local=local)
        with loop_only(monkeypatch):
            want = _run(p, local=local)
        assert not got[0].any() and not want[0].any()
    else:
        got, want = _both(monkeypatch, p)
        counts = torch.bincount(idx.reshape(-1), minlength=E)
        assert (counts == 0).any() if case == "empty_experts" else counts[3] >= T
        assert not got[1]["gate"][:, counts == 0].any()  # an expert without tokens has no gradient
    _assert_equal(got, want)


@pytest.mark.parametrize("dtype", GROUPED_DTYPES, ids=str)
def test_expert_parallel_local_slices_equal_and_sum_to_the_whole(monkeypatch: pytest.MonkeyPatch,
                                                                 dtype: torch.dtype) -> None:
    """Each rank's experts ``first`` .. ``first + 3`` of 8: grouped = loop, and the two
    ranks' outputs add up to the whole layer's."""
    p = _problem(dtype, 3)
    parts = []
    for first in (0, 4):
        got, want = _both(monkeypatch, p, first=first, local=slice(first, first + 4))
        _assert_equal(got, want)
        parts.append(got[0])
    whole = _run(p)[0]
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close((parts[0].float() + parts[1].float()), whole.float(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", GROUPED_DTYPES, ids=str)
def test_tensor_parallel_ffn_slices_equal_and_down_bias_added_once(monkeypatch: pytest.MonkeyPatch,
                                                                   dtype: torch.dtype) -> None:
    """F_local = F / 2 with biases and a custom act: each rank's partial sum grouped = loop; the partials without the down bias, plus ``moe_expert_bias`` once, give the whole."""
    p = _problem(dtype, 4, f=32, biases=True)
    halves = (slice(0, 16), slice(16, 32))
    no_down = {k: v for k, v in p.items() if k != "down_bias"}
    partial = []
    for ffn in halves:
        got, want = _both(monkeypatch, no_down, ffn=ffn, act=clamped_glu)
        _assert_equal(got, want)
        partial.append(got[0].double())
    added_once = partial[0] + partial[1] + moe.moe_expert_bias(
        p["idx"], p["weights"], p["down_bias"].t()).double()
    want_whole = _dense(p, clamped_glu)
    tol = 1e-4 if dtype == torch.float32 else 0.3
    torch.testing.assert_close(added_once, want_whole, rtol=0, atol=tol)
    # each rank adding it would count it twice: far off, so the test tells the two apart
    twice = added_once + moe.moe_expert_bias(p["idx"], p["weights"], p["down_bias"].t()).double()
    assert (twice - want_whole).abs().max() > 3 * (added_once - want_whole).abs().max()


@pytest.mark.parametrize("dtype", GROUPED_DTYPES, ids=str)
def test_biases_and_custom_act_equal_and_mean_the_dense_experts(monkeypatch: pytest.MonkeyPatch,
                                                                dtype: torch.dtype) -> None:
    p = _problem(dtype, 5, biases=True)
    got, want = _both(monkeypatch, p, act=clamped_glu)
    _assert_equal(got, want)
    assert {"gate_bias", "up_bias", "down_bias"} <= set(got[1])
    tol = 2e-4 if dtype == torch.float32 else 0.5
    torch.testing.assert_close(got[0].double(), _dense(p, clamped_glu), rtol=0, atol=tol)
    plain = _run({k: v for k, v in p.items() if not k.endswith("_bias")})[0].double()
    err = (got[0].double() - _dense(p, clamped_glu)).abs().max()
    assert (plain - _dense(p, clamped_glu)).abs().max() > 3 * err  # the biases and act are visible


def test_default_loop_unchanged_in_float64() -> None:
    """float64 takes the loop (the probe refuses it), and the loop without biases or act is
    today's expression: SwiGLU experts, bit for bit."""
    p = _problem(torch.float64, 6)
    got = _run(p)[0]
    x, gate, up, down = p["x"], p["gate"].transpose(0, 1), p["up"].transpose(0, 1), p["down"].transpose(0, 1)
    flat = p["idx"].reshape(-1)
    order = torch.argsort(flat, stable=True)
    want = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=E).tolist()):
        sel = order[start:start + n]
        h = x[sel // K]
        y = F.linear(F.silu(F.linear(h, gate[e])) * F.linear(h, up[e]), down[e])
        want = want.index_add(0, sel // K, (y * p["weights"].reshape(-1)[sel, None]).to(x.dtype))
        start += n
    assert torch.equal(got, want)
    torch.testing.assert_close(got, _dense(p), rtol=0, atol=1e-12)


def test_autocast_grouped_equals_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under autocast (fp32 master weights, bf16 matmuls) the grouped path casts as F.linear does."""
    p = _problem(torch.float32, 7, biases=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = _both(monkeypatch, p)
    _assert_equal(got, want)
    assert got[0].dtype == torch.float32 and got[1]["gate"].dtype == torch.float32


def test_broadcast_gradient_reaches_the_grouped_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """An act that reduces its gate per row (``u * g.sum(-1)``) hands the gate projection a stride-0
    gradient, which ``_grouped_mm``'s backward refuses ("Invalid strides/sizes"); the grouped path
    makes it dense, and the gradients are the loop's."""
    p = _problem(torch.float32, 8)

    def sum_gated(g: Tensor, u: Tensor) -> Tensor:
        return u * g.sum(-1, keepdim=True)

    got, want = _both(monkeypatch, p, act=sum_gated)
    _assert_equal(got, want)


def test_probe_refuses_float64_and_takes_the_half_and_single_dtypes() -> None:
    cpu = torch.device("cpu")
    assert not grouped.grouped_mm_works(cpu, torch.float64)
    assert all(grouped.grouped_mm_works(cpu, dt) for dt in GROUPED_DTYPES)


def test_probe_runs_once_per_device_and_dtype_and_not_poisoned_by_no_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    real = grouped._probe

    def counted(device: torch.device, dtype: torch.dtype) -> bool:
        calls.append(dtype)
        return real(device, dtype)

    monkeypatch.setattr(grouped, "_WORKS", {})
    monkeypatch.setattr(grouped, "_probe", counted)
    p = _problem(torch.float32, 9)
    with torch.inference_mode():  # the first call in inference mode still probes autograd
        for _ in range(3):
            moe.moe_experts(p["x"], p["idx"], p["weights"], p["gate"], p["up"], p["down"])
    with torch.no_grad():
        moe.moe_experts(p["x"], p["idx"], p["weights"], p["gate"], p["up"], p["down"])
    assert calls == [torch.float32]
    assert grouped._WORKS == {("cpu", None, torch.float32): True}


def test_probe_picks_the_loop_without_grouped_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grouped, "_WORKS", {})
    monkeypatch.delattr(torch, "_grouped_mm")
    p = _problem(torch.float32, 10)
    assert not grouped.grouped_runs(p["x"], *(p[k].transpose(0, 1) for k in ("gate", "up", "down")))
    with counting_grouped(monkeypatch) as calls:
        out = moe.moe_experts(p["x"], p["idx"], p["weights"], p["gate"], p["up"], p["down"])
    assert not calls
    torch.testing.assert_close(out.double(), _dense(p), rtol=0, atol=1e-3)


@pytest.mark.parametrize("case", ["hidden_not_16_bytes", "ffn_not_16_bytes", "interleaved_gate", "mixed_dtypes"])
def test_layouts_grouped_mm_cannot_read_take_the_loop(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Misaligned rows (H or F_local values not a multiple of 16 bytes), a weight view that is
    neither row- nor column-major (gate / up interleaved in one fused weight, as GPT-OSS stores
    them) and mixed dtypes run the loop, with the loop's result."""
    gen = torch.Generator().manual_seed(11)
    h, f = (6, 8) if case == "hidden_not_16_bytes" else (8, 6) if case == "ffn_not_16_bytes" else (8, 8)
    x = torch.randn(T, h, generator=gen)
    idx = torch.randint(0, E, (T, K), generator=gen)
    w = torch.rand(T, K, generator=gen)
    gate_up = torch.randn(E, h, 2 * f, generator=gen)  # [E, H, 2F]: HF GPT-OSS's fused, interleaved
    if case == "interleaved_gate":
        gate, up = gate_up[..., ::2].transpose(1, 2), gate_up[..., 1::2].transpose(1, 2)  # [E, F, H]
    else:
        gate, up = torch.randn(E, f, h, generator=gen), torch.randn(E, f, h, generator=gen)
    down = torch.randn(E, h, f, generator=gen)
    if case == "mixed_dtypes":
        down = down.to(torch.bfloat16)
        assert not grouped.grouped_runs(x, gate, up, down)
        return  # the loop's F.linear refuses mixed dtypes too: nothing to compare
    assert not grouped.grouped_runs(x, gate, up, down)
    with counting_grouped(monkeypatch) as calls:
        got = moe.experts_swiglu(x, idx, w, gate, up, down)
    assert not calls
    with loop_only(monkeypatch):
        assert torch.equal(got, moe.experts_swiglu(x, idx, w, gate, up, down))
    # the same numbers made contiguous (aligned cases only) would take the grouped path
    if case == "interleaved_gate":
        assert grouped.grouped_runs(x, gate.contiguous(), up.contiguous(), down)


def test_stacked_linear_views_need_no_copy() -> None:
    """The [E, in, out] operands of StackedLinear's [out, E, in] weights are views grouped_mm reads
    as they are (column-major, leading stride E * in)."""
    gate, down = moe.StackedLinear(E, H, FFN), moe.StackedLinear(E, FFN, H)
    for w in (gate.weight, down.weight):
        view = w.transpose(0, 1).transpose(1, 2)  # what grouped_experts_ffn hands _grouped_mm
        assert grouped.grouped_layout(view) and view.data_ptr() == w.data_ptr()
        assert view.stride()[-2:] == (1, w.shape[1] * w.shape[2])


def test_loop_only_turns_the_grouped_path_off_inside_and_back_on_after() -> None:
    # torch's split-backward schedules run their experts so (runtime/train/program.py)
    x, gate, up, down = torch.randn(8, 16), torch.randn(4, 8, 16), torch.randn(4, 8, 16), torch.randn(4, 16, 8)
    gate, up, down = gate.transpose(1, 2).contiguous().transpose(1, 2), up.transpose(1, 2).contiguous().transpose(1, 2), \
        down.transpose(1, 2).contiguous().transpose(1, 2)
    before = grouped.grouped_runs(x, gate, up, down)
    assert before  # float32, 16-byte rows: the grouped path runs here
    with grouped.loop_only():
        assert not grouped.grouped_runs(x, gate, up, down)
    assert grouped.grouped_runs(x, gate, up, down) == before
