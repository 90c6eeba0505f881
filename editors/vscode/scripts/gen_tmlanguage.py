"""Generate syntaxes/mesh.tmLanguage.json from grammar/mesh.lark, so highlighting cannot drift.

The keywords are every quoted word of the Lark grammar; the built-in names (rules, schedules,
primitives, activations, dtypes) come from the front end's own tables. Run it after changing the
grammar: `python editors/vscode/scripts/gen_tmlanguage.py` (tests/lsp/test_textmate.py fails while
the committed file is stale).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
OUT = HERE.parent / "syntaxes" / "mesh.tmLanguage.json"

# Words that open a declaration and are followed by its name.
DECLARATIONS = ("mesh", "model", "family", "plan", "device")


def lark_keywords(text: str) -> list[str]:
    """Every word the grammar spells in quotes (`"shard"`), in first-seen order."""
    text = re.sub(r"//[^\n]*", "", text)
    return list(dict.fromkeys(re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)"', text)))


def _alt(words: list[str] | tuple[str, ...]) -> str:
    # longest first, so `interleaved_1f1b` is not read as `1f1b`-less prefix of something else
    return "|".join(sorted(set(words), key=lambda w: (-len(w), w)))


def build(lark_text: str) -> dict:
    from meshllm_dsl.front.resolve import PRIMITIVES
    from meshllm_dsl.ir import DTYPES, RULES, SCHEDULES
    from meshllm_dsl.primitives.mlp import ACTIVATIONS

    keywords = lark_keywords(lark_text)
    other = [k for k in keywords if k not in DECLARATIONS and k != "include"]
    word = r"[A-Za-z_][A-Za-z0-9_]*"
    patterns = [
        {"name": "comment.line.number-sign.mesh", "match": r"#.*$"},
        {"name": "string.quoted.double.mesh", "match": r'"[^"\n\\]*"?'},
        {"match": r"\b(include)\b", "captures": {"1": {"name": "keyword.control.import.mesh"}}},
        {"match": rf"\b({_alt(DECLARATIONS)})\b(?:\s+({word}))?",
         "captures": {"1": {"name": "storage.type.mesh"}, "2": {"name": "entity.name.type.mesh"}}},
        # A schedule's name may start with a digit (`1f1b`), so a misspelt one (`1f1f`) is still a
        # name there, as the grammar's SCHEDULE_NAME reads it, not an invalid number.
        {"match": rf"\b(schedule)\s+({_alt(SCHEDULES)})\b",
         "captures": {"1": {"name": "keyword.other.mesh"}, "2": {"name": "constant.language.schedule.mesh"}}},
        {"match": r"\b(schedule)\s+([A-Za-z0-9_]+)",
         "captures": {"1": {"name": "keyword.other.mesh"}, "2": {"name": "variable.other.mesh"}}},
        {"name": "keyword.other.mesh", "match": rf"\b({_alt(other)})\b"},
        {"name": "support.function.rule.mesh", "match": rf"\b({_alt(RULES)}|cross_entropy)\b"},
        {"name": "support.function.primitive.mesh", "match": rf"\b({_alt(list(PRIMITIVES))})\b(?=\s*\()"},
        {"name": "constant.language.schedule.mesh", "match": rf"(?<![A-Za-z0-9_])({_alt(SCHEDULES)})\b"},
        {"name": "constant.language.mesh", "match": rf"\b({_alt([*DTYPES, *ACTIVATIONS, 'true', 'false'])})\b"},
        {"name": "constant.numeric.float.mesh", "match": r"\b[0-9]+\.[0-9]+(?:[eE][-+]?[0-9]+)?\b|\b[0-9]+[eE][-+]?[0-9]+\b"},
        {"name": "constant.numeric.integer.mesh", "match": r"\b[0-9][0-9_]*\b"},
        {"name": "variable.other.mesh", "match": word},
        {"name": "keyword.operator.arrow.mesh", "match": r"->"},
        {"name": "keyword.operator.mesh", "match": r"[=*/+\-]"},
        {"name": "punctuation.separator.mesh", "match": r"[,.:]"},
        {"name": "punctuation.section.block.mesh", "match": r"[{}]"},
        {"name": "punctuation.section.parens.mesh", "match": r"[()\[\]]"},
        {"name": "invalid.illegal.mesh", "match": r"[^\s]"},
    ]
    return {
        "$schema": "https://raw.githubusercontent.com/martinring/tmlanguage/master/tmlanguage.json",
        "name": "Mesh",
        "scopeName": "source.mesh",
        "fileTypes": ["mesh"],
        "comment": "Generated from grammar/mesh.lark by editors/vscode/scripts/gen_tmlanguage.py; do not edit.",
        "patterns": patterns,
    }


def render() -> str:
    lark_text = (ROOT / "grammar" / "mesh.lark").read_text()
    return json.dumps(build(lark_text), indent=2) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        return 0 if OUT.exists() and OUT.read_text() == text else 1
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
