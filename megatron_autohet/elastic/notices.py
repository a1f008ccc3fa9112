"""Preemption notices: watch the cloud's metadata server (or signals), write one small JSON file.

A spot node learns it will go away shortly before it does: AWS says so about 2 minutes ahead
(IMDSv2 ``spot/instance-action``), GCP and Azure about 30 s ahead (``instance/preempted``,
Scheduled Events ``Preempt``), Kubernetes with SIGTERM (SIGKILL after the grace period), Slurm
with the signal of ``--signal=B:USR1@N``. Each source has a watcher whose ``poll()`` is one check;
:func:`watch` polls them all until a preempt notice, writes it atomically to the notice file (what
the training job reads) and logs it.

Two kinds: ``preempt`` (the node will go away, ``deadline_unix`` says when if known) and
``rebalance`` (AWS's advisory early warning: the node is at elevated risk; watching goes on).

Only the standard library: the watcher must run on any node image, next to any job.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import math
import queue
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from email.message import Message
from pathlib import Path
from typing import Callable, Protocol

from megatron_autohet.checkpoint.manifest import write_atomic
from megatron_autohet.errors import ConfigError

SOURCES = ("aws", "gcp", "azure", "signal")
KINDS = ("preempt", "rebalance")

HTTP_TIMEOUT_S = 2.0
AWS_BASE_URL = "http://169.254.169.254"
GCP_BASE_URL = "http://metadata.google.internal"
AZURE_BASE_URL = "http://169.254.169.254"
AWS_TOKEN_TTL_S = 21600                 # IMDSv2's maximum
AWS_TOKEN_REFRESH_MARGIN_S = 60.0       # renew this long before expiry, not after a failed GET
GCP_SPOT_GRACE_S = 30.0                 # Spot VMs: ~30 s from the ACPI soft-off to the hard stop
SIGNAL_GRACE_S = 30.0                   # Kubernetes' default terminationGracePeriodSeconds
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")  # Kubernetes; Slurm's --signal=B:USR1@N


def _print(line: str) -> None:
    print(line, flush=True)


# ---- the notice and its file -----------------------------------------------------------------

@dataclass(frozen=True)
class Notice:
    source: str                     # one of SOURCES
    kind: str                       # one of KINDS
    deadline_unix: float | None     # when the node is expected to go; None if unknown
    received_unix: float
    detail: dict = field(default_factory=dict)   # raw fields worth logging

    @property
    def seconds_to_deadline(self) -> float | None:
        return None if self.deadline_unix is None else self.deadline_unix - self.received_unix

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "<notice>") -> Notice:
        """The notice ``text`` holds; a ConfigError naming ``where`` and the field otherwise."""
        allowed = "a JSON object with " + ", ".join(f.name for f in fields(cls))
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(where, "<file>", f"not JSON ({err})", allowed) from None
        if not isinstance(data, dict):
            raise ConfigError(where, "<file>", f"a JSON {type(data).__name__}", allowed)
        checks = {"source": (lambda v: v in SOURCES, ", ".join(SOURCES)),
                  "kind": (lambda v: v in KINDS, ", ".join(KINDS)),
                  "deadline_unix": (lambda v: v is None or _is_number(v), "a number or null"),
                  "received_unix": (_is_number, "a number"),
                  "detail": (lambda v: isinstance(v, dict), "a JSON object")}
        for name, (ok, what) in checks.items():
            if name not in data:
                raise ConfigError(where, name, "missing", what)
            if not ok(data[name]):
                raise ConfigError(where, name, f"got {data[name]!r}", what)
        return cls(**{name: data[name] for name in checks})


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def write_notice(path: str | Path, notice: Notice) -> Notice:
    """Write ``notice`` to ``path`` atomically (a reader sees the old file or the new one) and
    return what the file holds afterwards: a preempt notice already there is kept when ``notice``
    is only a rebalance (the advisory must not hide that the node is going away)."""
    try:
        current = read_notice(path)
    except ConfigError:
        current = None                  # not a notice: ours replaces it
    if current is not None and current.kind == "preempt" and notice.kind != "preempt":
        return current
    write_atomic(path, (notice.to_json() + "\n").encode())
    return notice


def read_notice(path: str | Path) -> Notice | None:
    """The notice in ``path``; None when there is no file; ConfigError when it is not a notice."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    return Notice.from_json(text, str(path))


