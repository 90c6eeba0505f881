"""Spec text the test suites share (tests/ is on sys.path through tests/conftest.py)."""

# The Megatron tensor-parallel layout of a Llama block over an axis named `tensor`: q, k, v and
# gate, up column-parallel, o and down row-parallel, the embedding and head split over the vocab.
MEGATRON = """
    shard blocks.*.attn.{q,k,v} column(tensor)
    shard blocks.*.attn.o row(tensor)
    shard blocks.*.mlp.{gate,up} column(tensor)
    shard blocks.*.mlp.down row(tensor)
    shard embed vocab_parallel(tensor)
    shard lm_head column(tensor)
"""
