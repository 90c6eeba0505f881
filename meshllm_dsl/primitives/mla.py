"""`mla(hidden, heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, ...)`: multi-head
latent attention (DeepSeek-V2 / V3, Kimi K2; transformers' `DeepseekV3Attention`), a block's sublayer.

Queries come through a low-rank latent (`q_a` -> RMSNorm -> `q_b`) or, with `q_lora_rank = 0`, one
projection `q`; keys and values from a compressed latent: `kv_a` gives [kv_lora_rank | qk_rope_head_dim],
the latent goes through its RMSNorm and `kv_b` to per head [qk_nope_head_dim | v_head_dim], and the
rotary part is one key shared by every head. Rotary applies to the rope parts only.

Tensor parallelism splits the heads, as Megatron-Core's MLASelfAttention and torchtitan's deepseek_v3
plan do: the up-projections (`q_b` or `q`, `kv_b`) column-parallel, `o` row-parallel, the
down-projections `q_a` / `kv_a` and their norms whole on every rank. The rank-local heads' gradients
of a whole latent are partial sums, so f (`copy_to`) sits on the normed latents and the shared rotary
key (one all-reduce of them concatenated), not on the block's input: the replicated down-projections
and norms then get whole gradients.

Context parallelism gathers the latents, not the heads: the normed latent and the rotated shared key
of every rank's tokens (one all-gather of kv_lora_rank + qk_rope_head_dim values per token), which
each rank up-projects through its kv_b shard (runtime/parallel/context.py `gather_latent`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from meshllm_dsl.codes import E0304, E0402, E0405
from meshllm_dsl.diagnostics import make_rule
from meshllm_dsl.ir import DTYPES, Collective, Leaf, Placement, Tensor, Unit, UnitFlow
from meshllm_dsl.parallel import costs
from meshllm_dsl.parallel.costs import Matmul, Work
from meshllm_dsl.parallel.flow import FlowSite, R, at_residual, partial_error, through
from meshllm_dsl.primitives import Built, Primitive
from meshllm_dsl.primitives.args import Arg, const

if TYPE_CHECKING:
    from meshllm_dsl.front.site import UnitSite
    from meshllm_dsl.ir import PlanIR
    from meshllm_dsl.parallel.costs import HeldUnit

# The down-projections: whole on every rank (their outputs are the latents every head reads).
DOWN = ("q_a", "kv_a")
# Kernels beyond planner.KERNELS' parts, forward and backward, counted with `meshc run --profile`
# (torch 2.13 CPU, 2026-12-04): the latents' and rope parts' splits, concatenations, views and the
# shared key's expansion; rope_interleave's even / odd halves of q and k; under tensor parallelism
# f's concatenation of the latents and its split.
_KERNELS = {"latents": 33, "deinterleave": 11, "split_heads": 25}


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's 0.1 m ln(factor) + 1 (1 for a factor <= 1): transformers' yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(a: Mapping[str, Any]) -> float:
    """The logits' scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale(factor,
    mscale_all_dim) squared where a yarn rope gives mscale_all_dim (transformers' yarn_apply_mscale)."""
    scale = float(a["qk_nope_head_dim"] + a["qk_rope_head_dim"]) ** -0.5
    scaling = dict(a.get("rope_scaling") or ())
    if scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def _splits_heads(hu: HeldUnit) -> bool:
    """Whether its heads are split (its flow has f, the copy_to in front of the up-projections)."""
    return hu.flow is not None and any(c.where == "input" for c in hu.flow.collectives)


@attrs.frozen
class Mla(Primitive):
    def build(self, site: UnitSite) -> Built | None:
        b, name, span, unit, r, decl = site.b, site.name, site.span, site.unit, site.r, site.decl
        hid, h = b["hidden"], b["heads"]
        ql, kvl = b["q_lora_rank"], b["kv_lora_rank"]
        nope, rope, vd = b["qk_nope_head_dim"], b["qk_rope_head_dim"], b["v_head_dim"]
        if rope % 2:
            r.error(E0304, f"`{name}`: qk_rope_head_dim ({rope}) is odd", site.arg_span("qk_rope_head_dim"),
                    label="rotary turns pairs of values",
                    help=f"use an even qk_rope_head_dim, e.g. {rope + 1}")
            return None
        hu, hidu = (site.lg.get("heads", "heads"), h), unit("hidden")

        def lin(n: str, rows: int, cols: int, out: tuple[tuple[str, int], ...], inp: tuple[tuple[str, int], ...],
                bias: bool, norm: int = 0) -> Leaf:
            ps = [Tensor("weight", (rows, cols), (out, inp))]
            if bias:
                ps.append(Tensor("bias", (rows,), (out,)))
            if norm:
                # the latent's RMSNorm scale (HF's q_a_layernorm / kv_a_layernorm): whole, as its layer
                ps.append(Tensor("norm", (norm,), ((),)))
            return Leaf(n, (name, n), "linear", tuple(ps), inp, out, span=span)

        qk = nope + rope
        # A latent is made of no shard unit: no rule splits a down-projection's output.
        if ql:
            leaves = [lin("q_a", ql, hid, (), (hidu,), b["bias"], norm=ql), lin("q_b", h * qk, ql, (hu,), (), False)]
        else:
            leaves = [lin("q", h * qk, hid, (hu,), (hidu,), False)]
        leaves += [lin("kv_a", kvl + rope, hid, (), (hidu,), b["bias"], norm=kvl),
                   lin("kv_b", h * (nope + vd), kvl, (hu,), (), False),
                   lin("o", hid, h * vd, (hidu,), (hu,), b["bias"])]
        scaling = None
        if b["rope_type"] == "yarn":
            if b["rope_factor"] < 1.0 or b["rope_original_positions"] < 1:
                r.error(E0304, f"`{name}`: yarn rope scaling needs rope_factor >= 1 and rope_original_positions >= 1",
                        decl.call.span, label="invalid yarn rope scaling",
                        help="give the config's rope_scaling factor and original_max_position_embeddings")
                return None
            scaling = (("rope_type", "yarn"), ("factor", b["rope_factor"]),
                       ("original_max_position_embeddings", int(b["rope_original_positions"])),
                       ("beta_fast", b["rope_beta_fast"]), ("beta_slow", b["rope_beta_slow"]),
                       ("truncate", b["rope_truncate"]))
            # 0: absent from the config (transformers' attention factor is then mscale(factor))
            scaling += tuple((k, b[f"rope_{k}"]) for k in ("mscale", "mscale_all_dim") if b[f"rope_{k}"])
        elif given := [n for n, off in (("rope_factor", 1.0), ("rope_mscale", 0.0), ("rope_mscale_all_dim", 0.0))
                       if b[n] != off]:
            which = given[0]
            r.error(E0304, f"`{name}`: `{which}` is given but rope_type is default", site.arg_span(which),
                    label="only yarn rope scaling reads it",
                    help="use rope_type = yarn with its rope_factor, or drop rope_factor, rope_mscale and rope_mscale_all_dim")
            return None
        attrs_ = {"hidden": hid, "heads": h, "q_lora_rank": ql, "kv_lora_rank": kvl, "qk_nope_head_dim": nope,
                  "qk_rope_head_dim": rope, "v_head_dim": vd, "rope_theta": b["rope_theta"],
                  "rope_interleave": b["rope_interleave"], "bias": b["bias"], "norm_eps": b["norm_eps"],
                  "rope_scaling": scaling}
        return attrs_, leaves

    # -- flow
    def flow(self, site: FlowSite) -> UnitFlow | None:
        unit, r, pl, name = site.unit, site.r, site.pl, site.name
        leaves = [leaf.name for leaf in unit.leaves]
        for leaf in (n for n in DOWN if n in leaves):
            p = pl(leaf)
            if p.sharded:
                r.error(E0405, f"`{name(leaf)}` is a latent down-projection: it cannot be split ({p.rule}({', '.join(p.axes)}))",
                        p.span, label="every head reads the whole latent",
                        help=f"make `{name(leaf)}` replicated; tensor parallelism splits the heads: "
                        f"`{name('q_b' if 'q_b' in leaves else 'q')}` and `{name('kv_b')}` column, `{name('o')}` row",
                        suggestions=make_rule(p.span, "replicate"))
                return None
        ups = ["q_b" if "q_b" in leaves else "q", "kv_b"]
        collectives: list[Any] = []
        layouts = {}
        for leaf in ups:
            y = through(pl(leaf), R, name(leaf), r, collectives, out="heads")
            if y is None:
                return None
            if y.partial_axes():
                partial_error(y, "the attention softmax", pl(leaf).span, r, name(leaf))
                return None
            layouts[leaf] = y
        if layouts[ups[0]] != layouts[ups[1]]:
            a, b = layouts[ups[0]], layouts[ups[1]]
            r.error(E0402, f"latent attention combines `{name(ups[0])}` ({a}) with `{name(ups[1])}` ({b})",
                    pl(ups[1]).span or pl(ups[0]).span, label="layouts differ",
                    help=f"give `{name(ups[0])}` and `{name(ups[1])}` the same rule (column over the tensor axes)")
            return None
        p_o = pl("o")
        if layouts[ups[0]] == R and p_o.sharded:
            r.error(E0402, f"`{name('o')}` is row-parallel over {' x '.join(p_o.axes)} but `{name(ups[0])}` "
                    f"and `{name('kv_b')}` are replicated", p_o.span, label="row without its column layers",
                    help=f"split `{name(ups[0])}` and `{name('kv_b')}` column({', '.join(p_o.axes)}) too, or make "
                    f"`{name('o')}` replicated")
            return None
        seen: list[Any] = []
        for c in collectives:  # copy_to once per axes: the code applies it to each latent
            if c not in seen:
                seen.append(c)
        collectives = seen
        y = through(p_o, layouts[ups[0]], name("o"), r, collectives, (name(ups[0]), pl(ups[0])))
        if y is None:
            return None
        inside = (*((leaf, R) for leaf in DOWN if leaf in leaves), *((leaf, layouts[leaf]) for leaf in ups), ("o", y))
        return at_residual(y, name("o"), p_o, collectives, r, inside)

    def collective_width(self, unit: Unit, c: Collective) -> int | None:
        if c.where != "input":
            return None  # o's sum: the residual stream
        # f over the concatenation: the normed query latent (or the input), the normed latent, the rotary key
        _, ql, kvl, _, rope, _ = self._dims(unit)
        return (ql or int(unit.attr("hidden"))) + kvl + rope  # type: ignore[arg-type]

    # -- costs
    def _local_heads(self, plan: PlanIR, hu: HeldUnit) -> int:
        kv_b = next(leaf for leaf in hu.unit.leaves if leaf.name == "kv_b")
        return int(hu.unit.attr("heads")) // costs.axes_size(plan, hu.placement(kv_b))  # type: ignore[arg-type]

    def _dims(self, unit: Unit) -> tuple[int, int, int, int, int, int]:
        """(hidden, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)"""
        return tuple(int(unit.attr(k)) for k in ("hidden", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",  # type: ignore[return-value, arg-type]
                                                  "qk_rope_head_dim", "v_head_dim"))

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        # What autograd keeps, listed with saved_tensors_hooks on the generated forward and measured
        # with `meshc run --profile` (tests/mla/test_mla_memory.py).
        e, fp32 = DTYPES[plan.dtype], costs.FP32
        hid, ql, kvl, nope, rope, vd = self._dims(hu.unit)
        h = self._local_heads(plan, hu)
        saved = e * local * hid  # the normed input, read by the down-projections (or q)
        saved += self.core_bytes(plan, hu, tokens, seq, micro, flash_attention)
        if ql:  # the query latent before its RMSNorm and the fp32 reciprocal RMS
            saved += e * tokens * ql + fp32 * tokens
        # kv_a's whole output (the latent norm's input is a view of it) and the reciprocal RMS
        saved += e * tokens * (kvl + rope) + fp32 * tokens
        # Under context parallelism kv_b reads every rank's latents (the whole sequence's micro x s
        # tokens): a view of the gathered [latent | rotary key], which it keeps whole.
        keys = micro * seq if plan.context_size > 1 else tokens
        if _splits_heads(hu):
            # the up-projections read views of f's concatenation: the normed query latent (or the
            # input), the normed latent and the rotary key
            saved += e * tokens * ((ql or hid) + kvl + rope)
        elif plan.context_size > 1:
            saved += e * tokens * ql  # q_b's input, the normed query latent
        else:
            saved += e * tokens * (ql + kvl)  # q_b's and kv_b's inputs, the normed latents
        if plan.context_size > 1:
            saved += e * keys * (kvl + rope)  # the gathered latents, kv_b's input
        saved += e * tokens * h * (nope + rope)  # q, rotary applied, for the core
        saved += e * tokens * h * vd  # o's input (the core's output reshaped: a copy)
        saved += 2 * e * (tokens // max(1, micro)) * rope  # rotary cos and sin
        if hu.prefix and plan.recompute == "attention" and plan.context_size == 1:
            # the rotated rotary key, an input of the recomputed region (under context parallelism
            # a view of the gathered latents, counted above)
            saved += e * tokens * rope
        return saved

    def core_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> int:
        # The recomputed region (`recompute = attention`) runs from the latents: kv_b's up-projection,
        # k and v, and the core; what it keeps for backward, all rebuilt when backward reruns it.
        e, fp32 = DTYPES[plan.dtype], costs.FP32
        _, _, _, nope, rope, vd = self._dims(hu.unit)
        h = self._local_heads(plan, hu)
        # a fused kernel keeps its output and the fp32 log-sum-exp per head; without one (as CPU's
        # SDPA under context parallelism's mask) the probabilities
        core = e * tokens * h * vd + fp32 * tokens * h if flash_attention else e * tokens * h * seq
        # Under context parallelism kv_b up-projects every rank's latents: the whole sequence's keys.
        keys = micro * seq if plan.context_size > 1 else tokens
        if plan.context_size > 1:
            # runtime/parallel/context.py, inside the core: the [s / c, s] mask (the whole sequence's
            # k and v come from kv_b here: the core gathers nothing)
            core += (tokens // max(1, micro)) * seq
            if not flash_attention:
                # SDPA's unfused path under the mask of global positions keeps its own contiguous
                # copies of the whole sequence's k and v (transposed views of the cat and of kv_b's output)
                return core + e * keys * h * (nope + rope + vd)
        # k, and kv_b's whole output (v is a view of it): the core's inputs
        return core + e * keys * h * (nope + rope) + e * keys * h * (nope + vd)

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        return 0  # sequence parallelism is refused (regather is 0); nothing measured beyond what it saved

    def kernels(self, plan: PlanIR, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        ql = int(hu.unit.attr("q_lora_rank"))  # type: ignore[arg-type]
        # q, k, v as heads; the latent norms; then what `meshc run --profile` counted beyond them
        # (tests/mla/test_mla_kernels.py): the splits, concatenations and expansions of the rope parts
        n = linears + 3 * k["heads"] + k["attention_core"] + k["residual"] + k["rotary"] + _KERNELS["latents"]
        n += (2 if ql else 1) * k["rmsnorm"]
        n += _KERNELS["deinterleave"] if hu.unit.attr("rope_interleave") else 0
        return n + (_KERNELS["split_heads"] if _splits_heads(hu) else 0)

    def flops_per_token(self, unit: Unit, seq: int) -> int:
        # Its projections, and the core over `seq` keys: q.k over nope + rope dims and p.v over
        # v_head_dim, 2 flops each per key and head (no halving for the causal mask: `work`'s count).
        _, _, _, nope, rope, vd = self._dims(unit)
        return super().flops_per_token(unit, seq) + 2 * seq * int(unit.attr("heads")) * (nope + rope + vd)  # type: ignore[arg-type]

    def work(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> Work:
        # The core per local head and sequence: scores q k^T ([s, nope + rope] x [nope + rope, s]) and
        # p v ([s, s] x [s, v_head_dim]); under context parallelism a rank's queries meet all s keys.
        _, _, _, nope, rope, vd = self._dims(hu.unit)
        h, queries = self._local_heads(plan, hu), tokens // max(1, micro)
        io = (queries + seq) * (nope + rope + vd) if flash_attention else None
        core = (Matmul(queries, seq, nope + rope, micro * h, core=True, io=io),
                Matmul(queries, vd, seq, micro * h, core=True, io=io))
        linears = costs.linear_matmuls(plan, hu, tokens)
        if plan.context_size > 1:
            # kv_b up-projects every context rank's gathered latents: the whole sequence's micro x s
            # tokens on each rank, c times its own (the price of gathering the latent, not k and v)
            linears = tuple(attrs.evolve(mm, m=micro * seq) if mm.leaf.rsplit(".", 1)[-1] == "kv_b" else mm
                            for mm in linears)
        return Work(linears + core)

    def cached_values(self, unit: Unit) -> int:
        # the normed latent and the rotated shared key, whatever the heads (DeepSeek-V3: 512 + 64)
        return int(unit.attr("kv_lora_rank")) + int(unit.attr("qk_rope_head_dim"))  # type: ignore[arg-type]

    def local_cached_values(self, plan: PlanIR, hu: HeldUnit) -> int:
        return self.cached_values(hu.unit)  # the latent is whole on every rank

    def gathered_values(self, plan: PlanIR, hu: HeldUnit) -> int:
        # context parallelism gathers the normed latent and the rotated shared key, whatever the
        # heads (DeepSeek-V3: 576 values per token, not 128 heads x (192 + 128)); each rank then
        # up-projects every rank's latents (work)
        return self.cached_values(hu.unit)

    def gathered_tensors(self) -> int:
        return 1  # the latent and the rotary key concatenated: one all-gather (runtime ContextShard.gather_latent)

    # -- codegen
    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        d: dict[str, Any] = {k: a[k] for k in ("hidden", "heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                               "qk_rope_head_dim", "v_head_dim", "rope_theta", "rope_interleave",
                                               "bias", "norm_eps")}
        if a.get("rope_scaling"):
            d["rope_scaling"] = dict(a["rope_scaling"])
        return d

    def core_lines(self, w: Any, attr: str, unit: Unit, a: Mapping[str, Any],
                   placement: Mapping[str, Placement], x: str) -> list[Any]:
        raise AssertionError("mla writes its whole forward (sublayer_lines)")

    def sublayer_lines(self, w: Any, attr: str, unit: Unit, flow: UnitFlow, placement: dict[str, Placement],
                       x: str) -> list[Any]:
        a = dict(unit.attrs)
        hid, heads = a["hidden"], a["heads"]
        ql, kvl = a["q_lora_rank"], a["kv_lora_rank"]
        nope, rope, vd = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
        m, eps = f"self.{attr}", float(a["norm_eps"])
        copy = next((c for c in flow.collectives if c.where == "input"), None)
        reduce = next((c for c in flow.collectives if c.where == "output"), None)
        if (copy is not None and copy.op != "copy_to") or (reduce is not None and reduce.op != "reduce_from"):
            raise AssertionError(f"mla: {copy} / {reduce} (sequence parallelism) are refused by the checker")
        h = w.local_heads(unit, "kv_b", heads, placement)
        of = f"{h} of {heads} heads" if h != heads else f"{heads} heads"

        lines: list[Any] = []
        q_in = "q" if ql else x  # what the query's up-projection reads: the normed latent, or the input
        q_width = ql or hid
        if ql:
            lines += [w.line(f"q = {m}.q_a({x})", f"[b, s, {ql}] the query latent, whole on every rank"),
                      w.line(f"q = rt.rms_norm(q, {m}.q_a.norm, {eps!r})", f"RMSNorm of the latent: [{ql}] scale")]
        lines += [
            w.line(f"kv = {m}.kv_a({x})", f"[b, s, {kvl} latent + {rope} shared rotary key], whole on every rank"),
            w.line(f"latent, k_pe = kv.split([{kvl}, {rope}], dim=-1)"),
            w.line(f"latent = rt.rms_norm(latent, {m}.kv_a.norm, {eps!r})", f"RMSNorm of the latent: [{kvl}] scale"),
        ]
        if copy is not None:
            # One f for all three: each rank's heads give part of their gradients, summed in one all-reduce.
            lines += [
                w.line(f"whole = rt.copy_to(torch.cat([{q_in}, latent, k_pe], dim=-1), {w.group(copy.axes)})",
                       f"f: [b, s, {q_width} + {kvl} + {rope}] identity; backward all-reduces over "
                       f"{w.axes_text(copy.axes)} ({w.n(copy.axes)}) what the rank's heads give the "
                       + ("normed query latent" if ql else "input") + ", the normed latent and the rotary key"),
                w.line(f"q_in, latent, k_pe = whole.split([{q_width}, {kvl}, {rope}], dim=-1)"),
            ]
            q_in = "q_in"
        lines.append(w.line(f"q = {m}.{'q_b' if ql else 'q'}({q_in}).view(b, s, {h}, {nope + rope})",
                            f"[b, s, {of}, {nope} nope + {rope} rope]"))
        lines += [
            w.line(f"q_nope, q_pe = q.split([{nope}, {rope}], dim=-1)"),
            w.line(f"k_pe = k_pe.view(b, s, 1, {rope})", "[b, s, 1, rope]: one rotary key for every head"),
        ]
        if a["rope_interleave"]:
            lines.append(w.line("q_pe, k_pe = rt.deinterleave(q_pe), rt.deinterleave(k_pe)",
                                "rope_interleave: pairs (x0, x1), (x2, x3).. become halves (evens | odds)"))
        scaling = tuple(a["rope_scaling"]) if a.get("rope_scaling") else None
        tail = f", scaling={scaling!r}" if scaling else ""
        lines += [
            w.line(f"q_pe, k_pe = rt.apply_rotary(q_pe, k_pe, {w.positions('q')}, theta={float(a['rope_theta'])!r}{tail})",
                   "rotary on the rope parts only" + (" (yarn rope scaling: runtime/model/rope.py)" if scaling else "")),
            w.line("q = torch.cat([q_nope, q_pe], dim=-1)", f"[b, s, {h}, {nope + rope}]"),
        ]
        scale = softmax_scale(a)
        if w.plan.roles.context:
            cp = w.plan.roles.context
            n = w.plan.mesh.size(*cp)
            # Gather the latent, not the heads: kv_lora_rank + rope values per token instead of
            # heads x (nope + rope + v_head_dim); each rank then up-projects every rank's latents.
            lines.append(w.line(f"latent, k_pe, cache = {w.latent_keys()}(latent, k_pe)",
                                f"[b, t, {kvl}], [b, t, 1, {rope}]: every context rank's, t = s x {n} in rank order, one "
                                f"all-gather of [b, s, {kvl} + {rope}] over {w.axes_text(cp)} ({n}) (backward "
                                "reduce-scatters it); while decoding the cached ones"))
            up = f"[b, t, {of}, {nope} nope key + {vd} value]: every rank's tokens' keys and values, up-projected here"
            what = (f"[b, s, {h * vd}] causal over the whole sequence's keys (masked by global positions); "
                    f"logits scaled by {scale!r}")
        else:
            lines.append(w.line(f"latent, k_pe, cache = {w.latent_keys()}(latent, k_pe)",
                                "while decoding: the cached latents and rotary keys of every position so far, t of "
                                "them (else as given)"))
            up = f"[b, t, {of}, {nope} nope key + {vd} value]"
            what = f"[b, s, {h * vd}] causal; logits scaled by {scale!r}"
        # From the latents to the heads' attention: kv_b's up-projection, k and v, the core.
        core = [
            w.line(f"kv = {m}.kv_b(latent).view(b, -1, {h}, {nope + vd})", up),
            w.line(f"k_nope, v = kv.split([{nope}, {vd}], dim=-1)"),
            w.line(f"k = torch.cat([k_nope, k_pe.expand(b, -1, {h}, {rope})], dim=-1)", f"[b, t, {h}, {nope + rope}]"),
        ]
        call = f"{w.gathered_attention()}(q, k, v, scale={scale!r}, kv_cache=cache)"
        if w.plan.recompute == "attention":
            # The recomputed region starts from the latents, not from the heads' k and v: it keeps
            # q, the latent and the rotary key (DeepSeek-V3: 576 values per token, not 128 x 320;
            # under context parallelism the whole sequence's), and backward reruns kv_b with the core.
            lines.append(w.line(""))
            lines.append(w.line("def attend(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:",
                                "the attention from the latents, rerun in backward"))
            lines += [w.line("    " + ln.code, ln.comment) for ln in core]
            lines.append(w.line(f"    return {call}", what))
            lines.append(w.line(""))
            lines.append(w.line("a = rt.recompute(attend, q, latent, k_pe)",
                                "keeps q, the latent and the rotary key; backward reruns kv_b and the core"))
        else:
            lines += core
            lines.append(w.line(f"a = {call}", what))
        o = unit.leaves[-1]
        bias = f" + {m}.o.bias" if len(o.params) > 1 else ""
        if reduce is not None:
            product = f"rt.row_matmul({m}.o, a)" if w.plan.float8 is not None else f"F.linear(a, {m}.o.weight)"
            n = w.n(reduce.axes)
            lines += [w.line(f"out = {product}", f"[b, s, {hid}] Partial over {w.axes_text(reduce.axes)}"),
                      w.line(f"out = rt.reduce_from(out, {w.group(reduce.axes)}){bias}",
                             f"g: all-reduce over {w.axes_text(reduce.axes)} ({n}) -> [b, s, {hid}]")]
        else:
            lines.append(w.line(f"out = {m}.o(a)", f"[b, s, {hid}]"))
        return lines


MLA = Mla("mla", sublayer=True, float8_linears=True, reads_sequence=True, caches_kv=True, recomputed_core=True,
          core_reruns=("kv_b",), sequence_parallel=False, whole=DOWN, width_arg="hidden", args=(
    Arg("hidden", "dim"),
    Arg("heads", "dim"),
    Arg("kv_lora_rank", "dim"),
    Arg("qk_nope_head_dim", "dim"),
    Arg("qk_rope_head_dim", "dim"),
    Arg("v_head_dim", "dim"),
    Arg("q_lora_rank", "dim", const(0), minimum=0),  # 0: one projection q (DeepSeek-V2-Lite), no query latent
    Arg("rope_theta", "float", const(10000.0)),
    Arg("rope_interleave", "bool", const(True)),  # HF's rope_interleave: rotary pairs are adjacent values
    Arg("bias", "bool", const(False)),  # HF's attention_bias: q_a, kv_a and o (the up-projections never have one)
    Arg("norm_eps", "float", const(1e-6)),  # the latents' RMSNorm (transformers builds them with 1e-6)
    Arg("rope_type", "choice", const("default"), ("default", "yarn")),
    Arg("rope_factor", "float", const(1.0)),
    Arg("rope_original_positions", "float", const(4096.0)),
    Arg("rope_beta_fast", "float", const(32.0)),
    Arg("rope_beta_slow", "float", const(1.0)),
    Arg("rope_truncate", "bool", const(True)),
    # yarn: the attention factor mscale(f, mscale) / mscale(f, mscale_all_dim) on cos and sin, and
    # the logits scaled by mscale(f, mscale_all_dim)^2 (0: absent from the config)
    Arg("rope_mscale", "float", const(0.0)),
    Arg("rope_mscale_all_dim", "float", const(0.0)),
))
