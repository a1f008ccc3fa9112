"""Where recovery gets a step's chunks: the checkpoint tiers behind one interface (no torch).

A tier is a :class:`ChunkSource`: its ``name`` (the key of its bytes in the recovery report, and
each :class:`Fetch`'s ``source``) and ``serve(rank, index)``, the fetch that gets main chunk
``index`` (of the manifest's items) to ``rank`` from this tier, or None when the tier holds no
copy of it. :func:`~megatron_autohet.checkpoint.recovery_plan.assign_sources` builds the tiers
for one round and asks them in order, for every chunk every rank needs; the first that serves it
does. The three, cheapest first:

``OwnDiskSource``      a copy (main file or replica) on the rank's own disk
``PeerSource``         a surviving rank whose disk holds a copy: the one :data:`PeerPreference`
                       ranks first (on a fleet across zones, :class:`RankPlaces`: the same
                       zone's peers, then the region's, then the others'), then the one with the
                       fewest bytes assigned so far (spreading the sends), then the lowest rank
``ObjectStoreSource``  the step committed in the object store: each chunk downloaded ONCE (per
                       zone, on a fleet across zones), by the lowest rank needing it, which
                       forwards it to the others like a peer; so the store serves exactly the
                       chunks no surviving disk holds

They only plan (pure, and computed identically on every rank). The reading is recovery's
(checkpoint/recovery.py): it reads its own disk, runs the exchange with the peers and reads the
object store through a :class:`StoreReader`, which turns every failure of the store
(:class:`StoreError`) and every chunk that fails its checksum into a message: recovery never
handles a store's own errors. Its listing of the committed steps is tried again for a stated time
(:func:`reach_delays`, :data:`S3_REACH_S`) before the store counts as unreachable.

The object-store tier itself is built by one factory, checkpoint/options.py's ``object_store``
(the checkpointer, the elastic worker and ``autohet checkpoint`` build it there); today it is S3
(checkpoint/s3_store.py).

A new object store is one module: a class moving bytes as
:class:`~megatron_autohet.checkpoint.s3_store.S3Store` does (``get_bytes``, ``get_range``,
``steps_holding``, ``list_steps``, ``list_files``, ``put_bytes``, ``put_bytes_if_absent``,
``upload_file``, ``delete_step``, ``location.uri``) and raising a :class:`StoreError` subclass,
registered by the branch of options.py's ``object_store`` that builds it; upload
(checkpoint/upload.py), recovery (through :class:`StoreReader`) and ``autohet checkpoint`` use it
unchanged. A new order among the peers is a :data:`PeerPreference` given to
:class:`PeerSource` (the zones' is :meth:`RankPlaces.distance`, which ``assign_sources`` gives
it on a fleet across zones). A new kind of source, read in a way recovery does not know yet,
implements :class:`ChunkSource` here, takes its place in ``assign_sources``' list of tiers, and
needs its reading in recovery's ``_fetch_round``.

Zones: a byte received from a peer in another zone crossed the zone link and is billed at its
egress price (spec/cluster.py ``links``); recovery counts those bytes and dollars
(:meth:`RankPlaces.egress_usd_per_gb`). A chunk only the object store holds is downloaded once
per zone and forwarded inside it, not across: downloads from a bucket in the fleet's region are
not billed by the providers (AWS, Google Cloud), transfers between zones are. The bucket's own
region is not known here, so its downloads are counted at no egress.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from megatron_autohet.checkpoint.inspect import committed_s3, item_problem
from megatron_autohet.checkpoint.manifest import MANIFEST_FILE, ItemRecord, Manifest, step_dir_name
from megatron_autohet.spec.cluster import Cluster

# The tiers' names: keys of RecoveryReport.bytes and values of Fetch.source.
OWN, PEER, S3 = "own", "peer", "s3"


@dataclass(frozen=True)
class Fetch:
    """How rank ``rank`` gets main chunk ``index`` (of ``manifest.items``): read ``copy`` (a
    record of the main file or of a replica file) from its own disk, receive it from ``peer``
    (who reads ``copy`` from its disk), or download it from the object store (``copy`` is then
    the main record; with ``peer`` set, ``peer`` downloads it once for its node and sends it
    on)."""

    rank: int
    index: int
    source: str                       # OWN, PEER or S3
    copy: ItemRecord
    peer: int | None = None


# main chunk index -> (rank, copy) for each copy of it on a surviving disk, ranks ascending
Holders = dict[int, list[tuple[int, ItemRecord]]]


class ChunkSource(Protocol):
    """One tier as recovery plans from it (module docstring)."""

    name: str

    def serve(self, rank: int, index: int) -> Fetch | None:
        """How this tier gets chunk ``index`` to ``rank``; None: it cannot."""


@dataclass
class OwnDiskSource:
    """A copy on the rank's own disk: the first one it holds (the main file before replicas)."""

    holders: Holders
    name: ClassVar[str] = OWN

    def serve(self, rank: int, index: int) -> Fetch | None:
        own = [copy for holder, copy in self.holders[index] if holder == rank]
        return Fetch(rank, index, OWN, own[0]) if own else None


