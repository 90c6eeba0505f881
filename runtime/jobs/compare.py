"""A built program against the unsharded reference: the one comparison every equivalence check uses.

``meshc verify``, the property suite, the integration tests and the runtime's own tests all ask the
same question (does this plan compute what the unsharded model computes?), so they share this code:
same batches, same reference optimizer, same treatment of float32 rounding noise.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import Tensor

from meshllm_dsl.runtime.data.corpus import IGNORE
from meshllm_dsl.runtime.model import description
from meshllm_dsl.runtime.model.layers import cross_entropy
from meshllm_dsl.runtime.model.reference import build_reference, first_position
from meshllm_dsl.runtime.moe.routing import (
    RouterLog,
    RouterLosses,
    balance,
    balanced_routers,
    recording,
)
from meshllm_dsl.runtime.parallel.mesh import Mesh
from meshllm_dsl.runtime.train.program import Program, adamw_kwargs, lr_at

__all__ = ["NOISE_GRAD", "TOLERANCE", "PackedBatch", "compare_to_reference", "packed_batches", "reference_batches"]

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


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """A batch as runtime/data/corpus.py's ``Batch``: [B, S] each; documents / positions None for plain rows."""

    tokens: Tensor
    targets: Tensor
    documents: Tensor | None = None
    positions: Tensor | None = None


def packed_batches(vocab: int, batch: int, seq: int, steps: int, seed: int, *, documents: bool, restart: bool,
                   ignored: bool = True) -> list[PackedBatch]:
    """Deterministic batches, identical on every rank, with random document boundaries in every row
    (``documents``: up to 3 cuts a row, so some rows hold one document), positions restarting at each
    document (``restart``), and ``ignored``: the target of each document's last token (the next
    document's first: no loss, as a packer leaves it) and about one target in 8 more ``IGNORE``."""
    gen = torch.Generator().manual_seed(seed + 2)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
        targets = torch.randint(0, vocab, (batch, seq), generator=gen)
        docs = pos = None
        if documents:
            starts = torch.zeros(batch, seq, dtype=torch.long)
            for row in range(batch):
                cuts = torch.randperm(seq - 1, generator=gen)[: int(torch.randint(0, 4, (), generator=gen))] + 1
                starts[row, cuts] = 1
            docs = starts.cumsum(1)  # [B, S] 0, 0, 1, 1, 1, 2, ...
            if ignored:
                last = torch.cat([docs[:, 1:] != docs[:, :-1], torch.zeros(batch, 1, dtype=torch.bool)], 1)
                targets = targets.masked_fill(last, IGNORE)
            if restart:
                index = torch.arange(seq).expand(batch, seq)
                first = torch.where(starts.bool() | (index == 0), index, 0).cummax(1).values
                pos = index - first
        if ignored:
            targets = targets.masked_fill(torch.rand(batch, seq, generator=gen) < 0.125, IGNORE)
        out.append(PackedBatch(tokens, targets, docs, pos))
    return out


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


def _each_document_alone(ref: torch.nn.Module, batch: PackedBatch) -> Tensor:
    """Logits [B, S, vocab] of a packed batch with every document of every row run through the
    reference on its own, at the positions it has in the row (from 0 where they restart): what
    the document mask must reproduce."""
    assert batch.documents is not None
    rows = []
    for row in range(batch.tokens.shape[0]):
        docs = batch.documents[row]
        bounds = [0, *(torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1).tolist(), docs.shape[0]]
        parts = []
        for start, end in itertools.pairwise(bounds):
            first = start
            if batch.positions is not None:
                first = int(batch.positions[row, start])
                if not torch.equal(batch.positions[row, start:end], torch.arange(first, first + end - start)):
                    raise ValueError(f"row {row}: positions of tokens {start}..{end - 1} do not count up within their document")
            with first_position(first):
                parts.append(ref(batch.tokens[row : row + 1, start:end]))
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


def _by_layer(log: RouterLog, layers: int) -> RouterLog:
    """The routing of documents run alone one after another (each call ``layers`` entries, layer
    order) as one forward's: each layer's logits and choices over every document, in row order."""
    if len(log.logits) % layers:
        raise ValueError(f"{len(log.logits)} routing records for {layers} moe layers")
    return RouterLog(logits=[torch.cat(log.logits[i::layers]) for i in range(layers)],
                     chosen=[torch.cat(log.chosen[i::layers]) for i in range(layers)])


