"""A free local TCP port, for processes started on this machine that must be told one before
they start: the profiler's measuring processes, an emulated fleet's rendezvous, test servers.
Torch-free: the emulated fleet and the test servers never import torch."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on right now. Another process may take it before the caller binds
    it: whoever can bind port 0 itself (the system picks) does that instead, and an endpoint that
    must stay unreachable holds its port bound without listening (the tests' ``refused_url``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
