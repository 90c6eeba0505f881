"""Hugging Face checkpoints in and out, with the fused and mixture-of-experts forms (what differs per
family: its pack in meshllm_dsl/families)."""
