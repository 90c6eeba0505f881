"""`meshc import-megatron` / `import-torchtitan`: the .mesh plan of a Megatron-LM or torchtitan run.

`meshc import-megatron -o FILE.mesh [--devices N] [--hf-config DIR] -- ARGS...`:

ARGS is the `pretrain_gpt.py` argument line (what `meshc export --to megatron` writes). Each flag is
one of megatron.FLAGS, read with its type; any other flag, a missing or mistyped value, or a value
meshllm cannot honour is a located error (E1207) whose span is the argument in the line, never
ignored. The written spec says the run in meshllm's words: one mesh axis per Megatron group
(pipeline, data, expert, cp, tensor: Megatron's rank order, the tensor group fastest), the model from
the shape flags (or DIR's config.json, read as `meshc import-hf` reads it, the flags checked against
it), and a plan with Megatron's fixed tensor-parallel shards, explicit stages, schedule,
ZeRO (distributed optimizer / Megatron-FSDP), recomputation and precision. Every line of the plan
carries a `# from --flag value` comment, so the checker's diagnostics on the imported plan (sizes that
do not divide, say) name the argument they came from.

`meshc import-torchtitan -o FILE.mesh --hf-config DIR -- ARGS...` reads a torchtitan 0.3 line the same
way (torchtitan.KEYS, the overrides `--to torchtitan` writes); its model is DIR's config.json, as
torchtitan's is code in the config function, not flags.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshllm_dsl.codes import E1207
from meshllm_dsl.diagnostics import Diagnostic, SpecError, render_all
from meshllm_dsl.front.source import SourceFile, Span
from meshllm_dsl.interop.megatron import FLAGS, LAYERED_FAMILIES, ZERO

MESH = "megatron"
TITAN_MESH = "torchtitan"
MODEL = "model"
PLAN = "train"


class _Args:
    """The parsed argument line: values by flag, each with the span of its argument."""

    def __init__(self, args: list[str], flags: dict[str, type | None] = FLAGS, engine: str = "megatron",
                 subcommands: tuple[str, ...] = ()) -> None:
        self.source = SourceFile(f"<{engine} arguments>", " ".join(shlex.quote(a) for a in args))
        self.subcommand: str | None = None
        self.values: dict[str, Any] = {}
        self.spans: dict[str, Span] = {}
        self.errors: list[Diagnostic] = []
        offsets, at = [], 0
        for a in args:
            offsets.append(at)
            at += len(shlex.quote(a)) + 1
        i = 0
        while i < len(args):
            flag, span = args[i], self._span(offsets[i], args[i])
            if flag in subcommands and self.subcommand is None:
                self.subcommand, self.spans[flag] = flag, span
                i += 1
                continue
            kind = flags.get(flag, False)
            if kind is False:
                what = "an argument" if flag.startswith("-") else "a positional argument"
                self.error(span, f"`{flag}` is not a{'' if engine == 'torchtitan' else ' Megatron'} "
                           f"{'key' if engine == 'torchtitan' else 'flag'} meshc imports",
                           f"{what} meshc does not read",
                           f"remove it, or check it is one `meshc export --to {engine}` writes")
                # an unknown flag's value (if it has one) is not a second error
                i += 2 if flag.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--") else 1
                continue
            if kind is None:
                self.values[flag], self.spans[flag] = True, span
                i += 1
                continue
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                self.error(span, f"`{flag}` needs a value", "no value", f"write `{flag} VALUE`")
                i += 1
                continue
            raw = args[i + 1]
            vspan = self._span(offsets[i + 1], raw)
            try:
                value = kind(raw)
            except ValueError:
                self.error(vspan, f"`{flag} {raw}`: not {'an integer' if kind is int else 'a number'}",
                           "wrong type", f"write `{flag}` with a {kind.__name__} value")
                i += 2
                continue
            if kind is int and value < 1 and not flag.endswith(("-in-bf16", "_less_layers")):
                self.error(vspan, f"`{flag} {raw}`: not a positive integer", "not positive", f"write `{flag}` >= 1")
            self.values[flag], self.spans[flag] = value, Span(self.source, span.start, vspan.end)
            i += 2

    def _span(self, start: int, arg: str) -> Span:
        return Span(self.source, start, start + len(shlex.quote(arg)))

    def error(self, span: Span | None, message: str, label: str, help: str) -> None:  # noqa: A002
        self.errors.append(Diagnostic(E1207, message, span, label=label, help=help))

    def get(self, flag: str, default: Any = None) -> Any:
        return self.values.get(flag, default)

    def src(self, *flags: str) -> str:
        """`# from --a 1 --b` for the flags given: where a spec line comes from."""
        given = [self.spans[f].text for f in flags if f in self.spans]
        return f"  # from {' '.join(given)}" if given else ""

    def refuse(self, flag: str, message: str, help: str) -> None:  # noqa: A002
        self.error(self.spans.get(flag), message, "not imported", help)

    def want(self, flag: str, allowed: tuple[Any, ...], why: str) -> None:
        if flag in self.values and self.values[flag] not in allowed:
            self.refuse(flag, f"`{self.spans[flag].text}`: {why}",
                        f"use {' or '.join(f'`{flag} {a}`' for a in allowed)}")


def _layered_model(a: _Args, lines: list[str]) -> tuple[str, list[str]]:
    """A DeepSeek-V3-class line (sigmoid routing with the expert bias; multi-latent attention: the
    deepseek_v3 family, else GQA with q / k layernorm: glm4_moe), its dense first blocks from
    `--moe-layer-freq`."""
    mla = "--multi-latent-attention" in a.values
    family = "deepseek_v3" if mla else "glm4_moe"
    layers, ffn = a.get("--num-layers", 1), a.get("--ffn-hidden-size", 4 * a.get("--hidden-size", 1))
    freq = a.get("--moe-layer-freq")
    dense = 0
    if freq is not None:
        m = re.fullmatch(r"\(\[0\]\*(\d+)\+\[1\]\*(\d+)\)", freq)
        if m is None or int(m[1]) + int(m[2]) != layers:
            a.refuse("--moe-layer-freq", f"`--moe-layer-freq {freq}`: meshllm's {family} has dense blocks first, then "
                     "moe blocks", f"write `([0]*D+[1]*M)` with D + M = `--num-layers` ({layers})")
        else:
            dense = int(m[1])
    for flag, want, why in (("--moe-router-score-function", ("sigmoid",), "DeepSeek-V3's routers score by sigmoid"),
                            ("--normalization", ("RMSNorm",), "DeepSeek-V3-class models use RMSNorm"),
                            ("--rope-type", ("yarn", "rope") if mla else (), "multi-latent attention's rope"),
                            ("--moe-router-load-balancing-type", ("none",), "meshllm balances by the expert bias only"),
                            ("--position-embedding-type", ("rope",), "DeepSeek-V3-class models use rope")):
        a.want(flag, want, why)
    for flag, why in (("--moe-router-enable-expert-bias", "the routers choose with their correction bias"),
                      ("--swiglu", "SwiGLU MLPs"), ("--disable-bias-linear", "no biases on the linears"),
                      ("--untie-embeddings-and-output-weights", "an untied head"),
                      ("--moe-router-score-function", "sigmoid routing")):
        if flag not in a.values:
            a.error(None, f"`{flag}` is missing: meshllm's {family} has {why}", "missing", f"add `{flag}`")
    expert_ffn = a.get("--moe-ffn-hidden-size", ffn)
    shared = a.get("--moe-shared-expert-intermediate-size", 0)
    if shared % expert_ffn:
        a.refuse("--moe-shared-expert-intermediate-size", f"a shared expert of {shared}, not a multiple of the experts' "
                 f"{expert_ffn}", "meshllm's shared experts are whole experts")
    if "--moe-shared-expert-gate" in a.values:
        a.refuse("--moe-shared-expert-gate", f"a gated shared expert: meshllm's {family} adds it ungated", "drop it")
    lines += [f"first_dense = {dense}{a.src('--moe-layer-freq')}",
              f"expert_ffn = {expert_ffn}{a.src('--moe-ffn-hidden-size')}",
              f"experts = {a.get('--num-experts')}{a.src('--num-experts')}",
              f"top_k = {a.get('--moe-router-topk', 2)}{a.src('--moe-router-topk')}",
              f"groups = {a.get('--moe-router-num-groups', 1)}{a.src('--moe-router-num-groups')}",
              f"topk_groups = {a.get('--moe-router-group-topk', 1)}{a.src('--moe-router-group-topk')}",
              f"routed_scaling = {float(a.get('--moe-router-topk-scaling-factor', 1.0))!r}"
              f"{a.src('--moe-router-topk-scaling-factor')}",
              f"shared_experts = {shared // expert_ffn}{a.src('--moe-shared-expert-intermediate-size')}",
              f"balance_rate = {float(a.get('--moe-router-bias-update-rate', 1e-3))!r}"
              f"{a.src('--moe-router-bias-update-rate')}",
              f"norm_eps = {a.get('--norm-epsilon', 1e-5)!r}{a.src('--norm-epsilon')}",
              f"rope_theta = {float(a.get('--rotary-base', 10000))!r}{a.src('--rotary-base')}"]
    if "--moe-z-loss-coeff" in a.values:
        lines.append(f"z_loss_coef = {a.get('--moe-z-loss-coeff')!r}{a.src('--moe-z-loss-coeff')}")
    if mla:
        lines += [f"q_lora_rank = {a.get('--q-lora-rank', 0)}{a.src('--q-lora-rank')}",
                  f"kv_lora_rank = {a.get('--kv-lora-rank', 32)}{a.src('--kv-lora-rank')}",
                  f"qk_nope_head_dim = {a.get('--qk-head-dim', 128)}{a.src('--qk-head-dim')}",
                  f"qk_rope_head_dim = {a.get('--qk-pos-emb-head-dim', 64)}{a.src('--qk-pos-emb-head-dim')}",
                  f"v_head_dim = {a.get('--v-head-dim', 128)}{a.src('--v-head-dim')}"]
        if "--qk-layernorm" not in a.values:
            a.error(None, "multi-latent attention without `--qk-layernorm`: DeepSeek-V3 normalises its latents",
                    "missing", "add `--qk-layernorm`")
        if a.get("--rope-type", "yarn") == "yarn":  # MLATransformerConfig's YaRN: 4096 original positions, betas 32 / 1
            lines += [f"rope_type = yarn{a.src('--rope-type')}",
                      f"rope_factor = {float(a.get('--rotary-scaling-factor', 1.0))!r}{a.src('--rotary-scaling-factor')}",
                      "rope_original_positions = 4096.0  # MLATransformerConfig's original_max_position_embeddings",
                      f"rope_mscale = {float(a.get('--mscale', 1.0))!r}{a.src('--mscale')}",
                      f"rope_mscale_all_dim = {float(a.get('--mscale-all-dim', 0.0))!r}{a.src('--mscale-all-dim')}"]
    else:
        heads = a.get("--num-attention-heads", 1)
        kv = a.get("--num-query-groups", heads) if "--group-query-attention" in a.values else heads
        head_dim = a.get("--kv-channels", a.get("--hidden-size", 1) // heads)
        lines += [f"kv_heads = {kv}{a.src('--group-query-attention', '--num-query-groups')}",
                  f"head_dim = {head_dim}{a.src('--kv-channels')}",
                  f"rotary_dim = {round(head_dim * a.get('--rotary-percent', 1.0))}{a.src('--rotary-percent')}",
                  f"attn_bias = {'true' if '--add-qkv-bias' in a.values else 'false'}{a.src('--add-qkv-bias')}",
                  f"qk_norm = {'head' if '--qk-layernorm' in a.values else 'none'}{a.src('--qk-layernorm')}"]
    for flag in ("--mscale", "--mscale-all-dim", "--rotary-scaling-factor", "--q-lora-rank", "--kv-lora-rank",
                 "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--rope-type"):
        if flag in a.values and not mla:
            a.refuse(flag, f"`{flag}` without `--multi-latent-attention`", "drop it, or add `--multi-latent-attention`")
    if "--rotary-percent" in a.values and mla:
        a.refuse("--rotary-percent", "a partial rotary in multi-latent attention", "drop it")
    lines.append(f"tie_embeddings = false{a.src('--untie-embeddings-and-output-weights')}")
    return family, lines


def _model(a: _Args) -> tuple[str, list[str]]:
    """(family, the model's setting lines) from the shape flags."""
    for need in ("--num-layers", "--hidden-size", "--num-attention-heads", "--vocab-size"):
        if need not in a.values:
            a.error(None, f"`{need}` is missing: the model's shape comes from the flags", "missing",
                    f"add `{need} N`")
    layers, hidden, heads = a.get("--num-layers", 1), a.get("--hidden-size", 1), a.get("--num-attention-heads", 1)
    ffn = a.get("--ffn-hidden-size", 4 * hidden)
    lines = [f"vocab = {a.get('--vocab-size', 1)}{a.src('--vocab-size')}", f"hidden = {hidden}{a.src('--hidden-size')}",
             f"layers = {layers}{a.src('--num-layers')}", f"heads = {heads}{a.src('--num-attention-heads')}",
             f"ffn = {ffn}{a.src('--ffn-hidden-size')}"]
    a.want("--make-vocab-size-divisible-by", (1,), "Megatron pads the vocabulary, meshllm's model is unpadded")
    for flag in ("--attention-dropout", "--hidden-dropout"):  # Megatron's default is 0.1; meshllm has no dropout
        if flag not in a.values:
            a.error(None, f"`{flag}` is missing: Megatron drops out 0.1 by default, meshllm's models never",
                    "missing", f"add `{flag} 0.0`")
        a.want(flag, (0.0,), "meshllm's models have no dropout")
    if "--num-experts" in a.values and ("--multi-latent-attention" in a.values
                                        or "--moe-router-score-function" in a.values):
        return _layered_model(a, lines)
    if "--num-experts" not in a.values:
        for flag in [f for f in a.values if f.startswith("--moe-")]:
            a.refuse(flag, f"`{flag}` without `--num-experts`: a dense model has no router", "drop it, or add `--num-experts`")
    eps = a.get("--norm-epsilon", 1e-5)
    norm = a.get("--normalization", "LayerNorm")
    if norm == "LayerNorm":
        family = "gpt2"
        if "--openai-gelu" not in a.values:
            a.error(None, "GELU without `--openai-gelu`: meshllm's gpt2 uses the tanh GELU", "missing",
                    "add `--openai-gelu`")
        a.want("--position-embedding-type", ("learned_absolute",), "meshllm's gpt2 learns its positions")
        for flag in ("--swiglu", "--disable-bias-linear", "--group-query-attention", "--num-experts"):
            if flag in a.values:
                a.refuse(flag, f"`{flag}` with LayerNorm: not a meshllm family (gpt2 has biases, GELU, MHA)",
                         "drop it, or use `--normalization RMSNorm` for a llama-family model")
        lines += [f"positions = {a.get('--max-position-embeddings', 1024)}{a.src('--max-position-embeddings')}",
                  f"norm_eps = {eps!r}{a.src('--norm-epsilon')}",
                  f"tie_embeddings = {'false' if '--untie-embeddings-and-output-weights' in a.values else 'true'}"
                  f"{a.src('--untie-embeddings-and-output-weights')}"]
        return family, lines
    if norm != "RMSNorm":
        a.refuse("--normalization", f"`--normalization {norm}`", "use RMSNorm or LayerNorm")
    family = _moe_family(a) if "--num-experts" in a.values else "llama"
    for flag, why in (("--swiglu", "meshllm's llama-like families use SwiGLU"),
                      ("--disable-bias-linear", "meshllm's llama-like families have no biases on every linear")):
        if flag not in a.values:
            a.error(None, f"RMSNorm without `{flag}`: {why}", "missing", f"add `{flag}`")
    a.want("--position-embedding-type", ("rope",), "meshllm's llama-like families use rope")
    if "--openai-gelu" in a.values:
        a.refuse("--openai-gelu", "`--openai-gelu` with `--swiglu`", "drop it")
    kv = a.get("--num-query-groups", heads) if "--group-query-attention" in a.values else heads
    lines.append(f"kv_heads = {kv}{a.src('--group-query-attention', '--num-query-groups')}")
    if "--kv-channels" in a.values:
        lines.append(f"head_dim = {a.get('--kv-channels')}{a.src('--kv-channels')}")
    lines += [f"norm_eps = {eps!r}{a.src('--norm-epsilon')}",
              f"rope_theta = {float(a.get('--rotary-base', 10000))!r}{a.src('--rotary-base')}"]
    if "--use-rope-scaling" in a.values:
        if family == "llama":
            lines += [f"rope_type = llama3{a.src('--use-rope-scaling')}",
                      f"rope_factor = {float(a.get('--rope-scaling-factor', 8.0))!r}{a.src('--rope-scaling-factor')}"]
        else:
            a.refuse("--use-rope-scaling", f"llama3 rope scaling on a `{family}` model", "drop it")
    # the q / k / v biases and q / k norms: settings of a llama, fixed by the mixture-of-experts families
    fixed = {"mixtral": (), "qwen2_moe": ("--add-qkv-bias",), "qwen3_moe": ("--qk-layernorm",)}.get(family)
    if fixed is None:
        if "--add-qkv-bias" in a.values:
            # Megatron's --add-qkv-bias biases q / k / v only (Qwen2's), not the output projection
            lines += [f"attn_bias = true{a.src('--add-qkv-bias')}", f"attn_out_bias = false{a.src('--add-qkv-bias')}"]
        if "--qk-layernorm" in a.values:
            lines.append(f"qk_norm = head{a.src('--qk-layernorm')}")
    else:
        for flag in ("--add-qkv-bias", "--qk-layernorm"):
            if (flag in a.values) != (flag in fixed):
                a.refuse(flag if flag in a.values else "--num-experts",
                         f"meshllm's `{family}` {'has' if flag in fixed else 'has no'} `{flag}`",
                         f"{'add' if flag in fixed else 'drop'} `{flag}`")
        moe_ffn = a.get("--moe-ffn-hidden-size", ffn)
        if moe_ffn != ffn:
            a.refuse("--moe-ffn-hidden-size", "experts of another width than `--ffn-hidden-size`: meshllm's "
                     "mixture-of-experts families have no dense layer to give it", "make them equal")
        lines += [f"experts = {a.get('--num-experts')}{a.src('--num-experts')}",
                  f"top_k = {a.get('--moe-router-topk', 2)}{a.src('--moe-router-topk')}"]
        if family == "mixtral":
            if "--moe-router-pre-softmax" in a.values:
                a.refuse("--moe-router-pre-softmax", "Mixtral renormalises its top-k", "drop it")
        else:
            lines.append(f"norm_topk_prob = {'false' if '--moe-router-pre-softmax' in a.values else 'true'}"
                         f"{a.src('--moe-router-pre-softmax')}")
        if family == "qwen2_moe":
            if "--moe-shared-expert-gate" not in a.values:
                a.refuse("--moe-shared-expert-intermediate-size", "a shared expert without its gate: Qwen2-MoE's "
                         "is gated", "add `--moe-shared-expert-gate`")
            lines.append(f"shared_ffn = {a.get('--moe-shared-expert-intermediate-size')}"
                         f"{a.src('--moe-shared-expert-intermediate-size', '--moe-shared-expert-gate')}")
        # Megatron's per-layer switch loss is not meshllm's (transformers' over all layers at once): only
        # none (or aux_loss with Megatron's default coefficient 0) is the same run
        a.want("--moe-router-load-balancing-type", ("none",),
               "Megatron adds a load-balancing loss per layer, meshllm's is transformers' over all layers at once")
        if "--moe-z-loss-coeff" in a.values:
            lines.append(f"z_loss_coef = {a.get('--moe-z-loss-coeff')!r}{a.src('--moe-z-loss-coeff')}")
    lines.append(f"tie_embeddings = {'false' if '--untie-embeddings-and-output-weights' in a.values else 'true'}"
                 f"{a.src('--untie-embeddings-and-output-weights')}")
    return family, lines


def _moe_family(a: _Args) -> str:
    """The meshllm family of a mixture-of-experts line: a (gated) shared expert is Qwen2-MoE's, per-head
    q / k norms Qwen3-MoE's, neither Mixtral's."""
    if "--moe-shared-expert-intermediate-size" in a.values:
        return "qwen2_moe"
    if "--moe-shared-expert-gate" in a.values:
        a.refuse("--moe-shared-expert-gate", "a shared-expert gate without a shared expert",
                 "add `--moe-shared-expert-intermediate-size N` or drop it")
    return "qwen3_moe" if "--qk-layernorm" in a.values else "mixtral"


_SHARDS = {
    "gpt2": ("blocks.*.attn.qkv column", "blocks.*.attn.o row", "blocks.*.mlp.up column", "blocks.*.mlp.down row",
             "embed vocab_parallel", "lm_head column"),
    "llama": ("blocks.*.attn.{q,k,v} column", "blocks.*.attn.o row", "blocks.*.mlp.{gate,up} column",
              "blocks.*.mlp.down row", "embed vocab_parallel", "lm_head column"),
}


# Megatron's TP plan for DeepSeek-V3's latent attention / GLM-4.5's attention, over the dense and moe repeats
_LAYERED_COMMON = ("{dense,blocks}.*.attn.o row(tensor)", "{dense,blocks}.*.mlp.{gate,up} column(tensor)",
                   "{dense,blocks}.*.mlp.down row(tensor)", "blocks.*.mlp.{shared_gate,shared_up} column(tensor)",
                   "blocks.*.mlp.shared_down row(tensor)", "embed vocab_parallel(tensor)", "lm_head column(tensor)")
_LAYERED_SHARDS = {
    "deepseek_v3": ("{dense,blocks}.*.attn.{q_b,kv_b} column(tensor)", "{dense,blocks}.*.attn.{q_a,kv_a} replicate",
                    *_LAYERED_COMMON),
    "glm4_moe": ("{dense,blocks}.*.attn.{q,k,v} column(tensor)", *_LAYERED_COMMON),
}


# Megatron's shape flags and the model settings they are, for checking them against a config.json.
_SHAPE = {"--num-layers": "layers", "--hidden-size": "hidden", "--num-attention-heads": "heads",
          "--ffn-hidden-size": "ffn", "--vocab-size": "vocab", "--num-query-groups": "kv_heads",
          "--kv-channels": "head_dim", "--num-experts": "experts", "--moe-router-topk": "top_k",
          "--norm-epsilon": "norm_eps", "--rotary-base": "rope_theta", "--max-position-embeddings": "positions"}


def _hf_model(a: _Args, family: str, hf_dir: str) -> list[str]:
    """The model's settings from `hf_dir`/config.json (import-hf's reading), each flag of the line
    checked against the setting it gives: a run whose flags say another model is an error at the flag."""
    from meshllm_dsl.interop.import_hf import _num, model_settings, read_config

    where = str(Path(hf_dir) / "config.json")
    hf_family, settings, _ = model_settings(read_config(Path(hf_dir)), where)
    if hf_family != family:
        a.error(None, f"{where} is a `{hf_family}` model but the flags describe a `{family}` one", "another family",
                "give the config of the model the run trains")
    values = {k: v for k, v, _ in settings}
    for flag, key in _SHAPE.items():
        if flag in a.values and key in values and a.values[flag] != values[key] and not (
                key == "positions" and family != "gpt2"):
            a.refuse(flag, f"`{a.spans[flag].text}` but {where} gives {key} = {_num(values[key])}",
                     "make the flag the config's value (or drop --hf-config to take the flags' model)")
    return [f"{k} = {_num(v)}  # from config.json {src}" for k, v, src in settings if k != "dtype"]


def spec_text(args: list[str], devices: int | None, hf_config: str | None = None) -> str:
    """The .mesh text of the run `args` on `devices` (default: one data-parallel replica); the model
    from `hf_config`'s config.json when given, else from the shape flags."""
    a = _Args(args)
    family, model_lines = _model(a)
    if hf_config is not None:
        model_lines = _hf_model(a, family, hf_config)
    tp, pp = a.get("--tensor-model-parallel-size", 1), a.get("--pipeline-model-parallel-size", 1)
    cp, ep = a.get("--context-parallel-size", 1), a.get("--expert-model-parallel-size", 1)
    sizes = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size")
    devices = tp * pp * cp if devices is None else devices
    if devices % (tp * pp * cp):
        a.refuse(next((f for f in sizes if f in a.values), sizes[0]),
                 f"{devices} devices are not a multiple of tensor x pipeline x context = {tp * pp * cp}",
                 "give --devices a multiple of the model-parallel sizes")
    dp = max(devices // (tp * pp * cp), 1)
    a.want("--expert-tensor-parallel-size", (tp,), "meshllm splits the experts' ffn over the tensor axis as a dense one's")
    if dp % ep:
        a.refuse("--expert-model-parallel-size", f"`--expert-model-parallel-size {ep}` does not divide the "
                 f"{dp} data-parallel ranks", "meshllm splits the experts over data-parallel axes")
    if ep > 1 and family not in ("mixtral", "qwen2_moe", "qwen3_moe", *LAYERED_FAMILIES):
        a.refuse("--expert-model-parallel-size", "expert parallelism without `--num-experts`", "add `--num-experts`")
    # the mesh: Megatron's order tp-cp-ep-dp-pp, tensor fastest; meshllm's last axis is the fastest
    axes = [("pipeline", pp, "--pipeline-model-parallel-size"), ("data", dp // ep, None),
            ("expert", ep, "--expert-model-parallel-size"), ("cp", cp, "--context-parallel-size"),
            ("tensor", tp, "--tensor-model-parallel-size")]
    axes = [x for x in axes if x[1] > 1] or [("data", 1, None)]
    names = [n for n, _, _ in axes]
    batch_axes = [n for n in names if n in ("data", "expert")]
    replicas = batch_axes + (["cp"] if cp > 1 else [])

    gbs, mbs = a.get("--global-batch-size"), a.get("--micro-batch-size", 1)
    gbs = mbs * dp if gbs is None else gbs
    if gbs % (mbs * dp):
        a.refuse("--global-batch-size", f"global batch {gbs} is not micro batch {mbs} x {dp} data-parallel ranks "
                 "x microbatches", "make it a multiple")
    seq = a.get("--seq-length")
    if seq is None:
        a.error(None, "`--seq-length` is missing", "missing", "add `--seq-length N`")
    plan = [f"batch = {gbs}{a.src('--global-batch-size')}", f"seq = {seq}{a.src('--seq-length')}",
            f"microbatches = {max(gbs // (mbs * dp), 1)}{a.src('--micro-batch-size')}"]
    layout = [f"batch -> {' * '.join(batch_axes)}"] if batch_axes else []
    seq_axes = (["tensor"] if "--sequence-parallel" in a.values and tp > 1 else []) + (["cp"] if cp > 1 else [])
    if "--sequence-parallel" in a.values and tp == 1:
        a.refuse("--sequence-parallel", "sequence parallelism without tensor parallelism", "drop it")
    if seq_axes:
        layout.append(f"seq -> {' * '.join(seq_axes)}")
    if ep > 1:
        layout.append("experts -> expert")
    if layout:
        plan.append(f"layout {{ {', '.join(layout)} }}{a.src('--sequence-parallel', '--context-parallel-size', '--expert-model-parallel-size')}")
    if tp > 1 and family in LAYERED_FAMILIES:  # Megatron's TP plan in the dense and moe repeats' names
        src = a.src("--tensor-model-parallel-size")
        plan += [f"shard {x}{src}" for x in _LAYERED_SHARDS[family]]
    elif tp > 1:
        for shard in _SHARDS["gpt2" if family == "gpt2" else "llama"]:
            plan.append(f"shard {shard}(tensor){a.src('--tensor-model-parallel-size')}")
        if family == "qwen2_moe":
            plan += [f"shard blocks.*.mlp.{{shared_gate,shared_up}} column(tensor){a.src('--tensor-model-parallel-size')}",
                     f"shard blocks.*.mlp.shared_down row(tensor){a.src('--tensor-model-parallel-size')}"]
    if tp > 1 and family in ("mixtral", "qwen2_moe", "qwen3_moe", *LAYERED_FAMILIES):  # every leaf is placed
        plan.append("shard blocks.*.mlp.router replicate")
    if tp > 1 and family == "qwen2_moe":
        plan.append("shard blocks.*.mlp.shared_router replicate")
    plan += _stages(a, pp, a.get("--num-layers", 1))
    if "--reset-attention-mask" in a.values:
        plan.append(f"pack = documents{a.src('--reset-attention-mask')}")
        if "--reset-position-ids" in a.values:
            plan.append(f"positions = restart{a.src('--reset-position-ids')}")
    elif "--reset-position-ids" in a.values:
        a.refuse("--reset-position-ids", "positions reset at documents that attention is not masked at",
                 "add `--reset-attention-mask` (meshllm restarts positions only within a document mask)")
    plan += _recompute(a)
    plan += _precision(a)
    zero = _zero(a)
    opt = [f"    zero {zero} over {' * '.join(replicas)}{a.src(*[f for f, _ in ZERO[zero]])}"] if zero and replicas else []
    if zero and not replicas:
        a.refuse("--use-distributed-optimizer", "a distributed optimizer with one data-parallel rank", "drop it")
    plan += ["optimizer adamw {", *opt, "}"]
    if a.errors:
        raise SpecError(a.errors)
    mesh = (f"mesh {MESH} {{\n    axes {', '.join(f'{n} = {s}' for n, s, _ in axes)}"
            f"{a.src(*[f for _, _, f in axes if f])}\n}}\n")
    body = "\n".join(f"    {x}" if not x.startswith("    ") else f"    {x}" for x in model_lines)
    plan_body = "\n".join(f"    {x}" for x in plan)
    return (f"# Imported from a Megatron-LM argument line by `meshc import-megatron`: {shlex.join(args)}\n"
            f"{mesh}\nmodel {MODEL} = {family} {{\n{body}\n    dtype = {'bf16' if '--bf16' in a.values else 'fp32'}"
            f"{a.src('--bf16')}\n}}\n\nplan {PLAN} on {MESH} for {MODEL} {{\n{plan_body}\n}}\n")


def _stages(a: _Args, pp: int, layers: int) -> list[str]:
    """Megatron's pipeline split as explicit stages: round-robin virtual stages, even or by the layout string."""
    if pp == 1:
        for flag in ("--num-layers-per-virtual-pipeline-stage", "--pipeline-model-parallel-layout"):
            if flag in a.values:
                a.refuse(flag, f"`{flag}` without pipeline parallelism", "drop it")
        return []
    counts: list[int] = []
    if "--pipeline-model-parallel-layout" in a.values:
        layout = a.get("--pipeline-model-parallel-layout")
        stages = layout.split("|")
        for i, stage in enumerate(stages):
            want = ("E" if i == 0 else "") + "t" * stage.count("t") + ("L" if i == len(stages) - 1 else "")
            if stage != want or len(stages) % pp:
                a.refuse("--pipeline-model-parallel-layout", f"layout `{layout}`: meshc imports stages written "
                         "`E` + `t` per block on the first, `t`s, and `L` on the last, a multiple of the pipeline size",
                         "write each stage's blocks as `t`s (no `*`, `m` or `(...)`)")
                return []
            counts.append(stage.count("t"))
    else:
        per = a.get("--num-layers-per-virtual-pipeline-stage")
        per = per if per is not None else layers // pp
        if layers % per or (layers // per) % pp:
            a.refuse("--num-layers-per-virtual-pipeline-stage" if "--num-layers-per-virtual-pipeline-stage" in a.values
                     else "--pipeline-model-parallel-size",
                     f"{layers} layers do not split into {pp} ranks of stages of {per}", "make them divide")
            return []
        counts = [per] * (layers // per)
    if sum(counts) != layers:
        a.refuse("--pipeline-model-parallel-layout", f"the layout holds {sum(counts)} blocks, the model {layers}",
                 "give every block a `t`")
        return []
    virtual = len(counts) // pp
    src = a.src("--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage", "--pipeline-model-parallel-layout")
    out = [f"stages over pipeline{f' virtual {virtual}' if virtual > 1 else ''} {{{src}"]
    start = 0
    for i, n in enumerate(counts):
        items = (["embed"] if i == 0 else []) + ([f"blocks[{start}:{start + n}]"] if n else [])
        items += ["norm", "lm_head"] if i == len(counts) - 1 else []
        out.append(f"    {i}: {', '.join(items)}")
        start += n
    out += ["}", f"schedule {'interleaved_1f1b' if virtual > 1 else '1f1b'}"]
    return out


def _recompute(a: _Args) -> list[str]:
    gran = a.get("--recompute-granularity")
    if gran is None:
        for flag in ("--recompute-method", "--recompute-num-layers", "--recompute-modules"):
            if flag in a.values:
                a.refuse(flag, f"`{flag}` without `--recompute-granularity`", "add `--recompute-granularity`")
        return []
    if gran == "full":
        a.want("--recompute-method", ("uniform",), "meshllm recomputes each block (uniform, 1 layer)")
        a.want("--recompute-num-layers", (1,), "meshllm recomputes each block (uniform, 1 layer)")
        if "--recompute-method" not in a.values:
            a.refuse("--recompute-granularity", "full recomputation without `--recompute-method`",
                     "add `--recompute-method uniform --recompute-num-layers 1`")
        return [f"recompute = blocks{a.src('--recompute-granularity', '--recompute-method', '--recompute-num-layers')}"]
    if gran == "selective":
        a.want("--recompute-modules", ("core_attn",), "meshllm's `recompute = attention` is the attention core")
        return [f"recompute = attention{a.src('--recompute-granularity', '--recompute-modules')}"]
    a.want("--recompute-granularity", ("full", "selective"), "Megatron's granularities")
    return []


def _precision(a: _Args) -> list[str]:
    """One `precision { ... }` (bf16 with fp32 main weights; the fp8 recipe) and the blocks kept in bf16."""
    parts, blocks, flags = [], [], ["--bf16", "--grad-reduce-in-bf16"]
    if "--bf16" in a.values:
        parts.append(f"params = bf16, master = fp32, reduce = {'bf16' if '--grad-reduce-in-bf16' in a.values else 'fp32'}")
    elif "--grad-reduce-in-bf16" in a.values:
        a.refuse("--grad-reduce-in-bf16", "bf16 gradients without `--bf16`", "add `--bf16`")
    if "--fp8-recipe" in a.values or "--fp8-format" in a.values:
        flags += ["--fp8-format", "--fp8-recipe"]
        recipe = {("hybrid", "tensorwise"): "fp8_tensorwise", ("e4m3", "mxfp8"): "mxfp8"}.get(
            (a.get("--fp8-format"), a.get("--fp8-recipe")))
        if recipe is None:
            a.refuse("--fp8-recipe" if "--fp8-recipe" in a.values else "--fp8-format",
                     f"fp8 format {a.get('--fp8-format')} with recipe {a.get('--fp8-recipe')}",
                     "use `--fp8-format hybrid --fp8-recipe tensorwise` or `--fp8-format e4m3 --fp8-recipe mxfp8`")
        else:
            parts.append(f"matmul = {recipe}")
        if "--first-last-layers-bf16" in a.values:
            layers = a.get("--num-layers", 1)
            start, end = a.get("--num-layers-at-start-in-bf16", 1), a.get("--num-layers-at-end-in-bf16", 1)
            src = a.src("--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16")
            blocks = [f"precision blocks.{b} matmul = bf16{src}" for b in [*range(start), *range(layers - end, layers)]]
    return ([f"precision {{ {', '.join(parts)} }}{a.src(*flags)}"] if parts else []) + blocks


def _zero(a: _Args) -> int:
    if "--use-megatron-fsdp" in a.values:
        a.want("--data-parallel-sharding-strategy", ("optim_grads", "optim_grads_params"),
               "meshllm's ZeRO 2 / 3 (ZeRO 1 is `--use-distributed-optimizer` alone)")
        a.want("--ckpt-format", ("fsdp_dtensor",), "Megatron-FSDP saves fsdp_dtensor checkpoints only")
        return 3 if a.get("--data-parallel-sharding-strategy", "optim_grads_params") == "optim_grads_params" else 2
    # --ckpt-format alone is how checkpoints are saved, nothing of the plan
    if "--data-parallel-sharding-strategy" in a.values:
        a.refuse("--data-parallel-sharding-strategy", "`--data-parallel-sharding-strategy` without `--use-megatron-fsdp`",
                 "add `--use-megatron-fsdp` or drop it")
    return 1 if "--use-distributed-optimizer" in a.values else 0


_TITAN_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


def titan_spec_text(args: list[str], hf_config: str) -> str:
    """The .mesh text of the torchtitan 0.3 run `args` (`--module M --config C`, the `--section.key`
    overrides `--to torchtitan` writes, the activation-checkpoint subcommand); the model is
    `hf_config`'s config.json, torchtitan's being Python code in the config function, not flags."""
    from meshllm_dsl.interop.import_hf import _num, model_settings, read_config
    from meshllm_dsl.interop.torchtitan import KEYS, SCHEDULES, SUBCOMMANDS

    a = _Args(args, KEYS, "torchtitan", tuple(SUBCOMMANDS))
    where = str(Path(hf_config) / "config.json")
    family, settings, _ = model_settings(read_config(Path(hf_config)), where)
    if family not in ("llama", "qwen3_moe", "deepseek_v3"):
        a.error(None, f"{where} is a `{family}` model: torchtitan's llama3 / qwen3 are `llama` family models "
                "(qwen3 with per-head q / k norms), its qwen3 MoE the `qwen3_moe` family and its deepseek_v3 the "
                "`deepseek_v3` family", "another family", "give the config of the model the run trains")
    values = {k: v for k, v, _ in settings}
    P = "--parallelism."
    rep, shard = a.get(P + "data_parallel_replicate_degree", 1), a.get(P + "data_parallel_shard_degree", 1)
    tp, cp = a.get(P + "tensor_parallel_degree", 1), a.get(P + "context_parallel_degree", 1)
    pp, ep = a.get(P + "pipeline_parallel_degree", 1), a.get(P + "expert_parallel_degree", 1)
    if ep > 1 and family == "deepseek_v3" and tp > 1:
        # EP borrows the tensor ranks, so the routed experts are whole over TP while torchtitan splits the
        # shared experts there; meshllm adds the two only in one layout (E0402)
        a.refuse(P + "expert_parallel_degree", "expert parallelism beside tensor parallelism for DeepSeek-V3: "
                 "torchtitan keeps the routed experts whole over TP and splits the shared experts", "drop one of them")
    if ep > 1 and family not in ("qwen3_moe", "deepseek_v3"):
        a.refuse(P + "expert_parallel_degree", f"expert parallelism for a `{family}` model (no experts)", "drop it")
    if ep > 1 and shard % ep:
        # torchtitan's EP may borrow context and tensor ranks too; meshllm's import splits the FSDP ranks only
        a.refuse(P + "expert_parallel_degree", f"`{P}expert_parallel_degree {ep}` does not divide "
                 f"`{P}data_parallel_shard_degree {shard}`", "meshc imports EP over the FSDP (dp_shard) ranks")
    expert = ep if ep > 1 and not shard % ep else 1
    # torchtitan's mesh: pp, dp_replicate, dp_shard, cp, tp (tp fastest); FSDP shards over dp_shard x cp,
    # EP borrows the fastest FSDP ranks (dp_shard = data x expert here)
    axes = [("pipeline", pp, P + "pipeline_parallel_degree"), ("rep", rep, P + "data_parallel_replicate_degree"),
            ("data", shard // expert, P + "data_parallel_shard_degree"),
            ("expert", expert, P + "expert_parallel_degree"), ("cp", cp, P + "context_parallel_degree"),
            ("tensor", tp, P + "tensor_parallel_degree")]
    axes = [x for x in axes if x[1] > 1] or [("data", 1, None)]
    names = [n for n, _, _ in axes]
    batch_axes = [n for n in names if n in ("rep", "data", "expert")]
    zero_axes = [n for n in names if n in ("data", "expert", "cp")]
    dp = rep * shard

    T = "--training."
    gbs, local = a.get(T + "global_batch_size"), a.get(T + "local_batch_size")
    seq = a.get(T + "seq_len")
    for need, value in ((T + "global_batch_size", gbs), (T + "local_batch_size", local), (T + "seq_len", seq)):
        if value is None:
            a.error(None, f"`{need}` is missing", "missing", f"add `{need} N`")
    gbs, local = gbs or dp, local or 1
    if pp > 1:  # torchtitan splits the local batch into pipeline microbatches
        mb = a.get(P + "pipeline_parallel_microbatch_size", 1)
        micro, micro_src = local // mb, (T + "local_batch_size", P + "pipeline_parallel_microbatch_size")
        if local % mb or gbs != local * dp:
            a.refuse(P + "pipeline_parallel_microbatch_size", f"local batch {local} over microbatches of {mb} with "
                     f"global batch {gbs} and {dp} data ranks", "make local = global / data ranks, a multiple of it")
    else:  # gradient accumulation
        micro, micro_src = gbs // (local * dp), (T + "local_batch_size", T + "global_batch_size")
        if gbs % (local * dp):
            a.refuse(T + "global_batch_size", f"global batch {gbs} is not local batch {local} x {dp} data ranks x "
                     "accumulation steps", "make it a multiple")
    plan = [f"batch = {gbs}{a.src(T + 'global_batch_size')}", f"seq = {seq}{a.src(T + 'seq_len')}",
            f"microbatches = {max(micro, 1)}{a.src(*micro_src)}"]
    layout = [f"batch -> {' * '.join(batch_axes)}"] if batch_axes else []
    sp = tp > 1 and P + "no-enable_sequence_parallel" not in a.values  # torchtitan's default: on
    seq_axes = (["tensor"] if sp else []) + (["cp"] if cp > 1 else [])
    if seq_axes:
        layout.append(f"seq -> {' * '.join(seq_axes)}")
    if expert > 1:
        layout.append("experts -> expert")
    if layout:
        plan.append(f"layout {{ {', '.join(layout)} }}{a.src(P + 'no-enable_sequence_parallel', P + 'context_parallel_degree', P + 'expert_parallel_degree')}")
    if tp > 1:
        src = a.src(P + "tensor_parallel_degree")
        # torchtitan's qwen3 MoE: the router whole; the experts split by ffn over TP like a dense MLP, or
        # whole under EP (which borrows the tensor ranks)
        if family == "deepseek_v3":  # torchtitan's deepseek_v3 sharding.py: Megatron's plan for the latents
            plan += [f"shard {x}{src}" for x in _LAYERED_SHARDS["deepseek_v3"]]
        else:
            plan += [f"shard {x}(tensor){src}" for x in _SHARDS["llama"] if expert == 1 or ".mlp." not in x]
        if family != "llama":
            plan.append(f"shard blocks.*.mlp.router replicate{src}")
    if pp > 1:
        plan += _titan_stages(a, pp, values.get("layers", 1), {v: k for k, v in SCHEDULES.items()})
    # torchtitan 0.3's language models always attend within the documents its dataloader packs, with
    # positions restarting at each (export's W1203): the plan says so.
    plan += ["pack = documents  # torchtitan masks attention at document boundaries", "positions = restart"]
    balancer = a.get(P + "context_parallel_load_balancer", "headtail")
    a.want(P + "context_parallel_load_balancer", ("headtail", "ptrr"), "meshllm's context balances torchtitan has")
    if balancer == "ptrr" and cp > 1:  # without context ranks torchtitan builds no balancer
        plan.append(f"context_balance = ptrr{a.src(P + 'context_parallel_load_balancer')}")
    region = SUBCOMMANDS.get(a.subcommand or "activation-checkpoint:none", "none")
    if region != "none":
        plan.append(f"recompute = {region}{a.src(a.subcommand or '')}")
    if "--compile.enable" in a.values:
        a.want("--compile.components", ("model",), "meshllm compiles the model's blocks")
        plan.append(f"compile = blocks{a.src('--compile.enable', '--compile.components')}")
    master = _TITAN_DTYPES.get(a.get(T + "dtype", "float32"))
    params = _TITAN_DTYPES.get(a.get(T + "mixed_precision_param", "bfloat16"))
    for flag, got in ((T + "dtype", master), (T + "mixed_precision_param", params)):
        if got is None:
            a.want(flag, tuple(_TITAN_DTYPES), "meshllm's torchtitan dtypes")
    # torchtitan 0.3 always installs FSDP2's MixedPrecisionPolicy (fully_shard over a shard degree of 1
    # too): it computes in mixed_precision_param and keeps the weights in training.dtype
    master, params = master or "fp32", params or "bf16"
    if master != params:
        plan.append(f"precision {{ params = {params}, master = {master}, reduce = fp32 }}"
                    f"{a.src(T + 'dtype', T + 'mixed_precision_param')}")
    opt = []
    if zero_axes:
        policy = a.get(P + "fsdp_reshard_after_forward", "default")
        a.want(P + "fsdp_reshard_after_forward", ("always", "never", "default"), "torchtitan's reshard policies")
        zero = 3 if policy == "always" or (policy == "default" and pp == 1) else 2
        opt = [f"    zero {zero} over {' * '.join(zero_axes)}{a.src(P + 'fsdp_reshard_after_forward', P + 'data_parallel_shard_degree')}"]
    plan += ["optimizer adamw {", *opt, "}"]
    if a.errors:
        raise SpecError(a.errors)
    model = [f"{k} = {_num(v)}  # from config.json {src}" for k, v, src in settings if k != "dtype"]
    mesh = f"mesh {TITAN_MESH} {{\n    axes {', '.join(f'{n} = {s}' for n, s, _ in axes)}{a.src(*[f for _, _, f in axes if f])}\n}}\n"
    return (f"# Imported from a torchtitan argument line by `meshc import-torchtitan`: {shlex.join(args)}\n"
            f"{mesh}\nmodel {MODEL} = {family} {{\n" + "\n".join(f"    {x}" for x in model)
            + f"\n    dtype = {params}{a.src(T + 'mixed_precision_param')}\n}}\n\nplan {PLAN} on {TITAN_MESH} for {MODEL} {{\n"
            + "\n".join(f"    {x}" for x in plan) + "\n}\n")


def _titan_stages(a: _Args, pp: int, layers: int, schedules: dict[str, str]) -> list[str]:
    """torchtitan's stages: `layers_per_stage` blocks each, the first / last fewer by their `less_layers`."""
    P = "--parallelism."
    sched = a.get(P + "pipeline_parallel_schedule", "1F1B")
    if sched not in schedules:
        a.refuse(P + "pipeline_parallel_schedule", f"schedule `{sched}` is not one meshllm runs",
                 f"use one of {', '.join(schedules)}")
        return []
    per = a.get(P + "pipeline_parallel_layers_per_stage")
    first, last = a.get(P + "pipeline_parallel_first_stage_less_layers", 1), a.get(P + "pipeline_parallel_last_stage_less_layers", 1)
    if per is None:
        a.error(None, f"`{P}pipeline_parallel_layers_per_stage` is missing: meshc imports explicit stages", "missing",
                f"add `{P}pipeline_parallel_layers_per_stage N`")
        return []
    total = layers + first + last
    n = total // per
    if total % per or n % pp or first >= per or last >= per:
        a.refuse(P + "pipeline_parallel_layers_per_stage", f"{layers} blocks (+{first} first, +{last} last) do not "
                 f"make stages of {per} for {pp} ranks", "give a layers per stage that divides them")
        return []
    counts = [per] * n
    counts[0] -= first
    counts[-1] -= last
    virtual = n // pp
    src = a.src(P + "pipeline_parallel_degree", P + "pipeline_parallel_layers_per_stage",
                P + "pipeline_parallel_first_stage_less_layers", P + "pipeline_parallel_last_stage_less_layers")
    out = [f"stages over pipeline{f' virtual {virtual}' if virtual > 1 else ''} {{{src}"]
    start = 0
    for i, c in enumerate(counts):
        items = (["embed"] if i == 0 else []) + ([f"blocks[{start}:{start + c}]"] if c else [])
        items += ["norm", "lm_head"] if i == n - 1 else []
        out.append(f"    {i}: {', '.join(items)}")
        start += c
    return [*out, "}", f"schedule {schedules[sched]}{a.src(P + 'pipeline_parallel_schedule')}"]


def cmd_import_torchtitan(args: argparse.Namespace) -> int:
    return _write(args, lambda engine_args: titan_spec_text(engine_args, args.hf_config), "torchtitan")


def cmd_import_megatron(args: argparse.Namespace) -> int:
    from meshllm_dsl.cli.main import UsageError

    if args.devices is not None and args.devices < 1:
        raise UsageError(f"--devices must be a positive integer, got {args.devices}")
    return _write(args, lambda engine_args: spec_text(engine_args, args.devices, args.hf_config), "Megatron")


def _write(args: argparse.Namespace, make: Callable[[list[str]], str], engine: str) -> int:
    """Write the .mesh `make` gives for the arguments after `--`, once the checker accepts it: 1 with
    the located errors (E1207, or the checker's own on lines naming the arguments) otherwise."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.cli.main import UsageError
    from meshllm_dsl.families.config_fields import ConfigError, ImportError_
    from meshllm_dsl.runtime.outputs import check_new_file, write_output

    engine_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    if not engine_args:
        raise UsageError(f"give the {engine} arguments after `--`")
    if args.hf_config is not None and not Path(args.hf_config).is_dir():
        raise UsageError(f"no such directory: {args.hf_config}")
    out = Path(args.output)
    check_new_file(out, ".mesh file", args.force)
    try:
        text = make(engine_args)
    except SpecError as err:
        print(render_all(err.diagnostics), end="", file=sys.stderr)
        return 1
    except (ImportError_, ConfigError) as err:  # config.json unreadable, or a model meshllm cannot honour
        print(f"meshc: error: {err}", file=sys.stderr)
        return 1
    result = check_text(text, str(out))
    if not result.ok:  # the checker's own diagnostics, on lines that name the argument they came from
        print(render_all(result.diagnostics), end="", file=sys.stderr)
        return 1
    write_output(out, text.encode())
    print(f"wrote {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("import-megatron", help="a .mesh spec (mesh, model, plan `train`) from a Megatron-LM argument line")
    p.add_argument("-o", "--output", required=True, metavar="FILE.mesh")
    p.add_argument("--force", action="store_true", help="replace FILE.mesh if it exists")
    p.add_argument("--devices", type=int, help="devices of the run (default: tensor x pipeline x context, one replica)")
    p.add_argument("--hf-config", metavar="DIR", help="a Hugging Face model directory: the model from its config.json "
                   "(the shape flags must agree with it), not from the flags")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="pretrain_gpt.py's arguments, after `--`")
    p.set_defaults(func=cmd_import_megatron)
    t = sub.add_parser("import-torchtitan", help="a .mesh spec (mesh, model, plan `train`) from a torchtitan 0.3 "
                       "argument line and the model's Hugging Face config")
    t.add_argument("-o", "--output", required=True, metavar="FILE.mesh")
    t.add_argument("--force", action="store_true", help="replace FILE.mesh if it exists")
    t.add_argument("--hf-config", required=True, metavar="DIR",
                   help="the Hugging Face model directory of the model trained (torchtitan's model is in its config "
                        "function, not in the flags)")
    t.add_argument("args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                   help="torchtitan.train's arguments (--module, --config, overrides, subcommand), after `--`")
    t.set_defaults(func=cmd_import_torchtitan)
