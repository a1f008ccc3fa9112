"""Which saved chunks a rank of a new plan needs: pure functions (no torch).

A rank of the NEW plan asks for regions of global tensors (its shards: key, global offsets and
sizes) and for serialized objects (by key). :func:`needed_items` intersects them with the chunks
the manifest lists: exactly the chunks DCP will read for it, whatever layout saved them, and so
exactly the bytes that must be verified (and, when this rank's disk lacks them, fetched).
:func:`uncovered`: the wanted regions no chunk holds (a step that cannot serve this rank).

:func:`assign_sources` then says who serves each needed chunk to each rank, asking the tiers of
checkpoint/sources.py in order (own disk, peers, object store); :func:`copies_of`: the records
holding each main chunk's bytes (main file, replicas). On a fleet across zones
:func:`zone_traffic` says what a round's fetches send inside zones and across them, and what
crossing them costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_autohet.checkpoint.manifest import ItemRecord
from megatron_autohet.checkpoint.sources import (ChunkSource, Fetch, Holders, ObjectStoreSource,
                                                 OwnDiskSource, PeerSource, RankPlaces)


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


def uncovered(items: list[ItemRecord], wanted: list[Wanted]) -> list[Wanted]:
    """The wanted regions the chunks do not cover entirely (objects: no chunk of that key). The
    main chunks of a step are disjoint, so a region is covered when the volumes of its
    intersections with them add up to its own."""
    by_key: dict[str, list[ItemRecord]] = {}
    for item in items:
        by_key.setdefault(item.key, []).append(item)
    out = []
    for want in wanted:
        found = [item for item in by_key.get(want.key, ()) if _overlaps(item, want)]
        if want.offsets is None:
            covered = bool(found)
        else:
            volume = 0
            for item in found:
                part = 1
                for io, is_, wo, ws in zip(item.offsets, item.sizes, want.offsets, want.sizes):
                    part *= min(io + is_, wo + ws) - max(io, wo)
                volume += part
            covered = volume == math.prod(want.sizes)
        if not covered:
            out.append(want)
    return out


# ---- where each needed chunk comes from --------------------------------------------------------

class ChunkUnavailable(RuntimeError):
    """A needed chunk is on no surviving disk and there is no S3 copy."""


def copies_of(items: list[ItemRecord], replicas: list[ItemRecord]) -> list[list[ItemRecord]]:
    """For each main chunk, the records that hold its bytes: the main record first, then the
    replicas (usable in its place only with the same byte length: DCP reads ``length`` bytes at
    the main record's offset)."""
    by_region = {item.region: [item] for item in items}
    for replica in replicas:
        main = by_region.get(replica.region)
        if main is not None and replica.length == main[0].length:
            main.append(replica)
    return [by_region[item.region] for item in items]


def assign_sources(items: list[ItemRecord], replicas: list[ItemRecord],
                   needed: dict[int, list[int]], present: dict[int, set[str]],
                   s3_available: bool, places: RankPlaces | None = None) -> list[Fetch]:
    """Every rank's fetches, computed identically on every rank.

    ``needed``: rank -> indices of the main chunks it needs; ``present``: rank -> the files of
    the step its own disk holds (verified sizes); ``s3_available``: the step is committed in the
    object store. Each chunk comes from the first tier that has it (checkpoint/sources.py),
    cheapest first: a copy on the rank's own disk; else a peer holding a copy (on a fleet
    across zones, ``places``: one in the same zone first, then in the same region; then the one
    with the fewest bytes assigned so far, spreading the sends); else S3, downloaded ONCE per
    chunk (per zone, with ``places``) by the lowest rank needing it, which then serves the
    others like a peer - so S3 serves exactly the chunks no surviving disk holds.
    """
    copies = copies_of(items, replicas)
    holders: Holders = {}
    for index in sorted({i for wanted in needed.values() for i in wanted}):
        holders[index] = [(rank, copy) for rank in sorted(present)
                          for copy in copies[index] if copy.file in present[rank]]
    peers = PeerSource(holders, places.distance) if places else PeerSource(holders)
    store = ObjectStoreSource(items, s3_available, places.zone) if places else ObjectStoreSource(
        items, s3_available)
    tiers: list[ChunkSource] = [OwnDiskSource(holders), peers, store]
    fetches = []
    for rank in sorted(needed):
        for index in needed[rank]:
            # the first tier that serves it (a later one is not asked: serving books bytes)
            fetch = next((f for tier in tiers if (f := tier.serve(rank, index)) is not None),
                         None)
            if fetch is None:
                item = items[index]
                where = "" if item.offsets is None else f" at {item.offsets}"
                raise ChunkUnavailable(
                    f"so chunk {item.key}{where} (file {item.file}) is on no surviving node's "
                    "disk, and no S3 copy of the step is configured")
            fetches.append(fetch)
    return fetches


@dataclass(frozen=True)
class ZoneTraffic:
    """The peer-to-peer bytes of a recovery on a fleet across zones, job-wide: sent inside a
    zone, sent across zones, and the egress USD of the latter (own-disk reads cross nothing, and
    the object store's downloads are not billed: checkpoint/sources.py, "Zones")."""

    same_zone_bytes: int = 0
    other_zone_bytes: int = 0
    egress_usd: float = 0.0

    def __add__(self, other: ZoneTraffic) -> ZoneTraffic:
        return replace(self, same_zone_bytes=self.same_zone_bytes + other.same_zone_bytes,
                       other_zone_bytes=self.other_zone_bytes + other.other_zone_bytes,
                       egress_usd=self.egress_usd + other.egress_usd)


def zone_traffic(fetches: list[Fetch], places: RankPlaces) -> ZoneTraffic:
    """What ``fetches`` send from rank to rank (a peer's copy, or a chunk a peer downloaded and
    forwards), inside zones and across them, at each crossed link's egress price per GB (1e9
    bytes, as the cost model counts them)."""
    same = other = 0
    usd = 0.0
    for f in fetches:
        if f.peer is None:
            continue
        if places.zone(f.rank) == places.zone(f.peer):
            same += f.copy.length
        else:
            other += f.copy.length
            usd += f.copy.length / 1e9 * places.egress_usd_per_gb(f.rank, f.peer)
    return ZoneTraffic(same, other, usd)
