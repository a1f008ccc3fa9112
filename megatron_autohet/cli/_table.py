"""Plain-text tables for the CLI: left-aligned columns, a dashed rule under the header."""

from __future__ import annotations


def format_table(header, rows) -> str:
    header = [str(c) for c in header]
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]

    def line(cells) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])