def preempt_notice_in(path: str | Path) -> bool:
    """Whether ``path`` holds a preempt notice: the node is going away. A rebalance
    recommendation is advice (the node stays, and a later preemption is still a notice); no file,
    or one that is not a notice, is no notice either."""
    try:
        notice = read_notice(path)
    except ConfigError:
        return False
    return notice is not None and notice.kind == "preempt"


def iso_utc(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe(notice: Notice) -> str:
    """One log line for ``notice``, e.g. ``preemption notice from aws: terminate at
    2026-11-23T08:22:00Z (in 118.0 s)``."""
    if notice.kind == "rebalance":
        return (f"rebalance recommendation from {notice.source} (advisory: elevated risk of "
                f"interruption); still watching")
    what = {"aws": notice.detail.get("action", "interruption"), "gcp": "preempted",
            "azure": f"Preempt event {notice.detail.get('EventId', '?')}",
            "signal": notice.detail.get("signal", "signal")}[notice.source]
    if notice.deadline_unix is None:
        return f"preemption notice from {notice.source}: {what}, deadline unknown"
    return (f"preemption notice from {notice.source}: {what} at {iso_utc(notice.deadline_unix)} "
            f"(in {notice.seconds_to_deadline:.1f} s)")


# ---- HTTP to a metadata server -----------------------------------------------------------------

# Metadata servers are link-local: an HTTP(S)_PROXY from the environment must never see the
# requests (it could not reach the server, and a token must not leave the node).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MetadataError(RuntimeError):
    """The metadata server answered, but not as the cloud documents it."""


@dataclass(frozen=True)
class _Response:
    status: int
    headers: Message
    body: bytes


def _request(method: str, url: str, headers: dict[str, str], timeout_s: float) -> _Response:
    """One request; any HTTP status is returned, a network failure raises (OSError,
    http.client.HTTPException)."""
    request = urllib.request.Request(url, method=method, headers=headers,
                                     data=b"" if method == "PUT" else None)
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            return _Response(response.status, response.headers, response.read())
    except urllib.error.HTTPError as err:
        with err:
            return _Response(err.code, err.headers, err.read())


def _json_object(response: _Response, what: str) -> dict:
    try:
        data = json.loads(response.body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise MetadataError(f"{what}: not a JSON object: {response.body[:200]!r}")
    return data


class Watcher(Protocol):
    source: str
    wait_s: float       # how long one poll() may wait for a change (0: an instant check)

    def poll(self) -> Notice | None: ...


class _MetadataWatcher:
    """What the cloud watchers share: an unreachable or misbehaving metadata server is logged
    once per outage and polling goes on (the node may still be preempted later)."""

    source = ""

    def __init__(self, base_url: str, timeout_s: float, log: Callable[[str], None]):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.wait_s = 0.0
        self.log = log
        self._failing = False

    def poll(self) -> Notice | None:
        try:
            notice = self._check()
        except (OSError, http.client.HTTPException, MetadataError) as err:
            if not self._failing:
                self.log(f"WARNING: {self.source} metadata server {self.base_url}: {err}; "
                         f"polling on")
            self._failing = True
            return None
        self._failing = False
        return notice

    def _check(self) -> Notice | None:
        raise NotImplementedError


class AwsWatcher(_MetadataWatcher):
    """EC2 spot interruption (``spot/instance-action``) and rebalance recommendation, over IMDSv2
    (a session token from ``PUT /latest/api/token``, renewed before expiry and after a 401)."""

    source = "aws"
    INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
    REBALANCE = "/latest/meta-data/events/recommendations/rebalance"

    def __init__(self, base_url: str = AWS_BASE_URL, *, timeout_s: float = HTTP_TIMEOUT_S,
                 token_ttl_s: int = AWS_TOKEN_TTL_S, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = _print):
        super().__init__(base_url, timeout_s, log)
        self.token_ttl_s = token_ttl_s
        self._clock = clock
        self._token: str | None = None
        self._token_expires = 0.0

    def _refresh_token(self) -> str:
        asked = self._clock()
        response = _request("PUT", f"{self.base_url}/latest/api/token",
                            {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
                            self.timeout_s)
        if response.status != 200:
            raise MetadataError(f"PUT /latest/api/token: HTTP {response.status}")
        self._token = response.body.decode().strip()
        self._token_expires = asked + self.token_ttl_s
        return self._token

    def _get(self, path: str) -> _Response:
        token = self._token
        if token is None or self._clock() >= self._token_expires - AWS_TOKEN_REFRESH_MARGIN_S:
            token = self._refresh_token()
        response = _request("GET", self.base_url + path, {"X-aws-ec2-metadata-token": token},
                            self.timeout_s)
        if response.status == 401:      # revoked or expired early (e.g. IMDS restarted): renew once
            response = _request("GET", self.base_url + path,
                                {"X-aws-ec2-metadata-token": self._refresh_token()},
                                self.timeout_s)
        if response.status not in (200, 404):
            raise MetadataError(f"GET {path}: HTTP {response.status}")
        return response

    def _check(self) -> Notice | None:
        action = self._get(self.INSTANCE_ACTION)
        if action.status == 200:
            received = time.time()
            data = _json_object(action, self.INSTANCE_ACTION)
            return Notice("aws", "preempt", _parse_iso_utc(data.get("time")), received,
                          {k: data[k] for k in ("action", "time") if k in data})
        rebalance = self._get(self.REBALANCE)
        if rebalance.status == 404:
            return None
        data = _json_object(rebalance, self.REBALANCE)
        return Notice("aws", "rebalance", None, time.time(),
                      {k: data[k] for k in ("noticeTime",) if k in data})


def _parse_iso_utc(text) -> float | None:
    """AWS's ``2026-11-23T08:22:00Z``; None when absent or in another form (the notice still
    counts: an instance-action document exists only when an interruption is planned)."""
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=timezone.utc).timestamp()
    except (TypeError, ValueError):
        return None


class GcpWatcher(_MetadataWatcher):
    """GCP ``instance/preempted`` (``TRUE``/``FALSE``). With ``wait_s`` > 0 a poll is a hanging
    GET (``wait_for_change`` with the last ETag) that returns as soon as the value changes, so
    the notice arrives at once without polling often."""

    source = "gcp"
    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, base_url: str = GCP_BASE_URL, *, wait_s: float = 0.0,
                 grace_s: float = GCP_SPOT_GRACE_S, timeout_s: float = HTTP_TIMEOUT_S,
                 log: Callable[[str], None] = _print):
        super().__init__(base_url, timeout_s, log)
        self.wait_s = wait_s
        self.grace_s = grace_s
        self._etag: str | None = None

    def _check(self) -> Notice | None:
        url, timeout_s = self.base_url + self.PATH, self.timeout_s
        # Without an ETag a wait_for_change request blocks until the *next* change and would miss
        # a VM preempted before the first poll: the first request reads the value and its ETag.
        if self.wait_s > 0 and self._etag is not None:
            wait = math.ceil(self.wait_s)
            url += "?" + urllib.parse.urlencode({"wait_for_change": "true",
                                                 "last_etag": self._etag, "timeout_sec": wait})
            timeout_s += wait
        response = _request("GET", url, {"Metadata-Flavor": "Google"}, timeout_s)
        if response.status != 200:
            raise MetadataError(f"GET {self.PATH}: HTTP {response.status}")
        self._etag = response.headers.get("ETag", self._etag)
        value = response.body.decode().strip()
        if value == "FALSE":
            return None
        if value != "TRUE":
            raise MetadataError(f"GET {self.PATH}: {value[:200]!r}, expected TRUE or FALSE")
        received = time.time()
        return Notice("gcp", "preempt", received + self.grace_s, received, {"preempted": value})


class AzureWatcher(_MetadataWatcher):
    """Azure Scheduled Events: a ``Preempt`` event naming this VM (Spot eviction, ~30 s ahead).

    The event is not acknowledged: an acknowledgement lets Azure evict at once, and the job
    wants every second until ``NotBefore``."""

    source = "azure"
    EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
    VM_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(self, base_url: str = AZURE_BASE_URL, *, vm_name: str | None = None,
                 timeout_s: float = HTTP_TIMEOUT_S, log: Callable[[str], None] = _print):
        super().__init__(base_url, timeout_s, log)
        self.vm_name = vm_name

    def _get(self, path: str) -> _Response:
        response = _request("GET", self.base_url + path, {"Metadata": "true"}, self.timeout_s)
        if response.status != 200:
            raise MetadataError(f"GET {path}: HTTP {response.status}")
        return response

    def _check(self) -> Notice | None:
        if self.vm_name is None:
            self.vm_name = self._get(self.VM_NAME).body.decode().strip()
        document = _json_object(self._get(self.EVENTS), self.EVENTS)
        for event in document.get("Events") or []:
            if event.get("EventType") == "Preempt" and self.vm_name in (event.get("Resources")
                                                                          or []):
                detail = {k: event[k] for k in ("EventId", "EventStatus", "NotBefore",
                                                "EventSource", "Description") if k in event}
                detail["DocumentIncarnation"] = document.get("DocumentIncarnation")
                return Notice("azure", "preempt", _parse_rfc1123(event.get("NotBefore")),
                              time.time(), detail)
        return None


def _parse_rfc1123(text) -> float | None:
    """Azure's ``Mon, 19 Sep 2016 18:29:47 GMT``; None when empty (a Started event has none)."""
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError):
        return None


