"""How the planner writes numbers and tables: byte sizes in binary units, counts, seconds, and
aligned text columns (`meshc plan`, `meshc suggest`, `meshc explain`)."""

from __future__ import annotations

GB, GIB = 10**9, 2**30


def fmt_bytes(n: float) -> str:
    """Binary units, the way device memory is quoted (80 GB on the box is 80 GiB to torch)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    if s > 0:
        return f"{s * 1e6:.0f} us"
    return "0"


def table_text(header: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    """Rows of cells in aligned columns, the header first; `right`: the columns aligned right (by
    default all but the first)."""
    right = right if right is not None else set(range(1, len(header)))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), *(line(r) for r in rows)]
