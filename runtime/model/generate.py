"""Greedy generation with a KV cache sharded over the tensor axis (see ``layers.DecodeSession``)."""

from __future__ import annotations

import torch
from torch import Tensor

from meshllm_dsl.runtime.model import rope
from meshllm_dsl.runtime.model.layers import DecodeSession
from meshllm_dsl.runtime.parallel import context

__all__ = ["greedy_generate"]


@torch.no_grad()
def greedy_generate(built: object, prompt: Tensor, n_new: int) -> Tensor:
    """Append ``n_new`` greedily chosen tokens to ``prompt`` [b, s]; the result is on every rank.

    Every rank of the mesh passes the same prompt.  Data-parallel replicas all decode the whole
    batch (inference has no gradients to average).  Stages run in order; activations move between
    pipeline ranks with point-to-point send / recv.
    """
    from meshllm_dsl.runtime.train.program import Built

    assert isinstance(built, Built)
    for m in built.modules.values():
        m.eval()
    session = DecodeSession()
    tokens = prompt.to(built.device)
    step_in = tokens  # the whole prompt first (prefill), then one token at a time
    # Context parallelism: a prompt that splits into the balanced chunks is prefilled split over the
    # context axes (each rank's caches then hold every rank's keys and values); else whole on each.
    cp = built.context
    split = cp is not None and cp.group is not None and tokens.shape[1] % (2 * cp.size) == 0
    reset = rope.cache_reset_length(built.program.model)
    for i in range(n_new):
        if reset is not None and session.offset <= reset < tokens.shape[1]:
            # longrope: the cached keys were rotated with the short factors; rerun the whole
            # sequence with the long ones, once, as transformers' Phi-3 does
            session, step_in = DecodeSession(), tokens
        if i == 0 and split:
            assert cp is not None
            with session.step(step_in.shape[1]), context.split_prefill():
                local = built.run_stages(cp.local(step_in))
            # [b, s / n, vocab / t] per context rank -> [b, s, vocab / t] in position order.
            local = None if local is None else cp.unshard(local)
        else:
            with session.step(step_in.shape[1]):
                local = built.run_stages(step_in)
        last = None if local is None else local[:, -1:]
        logits = built.gather_logits(last, (step_in.shape[0], 1))  # [b, 1, vocab] on every rank
        step_in = logits[:, -1].argmax(dim=-1, keepdim=True)  # [b, 1]
        tokens = torch.cat([tokens, step_in], dim=1)
    for m in built.modules.values():
        m.train()
    return tokens