# How much receiver ``rank`` prefers peer ``peer`` (smaller first), before the bytes assigned
# (RankPlaces.distance on a fleet across zones; else every peer is alike).
PeerPreference = Callable[[int, int], object]


def no_preference(rank: int, peer: int) -> int:
    return 0


def one_place(rank: int) -> None:
    """Every rank in one place: the object store's chunks downloaded once for the job."""
    return None


SAME_ZONE, SAME_REGION, OTHER_REGION = 0, 1, 2     # RankPlaces.distance


@dataclass(frozen=True)
class RankPlaces:
    """Where the ranks of a recovery are on a fleet across zones: ``nodes[rank]`` the node of
    each rank, a node of ``cluster`` (whose zones and links price what crosses them)."""

    cluster: Cluster
    nodes: tuple[str, ...]

    def zone(self, rank: int) -> str | None:
        return self.cluster.node(self.nodes[rank]).zone

    def distance(self, rank: int, peer: int) -> int:
        """The :data:`PeerPreference` of the zones: SAME_ZONE, SAME_REGION or OTHER_REGION."""
        a, b = self.zone(rank), self.zone(peer)
        if a == b:
            return SAME_ZONE
        regions = self.cluster.regions
        return SAME_REGION if regions[a] == regions[b] else OTHER_REGION

    def egress_usd_per_gb(self, rank: int, peer: int) -> float:
        """What a GB from ``peer`` to ``rank`` is billed (0 inside a zone)."""
        return self.cluster.link(self.nodes[peer], self.nodes[rank]).egress_usd_per_gb


@dataclass
class PeerSource:
    """A copy on a surviving peer's disk: the peer ``preference`` ranks first, then the one with
    the fewest bytes assigned so far in this round, then the lowest rank."""

    holders: Holders
    preference: PeerPreference = no_preference
    name: ClassVar[str] = PEER
    sent: dict[int, int] = field(default_factory=dict)     # peer -> bytes assigned to send

    def serve(self, rank: int, index: int) -> Fetch | None:
        offers = [(holder, copy) for holder, copy in self.holders[index] if holder != rank]
        if not offers:
            return None
        peer, copy = min(offers, key=lambda hc: (self.preference(rank, hc[0]),
                                                 self.sent.get(hc[0], 0), hc[0]))
        self.sent[peer] = self.sent.get(peer, 0) + copy.length
        return Fetch(rank, index, PEER, copy, peer)


@dataclass
class ObjectStoreSource:
    """The main record from the object store, when the step is committed there (``committed``):
    downloaded by the first (lowest) rank asking for the chunk in its place (``place_of``: its
    zone on a fleet across zones, where a transfer between zones is billed and a download is
    not; module doc), which forwards it to the others there."""

    items: list[ItemRecord]
    committed: bool
    place_of: Callable[[int], object] = one_place
    name: ClassVar[str] = S3
    # (chunk index, place) -> the rank downloading it
    downloader: dict[tuple[int, object], int] = field(default_factory=dict)

    def serve(self, rank: int, index: int) -> Fetch | None:
        if not self.committed:
            return None
        first = self.downloader.setdefault((index, self.place_of(rank)), rank)
        return Fetch(rank, index, S3, self.items[index], None if first == rank else first)


# ---- the object store at run time --------------------------------------------------------------

# How long a resume keeps trying to list an unreachable object store, in seconds of waits between
# attempts (each attempt is itself bounded by the store client's timeouts and retries): then the
# job stops, unless told to go on without it (checkpoint/recovery.py). The environment variable
# (internal: tests) gives another total.
S3_REACH_S = 60.0
S3_REACH_ENV = "AUTOHET_S3_REACH_S"


