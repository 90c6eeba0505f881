"""`meshc lsp`: a Language Server Protocol server for .mesh files.

`analysis` answers every question (diagnostics, symbols, hover, definition, references, completion,
code actions, formatting) from the front end's own results, without pygls; `server` wires it to
LSP over stdio with pygls. Only `server` needs the optional `[lsp]` extra, and nothing here imports
torch: the server must start fast and stay small.
"""

from __future__ import annotations


def main() -> int:
    try:
        from meshllm_dsl.lsp.server import serve
    except ModuleNotFoundError as err:
        if err.name not in ("pygls", "lsprotocol"):
            raise
        import sys

        print('meshc lsp needs the [lsp] extra: pip install "meshllm[lsp]"', file=sys.stderr)
        return 2
    serve()
    return 0
