"""Tiny random Hugging Face models, built offline, and .mesh specs that describe them.

Weights are redrawn away from HF's init (norm weights away from 1, biases away from 0, attention
peaked): HF's init hides convention errors such as swapped norms, dropped biases or a wrong GELU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 64
# Llama with each rope scaling transformers computes (runtime/model/rope.py); dynamic's 6 positions are
# fewer than the tests' 8 tokens, so its frequencies grow with the sequence.
ROPE_KINDS = ("llama_linear", "llama_dynamic", "llama_yarn")
KINDS = ("llama", "llama3_tied", "mistral", "qwen2", "gpt2", "qwen3", "phi3")
# Phi-3's longrope (phi3_longrope): one factor per rotary frequency (head_dim 16 / 2), short ones up to
# 6 positions, long ones (far apart from the short) beyond.
LONGROPE_ORIGINAL = 6
LONGROPE_SHORT = (1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6)
LONGROPE_LONG = (1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0)


def _config(kind: str) -> Any:
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=64, rms_norm_eps=1e-6)
    rope = {"llama_linear": ({"rope_type": "linear", "factor": 2.0}, 128),
            "llama_dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 6),
            "llama_yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192)}
    if kind in rope:
        params, positions = rope[kind]
        return tf.LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=positions,
                              rope_parameters={"rope_theta": 10000.0, **params})
    if kind == "llama":  # GQA, untied head
        return tf.LlamaConfig(**common, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama3_tied":  # tied head and llama3 rope scaling
        return tf.LlamaConfig(
            **common, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            rope_theta=500000.0,
        )
    if kind == "mistral":
        return tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False)
    if kind == "qwen2":  # q, k, v biases
        return tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False)
    if kind == "qwen3":  # q / k RMSNorm per head; head_dim 16, not hidden / heads
        return tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    if kind == "mistral_window":  # a sliding window of 3, shorter than the tests' sequences
        return tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=3, tie_word_embeddings=False)
    if kind == "gemma2":  # window 3 on blocks 0 and 2; caps small enough to bite; scale 1/sqrt(24)
        return tf.Gemma2Config(**common, num_key_value_heads=2, head_dim=16, sliding_window=3,
                               query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                               max_position_embeddings=64)
    if kind == "gemma3":  # block 2 global (pattern 3), rope bases 1e6 global / 1e4 local, q / k norms
        return tf.Gemma3TextConfig(**common, num_key_value_heads=2, head_dim=16, sliding_window=3,
                                   sliding_window_pattern=3, query_pre_attn_scalar=24, max_position_embeddings=64)
    if kind == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint; no end token in the vocab
        return tf.Phi3Config(**common, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=None,
                             bos_token_id=None, eos_token_id=None)
    if kind == "phi3_longrope":  # longrope: short factors within 6 positions, long ones beyond; head_dim 16
        return tf.Phi3Config(**{**common, "hidden_size": 64}, num_key_value_heads=2, tie_word_embeddings=False,
                             pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=24,
                             original_max_position_embeddings=LONGROPE_ORIGINAL,
                             rope_scaling={"type": "longrope", "short_factor": list(LONGROPE_SHORT),
                                           "long_factor": list(LONGROPE_LONG)})
    if kind == "phi3_window":  # Phi-3 attends within sliding_window exactly as Mistral does
        return tf.Phi3Config(**common, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=None,
                             bos_token_id=None, eos_token_id=None, sliding_window=3)
    if kind == "olmo2":  # norms after the sublayers, q / k norms over the whole projection; no end token
        return tf.Olmo2Config(**common, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=None,
                              bos_token_id=None, eos_token_id=None)
    if kind == "gpt2":  # odd vocab
        return tf.GPT2Config(vocab_size=67, n_embd=32, n_layer=4, n_head=4, n_positions=32,
                             bos_token_id=0, eos_token_id=0)
    raise ValueError(kind)


def build_hf(kind: str, directory: Path, seed: int = 0, redraw: bool = True) -> Any:
    """Save a tiny random ``kind`` model (redrawn weights, float32) to ``directory``; return it.

    ``redraw=False`` keeps HF's own init (norms one, biases zero), which is what catches eps errors.
    """
    import torch
    import transformers as tf

    cfg = _config(kind)
    cls = {"gpt2": tf.GPT2LMHeadModel, "mistral": tf.MistralForCausalLM, "mistral_window": tf.MistralForCausalLM,
           "gemma2": tf.Gemma2ForCausalLM, "gemma3": tf.Gemma3ForCausalLM,
           "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "phi3": tf.Phi3ForCausalLM, "phi3_window": tf.Phi3ForCausalLM,
           "phi3_longrope": tf.Phi3ForCausalLM,
           "olmo2": tf.Olmo2ForCausalLM}.get(kind, tf.LlamaForCausalLM)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    if not redraw:
        model.save_pretrained(directory)
        return model
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            elif "wpe" in name:
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.25 * noise)  # larger than HF's 0.02: peaked attention, big activations
    model.save_pretrained(directory)
    return model


SPEC_MODELS = {
    "llama": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
             " norm_eps = 1e-6, dtype = fp32 }",
    "llama3_tied": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
                   " norm_eps = 1e-6, rope_theta = 500000.0, tie_embeddings = true, rope_factor = 8.0,"
                   " rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0, rope_original_positions = 16,"
                   " dtype = fp32 }",
    "llama_linear": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
                    " norm_eps = 1e-6, rope_type = linear, rope_factor = 2.0, dtype = fp32 }",
    "llama_dynamic": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
                     " norm_eps = 1e-6, rope_type = dynamic, rope_factor = 2.0, rope_original_positions = 6,"
                     " dtype = fp32 }",
    "llama_yarn": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
                  " norm_eps = 1e-6, rope_type = yarn, rope_factor = 4.0, rope_original_positions = 2048,"
                  " dtype = fp32 }",
    # OLMo 2's q / k norm over the whole projection in a Llama block (the olmo2 family has it with norms
    # after the sublayers); split by heads, its sum of squares is all-reduced over the tensor axis.
    "llama_qk_full": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
                     " norm_eps = 1e-6, qk_norm = full, dtype = fp32 }",
    "mistral": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
               " norm_eps = 1e-6, dtype = fp32 }",
    "qwen2": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
             " norm_eps = 1e-6, attn_bias = true, attn_out_bias = false, dtype = fp32 }",
    "qwen3": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, head_dim = 16,"
             " ffn = 64, norm_eps = 1e-6, qk_norm = head, dtype = fp32 }",
    "mistral_window": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
                      " norm_eps = 1e-6, window = 3, dtype = fp32 }",
    "gemma2": "model m = gemma2 { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, head_dim = 16,"
              " ffn = 64, window = 3, query_pre_attn_scalar = 24, attn_softcap = 5.0, final_softcap = 10.0,"
              " dtype = fp32 }",
    "gemma3": "model m = gemma3 { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, head_dim = 16,"
              " ffn = 64, window = 3, global_every = 3, query_pre_attn_scalar = 24, dtype = fp32 }",
    "olmo2": "model m = olmo2 { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
             " norm_eps = 1e-6, rope_theta = 10000.0, dtype = fp32 }",
    "phi3": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
            " norm_eps = 1e-6, dtype = fp32 }",
    # factor 24 / 6 = max_position_embeddings / original_max_position_embeddings, as transformers computes it
    "phi3_longrope": "model m = llama { vocab = 64, hidden = 64, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
                     " norm_eps = 1e-6, rope_type = longrope, rope_factor = 4.0,"
                     f" rope_original_positions = {LONGROPE_ORIGINAL},"
                     f" rope_short_factor = [{', '.join(map(str, LONGROPE_SHORT))}],"
                     f" rope_long_factor = [{', '.join(map(str, LONGROPE_LONG))}], dtype = fp32 }}",
    "phi3_window": "model m = llama { vocab = 64, hidden = 32, layers = 4, heads = 4, kv_heads = 2, ffn = 64,"
                   " norm_eps = 1e-6, window = 3, dtype = fp32 }",
    "gpt2": "model m = gpt2 { vocab = 67, hidden = 32, layers = 4, heads = 4, positions = 32 }",
    # 67 rows padded to 68 so the tensor axis splits the vocabulary; row 67 is masked
    "gpt2_padded": "model m = gpt2 { vocab = 68, vocab_used = 67, hidden = 32, layers = 4, heads = 4,"
                   " positions = 32 }",
}

_TP = "heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor"

PLANS = {  # mesh axes, layout entries, other plan lines
    "single": ("one = 1", "", ""),
    "tensor2": ("tensor = 2", _TP, ""),
    "pipeline2_tensor2": ("pipeline = 2, tensor = 2", _TP, "    microbatches = 2\n    stages over pipeline balanced\n"),
    "data2_tensor2": ("data = 2, tensor = 2", _TP + ", batch -> data", ""),
    # ZeRO-3: FSDP2 shards the loaded tensor-parallel slices over data; export gathers them back.
    "data2_tensor2_zero3": ("data = 2, tensor = 2", _TP + ", batch -> data", "    optimizer adamw { zero 3 }\n"),
}


def spec(kind: str, plan: str) -> str:
    axes, layout, rest = PLANS[plan]
    if kind == "gpt2_padded" and layout:
        layout = layout.replace("kv_heads -> tensor, ", "")
    elif kind == "gpt2" and layout:
        # fused qkv has no separate kv heads; 67 rows do not split over 2
        layout = layout.replace("kv_heads -> tensor, ", "").replace(", vocab -> tensor", "")
        if "tensor" in layout:
            rest += "    shard embed replicate\n    shard lm_head replicate\n"
    body = (f"    layout {{ {layout} }}\n" if layout else "") + rest
    return f"mesh m {{ axes {axes} }}\n{SPEC_MODELS[kind]}\nplan p on m for m {{\n    batch = 4\n    seq = 8\n{body}}}\n"


def compiled_module(text: str, name: str, directory: Path) -> tuple[str, int]:
    """Check `text` (one plan), write its generated module to `directory`/`name`.py; return the
    module's path and the plan's device count."""
    from meshllm_dsl.checker import check_text
    from meshllm_dsl.codegen.emit import render_plan

    result = check_text(text, f"{name}.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    (p,) = result.plans.values()
    path = directory / f"{name}.py"
    path.write_text(render_plan(p, f"{name}.mesh", text))
    return str(path), p.mesh.devices


def logits_job(ctx: Any, path: str, weights: str, tokens: Any, n_new: int = 0) -> Any:
    """On every rank: build the generated plan from ``weights``; full logits (and greedy tokens)."""
    from meshllm_dsl.runtime import greedy_generate
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), weights=weights)
    logits = built.forward(tokens)
    generated = greedy_generate(built, tokens[:1], n_new) if n_new else None
    return (logits, generated) if ctx.rank == 0 else None


def export_job(ctx: Any, path: str, weights: str, out: str, max_shard_bytes: int) -> None:
    """On every rank: load ``weights`` into the plan and export it again (--steps 0)."""
    from meshllm_dsl.runtime.hf.weights import export_hf
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), weights=weights)
    export_hf(built, out, source=weights, max_shard_bytes=max_shard_bytes)


def own_config_export_job(ctx: Any, path: str, weights: str, out: str) -> None:
    """On every rank: load ``weights`` and export with meshllm's own config.json (no source given)."""
    from meshllm_dsl.runtime.hf.weights import export_hf
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    export_hf(program.build(ctx.mesh(program.axes), weights=weights), out)


