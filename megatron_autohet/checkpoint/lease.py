"""One live writer per checkpoint location: a lease the writing job holds and refreshes (no torch).

Two jobs saving to one place destroy each other's steps: their saves interleave, a manifest ends
up over the other job's files, and a resume loads another run's step without a word. So a job
that saves holds a lease on every location it writes - the ``--save`` directory, each node-local
directory, the S3 prefix - taken before its first save (before the workers start, for
``autohet train``), refreshed every :data:`REFRESH_S` seconds by a heartbeat, released when the
job ends. A second job finds it and is refused in one line naming the live owner.

The lease is a small JSON record, :data:`LEASE_FILE` in the directory or under the prefix:
the owner (one name for the whole job: every process of it, and every agent of an elastic job,
refreshes the same lease), the host, the process that refreshed it last and when. It is free when

* nobody holds it, or the holder is this job (a restart of it, another rank of it);
* its heartbeat is older than its ``stale_s`` (default :data:`DEFAULT_STALE_S`: longer than an
  elastic job's round change, during which nobody refreshes it);
* its holder is known dead: the same host (and boot) and that process gone;
* the user says the owner is dead (``--autohet-take-over-ckpt``).

Taking and refreshing are compare-and-swap where the location can do it: S3 with conditional
writes (``If-None-Match`` to create, ``If-Match`` the ETag read to replace), so of two jobs
taking a free lease at once exactly one wins. A directory has no compare-and-swap: the lease is
created with ``link`` (fails if it exists) and replaced with a rename, then read back; of two
jobs taking over one stale lease in the same instant the loser finds out at its next heartbeat.
A holder that finds another owner in its lease has lost it (:class:`LeaseLost`): its saves stop
committing (checkpoint/checkpointer.py), so a taken-over job cannot replace the new owner's
steps.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_autohet.checkpoint.manifest import fsync_dir
from megatron_autohet.checkpoint.options import object_store
from megatron_autohet.checkpoint.sources import StoreError
from megatron_autohet.errors import ConfigError

LEASE_FILE = "autohet-writer.lease"
# beside it: held while a writer compares and writes the lease (DirectorySlot)
LOCK_FILE = "autohet-writer.lease.lock"
DEFAULT_STALE_S = 120.0
REFRESH_S = 10.0
TAKE_OVER_FLAG = "--autohet-take-over-ckpt"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs here: a zombie does not (a killed job's ranks stay zombies until
    something reaps them, which a container's init may never do)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, and when it last said it was alive."""
    owner: str
    host: str
    boot_id: str
    pid: int
    heartbeat: float          # time.time() of the last refresh
    stale_s: float = DEFAULT_STALE_S

    @classmethod
    def me(cls, owner: str, stale_s: float) -> "Holder":
        return cls(owner=owner, host=socket.gethostname(), boot_id=_boot_id(), pid=os.getpid(),
                   heartbeat=time.time(), stale_s=stale_s)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Holder | None":
        """The record, or None for one that cannot be read (a torn or foreign file: free)."""
        try:
            data = json.loads(raw)
            return cls(owner=str(data["owner"]), host=str(data["host"]),
                       boot_id=str(data.get("boot_id", "")), pid=int(data["pid"]),
                       heartbeat=float(data["heartbeat"]),
                       stale_s=float(data.get("stale_s", DEFAULT_STALE_S)))
        except (ValueError, KeyError, TypeError):
            return None

    def known_dead(self) -> bool:
        """Its process is gone, as this host can tell: same host and boot, no such pid."""
        return (self.host == socket.gethostname() and self.boot_id == _boot_id()
                and not _alive(self.pid))

    def stale(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) - self.heartbeat > self.stale_s

    def describe(self, now: float | None = None) -> str:
        age = max(0.0, (now if now is not None else time.time()) - self.heartbeat)
        return (f"{self.owner} (host {self.host}, pid {self.pid}, last heartbeat {age:.0f} s ago; "
                f"stale after {self.stale_s:.0f} s)")


class LeaseHeld(Exception):
    """Another live job holds the lease of ``where``."""

    def __init__(self, where: str, holder: Holder):
        self.where = where
        self.holder = holder
        super().__init__(f"{where} is being written by a live job: {holder.describe()}")

    def allowed(self) -> str:
        return (f"one writer per checkpoint location: save elsewhere, wait for that job to end "
                f"(or its lease to go stale), or {TAKE_OVER_FLAG} if it is known to be dead")