def reach_delays(total: float | None = None) -> list[float]:
    """The waits between attempts at listing the store: 1, 2, 4, 8 s, then 15 s apart, the last
    cut so that they add up to ``total`` (default :data:`S3_REACH_S`, or the environment's
    :data:`S3_REACH_ENV`); none for 0."""
    if total is None:
        total = float(os.environ.get(S3_REACH_ENV, S3_REACH_S))
    delays: list[float] = []
    while sum(delays) < total:
        delays.append(min(2.0 ** len(delays), 15.0, total - sum(delays)))
    return delays


# Attempts at each read of a step before recovery gives the step up (falls back to an older one).
FILE_ATTEMPTS = 3


class StoreError(RuntimeError):
    """An object store's operation failed (S3: s3_store.S3Error); the message names the
    operation, the address and the store's reason, never credentials."""

    @property
    def permanent(self) -> bool:
        """The store cannot work at all (no such bucket, credentials refused), as opposed to
        an outage that trying again may outlast."""
        return False


@dataclass
class StoreReader:
    """The object-store tier as recovery reads it: what the store cannot give comes back as a
    message (``str``), never as the store's exception, except where noted."""

    store: object          # an S3Store (module docstring: what a store provides)
    attempts: int = FILE_ATTEMPTS       # of each read of recovery (:meth:`_retried`)
    sleep: Callable[[float], object] = time.sleep

    def uri(self, relative: str = "") -> str:
        return self.store.location.uri(relative)

    def committed_steps(self, log, *, sleep=time.sleep) -> set[int] | str:
        """Steps with a manifest in the store (a listing: no manifest is downloaded), or, when
        the store cannot be reached, how it was tried and the last failure's message: the
        listing is tried again after each of :func:`reach_delays` (said once with ``log`` at the
        first failure), as a store down for a minute must not make a resume miss the steps it
        holds; a permanent failure (no such bucket, credentials refused) is not tried again."""
        delays = reach_delays()
        for attempt in range(len(delays) + 1):
            try:
                return set(committed_s3(self.store))
            except StoreError as err:
                if err.permanent:
                    return f"not tried again, as waiting cannot mend it: {err}"
                if attempt == len(delays):
                    return f"tried for {sum(delays):g} s: {err}"
                if attempt == 0:
                    log(f"WARNING: the S3 tier {self.uri()} is unreachable ({err}); trying "
                        f"again for up to {sum(delays):g} s ({len(delays)} more attempts)")
                sleep(delays[attempt])
        raise AssertionError("unreachable: the last attempt returns")

    def manifest(self, iteration: int) -> Manifest | str:
        """The manifest of a step committed in the store, or why it cannot be had or read."""
        key = f"{step_dir_name(iteration)}/{MANIFEST_FILE}"
        raw = self._retried(lambda: self.store.get_bytes(key))
        if isinstance(raw, str):
            return raw
        if not raw:
            return f"{self.uri(key)} is gone since the listing"
        try:
            return Manifest.from_json(raw, self.uri(key))
        except ValueError as err:
            return str(err)

    def files(self, iteration: int, names) -> dict[str, bytes | None] | str:
        """Whole files of a step (None: absent), unchecked; or why the store did not give them.
        Every rank reads them at once: the caller agrees on the outcome before any rank falls
        back to an older step."""
        files = {}
        for name in names:
            raw = self._retried(lambda: self.store.get_bytes(f"{step_dir_name(iteration)}/{name}"))
            if isinstance(raw, str):
                return raw
            files[name] = raw
        return files

    def _retried(self, request):
        """``request()``, tried again after a StoreError (1, 2 s apart: :data:`FILE_ATTEMPTS` in
        all, each with the client's own retries inside); the last failure's message."""
        for attempt in range(self.attempts):
            try:
                return request()
            except StoreError as err:
                if attempt == self.attempts - 1:
                    return str(err)
                self.sleep(2.0 ** attempt)
        raise AssertionError("unreachable: the last attempt returns")

    def chunk(self, iteration: int, record: ItemRecord) -> bytes | str:
        """Chunk ``record`` of a step (one ranged GET), checked against its checksum; or why
        not (the store failed, or the bytes do not match)."""
        key = f"{step_dir_name(iteration)}/{record.file}"
        raw = self._retried(lambda: self.store.get_range(key, record.offset, record.length))
        if isinstance(raw, str):
            return raw
        if item_problem(record, raw) is not None:
            return (f"{self.uri(key)}: bytes {record.offset}-{record.offset + record.length} "
                    f"({record.key}) do not match their checksum in the manifest")
        return raw
