"""`moe(hidden, ffn, experts, top_k, ...)`: a block's mixture-of-experts feed-forward sublayer
(the moe families of meshllm_dsl/families/ declare it).

A router linear without bias scores the experts; softmax then top-k picks `top_k` of them per token,
optionally renormalising the chosen weights (`norm_topk_prob`); `experts` SwiGLU experts run on the
tokens routed to them, dropless. Optionally a shared SwiGLU expert every token passes through,
scaled by a sigmoid gate (`shared_expert = true`, `shared_ffn`).

Parameters: `router` [experts, hidden]; the experts stacked as `gate` / `up` [ffn, experts, hidden]
and `down` [hidden, experts, ffn], the experts dim in the middle so a column rule splits dim 0 (ffn
of every expert) and a row rule the last dim, as for a plain linear; the shared expert's
`shared_gate` / `shared_up` / `shared_down` and its gate `shared_router` [1, hidden].

Tensor parallelism inside the experts is the dense MLP's (`ffn -> tensor`: gate / up column, down
row); the router and the routing are replicated, so every rank picks the same experts. Splitting
the experts themselves over batch, context or tensor axes (`experts -> D`, expert parallelism)
gives each rank experts / |D| of them; tokens travel to their experts' ranks and back by all-to-all
(runtime/moe/dispatch.py; over tensor axes each rank first takes its share of the same tokens and
all-gathers the outputs), and the router stays whole on every rank.

Routing settings (runtime/moe/routing.py, where the semantics are written down): `aux_loss_coef`
(transformers' load-balancing loss in the training loss), `z_loss_coef` (ST-MoE's router z-loss),
`seq_aux_loss` (DeepSeek-V3's sequence-wise balance loss's alpha) and `capacity` (a capacity
factor; 0 is dropless). The checker validates their ranges here and
refuses the router losses with a pipeline (checker/passes.py `moe_routing`).

DeepSeekMoE (DeepSeek-V3, GLM-4.5; transformers' `DeepseekV3TopkRouter`): `scoring = sigmoid` scores
each expert sigmoid(logit) and chooses with a per-expert correction bias added to the scores (not
to the weights): the buffer `router.e_score_correction_bias` [experts], no gradient, no optimizer
state, in checkpoints. `groups` / `topk_groups`: group-limited routing (n_group / topk_group: each
token chooses among the experts of its topk_groups best groups, a group scored by its two best
experts). `routed_scaling` multiplies the chosen weights (routed_scaling_factor). `balance_rate`:
auxiliary-loss-free balancing, the bias moving by that rate toward balance after every optimizer
step (0: the bias stays as loaded). `shared_experts = N`: DeepSeek's shared experts, one ungated
SwiGLU of width `shared_ffn` (N x ffn unless given) every token passes through, added to the
routed output (`shared_expert = true` is Qwen2-MoE's sigmoid-gated one instead).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from meshllm_dsl.codes import E0307, E0309, E0402
from meshllm_dsl.ir import DTYPES, REPLICATE, Collective, Leaf, Placement, Tensor, Unit, UnitFlow
from meshllm_dsl.parallel import costs
from meshllm_dsl.parallel.collectives import spec
from meshllm_dsl.parallel.flow import FlowSite, R, at_residual, partial_error, through
from meshllm_dsl.primitives import Built, Primitive
from meshllm_dsl.primitives.args import Arg, const

if TYPE_CHECKING:
    from meshllm_dsl.front.site import UnitSite
    from meshllm_dsl.ir import PlanIR
    from meshllm_dsl.parallel.costs import HeldUnit

_EXPERTS = ("gate", "up", "down")
ROUTING = ("aux_loss_coef", "z_loss_coef", "capacity", "seq_aux_loss")  # the layer's routing settings (runtime/moe/routing.py)
# DeepSeekMoE's router and shared experts (runtime/moe/routing.py `choose_sigmoid`), with their
# values that leave a softmax router as it was.
DEEPSEEK: dict[str, Any] = {"scoring": "softmax", "groups": 1, "topk_groups": 1, "routed_scaling": 1.0,
                            "balance_rate": 0.0, "shared_experts": 0}
CORRECTION = "e_score_correction_bias"  # the router's buffer (transformers' name) under sigmoid scoring
LOAD = "expert_load"  # the router's buffer counting each expert's pairs over a step (with balance_rate)
# (runtime/moe/routing.py has the same two names; the compiler does not import the runtime.)


def _ungated(unit: Unit) -> bool:
    """Whether the unit's shared expert is DeepSeek's (no sigmoid gate)."""
    return bool(dict(unit.attrs).get("shared_experts"))


def _divisor_near(n: int, want: int) -> int:
    """The divisor of ``n`` closest to ``want`` (the smaller on a tie)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - want), d))
