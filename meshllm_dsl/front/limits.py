"""The ranges every number and name in a spec must lie in, so that nothing downstream (the checker,
the planner, `explain`, generated code, the runtime) meets a value it cannot handle.

The bounds are far above any real model or cluster, and small enough that the front end stays fast:
everything it does is linear in the text, or in a declared size bounded here.
"""

from __future__ import annotations

# Integer literals: more digits than this is not a size anyone means (and Python refuses to convert
# integers of more than 4,300 digits at all).
MAX_INT_DIGITS = 18
# Any integer a spec computes (dims, sizes, counts): the largest tensor dim torch indexes comfortably.
MAX_INT = 2**40
# Devices in one mesh (the product of its axis sizes), above the largest clusters built (about 100,000
# GPUs): `explain` lists every rank (2**17 ranks: a few seconds, 200 MB) and process groups enumerate them.
MAX_DEVICES = 2**17
# Blocks in one `repeat`: the checker, stage maps and generated code hold a record per block.
MAX_BLOCKS = 100_000
# Operators nested in one expression (`1 + 1 + ...`, `- - - 1`): the AST is walked recursively.
MAX_EXPR_DEPTH = 100
# Characters in a name: names become file names (`PLAN.py`) and Python identifiers.
MAX_NAME = 64
