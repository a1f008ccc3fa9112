"""A slow link to a server: a TCP proxy on 127.0.0.1 whose client-to-server direction carries at
most ``rate`` bytes/s over all its connections together (one token bucket, no burst), as one
node's uplink would. ``rate`` may change while it runs (None: no limit); the answers come back
unthrottled. A request through it cannot end sooner than its bytes take at ``rate``, however
loaded the machine: tests built on it only lean on that bound.
"""

from __future__ import annotations

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
        self._listener = socket.socket()
        # Small kernel buffers on the proxy's side (its connections inherit them): what a client
        # has written but the link has not carried stays small, so a client sees the rate.
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _PIECE * 4)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
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
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        try:
            while True:
                data = src.recv(_PIECE)
                if not data:
                    break
                if throttled:
                    self._wait_for(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def __enter__(self) -> "Throttle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