def error_job(ctx: Any, path: str, weights: str) -> str:
    """On every rank: the WeightsError that loading ``weights`` raises (or '' if it loads)."""
    from meshllm_dsl.runtime.hf.weights import WeightsError
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    try:
        program.build(ctx.mesh(program.axes), weights=weights)
    except WeightsError as err:
        return str(err)
    return ""


def bytes_read_job(ctx: Any, path: str, weights: str) -> int:
    """On every rank: bytes of checkpoint tensors this rank read while loading."""
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    return int(program.build(ctx.mesh(program.axes), weights=weights).weights_bytes_read)


def seeded_export_job(ctx: Any, path: str, out: str, tokens: Any) -> Any:
    """On every rank: the seeded (random) plan's logits, exported without a source directory."""
    from meshllm_dsl.runtime.hf.weights import export_hf
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    built = program.build(ctx.mesh(program.axes), seed=3)
    logits = built.forward(tokens)
    export_hf(built, out)
    return logits if ctx.rank == 0 else None


def reference_job(ctx: Any, path: str) -> dict[str, float]:
    """On every rank: max |sharded - unsharded reference| over 2 AdamW steps (float64)."""
    import torch

    from meshllm_dsl.runtime.jobs.compare import compare_to_reference
    from meshllm_dsl.verify.equivalence import load_generated

    program = load_generated(path).PROGRAM
    return compare_to_reference(program, ctx.mesh(program.axes), dtype=torch.float64, seed=0, steps=2)


def word_tokenizer(directory: Path, words: list[str]) -> Any:
    """A Hugging Face word-level tokenizer over ``words`` (plus <unk> and <eos>), trained offline and
    saved in ``directory`` with the end-of-text token named in tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tok
