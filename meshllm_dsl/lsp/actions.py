"""Quick fixes: each diagnostic's `suggestions` (edits with an applicability, made where the
diagnostic is) as an editor's code actions. Nothing here reads the help text, so rewording a help
never loses its fix, and a fix is exactly what the checker proposed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshllm_dsl.diagnostics import Applicability, Diagnostic
from meshllm_dsl.lsp.document import Fix, span_loc

if TYPE_CHECKING:
    from meshllm_dsl.lsp.document import Document


def fixes(a: Document, d: Diagnostic) -> list[Fix]:
    return [Fix(s.message, tuple((span_loc(e.span), e.text) for e in s.edits),
                preferred=s.applicability is Applicability.MACHINE_APPLICABLE)
            for s in d.suggestions if s.edits]
