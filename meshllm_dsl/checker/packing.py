"""How a plan's rows hold documents: the plan settings `pack = documents` and `positions = restart`.

`pack = documents`: each row of a batch holds several documents and a token attends only to the
earlier tokens of its own document (block-causal attention, as Llama 3 trains; runtime/model/
documents.py); `positions = restart`: rotary (and learned) positions restart at 0 at each document.
`context_balance = headtail | per_document | ptrr`: how a packed row's tokens spread over the context
ranks (runtime/parallel/context_layout.py); anything but head-tail needs documents to balance by
and context ranks to spread over.
The generated program carries them (``Program.document_mask`` / ``restart_positions`` /
``context_balance``): the data path packs by them and `meshc verify` compares on packed batches.
What the runtime does not carry through yet is refused here: a capacity factor drops (token, expert)
pairs by the whole forward's token order, which each document run alone (what `meshc verify`
compares with) does not reproduce. Router losses are over the forward's tokens in both
(runtime/jobs/compare.py gathers the documents' routing per layer); compiled blocks take each
microbatch's rows as graph inputs (runtime/model/documents.py ``active``).
"""

from __future__ import annotations

from meshllm_dsl import primitives
from meshllm_dsl.checker.context import PlanContext
from meshllm_dsl.codes import E0203, E0309
from meshllm_dsl.front import ast
from meshllm_dsl.front.names import or_list
from meshllm_dsl.ir import CONTEXT_BALANCES, PACKS, POSITIONS, Repeat


class PackingRules(PlanContext):
    def _choice(self, given: ast.Setting | None, key: str, choices: tuple[str, ...], what: str) -> str:
        """The value of `key = NAME` among ``choices``; the first (the default) when absent or wrong."""
        if given is None:
            return choices[0]
        v = given.value
        if not isinstance(v, ast.Name) or v.value not in choices:
            self.error(E0203, f"unknown `{key}` value", v.span, label=f"not {what}",
                       help=f"use {or_list([f'`{c}`' for c in choices])}")
            return choices[0]
        return v.value

    def packing(self, settings: dict[str, ast.Setting]) -> tuple[bool, bool]:
        """(document_mask, restart_positions) of `pack = none | documents` and `positions = continue | restart`."""
        pack = self._choice(settings.get("pack"), "pack", PACKS,
                            "a packing: `documents` masks attention at document boundaries")
        positions = self._choice(settings.get("positions"), "positions", POSITIONS,
                                 "a way of numbering positions: `restart` starts each document at 0")
        masked, restart = pack == "documents", positions == "restart"
        if restart and not masked and "pack" not in self.bad_settings:
            given = settings["positions"]
            self.error(E0309, "`positions = restart` without `pack = documents`", given.value.span,
                       label="positions restart at documents only a document mask keeps apart",
                       help="add `pack = documents` to the plan (or drop `positions = restart`)")
            restart = False
        capped = [u.name for item in self.model.items
                  for u in (item.body if isinstance(item, Repeat) else (item,))
                  if primitives.of(u).routes_experts and u.attr("capacity")]
        if masked and capped:
            self.error(E0309, "`pack = documents` with a capacity factor is not supported yet",
                       settings["pack"].value.span, label=f"`{capped[0]}` drops pairs by the whole forward's token order",
                       help="drop `capacity` from the model (or `pack = documents`): `meshc verify` compares packed rows "
                            "with each document alone, whose pairs a capacity would drop differently")
            masked = restart = False
        return masked, restart

    def context_balance(self, settings: dict[str, ast.Setting], masked: bool, context_axes: tuple[str, ...]) -> str:
        """`context_balance = headtail | per_document | ptrr`; head-tail (the default) when absent,
        wrong, or without the documents and context ranks a balance by documents needs."""
        given = settings.get("context_balance")
        balance = self._choice(given, "context_balance", CONTEXT_BALANCES,
                               "a context balance: `per_document` or `ptrr` spread packed rows by their documents")
        if given is None or balance == "headtail":
            return balance
        if not context_axes:
            self.error(E0309, f"`context_balance = {balance}` without context parallelism", given.value.span,
                       label="no context axes to spread the rows over",
                       help="split the sequence over a context axis (`layout { seq -> AXIS }`), or drop `context_balance`")
            return "headtail"
        if not masked and "pack" not in self.bad_settings:
            self.error(E0309, f"`context_balance = {balance}` without `pack = documents`", given.value.span,
                       label="balances by documents, which only a document mask keeps apart",
                       help="add `pack = documents` to the plan: without it head-tail already evens causal attention")
            return "headtail"
        return balance if masked else "headtail"
