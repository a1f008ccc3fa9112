"""Which saved chunks a rank of a new plan needs: pure functions (no torch).

A rank of the NEW plan asks for regions of global tensors (its shards: key, global offsets and
sizes) and for serialized objects (by key). :func:`needed_items` intersects them with the chunks
the manifest lists: exactly the chunks DCP will read for it, whatever layout saved them, and so
exactly the bytes that must be verified (and, when this rank's disk lacks them, fetched).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_autohet.checkpoint.manifest import ItemRecord


@dataclass(frozen=True)
class Wanted:
    key: str
    offsets: tuple[int, ...] | None          # None: a serialized object, matched by key
    sizes: tuple[int, ...] | None


def _overlaps(item: ItemRecord, want: Wanted) -> bool:
    if item.offsets is None or want.offsets is None:
        return item.offsets is None and want.offsets is None
    if len(item.offsets) != len(want.offsets):
        return False
    return all(io < wo + ws and wo < io + is_
               for io, is_, wo, ws in zip(item.offsets, item.sizes, want.offsets, want.sizes))


def needed_items(items: list[ItemRecord], wanted: list[Wanted]) -> list[ItemRecord]:
    """The chunks overlapping any wanted region (objects: same key), in manifest order."""
    by_key: dict[str, list[Wanted]] = {}
    for want in wanted:
        by_key.setdefault(want.key, []).append(want)
    return [item for item in items
            if any(_overlaps(item, want) for want in by_key.get(item.key, ()))]
