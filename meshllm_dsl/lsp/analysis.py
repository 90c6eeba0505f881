"""One open document as the language server keeps it: the document and its symbol index
(document.py) with the features that read them, hover (hover.py) and quick fixes (actions.py).

The features import the document, never this module, so the document sits below them and this
module above both; the document's names are imported back here for the callers that know them
from this module.
"""

from __future__ import annotations

from meshllm_dsl.diagnostics import Diagnostic
from meshllm_dsl.front.source import Span
from meshllm_dsl.lsp import actions, hover
from meshllm_dsl.lsp.document import (
    DECL_KEYWORDS,
    Document,
    Fix,
    LineIndex,
    Loc,
    Occ,
    SymbolIndex,
    leaf_paths,
    shard_matches,
    span_loc,
)


class Analysis(Document):
    """A document (`meshc check`'s diagnostics and its symbol index) with the features an editor asks of it."""

    def hover(self, offset: int) -> tuple[str, Span] | None:
        return hover.hover(self, offset)

    def fixes(self, d: Diagnostic) -> list[Fix]:
        return actions.fixes(self, d)


__all__ = ["DECL_KEYWORDS", "Analysis", "Fix", "LineIndex", "Loc", "Occ",
           "SymbolIndex", "leaf_paths", "shard_matches", "span_loc"]
