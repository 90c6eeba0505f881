"""`attention(hidden, heads, kv_heads, head_dim, ...)`: causal self-attention with grouped kv heads
and rotary positions, a block's sublayer: q, k, v (or one fused qkv) column layers, o the row layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from meshllm_dsl.codes import E0302, E0304
from meshllm_dsl.front.names import divisors, or_list
from meshllm_dsl.ir import DTYPES, Leaf, Placement, Tensor, Unit, UnitFlow
from meshllm_dsl.parallel import costs
from meshllm_dsl.parallel.costs import Matmul, Work
from meshllm_dsl.parallel.flow import FlowSite, sublayer_flow
from meshllm_dsl.primitives import Built, Primitive
from meshllm_dsl.primitives.args import Arg, const

if TYPE_CHECKING:
    from meshllm_dsl.front.site import UnitSite
    from meshllm_dsl.ir import PlanIR
    from meshllm_dsl.parallel.costs import HeldUnit


@attrs.frozen
class Attention(Primitive):
    def build(self, site: UnitSite) -> Built | None:
        """Its parameters (leaves) and attributes from the bound arguments; None after an error."""
        b, name, span, unit, r, decl = site.b, site.name, site.span, site.unit, site.r, site.decl
        lg = site.lg
        leaves: list[Leaf] = []
        hid, h, kv, hd = b["hidden"], b["heads"], b["kv_heads"], b["head_dim"]
        if h % kv:
            r.error(E0302, f"heads ({h}) is not a multiple of kv_heads ({kv})", decl.call.span,
                    label="grouped-query attention needs whole groups",
                    help=f"kv_heads must divide {h}: use {or_list(divisors(h))}")
            return None
        hu, kvu, hidu = (lg.get("heads", "heads"), h), (lg.get("kv_heads", "kv_heads"), kv), unit("hidden")

        qk_norm = b["qk_norm"]
        if qk_norm != "none" and b["fused_qkv"]:
            r.error(E0304, f"`{name}`: qk_norm = {qk_norm} needs separate q and k projections", decl.call.span,
                    label="fused_qkv = true", help="use fused_qkv = false with qk_norm, or qk_norm = none")
            return None

        if b["sinks"] and b["fused_qkv"]:
            r.error(E0304, f"`{name}`: sinks = true needs a separate q projection", decl.call.span,
                    label="fused_qkv = true", help="use fused_qkv = false with sinks (GPT-OSS has q, k, v apart)")
            return None

        def proj(n: str, rows: int, units: tuple[tuple[str, int], ...], segments: tuple[int, ...] = ()) -> Leaf:
            ps = [Tensor("weight", (rows, hid), (units, (hidu,)), segments)]
            if b["bias"]:
                ps.append(Tensor("bias", (rows,), (units,), segments))
            if n in ("q", "k") and qk_norm == "head":
                # One scale of head_dim shared by every head: made of no shard unit, so it stays
                # whole where the projection is split by heads.
                ps.append(Tensor("norm", (hd,), ((),)))
            elif n in ("q", "k") and qk_norm == "full":
                # A scale per output of the projection: split with it.
                ps.append(Tensor("norm", (rows,), (units,)))
            if n == "q" and b["sinks"]:
                # A logit per query head in the softmax's denominator: kept with q, split with its heads.
                ps.append(Tensor("sinks", (h,), ((hu,),)))
            return Leaf(n, (name, n), "linear", tuple(ps), (hidu,), units, span=span)

        if b["fused_qkv"]:
            leaves.append(proj("qkv", (h + 2 * kv) * hd, (hu, kvu), (h * hd, kv * hd, kv * hd)))
        else:
            leaves += [proj("q", h * hd, (hu,)), proj("k", kv * hd, (kvu,)), proj("v", kv * hd, (kvu,))]
        o = [Tensor("weight", (hid, h * hd), ((hidu,), (hu,)))]
        if b["out_bias"]:
            o.append(Tensor("bias", (hid,), ((hidu,),)))
        leaves.append(Leaf("o", (name, "o"), "linear", tuple(o), (hu,), (hidu,), span=span))
        rot = b["rotary_dim"]
        if rot != hd and (rot == 0 or rot % 2 or rot > hd):
            why = "rotates nothing" if rot == 0 else "is odd" if rot % 2 else f"exceeds head_dim ({hd})"
            r.error(E0304, f"`{name}`: rotary_dim ({rot}) {why}", site.arg_span("rotary_dim"),
                    label="rotary turns pairs of each head's first rotary_dim values",
                    help=("leave out rope_theta for no rotary positions, or " if rot == 0 else "")
                    + f"use an even rotary_dim from 2 to head_dim = {hd} (HF's head_dim x partial_rotary_factor), "
                    "or drop it to rotate every dim")
            return None
        if rot != hd and b["rope_theta"] is None:
            r.error(E0304, f"`{name}`: rotary_dim = {rot} without rope_theta", site.arg_span("rotary_dim"),
                    label="no rotary positions to apply to part of each head",
                    help="give rope_theta, or drop rotary_dim")
            return None
        scaling = None
        kind = b["rope_type"]
        factors = [n for n in ("rope_short_factor", "rope_long_factor") if b[n]]
        if kind == "longrope" and len(factors) < 2:
            missing = " and ".join(f"`{n}`" for n in ("rope_short_factor", "rope_long_factor") if n not in factors)
            r.error(E0304, f"`{name}`: longrope rope scaling needs {missing}", site.arg_span("rope_type"),
                    label="rope_type = longrope",
                    help=f"give rope_short_factor and rope_long_factor: lists of rotary_dim / 2 = {rot // 2} numbers each "
                    "(Phi-3's rope_scaling short_factor and long_factor)")
            return None
        if kind != "longrope" and factors:
            r.error(E0304, f"`{name}`: `{factors[0]}` is given but rope_type is {kind}", site.arg_span(factors[0]),
                    label="only rope_type = longrope reads this list",
                    help="use rope_type = longrope, or drop rope_short_factor and rope_long_factor")
            return None
        # llama3 is the type a bare rope_factor has always meant; at factor 1 it leaves rope unchanged
        if kind != "default" and (kind != "llama3" or b["rope_factor"] != 1.0):
            if b["rope_theta"] is None or b["rope_original_positions"] < 1 \
                    or (kind == "llama3" and b["rope_high_freq_factor"] <= b["rope_low_freq_factor"]):
                r.error(E0304, f"`{name}`: rope scaling needs rope_theta, rope_original_positions >= 1"
                        + (" and rope_high_freq_factor > rope_low_freq_factor" if kind == "llama3" else ""),
                        decl.call.span, label=f"invalid {kind} rope scaling")
                return None
            scaling = _rope_scaling(kind, b)
        attrs_ = {"hidden": hid, "heads": h, "kv_heads": kv, "head_dim": hd, "rope_theta": b["rope_theta"],
                  "bias": b["bias"], "out_bias": b["out_bias"], "fused_qkv": b["fused_qkv"], "rope_scaling": scaling,
                  "qk_norm": qk_norm, "qk_norm_eps": b["qk_norm_eps"], "qk_norm_offset": b["qk_norm_offset"],
                  "window": b["window"], "global_every": b["global_every"], "local_rope_theta": b["local_rope_theta"],
                  "softcap": b["softcap"], "scale_dim": b["scale_dim"], "sinks": b["sinks"], "rotary_dim": rot}
        if b["global_every"] and not b["window"]:
            r.error(E0304, f"`{name}`: global_every = {b['global_every']} without a window", decl.call.span,
                    label="every layer already attends to the whole sequence",
                    help="give `window = N` (the sliding window of the other layers), or drop global_every")
            return None
        return attrs_, leaves

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        unit, e, fp32 = hu.unit, DTYPES[plan.dtype], costs.FP32
        hid, heads, kv, hd = (int(unit.attr(k)) for k in ("hidden", "heads", "kv_heads", "head_dim"))  # type: ignore[arg-type]
        leaves = {leaf.name: leaf for leaf in unit.leaves}
        if "qkv" in leaves:
            tq = tk = costs.axes_size(plan, hu.placement(leaves["qkv"]))
        else:
            tq, tk = costs.axes_size(plan, hu.placement(leaves["q"])), costs.axes_size(plan, hu.placement(leaves["k"]))
        hq, hk = heads // tq, kv // tk
        saved = e * local * hid  # the normed input, shared by the q / k / v projections
        saved += e * tokens * (hq + 2 * hk) * hd  # q, k, v (after rotary) for the attention core
        saved += e * tokens * hq * hd  # the attention output: the core's result and o's input
        if unit.attr("rope_theta"):
            # rotary cos and sin ([s, 1, rotary_dim] each), kept by q * cos, k * cos
            saved += 2 * e * (tokens // max(1, micro)) * int(unit.attr("rotary_dim") or hd)  # type: ignore[arg-type]
        qk = unit.attr("qk_norm")
        if qk == "head":  # the runtime's RMSNorm Function: q and k before it, an fp32 reciprocal RMS per head
            saved += e * tokens * (hq + hk) * hd + fp32 * tokens * (hq + hk)
        elif qk == "full":  # plain autograd: the inputs, the normalised rows the scale multiplies, fp32 RMS per token
            saved += 2 * e * tokens * (hq + hk) * hd + 2 * fp32 * tokens
        saved += costs.attention_core_bytes(plan, hu, tokens, seq, micro, flash_attention)
        a = dict(unit.attrs)
        if a.get("softcap") and hq > hk:
            saved += 2 * e * tokens * hq * hd  # the soft-capped core's k and v repeated to every query head
        if a.get("sinks"):
            # The sink core's written-out scores (runtime/model/layers.py sink_attention): fp32 probabilities
            # [b, h, s, s + 1] kept by the softmax, their cast kept by p v, and k, v repeated to every query head.
            saved += fp32 * tokens * hq * (seq + 1) + e * tokens * hq * seq + (2 * e * tokens * hq * hd if hq > hk else 0)
        blocks = hu.indices or (0,)
        if plan.context_size > 1:
            # Context parallelism (runtime/parallel/context.py): every block masks by global positions, a
            # [s / c, s] boolean, and the kernel keeps the all-gathered k and v, [b, s, kv, d] each.
            saved += (tokens // max(1, micro)) * seq + 2 * e * micro * seq * hk * hd
            return saved
        windowed = sum(1 for i in blocks if layer_window(a, i))
        saved += seq * seq * windowed // len(blocks)  # a window's [s, s] boolean mask, kept by the masked kernel (per copy)
        return saved

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        if not regather:
            return 0  # nothing measured beyond what it saved
        unit = hu.unit
        hq, hd = costs.local_heads(plan, hu), int(unit.attr("head_dim"))  # type: ignore[arg-type]
        hk = int(unit.attr("kv_heads")) * hq // int(unit.attr("heads"))  # type: ignore[arg-type]
        return DTYPES[plan.dtype] * tokens * (hq + 2 * hk) * hd + regather

    def kernels(self, plan: PlanIR, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        n = linears + 3 * k["heads"] + k["attention_core"] + k["residual"]
        n += k["split_qkv"] if hu.unit.attr("fused_qkv") else 0
        n += 2 * k["rmsnorm"] if hu.unit.attr("qk_norm") in ("head", "full") else 0  # q's and k's
        return n + (k["rotary"] if hu.unit.attr("rope_theta") else 0)

    def flops_per_token(self, unit: Unit, seq: int) -> int:
        # Its projections, and the core over `seq` keys (4 s d per head, no halving for the causal
        # mask: `work`'s count); a sliding window sees at most `window` of them.
        window = int(unit.attr("window") or 0)  # type: ignore[arg-type]
        keys = min(seq, window) if window and not unit.attr("global_every") else seq
        return super().flops_per_token(unit, seq) + 4 * keys * int(unit.attr("heads")) * int(unit.attr("head_dim"))  # type: ignore[arg-type]

    def work(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> Work:
        # The core, per local head and sequence: scores q k^T ([s, d] x [d, s]) and p v ([s, s] x
        # [s, d]), over every key position: 4 s d flops per head and token forward, the standard
        # count's 12 l h q t with its backward (torchtitan get_num_flop_per_token, PaLM appendix B:
        # no halving for the causal mask). A fused kernel keeps the scores on chip.
        # Under context parallelism a rank's s / c queries (tokens / micro) meet all s keys.
        hq, hd = costs.local_heads(plan, hu), int(hu.unit.attr("head_dim"))  # type: ignore[arg-type]
        queries = tokens // max(1, micro)
        io = (queries + seq) * hd if flash_attention else None
        core = (Matmul(queries, seq, hd, micro * hq, core=True, io=io),
                Matmul(queries, hd, seq, micro * hq, core=True, io=io))
        return Work(costs.linear_matmuls(plan, hu, tokens) + core)

    def flow(self, site: FlowSite) -> UnitFlow | None:
        return sublayer_flow(site, "the attention softmax", "attention", "heads")

    def cached_positions(self, unit: Unit, index: int, seq: int) -> int:
        window = layer_window(dict(unit.attrs), index)
        return min(seq, window) if window else seq

    def core_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> int:
        return costs.attention_core_bytes(plan, hu, tokens, seq, micro, flash_attention)

    def cached_values(self, unit: Unit) -> int:
        return 2 * int(unit.attr("kv_heads")) * int(unit.attr("head_dim"))  # type: ignore[arg-type]  # k and v

    def local_cached_values(self, plan: PlanIR, hu: HeldUnit) -> int:
        return 2 * _local_kv_heads(plan, hu) * int(hu.unit.attr("head_dim"))  # type: ignore[arg-type]

    def gathered_values(self, plan: PlanIR, hu: HeldUnit) -> int:
        return self.local_cached_values(plan, hu)  # k and v of this rank's kv heads

    def block_variant(self, unit: Unit, index: int) -> tuple[Any, ...]:
        a = dict(unit.attrs)
        return layer_window(a, index), layer_rope_theta(a, index)

    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        d: dict[str, Any] = dict(
            hidden=a["hidden"], heads=a["heads"], kv_heads=a["kv_heads"], head_dim=a["head_dim"],
            rope_theta=a["rope_theta"], qkv_bias=a["bias"], o_bias=a["out_bias"], fused_qkv=a["fused_qkv"])
        if a.get("rope_scaling"):
            d["rope_scaling"] = dict(a["rope_scaling"])
        if a.get("qk_norm", "none") != "none":
            d["qk_norm"], d["qk_norm_eps"] = a["qk_norm"], a["qk_norm_eps"]
            if a.get("qk_norm_offset"):
                d["qk_norm_offset"] = a["qk_norm_offset"]
        # Written only where set, so a description without them reads as before.
        if a.get("window"):
            d.update(window=a["window"], global_every=a["global_every"])
            if a["local_rope_theta"] != a["rope_theta"]:
                d["local_rope_theta"] = a["local_rope_theta"]
        if a.get("softcap"):
            d["softcap"] = a["softcap"]
        if a.get("scale_dim") not in (None, a["head_dim"]):
            d["scale_dim"] = a["scale_dim"]
        if a.get("sinks"):
            d["sinks"] = True
        if a.get("rotary_dim") not in (None, a["head_dim"]):
            d["rotary_dim"] = a["rotary_dim"]
        return d

    def core_lines(self, w: Any, attr: str, unit: Unit, a: Mapping[str, Any],
                   placement: Mapping[str, Placement], x: str) -> list[Any]:
        hd = a["head_dim"]
        lines: list[Any] = []
        if a["fused_qkv"]:
            h = w.local_heads(unit, "qkv", a["heads"], placement)
            kv = w.local_heads(unit, "qkv", a["kv_heads"], placement)
            lines.append(w.line(f"q, k, v = {w.proj(attr, 'qkv', x)}.split([{h * hd}, {kv * hd}, {kv * hd}], dim=-1)",
                                f"[b, s, {h}*{hd}], [b, s, {kv}*{hd}] x 2"))
            lines += [w.line(f"q = q.view(b, s, {h}, {hd})"), w.line(f"k = k.view(b, s, {kv}, {hd})"),
                      w.line(f"v = v.view(b, s, {kv}, {hd})")]
        else:
            h = w.local_heads(unit, "q", a["heads"], placement)
            kv = w.local_heads(unit, "k", a["kv_heads"], placement)
            qk = a.get("qk_norm", "none")
            if qk == "full":
                lines += _full_qk_norm_lines(w, attr, unit, a, placement, x)
                q_in, k_in = "q", "k"
            else:
                q_in, k_in = w.proj(attr, 'q', x), w.proj(attr, 'k', x)
            lines += [
                w.line(f"q = {q_in}.view(b, s, {h}, {hd})", f"[b, s, {h} of {a['heads']} heads, {hd}]"),
                w.line(f"k = {k_in}.view(b, s, {kv}, {hd})", f"[b, s, {kv} of {a['kv_heads']} kv heads, {hd}]"),
                w.line(f"v = {w.proj(attr, 'v', x)}.view(b, s, {kv}, {hd})"),
            ]
            if qk == "head":
                eps = float(a["qk_norm_eps"])
                # x * (offset + scale), in fp32
                off = f", offset={float(a['qk_norm_offset'])!r}" if a.get("qk_norm_offset") else ""
                lines += [w.line(f"q = rt.rms_norm(q, self.{attr}.q.norm, {eps!r}{off})", f"RMSNorm per head: [{hd}] scale, every head"),
                          w.line(f"k = rt.rms_norm(k, self.{attr}.k.norm, {eps!r}{off})")]
        # The block class's blocks share a window (codegen/lower.py splits classes where they differ).
        window = layer_window(a, w.block_index)
        theta = layer_rope_theta(a, w.block_index)
        # Partial rotary (GPT-NeoX, Phi-2, GLM-4.5): only each head's first rotary_dim values turn.
        rot = a.get("rotary_dim") or hd
        partial, partial_what = (f", rotary_dim={rot}", f"; rotary on each head's first {rot} of {hd} dims") \
            if rot != hd else ("", "")
        if theta and a.get("rope_scaling"):
            scaling = tuple(a["rope_scaling"])
            lines.append(w.line(f"q, k = rt.apply_rotary(q, k, {w.positions('q')}, theta={float(theta)!r}, "
                                f"scaling={scaling!r}{partial})",
                                f"{dict(scaling)['rope_type']} rope scaling (runtime/model/rope.py){partial_what}"))
        elif theta and partial:
            lines.append(w.line(f"q, k = rt.apply_rotary(q, k, {w.positions('q')}, theta={float(theta)!r}{partial})",
                                partial_what[2:]))
        elif theta:
            lines.append(w.line(f"q, k = rt.apply_rotary(q, k, {w.positions('q')}, theta={float(theta)!r})"))
        what = f"[b, s, {h * hd}] causal; q heads per kv head: {h // kv if kv else 0}"
        if w.plan.roles.context:
            n = w.plan.mesh.size(*w.plan.roles.context)
            what = (f"[b, s, {h * hd}] causal over the whole sequence: k, v [b, s, {kv}, {hd}] all-gathered over "
                    f"{w.axes_text(w.plan.roles.context)} ({n}) to [b, {n} s, {kv}, {hd}] (backward reduce-scatters them); "
                    f"q heads per kv head: {h // kv if kv else 0}")
        extra = ""
        if window:
            extra += f", window={window}"
            what += f"; each token sees the last {window} positions"
        if a.get("scale_dim") not in (None, hd):
            extra += f", scale={float(a['scale_dim']) ** -0.5!r}"
            what += f"; logits scaled by 1/sqrt({a['scale_dim']})"
        if a.get("softcap"):
            extra += f", softcap={float(a['softcap'])!r}"
            what += f"; logits soft-capped at {a['softcap']}"
        if a.get("sinks"):
            extra += f", sinks=self.{attr}.q.sinks"
            what += f"; a sink logit per head in the softmax's denominator ([{h}] of {a['heads']})"
        if w.plan.recompute == "attention":
            # Selective recomputation: backward reruns only the attention core, from q, k, v.
            call = f"rt.recompute({w.attention()}, q, k, v{extra})"
            lines.append(w.line(f"a = {call}", what + "; recomputed in backward"))
        else:
            lines.append(w.line(f"a = {w.attention()}(q, k, v{extra})", what))
        return lines


def _local_kv_heads(plan: PlanIR, hu: HeldUnit) -> int:
    """The key / value heads on one device."""
    kv_leaf = next(lf for lf in hu.unit.leaves if lf.name in ("k", "qkv"))
    return int(hu.unit.attr("kv_heads")) // costs.axes_size(plan, hu.placement(kv_leaf))  # type: ignore[arg-type]


def layer_window(a: Mapping[str, Any], index: int) -> int:
    """The sliding window of block `index` (0: it attends to the whole causal prefix). With
    `global_every = K` every K-th block (1-based, HF's sliding_window_pattern) is global."""
    window, every = a.get("window") or 0, a.get("global_every") or 0
    return 0 if not window or (every and (index + 1) % every == 0) else int(window)


def layer_rope_theta(a: Mapping[str, Any], index: int) -> Any:
    """The rope base of block `index`: `local_rope_theta` in a windowed block, else rope_theta."""
    return a.get("local_rope_theta") if layer_window(a, index) else a["rope_theta"]




def _rope_scaling(kind: str, b: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The rope scaling's fields under transformers' names (rope_parameters), those `kind` reads."""
    factor, original = ("factor", b["rope_factor"]), ("original_max_position_embeddings", int(b["rope_original_positions"]))
    fields: tuple[tuple[str, Any], ...] = (("rope_type", kind), factor)
    if kind == "llama3":
        fields += (("low_freq_factor", b["rope_low_freq_factor"]), ("high_freq_factor", b["rope_high_freq_factor"]), original)
    elif kind == "dynamic":
        fields += (original,)  # the length the NTK formula scales from: config's max_position_embeddings
    elif kind == "yarn":
        fields += (original, ("beta_fast", b["rope_beta_fast"]), ("beta_slow", b["rope_beta_slow"]),
                   ("truncate", b["rope_truncate"]))
        if b["rope_attention_factor"]:  # 0: transformers' default, 0.1 ln(factor) + 1
            fields += (("attention_factor", b["rope_attention_factor"]),)
    elif kind == "longrope":
        # the short factors up to rope_original_positions, the long ones beyond (runtime/model/rope.py)
        fields += (original, ("short_factor", tuple(b["rope_short_factor"])),
                   ("long_factor", tuple(b["rope_long_factor"])))
        if b["rope_attention_factor"]:  # 0: transformers' default, sqrt(1 + ln(factor) / ln(original))
            fields += (("attention_factor", b["rope_attention_factor"]),)
    return fields


def _full_qk_norm_lines(w: Any, attr: str, unit: Unit, a: Mapping[str, Any],
                        placement: Mapping[str, Placement], x: str) -> list[Any]:
    """q and k projected, then RMSNorm over each whole projection (`qk_norm = full`). Split by heads, a rank
    holds part of each token's row: the sum of squares is all-reduced over the projection's axes."""
    eps, hd = float(a["qk_norm_eps"]), a["head_dim"]
    lines = []
    for n, count in (("q", a["heads"]), ("k", a["kv_heads"])):
        p = placement.get(f"{unit.name}.{n}")
        group = w.group(p.axes) if p is not None and p.sharded else "None"
        local = w.local_heads(unit, n, count, placement) * hd
        lines.append(w.line(f"{n} = rt.split_rms_norm({w.proj(attr, n, x)}, self.{attr}.{n}.norm, {eps!r}, {group}, {count * hd})",
                            f"[b, s, {local} of {count * hd}]; sum of squares over the whole row"
                            + (f" (all-reduced over {w.axes_text(p.axes)})" if group != "None" else "")))
    return lines


ATTENTION = Attention("attention", sublayer=True, float8_linears=True, reads_sequence=True, caches_kv=True, recomputed_core=True, width_arg="hidden", args=(
    Arg("hidden", "dim"),
    Arg("heads", "dim"),
    Arg("kv_heads", "dim", lambda b: b["heads"]),
    Arg("head_dim", "dim", lambda b: b["hidden"] // b["heads"] if b["hidden"] % b["heads"] == 0 else None),
    Arg("rope_theta", "float", const(None)),
    # Partial rotary (HF's head_dim x partial_rotary_factor: GPT-NeoX, Phi-2, GLM-4.5): rope turns each
    # head's first rotary_dim values (rotate_half over them, frequencies over rotary_dim), the rest pass.
    Arg("rotary_dim", "dim", lambda b: b["head_dim"], minimum=0),
    Arg("bias", "bool", const(False)),
    Arg("out_bias", "bool", lambda b: b["bias"]),
    Arg("fused_qkv", "bool", const(False)),
    # Rope scaling as transformers' rope_type computes it (runtime/model/rope.py): linear, dynamic (NTK:
    # rope_original_positions is the config's max_position_embeddings), yarn, longrope, llama3 (the
    # default type; with factor 1 the frequencies are unchanged).
    Arg("rope_factor", "float", const(1.0)),
    Arg("rope_low_freq_factor", "float", const(1.0)),
    Arg("rope_high_freq_factor", "float", const(4.0)),
    Arg("rope_original_positions", "float", const(8192.0)),
    Arg("rope_type", "choice", const("llama3"), ("default", "linear", "dynamic", "yarn", "longrope", "llama3")),
    Arg("rope_attention_factor", "float", const(0.0)),  # yarn, longrope: 0 is transformers' default for the factor
    Arg("rope_beta_fast", "float", const(32.0)),
    Arg("rope_beta_slow", "float", const(1.0)),
    Arg("rope_truncate", "bool", const(True)),
    # longrope (Phi-3): per-frequency divisors, one per rotary frequency (rotary_dim / 2), the short
    # ones while the sequence is within rope_original_positions, the long ones beyond it.
    Arg("rope_short_factor", "floats", const(()), length=lambda b: b["rotary_dim"] // 2, length_why="rotary_dim / 2"),
    Arg("rope_long_factor", "floats", const(()), length=lambda b: b["rotary_dim"] // 2, length_why="rotary_dim / 2"),
    # RMSNorm of q and k before rotary: `head` over each head with one head_dim scale, `full` over
    # the whole projection with a scale per output (the family packs say which family has which).
    Arg("qk_norm", "choice", const("none"), ("none", "head", "full")),
    Arg("qk_norm_eps", "float", const(1e-6)),
    Arg("qk_norm_offset", "float", const(0.0)),  # the q / k norms scale by (offset + weight), as rmsnorm's offset
    # Sliding-window attention: each token attends to the last `window` positions
    # (0: the whole causal prefix); with global_every = K every K-th block attends to everything.
    Arg("window", "dim", const(0), minimum=0),
    Arg("global_every", "dim", const(0), minimum=0),
    Arg("local_rope_theta", "float", lambda b: b["rope_theta"]),  # the rope base of windowed blocks
    Arg("softcap", "float", const(None)),  # attention logits tanh(x / softcap) * softcap
    Arg("scale_dim", "dim", lambda b: b["head_dim"]),  # logits / sqrt(scale_dim) (query_pre_attn_scalar)
    # GPT-OSS's attention sinks: a learned logit per head in the softmax's denominator (`q.sinks` [heads]).
    Arg("sinks", "bool", const(False)),
))
