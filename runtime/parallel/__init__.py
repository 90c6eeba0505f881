"""How tensors are split: the named mesh, tensor-parallel collectives, context parallelism, FSDP2 and
shards."""