_SHARED = ("shared_gate", "shared_up", "shared_down")


@attrs.frozen
class Moe(Primitive):
    def build(self, site: UnitSite) -> Built | None:
        b, name, span, unit, r = site.b, site.name, site.span, site.unit, site.r
        hid, ffn, n_exp, k = b["hidden"], b["ffn"], b["experts"], b["top_k"]
        if k > n_exp:
            r.error(E0307, f"`{name}`: top_k ({k}) is more than its {n_exp} experts", site.decl.call.span,
                    label="each token picks top_k distinct experts",
                    help=f"top_k must be at most experts ({n_exp}): use top_k = {min(2, n_exp)}, or more experts")
            return None
        if not self._routing_in_range(site, b, n_exp, k) or not self._deepseek_in_range(site, b, n_exp, k):
            return None
        hidu, fu, eu = unit("hidden"), unit("ffn"), unit("experts")

        def lin(n: str, rows: int, cols: int, ru: tuple[str, int] | None, cu: tuple[str, int], bias: bool = False) -> Leaf:
            units = ((ru,) if ru else (), (cu,))
            ps = [Tensor("weight", (rows, cols), units)] + ([Tensor("bias", (rows,), units[:1])] if bias else [])
            return Leaf(n, (name, n), "linear", tuple(ps), (cu,), (ru,) if ru else (), span=span)

        def stacked(n: str, rows: int, cols: int, ru: tuple[str, int], cu: tuple[str, int]) -> Leaf:
            ps = [Tensor("weight", (rows, n_exp, cols), ((ru,), (eu,), (cu,)))]
            if b["expert_bias"]:
                # [out, experts]: gate's and up's split with their experts and ffn; down's bias is added
                # once after the experts' sum (runtime/moe/experts.py moe_expert_bias), so every rank
                # holds all of it, whatever splits the experts.
                ps.append(Tensor("bias", (rows, n_exp), ((ru,), (eu,) if n != "down" else ())))
            return Leaf(n, (name, n), "linear", tuple(ps), (cu,), (ru,), span=span)

        leaves = [lin("router", n_exp, hid, eu, hidu, b["router_bias"]), stacked("gate", ffn, hid, fu, hidu),
                  stacked("up", ffn, hid, fu, hidu), stacked("down", hid, ffn, hidu, fu)]
        # `shared_expert` in the unit: it has shared-expert leaves, gated (Qwen2-MoE) unless `shared_experts`.
        shared = b["shared_expert"] or b["shared_experts"] > 0
        if shared:
            su = unit("shared_ffn")
            sf = b["shared_ffn"]
            leaves += [lin("shared_gate", sf, hid, su, hidu), lin("shared_up", sf, hid, su, hidu),
                       lin("shared_down", hid, sf, hidu, su)]
            if b["shared_expert"]:
                leaves.append(lin("shared_router", 1, hid, None, hidu))
        return {"hidden": hid, "ffn": ffn, "experts": n_exp, "top_k": k, "norm_topk_prob": b["norm_topk_prob"],
                "weights_fp32": b["weights_fp32"], "shared_expert": shared,
                "shared_ffn": b["shared_ffn"] if shared else None, **{a: float(b[a]) for a in ROUTING},
                **{a: b[a] for a in DEEPSEEK},
                "router_bias": b["router_bias"], "expert_bias": b["expert_bias"], "act": b["act"],
                "swiglu_alpha": float(b["swiglu_alpha"]), "swiglu_limit": float(b["swiglu_limit"])}, leaves

    def _routing_in_range(self, site: UnitSite, b: Mapping[str, Any], n_exp: int, k: int) -> bool:
        """The capacity factor's range (the resolver refuses negative routing settings): 0 (dropless)
        or one that can drop something (runtime/moe/routing.py)."""
        cap, most = b["capacity"], n_exp / k
        if cap > most:
            site.r.error(E0307, f"`{site.name}`: capacity = {cap:g} is more than experts / top_k = {most:g}: every "
                         "expert could take every token, so nothing is ever dropped", site.decl.call.span,
                         label="capacity factor out of range",
                         help=f"use 0 < capacity <= {most:g} (each expert takes ceil(capacity x tokens x top_k / "
                         "experts) tokens), or capacity = 0 for dropless routing")
            return False
        return True

    def _deepseek_in_range(self, site: UnitSite, b: Mapping[str, Any], n_exp: int, k: int) -> bool:
        """DeepSeekMoE's settings (runtime/moe/routing.py `choose_sigmoid`): the groups split the
        experts evenly, in groups of at least two (a group scores its two best experts); a token
        reaches the experts of its topk_groups groups, so top_k fits in them; the bias-based settings
        need sigmoid scoring; one kind of shared expert."""
        r, name = site.r, site.name
        groups, topk_groups, sigmoid = b["groups"], b["topk_groups"], b["scoring"] == "sigmoid"

        def bad(arg: str, message: str, label: str, help: str) -> bool:
            r.error(E0307, f"`{name}`: {message}", site.arg_span(arg), label=label, help=help)
            return False

        if not sigmoid:
            for arg, off in (("groups", 1), ("topk_groups", groups), ("balance_rate", 0.0)):
                if b[arg] != off:
                    return bad(arg, f"`{arg}` applies to sigmoid scoring; this layer scores with softmax",
                               "a setting of DeepSeek-V3's sigmoid router",
                               help=f"add `scoring = sigmoid` (DeepSeek-V3, GLM-4.5), or remove `{arg}`")
        elif b["aux_loss_coef"]:
            return bad("aux_loss_coef", "`aux_loss_coef` (transformers' load-balancing loss of softmax "
                       "probabilities) with `scoring = sigmoid`", "a softmax router's loss",
                       help="balance a sigmoid router with its correction bias: `balance_rate = 0.001` "
                       "(DeepSeek-V3's rate), and remove `aux_loss_coef`")
        if n_exp % groups:
            return bad("groups", f"groups = {groups} does not divide its {n_exp} experts",
                       "the groups split the experts evenly",
                       help=f"use groups dividing {n_exp} (e.g. {_divisor_near(n_exp, groups)})")
        if groups > 1 and n_exp // groups < 2:
            return bad("groups", f"groups = {groups} leaves {n_exp // groups} expert per group; a group "
                       "scores the sum of its two best experts", "groups of at least two experts",
                       help=f"use groups <= {n_exp // 2}, or groups = 1 (no group limit)")
        if topk_groups > groups:
            return bad("topk_groups", f"topk_groups = {topk_groups} is more than its {groups} groups",
                       "each token keeps topk_groups of the groups",
                       help=f"use topk_groups <= groups ({groups})")
        reach = topk_groups * (n_exp // groups)
        if k > reach:
            return bad("top_k", f"top_k ({k}) is more than the {reach} experts a token can reach: "
                       f"topk_groups ({topk_groups}) x experts / groups ({n_exp // groups})",
                       "more choices than the groups kept hold",
                       help=f"use top_k <= {reach}, or more topk_groups (up to {groups})")
        if b["shared_expert"] and b["shared_experts"]:
            return bad("shared_experts", "`shared_expert = true` (Qwen2-MoE's gated shared expert) and "
                       f"`shared_experts = {b['shared_experts']}` (DeepSeek's ungated ones) together",
                       "two kinds of shared expert",
                       help="keep one: `shared_experts = N` for DeepSeek-V3 / GLM-4.5, `shared_expert = true` "
                       "for Qwen2-MoE")
        return True

    # -- flow
    def flow(self, site: FlowSite) -> UnitFlow | None:
        unit, r, pl, name = site.unit, site.r, site.pl, site.name
        for leaf in ("router", "shared_router"):
            if leaf not in {lf.name for lf in unit.leaves}:
                continue
            p = pl(leaf)
            if p.sharded:
                what = "expert parallelism (the experts split over " + " x ".join(p.axes) + ")" if leaf == "router" \
                    else "a split shared-expert gate"
                r.error(E0309, f"`{name(leaf)}`: {what} is not supported yet", p.span,
                        label="the router must be whole on every rank",
                        help=f"make `{name(leaf)}` replicated; to split the experts over ranks use `experts -> D` "
                        "in the layout (D batch, context or tensor axes), or split the experts' ffn: `ffn -> AXIS`")
                return None
        collectives: list[Collective] = []
        groups = [_EXPERTS] + ([_SHARED] if unit.attr("shared_expert") else [])
        outs: list[tuple[str, Any]] = []  # (row layer, the layout of its output)
        for gate, up, down in groups:
            y_gate = through(pl(gate), R, name(gate), r, collectives)
            y_up = through(pl(up), R, name(up), r, collectives)
            if y_gate is None or y_up is None:
                return None
            if y_gate != y_up:
                r.error(E0402, f"the SwiGLU product combines `{name(gate)}` ({y_gate}) with `{name(up)}` ({y_up})",
                        pl(up).span or pl(gate).span, label="layouts differ",
                        help=f"give `{name(gate)}` and `{name(up)}` the same rule")
                return None
            if pl(gate).rule == "row":  # its output is a partial sum
                partial_error(y_gate, "the SwiGLU activation", pl(gate).span, r, name(gate))
                return None
            p_down = pl(down)
            if y_gate == R and p_down.sharded:
                r.error(E0402, f"`{name(down)}` is row-parallel over {' x '.join(p_down.axes)} but `{name(gate)}` "
                        f"and `{name(up)}` are replicated", p_down.span, label="row without its column layers",
                        help=f"split `{name(gate)}` and `{name(up)}` column({', '.join(p_down.axes)}) too, or make "
                        f"`{name(down)}` replicated")
                return None
            y = through(p_down, y_gate, name(down), r, collectives, (name(gate), pl(gate)))
            if y is None:
                return None
            outs.append((down, y))
        if len(outs) == 2 and outs[0][1] == R and outs[1][1] != R \
                and set(pl(_EXPERTS[0]).experts) & set(pl(outs[1][0]).axes):
            # The experts over a tensor axis the shared expert's ffn splits over: their tokens split
            # over it and their outputs all-gathered, whole; the shared expert's partial sum is
            # reduced alone and the routed sum added after (sublayer_lines).
            unique = list(dict.fromkeys(collectives))
            return at_residual(outs[1][1], name(outs[1][0]), pl(outs[1][0]), unique, r)
        if len(outs) == 2 and outs[0][1] != outs[1][1]:
            (d0, y0), (d1, y1) = outs
            r.error(E0402, f"the experts' output ({y0}) and the shared expert's ({y1}) are added, but their "
                    "layouts differ", pl(d1).span or pl(d0).span, label="layouts differ",
                    help="split the shared expert's ffn over the same axes as the experts' "
                    "(`shared_ffn -> AXIS` beside `ffn -> AXIS`), or neither")
            return None
        unique = list(dict.fromkeys(collectives))
        return at_residual(outs[0][1], name("down"), pl("down"), unique, r)

    # -- costs
    def _ffn_local(self, plan: PlanIR, hu: HeldUnit, leaf_name: str, size: str) -> int:
        leaf = next(lf for lf in hu.unit.leaves if lf.name == leaf_name)
        return int(hu.unit.attr(size)) // costs.axes_size(plan, hu.placement(leaf))  # type: ignore[arg-type]

    def _routed(self, plan: PlanIR, hu: HeldUnit, tokens: int) -> int:
        """(token, choice) pairs the experts compute: all of them dropless, at most each expert's
        capacity with a capacity factor (activations at capacity; balanced routing). With the
        experts over tensor axes a rank routes its share of the tokens (costs.routed_tokens)."""
        a = hu.unit.attr
        return costs.routed_pairs(costs.routed_tokens(plan, hu, tokens), int(a("top_k")), int(a("experts")),  # type: ignore[arg-type]
                                  float(a("capacity") or 0.0))  # type: ignore[arg-type]

    def saved_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, local: int, seq: int, micro: int,
                    flash_attention: bool) -> int:
        e, fp32 = DTYPES[plan.dtype], costs.FP32
        hid, n_exp = int(hu.unit.attr("hidden")), int(hu.unit.attr("experts"))  # type: ignore[arg-type]
        routed = self._routed(plan, hu, tokens)
        saved = e * local * hid  # the normed input (router and experts)
        saved += fp32 * tokens * n_exp  # router probabilities (softmax backward)
        saved += e * routed * hid  # each (token, choice) pair's gathered input
        saved += 4 * e * routed * self._ffn_local(plan, hu, "gate", "ffn")  # gate, up, silu(gate), product
        if hu.unit.attr("act") == "swiglu_clamped":
            # what autograd keeps beyond that for the clamped SwiGLU (runtime/moe/experts.py clamped_swiglu):
            # the clamped gate, sigmoid(alpha gate) and up + 1
            saved += 3 * e * routed * self._ffn_local(plan, hu, "gate", "ffn")
        saved += e * routed * hid  # expert outputs before the weighting
        if hu.unit.attr("shared_expert"):
            saved += 4 * e * tokens * self._ffn_local(plan, hu, "shared_gate", "shared_ffn")
        return saved

    def backward_bytes(self, plan: PlanIR, hu: HeldUnit, tokens: int, regather: int) -> int:
        e = DTYPES[plan.dtype]
        return 4 * e * self._routed(plan, hu, tokens) * self._ffn_local(plan, hu, "gate", "ffn")

    def runs_grouped(self, plan: PlanIR, hu: HeldUnit) -> bool:
        """Whether the runtime runs this layer's experts through torch._grouped_mm (runtime/moe/grouped.py
        grouped_runs, as the plan decides it): not in float64, which torch 2.13 refuses; rows of hidden
        and of the local ffn each a multiple of 16 bytes; not under a split-backward schedule
        (runtime/train/program.py: the loop there)."""
        if plan.dtype == "fp64" or plan.schedule in ("interleaved_zb", "zbv", "dualpipev"):
            return False
        e = DTYPES[plan.dtype]
        return all(n * e % 16 == 0 for n in (int(hu.unit.attr("hidden")), self._ffn_local(plan, hu, "gate", "ffn")))  # type: ignore[arg-type]

    def kernels(self, plan: PlanIR, hu: HeldUnit, k: Mapping[str, int], linears: int) -> int:
        """Where the grouped path runs (`runs_grouped`) a rank's experts are one set of kernels whatever
        their number; elsewhere the runtime runs each expert a rank holds on its rows, one after the
        other (runtime/moe/experts.py `experts_swiglu`; runtime/moe/dispatch.py under expert
        parallelism), so the kernels grow with the rank's local experts (all of them without expert
        parallelism), each at balanced routing receiving rows. `linears` counts the stacked gate / up /
        down once: they are in the experts' count instead."""
        degree = costs.expert_degree(plan, hu)
        local = int(hu.unit.attr("experts")) // degree  # type: ignore[arg-type]
        n = linears - len(_EXPERTS) * k["linear"] + k["moe_routing"] + k["residual"]
        grouped = self.runs_grouped(plan, hu)
        if degree > 1:
            n += k["expert_dispatch"] + local * degree * k["expert_dispatch_piece"]
            n += k["expert_parallel_grouped"] if grouped else local * k["expert_parallel_expert"]
        else:
            n += k["experts_grouped"] if grouped else local * k["expert"]
        if hu.unit.attr("shared_expert") and _ungated(hu.unit):  # DeepSeek's: its SwiGLU and the sum
            n += k["swiglu"] + k["residual"]
        elif hu.unit.attr("shared_expert"):  # its SwiGLU, the sigmoid gate, the scaling and the sum
            n += k["swiglu"] + k["activation"] + 2 * k["residual"]
        return n

    def work(self, plan: PlanIR, hu: HeldUnit, tokens: int, seq: int, micro: int, flash_attention: bool) -> Any:
        """Active work only: the router on every token, and each token's top_k experts (not all of
        them), plus the shared expert on every token."""
        hid, n_exp = int(hu.unit.attr("hidden")), int(hu.unit.attr("experts"))  # type: ignore[arg-type]
        routed, f = self._routed(plan, hu, tokens), self._ffn_local(plan, hu, "gate", "ffn")
        mm = [costs.Matmul(tokens, n_exp, hid), costs.Matmul(routed, f, hid, 2), costs.Matmul(routed, hid, f)]
        if hu.unit.attr("shared_expert"):
            s = self._ffn_local(plan, hu, "shared_gate", "shared_ffn")
            mm += [costs.Matmul(tokens, s, hid, 2), costs.Matmul(tokens, hid, s)]
            if not _ungated(hu.unit):
                mm.append(costs.Matmul(tokens, 1, hid))
        return costs.Work(tuple(mm))

    def flops_per_token(self, unit: Unit, seq: int) -> int:
        # Active work, as `work`: the router, top_k of the routed experts, the shared expert.
        hid, ffn, n_exp, k = (int(unit.attr(a)) for a in ("hidden", "ffn", "experts", "top_k"))  # type: ignore[arg-type]
        shared = int(unit.attr("shared_ffn") or 0) if unit.attr("shared_expert") else 0  # type: ignore[arg-type]
        gate = 1 if shared and not _ungated(unit) else 0  # Qwen2-MoE's [1, hidden] gate
        return 2 * hid * (n_exp + 3 * k * ffn + 3 * shared + gate)

    def unit_collectives(self, unit: Unit, placement: Mapping[str, Placement]) -> tuple[Collective, ...]:
        """Expert parallelism's token dispatch and combine (runtime/moe/dispatch.py), over the axes
        its experts are split over."""
        experts = next((p.experts for lf in unit.leaves for p in [placement.get(".".join(lf.path), REPLICATE)]
                        if p.experts), ())
        return (Collective("expert_all_to_all", experts, "the experts"),) if experts else ()

    def describe(self, a: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(hidden=a["hidden"], ffn=a["ffn"], experts=a["experts"], top_k=a["top_k"],
                 norm_topk_prob=a["norm_topk_prob"], weights_fp32=a["weights_fp32"])
        if a["shared_expert"]:
            d["shared_ffn"] = a["shared_ffn"]
        # Only when set, so the MODEL of a dropless model without router losses reads as before.
        d.update({r: a[r] for r in ROUTING if a.get(r)})
        d.update({r: a[r] for r, off in DEEPSEEK.items() if a.get(r, off) != off})
        d.update({r: True for r in ("router_bias", "expert_bias") if a.get(r)})
        if a.get("act", "swiglu") != "swiglu":
            d.update(act=a["act"], swiglu_alpha=a["swiglu_alpha"], swiglu_limit=a["swiglu_limit"])
        return d

    # -- codegen
    def init_lines(self, w: Any, attr: str, unit: Unit, placement: Mapping[str, Placement],
                   tied_here: bool) -> list[Any]:
        a = dict(unit.attrs)
        experts = any(placement.get(f"{unit.name}.{leaf.name}", REPLICATE).experts for leaf in unit.leaves)
        # Split experts run in a method of the layer's module, which FSDP2 can hook to shard them
        # over the batch ranks that replicate them (runtime/moe/dispatch.py ExpertsParallel).
        module = spec("expert_all_to_all").runtime  # the registered collective's issuer
        lines = [w.line(f"self.{attr} = rt.{module}()", "its experts split over ranks") if experts
                 else w.line(f"self.{attr} = nn.Module()")]
        for leaf in unit.leaves:
            p = placement.get(f"{unit.name}.{leaf.name}", REPLICATE)
            shape = w.plan.local_shape(leaf.params[0], p)
            rule = f"{p.rule}({', '.join(p.axes)})" if p.sharded else "replicated"
            if p.experts and len(shape) == 3:
                rule = (f"{rule}, " if p.sharded else "") + f"experts over {', '.join(p.experts)}"
            bias = next((t for t in leaf.params if t.name == "bias"), None)
            if len(shape) == 3:
                out_f, n_exp, in_f = shape
                biased, why_bias = "", ""
                if bias is not None:
                    bias_exp = w.plan.local_shape(bias, p)[1]
                    biased = f", bias_experts={bias_exp}"
                    why_bias = (f"; bias [{out_f}, {bias_exp}]" if leaf.name != "down"
                                else f"; bias [{out_f}, all {bias_exp} experts], added once after the sum")
                lines.append(w.line(f"self.{attr}.{leaf.name} = rt.StackedLinear({n_exp}, {in_f}, {out_f}{biased})",
                                    f"{rule}: [{out_f}, {n_exp} experts, {in_f}]{why_bias}"))
            else:
                out_f, in_f = shape
                why = {"router": "every rank routes every token", "shared_router": "the shared expert's gate"}
                lines.append(w.line(f"self.{attr}.{leaf.name} = nn.Linear({in_f}, {out_f}, bias={bias is not None})",
                                    f"{rule}: {why[leaf.name]}" if leaf.name in why else rule))
        if a.get("scoring") == "sigmoid":
            n_exp = a["experts"]
            lines.append(w.line(f"self.{attr}.router.register_buffer('{CORRECTION}', torch.zeros({n_exp}))",
                                f"[{n_exp}] chooses the experts, not a gradient parameter; the same on every rank"))
            if a.get("balance_rate"):
                lines += [w.line(f"self.{attr}.router.register_buffer('{LOAD}', torch.zeros({n_exp}, dtype=torch.long), "
                                 "persistent=False)",
                                 f"[{n_exp}] this rank's (token, choice) pairs per expert since the last optimizer step"),
                          w.line(f"self.{attr}.router.balance_rate = {a['balance_rate']!r}",
                                 "the bias's move toward balance after each optimizer step (Built.balance_experts)")]
        del a
        return lines

    def sublayer_lines(self, w: Any, attr: str, unit: Unit, flow: UnitFlow, placement: dict[str, Placement],
                       x: str) -> list[Any]:
        a = dict(unit.attrs)
        hid, n_exp, k = a["hidden"], a["experts"], a["top_k"]
        m = f"self.{attr}"
        copy = next((c for c in flow.collectives if c.where == "input"), None)
        reduce = next((c for c in flow.collectives if c.where == "output"), None)
        if (copy is not None and copy.op != "copy_to") or (reduce is not None and reduce.op != "reduce_from"):
            raise AssertionError(f"moe: {copy} / {reduce} (sequence parallelism) are refused by the checker")
        f_local = self._local(w, unit, placement, "gate", a["ffn"])
        cap = f", capacity={a['capacity']!r}{w.capacity_keep(x)}" if a.get("capacity") else ""
        cap += self._router_args(m, a)
        drop = (f"; past ceil({a['capacity']:g} x b*s x {k} / {n_exp}) per expert, id -1 (dropped)"
                if a.get("capacity") else "")
        if a.get("capacity") and w.plan.roles.context:
            n = w.plan.mesh.size(*w.plan.roles.context)
            drop += (f", counted over the whole sequences: ids all-gathered over {w.axes_text(w.plan.roles.context)} "
                     f"({n}) to [b, {n} s, {k}] in position order")
        router_bias = f", router_bias={m}.router.bias" if a.get("router_bias") else ""
        lines = [
            w.line(f"t = {x}.reshape(-1, {hid})", f"[b*s, {hid}] one row per token"),
            w.line(f"weights, chosen, _ = rt.moe_route(t, {m}.router.weight, top_k={k}, "
                   f"renormalize={a['norm_topk_prob']}, weights_fp32={a['weights_fp32']}{cap}{router_bias})",
                   f"[b*s, {k}] weights and ids of each token's experts, of {n_exp}; the same on every rank{drop}"),
        ]
        if a.get("expert_bias"):
            lines.append(w.line(f"down_bias = rt.moe_expert_bias(chosen, weights, {m}.down.bias)",
                                f"[b*s, {hid}] the chosen experts' down biases, weighted: whole on every rank, added after the sum"))
        act = ""
        if a.get("act", "swiglu") == "swiglu_clamped":
            act = f", act=rt.clamped_swiglu({float(a['swiglu_alpha'])!r}, {float(a['swiglu_limit'])!r})"
        xt = "t"
        experts = placement.get(f"{unit.name}.gate", REPLICATE).experts
        # Experts over tensor axes (the tokens the same along them): each of their ranks routes its
        # share of the tokens to whole experts and all-gathers the outputs, whole on every rank, so
        # they join the shared expert's partial sum after its reduction.
        split = tuple(a for a in experts if a in w.plan.roles.expert_token_split)
        if copy is not None:
            g, n = w.group(copy.axes), w.n(copy.axes)
            axes = w.axes_text(copy.axes)
            lines.append(w.line(f"xt = rt.copy_to(t, {g})", f"f: identity; backward all-reduces the experts' input gradient over {axes} ({n})"))
            if not split:
                lines.append(w.line(f"weights = rt.copy_to(weights, {g})",
                                    f"f: each rank's ffn slice gives part of the weights' gradient; backward sums it over {axes}"))
            xt = "xt"
        part = f" Partial over {w.axes_text(reduce.axes)}" if reduce is not None else ""
        weights_args = f"{m}.gate.weight, {m}.up.weight, {m}.down.weight"
        if split:
            n, s_n = w.n(experts), w.n(split)
            lines.append(w.line(f"routed = {m}.experts(t, chosen, weights, {w.group(experts)}{act}, split={w.group(split)})",
                                f"[b*s, {hid}]: {w.axes_text(split)} ({s_n}) split the tokens, each rank's b*s / {s_n} "
                                f"rows all-to-all over {w.axes_text(experts)} ({n}) to their experts' ranks and back, "
                                f"then all-gathered over {w.axes_text(split)}; {n_exp // n} of {n_exp} experts here, "
                                f"all {a['ffn']} ffn of each{', dropless' if not a.get('capacity') else ''}"))
            lines.append(w.line("out = torch.zeros_like(routed)", "the shared experts' sum, added to the routed one once reduced")
                         if a["shared_expert"] else w.line("out = routed", f"[b*s, {hid}]"))
        elif experts:
            n = w.n(experts)
            lines.append(w.line(f"out = {m}.experts({xt}, chosen, weights, {w.group(experts)}{act})",
                                f"[b*s, {hid}]{part}: all-to-all over {w.axes_text(experts)} ({n}) sends the [b*s*{k}, {hid}] "
                                f"(token, choice) rows to their experts' ranks, uneven splits, and back; {n_exp // n} of "
                                f"{n_exp} experts here, {f_local} of {a['ffn']} ffn of each"
                                f"{', dropless' if not a.get('capacity') else ''}"))
        else:
            if a.get("expert_bias"):
                weights_args += f", gate_bias={m}.gate.bias, up_bias={m}.up.bias"
            lines.append(w.line(f"out = rt.moe_experts({xt}, chosen, weights, {weights_args}{act})",
                                f"[b*s, {hid}]{part}: {f_local} of {a['ffn']} ffn of each expert"
                                f"{', dropless' if not a.get('capacity') else ''}"))
        if a["shared_expert"] and a.get("shared_experts"):
            s_local = self._local(w, unit, placement, "shared_gate", a["shared_ffn"])
            lines.append(w.line(f"out = out + {m}.shared_down(F.silu({m}.shared_gate({xt})) * {m}.shared_up({xt}))",
                                f"[b*s, {hid}]{part}: {a['shared_experts']} shared experts, ungated, {s_local} of "
                                f"{a['shared_ffn']} ffn"))
        elif a["shared_expert"]:
            s_local = self._local(w, unit, placement, "shared_gate", a["shared_ffn"])
            scale = f"torch.sigmoid({m}.shared_router(t))"
            if copy is not None:
                lines.append(w.line(f"scale = rt.copy_to({scale}, {w.group(copy.axes)})",
                                    "[b*s, 1] the shared expert's gate; backward sums its gradient like the weights'"))
                scale = "scale"
            lines.append(w.line(f"out = out + {scale} * {m}.shared_down(F.silu({m}.shared_gate({xt})) * {m}.shared_up({xt}))",
                                f"[b*s, {hid}]{part}: the shared expert, {s_local} of {a['shared_ffn']} ffn"))
        if reduce is not None:
            lines.append(w.line(f"out = rt.reduce_from(out, {w.group(reduce.axes)})",
                                f"g: all-reduce over {w.axes_text(reduce.axes)} ({w.n(reduce.axes)}) -> [b*s, {hid}]"))
        if split and a["shared_expert"]:
            lines.append(w.line("out = out + routed", f"[b*s, {hid}] the routed experts' whole sum, once"))
        if a.get("expert_bias"):
            lines.append(w.line("out = out + down_bias.to(out.dtype)", f"[b*s, {hid}] the down biases, once"))
        lines.append(w.line(f"out = out.view_as({x})", f"[b, s, {hid}]"))
        return lines

    def _router_args(self, m: str, a: Mapping[str, Any]) -> str:
        """`rt.moe_route`'s DeepSeek keywords where the layer sets them (none for a softmax router
        as it was, so its generated code stays the same)."""
        args = ""
        if a.get("scoring") == "sigmoid":
            args += f", scoring='sigmoid', bias={m}.router.{CORRECTION}"
            if a.get("groups", 1) > 1:
                args += f", groups={a['groups']}, topk_groups={a['topk_groups']}"
            if a.get("balance_rate"):
                args += f", load={m}.router.{LOAD}"
        if a.get("routed_scaling", 1.0) != 1.0:
            args += f", scaling={a['routed_scaling']!r}"
        return args

    def _local(self, w: Any, unit: Unit, placement: Mapping[str, Placement], leaf: str, size: int) -> int:
        p = placement.get(f"{unit.name}.{leaf}", REPLICATE)
        return size // w.n(p.axes) if p.sharded else size

    def core_lines(self, w: Any, attr: str, unit: Unit, a: Mapping[str, Any],
                   placement: Mapping[str, Placement], x: str) -> list[Any]:
        raise AssertionError("moe writes its whole forward (sublayer_lines); it has no core between projections")


MOE = Moe("moe", sublayer=True, routes_experts=True, width_arg="hidden", sequence_parallel=False, whole=("router", "shared_router"), args=(
    Arg("hidden", "dim"),
    Arg("ffn", "dim"),
    Arg("experts", "dim"),
    Arg("top_k", "dim"),
    Arg("norm_topk_prob", "bool", const(True)),
    # Keep the chosen weights in float32, or (False) cast them to the activations' dtype.
    Arg("weights_fp32", "bool", const(True)),
    Arg("shared_expert", "bool", const(False)),
    # DeepSeek's ungated shared experts: N of them, one SwiGLU of width N x ffn (0: none).
    Arg("shared_experts", "dim", const(0), minimum=0),
    Arg("shared_ffn", "dim", lambda bound: bound["ffn"] * max(1, bound["shared_experts"])),
    # Routing (runtime/moe/routing.py): the load-balancing loss's and router z-loss's coefficients in
    # the training loss, and the capacity factor (0: dropless).
    Arg("aux_loss_coef", "float", const(0.0)),
    Arg("z_loss_coef", "float", const(0.0)),
    Arg("capacity", "float", const(0.0)),
    # DeepSeek-V3's complementary sequence-wise balance loss: its alpha in the training loss (0: none).
    Arg("seq_aux_loss", "float", const(0.0)),
    # DeepSeek-V3's router (runtime/moe/routing.py `choose_sigmoid`): sigmoid scores chosen with a
    # correction bias, group-limited choice, the chosen weights' scale, and the bias's balancing rate.
    Arg("scoring", "choice", const("softmax"), ("softmax", "sigmoid")),
    Arg("groups", "dim", const(1)),
    Arg("topk_groups", "dim", lambda bound: bound["groups"]),
    Arg("routed_scaling", "float", const(1.0)),
    Arg("balance_rate", "float", const(0.0)),
    # GPT-OSS: a bias on the router's logits, biases on every expert's gate / up / down, and the clamped
    # SwiGLU (runtime/moe/experts.py clamped_swiglu): gate clamped above at swiglu_limit, up to
    # [-limit, limit], then (up + 1) * gate * sigmoid(swiglu_alpha * gate).
    Arg("router_bias", "bool", const(False)),
    Arg("expert_bias", "bool", const(False)),
    Arg("act", "choice", const("swiglu"), ("swiglu", "swiglu_clamped")),
    Arg("swiglu_alpha", "float", const(1.702)),
    Arg("swiglu_limit", "float", const(7.0)),
))