class SignalWatcher:
    """A signal as a preempt notice: Kubernetes sends SIGTERM ``terminationGracePeriodSeconds``
    (default 30) before SIGKILL, Slurm's ``--signal=B:USR1@N`` sends SIGUSR1 N seconds before the
    end: ``grace_s`` is that time. The first signal received sets the notice.

    Python runs signal handlers in the main thread only: create the watcher there (``poll`` may
    then run in any thread). ``close()`` puts the previous handlers back."""

    source = "signal"

    def __init__(self, signals: tuple[str, ...] = DEFAULT_SIGNALS, *,
                 grace_s: float = SIGNAL_GRACE_S, wait_s: float = 0.0):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("SignalWatcher must be created in the main thread (Python "
                               "delivers signals to handlers there only)")
        self.grace_s = grace_s
        self.wait_s = wait_s
        self._received = threading.Event()
        self._notice: Notice | None = None
        self._previous = {}
        for name in signals:
            number = signal.Signals[name]
            self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, signum, frame) -> None:
        if self._notice is None:
            received = time.time()
            self._notice = Notice("signal", "preempt", received + self.grace_s, received,
                                  {"signal": signal.Signals(signum).name})
        self._received.set()

    def poll(self) -> Notice | None:
        self._received.wait(self.wait_s)
        return self._notice

    def close(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}


