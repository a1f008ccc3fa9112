"""A slow link to a server: a TCP proxy on 127.0.0.1 whose client-to-server direction delivers at
most ``rate`` bytes/s over all its connections together (one token bucket, no burst), as one
node's uplink would. ``rate`` may change while it runs (None: no limit); the answers come back
unthrottled. A request through it cannot end sooner than its bytes take at ``rate``, however
loaded the machine: tests built on it only lean on that bound.

The proxy reads what a client sends at once and queues it (as a socket's send buffer would, only
without a bound): a client never waits to write, only for the answer. Waiting to write is what
the kernel's small buffers would make it do on a slow proxy, and urllib3 writes a request with
the connect timeout (botocore's 5 s), so a body the buffers could not take within it would fail
as it does on no real link of this rate.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from urllib.parse import urlsplit

_PIECE = 4096


class Throttle:
    def __init__(self, target_url: str, rate: float | None):
        parts = urlsplit(target_url)
        self.target = (parts.hostname, parts.port)
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = 0.0         # when the bucket has sent what it was given so far
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="throttle-accept").start()

    def _wait_for(self, nbytes: int) -> None:
        rate = self.rate
        if rate is None:
            return
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / rate
            until = self._free_at
        time.sleep(max(0.0, until - time.monotonic()))

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            queued: queue.Queue[bytes] = queue.Queue()
            threading.Thread(target=self._read, args=(client, queued), daemon=True).start()
            threading.Thread(target=self._deliver, args=(queued, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    @staticmethod
    def _read(src: socket.socket, queued: queue.Queue) -> None:
        try:
            while data := src.recv(_PIECE):
                queued.put(data)
        except OSError:
            pass
        queued.put(b"")

    def _deliver(self, queued: queue.Queue, dst: socket.socket) -> None:
        try:
            while data := queued.get():
                self._wait_for(len(data))
                dst.sendall(data)
        except OSError:
            pass
        _shut(dst)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_PIECE):
                dst.sendall(data)
        except OSError:
            pass
        _shut(src)
        _shut(dst)

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def __enter__(self) -> "Throttle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