class LeaseUnwritable(Exception):
    """The lease of ``where`` cannot be written there (a read-only or missing filesystem)."""

    def __init__(self, where: str, reason: str):
        self.where = where
        self.reason = reason
        super().__init__(f"{where}: cannot write its writer lease: {reason}")


class LeaseLost(Exception):
    """This job's lease of ``where`` now names another owner (it was taken over)."""

    def __init__(self, where: str, holder: Holder | None):
        self.where = where
        self.holder = holder
        who = holder.describe() if holder else "another job"
        super().__init__(f"the checkpoint lease of {where} was taken over: it now names {who}")


def rank_owner_name() -> str:
    """A job's owner name drawn by its rank 0 where no launcher named the run (autohet train's
    launcher and an elastic job's run id do): unique to this run, and saying where it ran."""
    return f"job {uuid.uuid4().hex[:8]} on {socket.gethostname()} (rank 0 pid {os.getpid()})"


class LeaseSlot(ABC):
    """Where one lease record lives. ``read`` returns (holder or None, a token for ``replace``);
    ``create``/``replace`` return False when another writer got there first."""

    where: str

    @abstractmethod
    def read(self) -> tuple[Holder | None, object]: ...

    @abstractmethod
    def create(self, holder: Holder) -> bool: ...

    @abstractmethod
    def replace(self, holder: Holder, token: object) -> bool: ...

    @abstractmethod
    def delete(self) -> None: ...


class DirectorySlot(LeaseSlot):
    """:data:`LEASE_FILE` in a checkpoint directory (created if missing); ``flag`` names it.

    A directory has no compare-and-swap: each write compares and renames while holding an
    exclusive ``flock`` of :data:`LOCK_FILE` beside it, which every writer takes. Without it a
    heartbeat that read its own record, then lost the lease to a take-over, would rename its
    record over the new owner's (the fsyncs of staging make that window long on a busy disk),
    and both jobs would go on writing. A file system without locks (some FUSE mounts) gets the
    writes unlocked: the rename alone, as atomic as it can be there."""

    def __init__(self, directory: str | Path, flag: str = "--save"):
        self.directory = Path(directory)
        self.path = self.directory / LEASE_FILE
        self.where = str(self.directory)
        self.flag = flag

    def read(self) -> tuple[Holder | None, object]:
        raw = self._current()
        return (None, None) if raw is None else (Holder.from_json(raw), raw)

    def _staged(self, holder: Holder) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{LEASE_FILE}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(holder.to_json())
            f.flush()
            os.fsync(f.fileno())
        return tmp

    @contextlib.contextmanager
    def _locked(self):
        with open(self.directory / LOCK_FILE, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:         # no locks on this file system (class docstring)
                yield
                return
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _current(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def create(self, holder: Holder) -> bool:
        tmp = self._staged(holder)          # the slow part before the lock
        try:
            with self._locked():
                os.link(tmp, self.path)     # atomic, and fails if a lease exists
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.directory)
        return True

    def replace(self, holder: Holder, token: object) -> bool:
        tmp = self._staged(holder)
        try:
            with self._locked():
                if self._current() != token:
                    return False
                os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.directory)
        return True

    def delete(self) -> None:
        with self._locked():
            self.path.unlink(missing_ok=True)


class ObjectStoreSlot(LeaseSlot):
    """:data:`LEASE_FILE` under an object store's prefix, with conditional writes (S3)."""

    flag = "--autohet-s3-uri"

    def __init__(self, store):
        self.store = store
        self.where = store.location.uri()

    def read(self) -> tuple[Holder | None, object]:
        found = self.store.get_bytes_and_etag(LEASE_FILE)
        if found is None:
            return None, None
        raw, etag = found
        return Holder.from_json(raw), etag

    def create(self, holder: Holder) -> bool:
        return self.store.put_bytes_if_absent(LEASE_FILE, holder.to_json())

    def replace(self, holder: Holder, token: object) -> bool:
        if token is None:
            return self.create(holder)
        return self.store.put_bytes_if_match(LEASE_FILE, holder.to_json(), str(token))

    def delete(self) -> None:
        self.store.delete_key(LEASE_FILE)


