"""Fake cloud metadata servers on 127.0.0.1 for the notice watchers' tests.

Each serves the paths, headers and bodies its cloud documents, refuses a request without the
cloud's required header as the cloud does (AWS: no valid IMDSv2 token -> 401; GCP: no
``Metadata-Flavor: Google`` -> 403; Azure: no ``Metadata: true`` -> 400), and has a method to
schedule a preemption while it runs. Use as a context manager; ``url`` is the base URL.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.fake.handle(self, "GET")

    def do_PUT(self):
        self.server.fake.handle(self, "PUT")

    def log_message(self, *args):
        pass


class FakeServer:
    def __init__(self):
        self.lock = threading.Condition()
        self.requests: list[tuple[str, str]] = []      # (method, path with query)
        self.closing = False
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.fake = self
        # a short poll interval: shutdown() waits for it, once per test
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,),
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        with self.lock:
            self.closing = True
            self.lock.notify_all()                  # release hanging GCP requests
        self._httpd.shutdown()
        self._httpd.server_close()

    def wait_for_requests(self, count: int, timeout: float = 20.0) -> None:
        """Until ``count`` requests have arrived (a safety timeout, not a timing assertion)."""
        with self.lock:
            if not self.lock.wait_for(lambda: len(self.requests) >= count, timeout):
                raise TimeoutError(f"{len(self.requests)} requests, waited for {count}")

    def handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        with self.lock:
            self.requests.append((method, request.path))
            self.lock.notify_all()
        split = urlsplit(request.path)
        status, headers, body = self.respond(method, split.path, parse_qs(split.query),
                                             request.headers)
        data = body.encode() if isinstance(body, str) else body
        request.send_response(status)
        for name, value in headers.items():
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def respond(self, method, path, query, headers) -> tuple[int, dict, str]:
        raise NotImplementedError


TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}
NOT_FOUND = (404, TEXT, "404 - Not Found")


class FakeAws(FakeServer):
    """EC2 IMDSv2: ``PUT /latest/api/token`` (TTL header 1-21600 required) hands out tokens;
    every GET needs a live one in ``X-aws-ec2-metadata-token``."""

    def __init__(self):
        super().__init__()
        self.tokens: set[str] = set()
        self.token_puts = 0
        self.instance_action: dict | None = None
        self.rebalance: dict | None = None

    def schedule_preemption(self, action: str = "terminate",
                            time: str = "2026-11-23T08:22:00Z") -> None:
        self.instance_action = {"action": action, "time": time}

    def recommend_rebalance(self, notice_time: str = "2026-11-23T08:17:00Z") -> None:
        self.rebalance = {"noticeTime": notice_time}

    def expire_tokens(self) -> None:
        """Every token handed out so far stops working (as after their TTL or an IMDS restart)."""
        self.tokens.clear()

    def respond(self, method, path, query, headers):
        if method == "PUT":
            if path != "/latest/api/token":
                return 405, TEXT, "405 - Method Not Allowed"
            ttl = headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, TEXT, "400 - Bad Request"
            token = uuid.uuid4().hex
            self.tokens.add(token)
            self.token_puts += 1
            return 200, {**TEXT, "X-aws-ec2-metadata-token-ttl-seconds": ttl}, token
        if headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return 401, TEXT, "401 - Unauthorized"
        documents = {"/latest/meta-data/spot/instance-action": self.instance_action,
                     "/latest/meta-data/events/recommendations/rebalance": self.rebalance}
        if documents.get(path) is None:
            return NOT_FOUND
        return 200, TEXT, json.dumps(documents[path])   # IMDS serves these as text/plain


class FakeGcp(FakeServer):
    """GCE metadata ``instance/preempted``: ``TRUE``/``FALSE`` with an ETag; with
    ``wait_for_change=true`` the request hangs until the value's ETag differs from ``last_etag``
    (or from the current one when none is given), or ``timeout_sec`` passes. ``waiting`` counts
    the requests hanging right now."""

    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self):
        super().__init__()
        self.value = "FALSE"
        self.waiting = 0

    @property
    def etag(self) -> str:
        return hashlib.md5(self.value.encode()).hexdigest()[:16]

    def schedule_preemption(self) -> None:
        with self.lock:
            self.value = "TRUE"
            self.lock.notify_all()

    def wait_until_waiting(self, timeout: float = 20.0) -> None:
        with self.lock:
            if not self.lock.wait_for(lambda: self.waiting > 0, timeout):
                raise TimeoutError("no wait_for_change request is hanging")

    def respond(self, method, path, query, headers):
        if headers.get("Metadata-Flavor") != "Google":
            return 403, {"Content-Type": "text/html"}, "Missing Metadata-Flavor:Google header."
        if method != "GET" or path != self.PATH:
            return NOT_FOUND
        if query.get("wait_for_change") == ["true"]:
            timeout = float(query.get("timeout_sec", ["300"])[0])
            with self.lock:
                # without last_etag the request waits for the next change of the current value
                last = query.get("last_etag", [self.etag])[0]
                self.waiting += 1
                self.lock.notify_all()
                self.lock.wait_for(lambda: self.etag != last or self.closing, timeout)
                self.waiting -= 1
        with self.lock:
            return 200, {"Content-Type": "application/text", "ETag": self.etag,
                         "Metadata-Flavor": "Google"}, self.value


class FakeAzure(FakeServer):
    """Azure IMDS: Scheduled Events (``api-version`` and ``Metadata: true`` required) and the
    VM's name (``compute/name`` with ``format=text``)."""

    def __init__(self, vm_name: str = "spot-vm-0"):
        super().__init__()
        self.vm_name = vm_name
        self.incarnation = 1
        self.events: list[dict] = []

    def schedule_event(self, event_type: str = "Preempt", resources: list[str] | None = None,
                       not_before: str = "Mon, 19 Sep 2016 18:29:47 GMT") -> str:
        event_id = str(uuid.uuid4()).upper()
        with self.lock:
            self.events.append({
                "EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
                "Resources": resources if resources is not None else [self.vm_name],
                "EventStatus": "Scheduled", "NotBefore": not_before,
                "Description": "", "EventSource": "Platform", "DurationInSeconds": -1})
            self.incarnation += 1
        return event_id

    def schedule_preemption(self) -> str:
        return self.schedule_event("Preempt")

    def respond(self, method, path, query, headers):
        if headers.get("Metadata") != "true":
            return 400, JSON, json.dumps({"error": "Bad request. Required metadata header not "
                                                   "specified"})
        if "api-version" not in query:
            return 400, JSON, json.dumps({"error": "Bad request. api-version was not specified"})
        if method == "GET" and path == "/metadata/scheduledevents":
            with self.lock:
                return 200, JSON, json.dumps({"DocumentIncarnation": self.incarnation,
                                              "Events": self.events})
        if method == "GET" and path == "/metadata/instance/compute/name" \
                and query.get("format") == ["text"]:
            return 200, TEXT, self.vm_name
        return NOT_FOUND