# ---- watching ------------------------------------------------------------------------------------

def watch(watchers: list[Watcher], notice_file: str | Path, *, poll_interval_s: float = 5.0,
          stop: threading.Event | None = None, events_jsonl: str | Path | None = None,
          log: Callable[[str], None] = _print) -> Notice | None:
    """Poll every watcher until one reports a preempt notice; write it to ``notice_file``, log it
    (one Megatron-style line, and one JSON line appended to ``events_jsonl`` when given) and
    return it. A rebalance notice is written and logged once per source, and watching goes on.
    Returns None when ``stop`` is set first.

    Each watcher polls in its own thread, so a slow or unreachable metadata server never delays
    another source; a watcher whose ``wait_s`` > 0 waits inside ``poll`` instead of sleeping."""
    stop = stop or threading.Event()
    done = threading.Event()
    found: queue.Queue[Notice] = queue.Queue()

    def run(watcher: Watcher) -> None:
        while not done.is_set():
            notice = watcher.poll()
            if notice is not None:
                found.put(notice)
                if notice.kind == "preempt":
                    return
            if not watcher.wait_s:
                done.wait(poll_interval_s)

    for watcher in watchers:
        threading.Thread(target=run, args=(watcher,), daemon=True,
                         name=f"notice-{watcher.source}").start()
    reported: set[tuple[str, str]] = set()
    try:
        while not stop.is_set():
            try:
                notice = found.get(timeout=0.2)     # wakes to see `stop`
            except queue.Empty:
                continue
            if (notice.source, notice.kind) in reported:
                continue        # a rebalance recommendation stays up: report it once
            reported.add((notice.source, notice.kind))
            write_notice(notice_file, notice)
            _report(notice, log, events_jsonl)
            if notice.kind == "preempt":
                return notice
        return None
    finally:
        done.set()


def _report(notice: Notice, log: Callable[[str], None], events_jsonl: str | Path | None) -> None:
    log(f" > {describe(notice)}")
    if events_jsonl:
        record = {"event": "notice", "source": notice.source, "kind": notice.kind,
                  "deadline_unix": notice.deadline_unix, "received_unix": notice.received_unix,
                  "seconds_to_deadline": notice.seconds_to_deadline, "detail": notice.detail}
        with open(events_jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