class Lease:
    """This job's lease over ``slots``: :meth:`take` (all or none), a heartbeat thread,
    :meth:`release`. ``owner`` names the job; every process of the job passes the same."""

    def __init__(self, slots: list[LeaseSlot], owner: str, *, stale_s: float = DEFAULT_STALE_S,
                 refresh_s: float = REFRESH_S):
        self.slots = slots
        self.owner = owner
        self.stale_s = stale_s
        self.refresh_s = refresh_s
        self.lost: LeaseLost | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, *, take_over: bool = False) -> None:
        """Hold every slot, or none (raises :class:`LeaseHeld` naming the first live owner, after
        giving back what this call created)."""
        created = []
        try:
            for slot in self.slots:
                try:
                    if self._take(slot, take_over):
                        created.append(slot)
                except OSError as err:
                    raise LeaseUnwritable(slot.where, err.strerror or str(err)) from err
        except BaseException:
            for slot in created:
                slot.delete()
            raise

    def _take(self, slot: LeaseSlot, take_over: bool) -> bool:
        for _ in range(5):          # a lost race re-reads: the winner may be dead or ourselves
            holder, token = slot.read()
            mine = Holder.me(self.owner, self.stale_s)
            if holder is None and token is None:
                if slot.create(mine):
                    return True
                continue
            if (holder is not None and holder.owner != self.owner and not take_over
                    and not holder.stale() and not holder.known_dead()):
                raise LeaseHeld(slot.where, holder)
            if slot.replace(mine, token):
                return False
        holder, _ = slot.read()
        raise LeaseHeld(slot.where, holder or Holder.me("another job", self.stale_s))

    def refresh(self) -> None:
        """One heartbeat on every slot; :class:`LeaseLost` when one names another owner."""
        for slot in self.slots:
            holder, token = slot.read()
            if holder is not None and holder.owner != self.owner:
                raise LeaseLost(slot.where, holder)
            # None: another process of this job released it at its end (an elastic job's
            # finished workers); the ones still running hold it again.
            if not slot.replace(Holder.me(self.owner, self.stale_s), token):
                raise LeaseLost(slot.where, slot.read()[0])

    def check(self) -> None:
        """Before a commit: the lease is still this job's (raises :class:`LeaseLost`)."""
        if self.lost is not None:
            raise self.lost
        for slot in self.slots:
            holder, _ = slot.read()
            if holder is not None and holder.owner != self.owner:
                self.lost = LeaseLost(slot.where, holder)
                raise self.lost

    def start_heartbeat(self) -> None:
        if self._thread is None and self.slots:
            self._thread = threading.Thread(target=self._beat, name="autohet-ckpt-lease",
                                            daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except LeaseLost as lost:
                self.lost = lost
                return
            except (OSError, StoreError):   # a store down for a while: the next beat retries
                continue

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def release(self) -> None:
        """Stop the heartbeat and remove every slot's lease that is still this job's."""
        self.stop_heartbeat()
        for slot in self.slots:
            try:
                holder, _ = slot.read()
                if holder is not None and holder.owner == self.owner:
                    slot.delete()
            except (OSError, StoreError):   # it goes stale on its own
                pass



def take_job_lease(options, roots: list[Path], owner: str, *, with_store: bool,
                   warn=print) -> Lease:
    """Take the writer lease of a job's checkpoint locations (``roots``: its save directories;
    ``with_store``: and its S3 prefix) for ``owner`` and start its heartbeat. A live owner, or
    an S3 tier that cannot work (no such bucket, credentials refused), is a ConfigError naming
    the flag; an S3 endpoint that cannot be reached right now leaves the prefix without a lease
    (``warn``: one line) - recovery and uploads have their own answers to that."""
    flag = "--autohet-local-ckpt-dir" if options.local_dir is not None else "--save"
    slots: list[LeaseSlot] = [DirectorySlot(root, flag) for root in dict.fromkeys(roots)]
    store = object_store(options) if with_store else None
    if store is not None:
        slots.append(ObjectStoreSlot(store))
    lease = Lease(slots, owner)
    try:
        lease.take(take_over=options.take_over)
    except (LeaseHeld, LeaseUnwritable) as err:
        slot = next(s for s in slots if s.where == err.where)
        raise ConfigError("<command line>", slot.flag, str(err),
                          err.allowed() if isinstance(err, LeaseHeld)
                          else "a directory this job can create and write") from None
    except StoreError as err:           # from the S3 slot, the last one
        if err.permanent:
            raise ConfigError("<command line>", "--autohet-s3-uri", f"{store.location.uri()} "
                              f"cannot be used: {err.reason}",
                              "a bucket that exists and that boto3's credentials may read and "
                              "write") from None
        warn(f"WARNING: {store.location.uri()} cannot be reached to take its writer lease "
             f"({err.reason}); the S3 prefix is written without one")
        lease = Lease(slots[:-1], owner)
        lease.take(take_over=options.take_over)
    lease.start_heartbeat()
    return lease
