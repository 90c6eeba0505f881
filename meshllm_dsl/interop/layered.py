"""The build of a DeepSeek-V3-class model as the engines' layered models read it: embed, a repeat of
dense blocks (optional), a repeat of moe blocks, norm, head; every block rmsnorm, attention, rmsnorm,
mlp / moe. torchtitan's deepseek_v3 (interop/torchtitan.py) and Megatron's GPT model with
`--moe-layer-freq` (interop/megatron.py) read the same shape; each then checks what its own model has."""

from __future__ import annotations

import attrs

from meshllm_dsl.ir import ModelIR, Repeat, Unit

_BLOCK = {"attn_norm", "attn", "mlp_norm", "mlp"}


@attrs.frozen
class LayeredBuild:
    tops: dict[str, Unit]  # embed, norm, lm_head
    dense: Repeat | None  # the dense blocks before the moe ones
    moe: Repeat
    bodies: tuple[dict[str, Unit], ...]  # each repeat's sublayers by name, dense first

    @property
    def attn(self) -> Unit:
        return self.bodies[-1]["attn"]

    @property
    def experts(self) -> Unit:
        return self.bodies[-1]["mlp"]

    @property
    def layers(self) -> int:
        """The blocks of both kinds: the engines' layers."""
        return self.moe.count + (self.dense.count if self.dense else 0)

    @property
    def dense_ffn(self) -> int:
        """The dense blocks' ffn; the experts' without dense blocks."""
        mlp = self.bodies[0]["mlp"] if self.dense else self.experts
        return int(mlp.attr("ffn"))  # type: ignore[arg-type]

    def norms(self) -> list[Unit]:
        """Every block's two norms and the final one."""
        return [b[n] for b in self.bodies for n in ("attn_norm", "mlp_norm")] + [self.tops["norm"]]

    def same_attention(self) -> bool:
        return all(dict(b["attn"].attrs) == dict(self.attn.attrs) for b in self.bodies)


def layered_build(model: ModelIR) -> LayeredBuild | None:
    """The layered build of ``model``, or None when it has another one."""
    repeats = [it for it in model.items if isinstance(it, Repeat)]
    tops = {it.name: it for it in model.items if not isinstance(it, Repeat)}
    bodies = tuple({u.name: u for u in r.body} for r in repeats)
    kinds = [b["mlp"].kind if set(b) == _BLOCK else None for b in bodies]
    if list(tops) != ["embed", "norm", "lm_head"] or kinds not in (["moe"], ["mlp", "moe"]):
        return None
    return LayeredBuild(tops, repeats[0] if len(repeats) == 2 else None, repeats[-1], bodies)
