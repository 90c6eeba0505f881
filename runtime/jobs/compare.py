"""A built program against the unsharded reference: the one comparison every equivalence check uses.

``meshc verify``, the property suite, the integration tests and the runtime's own tests all ask the
same question (does this plan compute what the unsharded model computes?), so they share this code:
same batches, same reference optimizer, same treatment of float32 rounding noise.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from meshllm_dsl.runtime.model import description
from meshllm_dsl.runtime.model.layers import cross_entropy
from meshllm_dsl.runtime.model.reference import build_reference
from meshllm_dsl.runtime.moe.routing import RouterLosses, balance, balanced_routers, recording
from meshllm_dsl.runtime.parallel.mesh import Mesh
from meshllm_dsl.runtime.train.program import Program, adamw_kwargs, lr_at

__all__ = ["NOISE_GRAD", "TOLERANCE", "compare_to_reference", "reference_batches"]

# Agreement expected between the sharded and the unsharded model: rounding, nothing more.
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
NOISE_GRAD = 1e-6  # float32 gradients below this are rounding noise for AdamW (see below)


def reference_batches(vocab: int, batch: int, seq: int, steps: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """Deterministic (tokens, targets) pairs, identical on every rank."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [
        (torch.randint(0, vocab, (batch, seq), generator=gen), torch.randint(0, vocab, (batch, seq), generator=gen))
        for _ in range(steps)
    ]


def _forwards(program: Program, mesh: Mesh, train: bool) -> int:
    """Into how many forwards (consecutive groups of sequences) the plan splits a batch, where that
    changes a moe model's result (a capacity factor, router losses: per forward's tokens): one per
    data-parallel rank, and in training one per microbatch of each."""
    moes = description.moe_layers(program.model)
    if not any(s.get("capacity") or s.get("aux_loss_coef") or s.get("z_loss_coef") for s in moes):
        return 1
    dp = mesh.size(*program.batch_axes) if program.batch_axes else 1
    return dp * (program.microbatches if train else 1)


def _reference_logits(ref: torch.nn.Module, tokens: Tensor, program: Program, mesh: Mesh) -> Tensor:
    return torch.cat([ref(tok) for tok in tokens.chunk(_forwards(program, mesh, train=False))])


def _reference_loss(ref: torch.nn.Module, tokens: Tensor, targets: Tensor, program: Program, mesh: Mesh) -> Tensor:
    """The unsharded model's training loss: the mean token cross-entropy, plus a moe model's router
    losses over the tokens of each forward the plan runs (one microbatch of one data-parallel rank:
    the batch in data ranks x microbatches consecutive groups), averaged like the cross-entropy."""
    losses = RouterLosses.of(program.model)
    groups = _forwards(program, mesh, train=True)
    if groups == 1 and losses is None:
        return cross_entropy(ref(tokens), targets)
    total = torch.zeros((), dtype=program.dtype)
    for tok, tgt in zip(tokens.chunk(groups), targets.chunk(groups)):
        with recording() as routing:
            logits = ref(tok)
        total = total + cross_entropy(logits, tgt) + (losses(routing, tok.shape[0]) if losses is not None else 0.0)
    return total / groups


def compare_to_reference(
    program: Program, mesh: Mesh, *, dtype: torch.dtype | None = None, seed: int = 0, steps: int = 1
) -> dict[str, float]:
    """Max |sharded - unsharded| per quantity, on this rank, after `steps` AdamW steps.

    Keys: ``logits`` (before training), ``loss@K`` for every step, ``grad_norm@K`` with a ``clip``
    setting, ``grad NAME`` for every parameter at step 0 (gathered to full shape, after clipping),
    ``param NAME`` for every parameter after the last step, ``buffer NAME`` for every sigmoid
    router's correction bias this rank holds after the last step (moved toward balance after each
    step where the layer sets `balance_rate`). Must be called on every rank of ``mesh``.
    """
    if dtype is not None:
        # Every dtype of a mixed-precision plan too, so its FSDP2 MixedPrecisionPolicy path runs
        # (casts, reduction dtype) while the comparison stays exact.
        # Float8 matmuls round by design and torch.compile reorders float sums: an exact comparison
        # checks the sharding with both off (tests/runtime/test_float8.py bounds float8's drift).
        program = dataclasses.replace(
            program,
            dtype=dtype,
            param_dtype=dtype if program.param_dtype is not None else None,
            reduce_dtype=dtype if program.reduce_dtype is not None else None,
            float8={},
            float8_gather=False,
            compile="none",
        )
    built = program.build(mesh, seed=seed)
    ref = build_reference(dict(program.model), program.dtype, seed=seed)
    ref_params = dict(ref.named_parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), **adamw_kwargs(program.optimizer))
    ref_routers = balanced_routers([ref])
    batches = reference_batches(program.vocab, program.batch, program.seq, steps, seed)
    errs: dict[str, float] = {}
    with torch.no_grad():
        errs["logits"] = (built.forward(batches[0][0]) - _reference_logits(ref, batches[0][0], program, mesh)).abs().max().item()
    smallest_grad = {name: torch.full_like(p, torch.inf) for name, p in ref_params.items()}
    for step, (tokens, targets) in enumerate(batches):
        loss = built.train_step(tokens, targets)
        ref_opt.zero_grad()
        ref_loss = _reference_loss(ref, tokens, targets, program, mesh)
        ref_loss.backward()
        errs[f"loss@{step}"] = abs(loss - ref_loss.item())
        if "clip" in program.optimizer:
            # torch's own clipping on the unsharded model: the norm the sharded run must reproduce.
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float(program.optimizer["clip"]))
            errs[f"grad_norm@{step}"] = abs(built.grad_norm - float(ref_norm))
        if step == 0:
            grads = built.full_grads()
            if set(grads) != set(ref_params):
                raise AssertionError(f"gradient names differ: {sorted(set(grads) ^ set(ref_params))}")
            for name, p in ref_params.items():
                errs[f"grad {name}"] = (grads[name] - p.grad).abs().max().item()
        for name, p in ref_params.items():
            assert p.grad is not None
            smallest_grad[name] = torch.minimum(smallest_grad[name], p.grad.abs())
        for group in ref_opt.param_groups:
            group["lr"] = lr_at(program.optimizer, step)
        ref_opt.step()
        balance(ref_routers, None)
    state = built.full_state_dict()
    if set(state) != set(ref_params):
        raise AssertionError(f"parameter names differ: {sorted(set(state) ^ set(ref_params))}")
    for name, p in ref_params.items():
        diff = (state[name] - p.detach()).abs()
        if program.dtype == torch.float32:
            # AdamW moves each element by about lr * g / (|g| + eps). Where the exact gradient is
            # zero or nearly (e.g. the key bias: softmax ignores a shift of every score), g is
            # float32 rounding noise of order 1e-9, comparable to eps, and the step amplifies it to
            # O(lr) in either implementation; one such step marks the element for good. Elements
            # whose gradient was that small at any step are compared in float64 (noise 1e-17, far
            # below eps), not here. Seen: a gradient of -2.4e-9 vs -2.2e-9 gave 1.6e-5 after AdamW.
            diff = diff[smallest_grad[name] > NOISE_GRAD]
        errs[f"param {name}"] = diff.max().item() if diff.numel() else 0.0
    ref_buffers = dict(ref.named_buffers())
    for name, buf in built.routing_buffers().items():
        errs[f"buffer {name}"] = (buf - ref_buffers[name]).abs().max().item()
    return errs
