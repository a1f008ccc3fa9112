"""`autohet rendezvous`: host the rendezvous store of elastic jobs (one small process).

torchrun's c10d rendezvous keeps its state in a TCPStore. Hosted here, on a machine that is not
preempted (the head node, a small on-demand VM), it outlives any node of the fleet; every
`autohet node` connects to it. It serves any number of jobs (each `--job-id` keys its own state)
and runs until stopped.
"""

from __future__ import annotations

import argparse
import signal
import threading
from datetime import timedelta


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "rendezvous", help="host the rendezvous store of elastic jobs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=29400,
                   help="TCP port to serve on (default 29400, torchrun's)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # torch: not at `autohet` start-up
    import torch.distributed as dist

    store = dist.TCPStore(args.host, args.port, is_master=True, multi_tenant=True,
                          wait_for_workers=False, timeout=timedelta(minutes=5))
    print(f"> rendezvous store serving on {args.host}:{store.port}", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    return 0