def _reference_loss(ref: torch.nn.Module, batch: PackedBatch, program: Program, mesh: Mesh) -> Tensor:
    """The unsharded model's training loss: the mean token cross-entropy over the counted targets,
    plus a moe model's router losses over the tokens of each forward the plan runs (one microbatch
    of one data-parallel rank: the batch in data ranks x microbatches consecutive groups), averaged
    over the groups. A packed batch: every document run alone (``_each_document_alone``); its router
    losses are over every token of the group's rows as the plan's forward routes them (each a
    product of sums over the forward's tokens, or per row for the sequence-wise loss)."""
    tokens, targets = batch.tokens, batch.targets
    losses = RouterLosses.of(program.model)
    groups = _forwards(program, mesh, train=True)
    packed = batch.documents is not None
    if packed and any(s.get("capacity") for s in description.moe_layers(program.model)):
        raise ValueError("packed batches compare with each document alone only for models without a capacity "
                         "factor (which drops pairs by the whole forward's token order)")
    if groups == 1 and losses is None:
        return cross_entropy(_each_document_alone(ref, batch) if packed else ref(tokens), targets)
    counted = max(int((targets != IGNORE).sum()), 1)
    total = torch.zeros((), dtype=program.dtype)
    for part in torch.arange(tokens.shape[0]).chunk(groups):  # the rows of each forward, as tokens.chunk splits
        group = PackedBatch(tokens[part], targets[part], None if batch.documents is None else batch.documents[part],
                            None if batch.positions is None else batch.positions[part])
        with recording() as routing:
            logits = _each_document_alone(ref, group) if packed else ref(group.tokens)
        if packed and losses is not None:
            routing = _by_layer(routing, len(description.moe_layers(program.model)))
        # each group's mean weighted by its share of the counted targets: the mean over all of them
        share = int((group.targets != IGNORE).sum()) * groups / counted
        total = total + cross_entropy(logits, group.targets) * share + (
            losses(routing, len(part)) if losses is not None else 0.0)
    return total / groups


def compare_to_reference(
    program: Program, mesh: Mesh, *, dtype: torch.dtype | None = None, seed: int = 0, steps: int = 1,
    ignored: bool = False,
) -> dict[str, float]:
    """Max |sharded - unsharded| per quantity, on this rank, after `steps` AdamW steps.

    Keys: ``logits`` (before training), ``loss@K`` for every step, ``grad_norm@K`` with a ``clip``
    setting, ``grad NAME`` for every parameter at step 0 (gathered to full shape, after clipping),
    ``param NAME`` for every parameter after the last step, ``buffer NAME`` for every sigmoid
    router's correction bias this rank holds after the last step (moved toward balance after each
    step where the layer sets `balance_rate`). Must be called on every rank of ``mesh``.

    A program with ``document_mask`` trains on packed batches (random document boundaries, positions
    restarting where ``restart_positions``, ignored targets) and the reference runs each document
    alone; ``ignored``: plain batches with some targets ``IGNORE``.
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
    packed = bool(getattr(program, "document_mask", False))
    if packed or ignored:
        batches = packed_batches(program.vocab, program.batch, program.seq, steps, seed, documents=packed,
                                 restart=bool(getattr(program, "restart_positions", False)))
    else:
        batches = [PackedBatch(t, y) for t, y in reference_batches(program.vocab, program.batch, program.seq, steps, seed)]
    errs: dict[str, float] = {}
    with torch.no_grad():
        first = batches[0]
        ref_logits = (_each_document_alone(ref, first) if first.documents is not None
                      else _reference_logits(ref, first.tokens, program, mesh))
        errs["logits"] = (built.forward(first.tokens, first.documents, first.positions) - ref_logits).abs().max().item()
    smallest_grad = {name: torch.full_like(p, torch.inf) for name, p in ref_params.items()}
    for step, batch in enumerate(batches):
        loss = built.train_step(batch.tokens, batch.targets, batch.documents, batch.positions)
        ref_opt.zero_grad()
        ref_loss = _reference_loss(ref, batch, program, mesh)
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
