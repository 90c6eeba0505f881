"""Training data: sources tokenized into document corpora (corpus.py), packed into rows (packing)."""
