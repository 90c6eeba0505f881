"""Hugging Face checkpoints in and out, with the fused, Gemma and mixture-of-experts forms."""
