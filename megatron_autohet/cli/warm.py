"""Warm workers: each node's training processes start from a fork server whose imports are done.

Not a sub-command: the entry point of `autohet node`'s workers (``python -m
megatron_autohet.cli.warm train ...``) and of its fork server (``--serve``).

A join (and any restart through torchrun) stops every worker and starts new ones in a new
rendezvous round. Cold, each new worker pays for Python, torch and megatron-core's imports before
it can say who it is - 20-55 s of the job's downtime on 2 loaded cores, the most of a join's.
Here `autohet node` first starts this module's fork server (``serve``): one process per node
that imports what a worker imports (nothing else: no tensor op, no CUDA, no process group, so
forking it is safe) and then waits. Only once it is ready does the node's agent enter the
rendezvous, so a node that joins is announced when it can start at once, and the job trains on
meanwhile. torchrun then starts, per worker, this module's client (``python -m
megatron_autohet.cli.warm train ...``: the standard library only, a few tens of ms), which
hands its arguments, environment, working directory and standard streams to the server; the
server forks a child that becomes the worker (``autohet train`` in the already imported
interpreter). The client stays what torchrun sees: it passes torchrun's signals on to the child
and exits with the child's status (a signal's death as 128 + the signal). A client that dies
(torchrun's SIGKILL after its shutdown timeout) takes its child with it.

Nothing outlives the node (system/parent_death.py): the client dies with torchrun's agent, the
server with `autohet node`, each forked worker with the server, however they end (kill -9
included); a client that hangs up at any point of its request - before the server read it,
before or after the fork - leaves no child behind and the server serving.

Without ``AUTOHET_WARM_SOCKET`` (a worker started by plain torchrun), or when the server cannot
be reached, the client runs the worker cold in its own process (exec).

Why this and not admitting joins at save points in the running processes: a join changes the
membership torchrun manages, and its agents restart every worker on any membership change
(there is no option to defer it); keeping the workers' processes across a join would mean
replacing torchrun's rounds by a membership protocol of our own. Warm processes keep torchrun's
rounds - its failure handling, the restarts after a loss without notice - and take the imports
out of every restart, not only out of joins.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import traceback

from megatron_autohet.cli.main import build_parser, main
from megatron_autohet.known_warnings import ignore_known_warnings
from megatron_autohet.system.parent_death import die_with_launcher, die_with_parent

SOCKET_ENV = "AUTOHET_WARM_SOCKET"
READY = b"ready\n"
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2)


# ---- the client: what torchrun starts ----------------------------------------------------------

def _cold(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "megatron_autohet.cli.main", *argv])


def _recv_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            return data
        data += chunk
    return data


def client(argv: list[str]) -> int:
    """Run ``autohet ARGV`` as a child of the node's fork server; its exit status."""
    die_with_launcher()                 # before the cold exec too: the signal survives exec
    path = os.environ.get(SOCKET_ENV)
    if not path:
        _cold(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError as err:
        print(f"autohet: the node's warm fork server at {path} is unreachable ({err}): "
              "starting this worker cold", file=sys.stderr, flush=True)
        _cold(argv)
    # torchrun's signals (its SIGTERM asks the worker to save and stop) go to the child; one that
    # comes before the child exists is passed on as soon as it does.
    child, pending = None, []

    def forward(signum, frame):
        if child is None:
            pending.append(signum)
            return
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass
    for sig in _FORWARDED:
        signal.signal(sig, forward)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()})
    socket.send_fds(conn, [request.encode() + b"\n"], [0, 1, 2])
    reply = _recv_line(conn)
    if not reply:
        print("autohet: the node's warm fork server closed the connection", file=sys.stderr)
        return 1
    child = int(reply)
    for signum in pending:
        forward(signum, None)
    ended = _recv_line(conn)
    if not ended:                       # the server died: the child went with it
        return 1
    code = int(ended)
    if code < 0:                        # the child died of a signal: say so as a shell would
        return 128 - code
    return code


# ---- the server: one per node, started by `autohet node` ---------------------------------------

def _preload() -> None:
    """Import what a worker imports, so that its fork starts training at once."""
    ignore_known_warnings()
    # torch, megatron-core and what the worker runs: in the server only, never in the client
    import torch.distributed  # noqa: F401

    import megatron_autohet.checkpoint.checkpointer
    import megatron_autohet.checkpoint.s3_store
    import megatron_autohet.elastic.worker
    import megatron_autohet.runtime.stage_model
    import megatron_autohet.runtime.trainer  # noqa: F401

    build_parser()                      # every sub-command module


def _become_worker(server: int, server_fds: list, request: dict, fds: list[int]) -> None:
    """In the forked child of the server (pid ``server``), which it dies with: close the
    server's sockets (``server_fds``: a client must see the server's end, not a copy held here),
    take the client's streams, environment and arguments, run ``autohet`` and end the process
    (never returns)."""
    status = 1
    try:
        die_with_parent(server)
        for held in server_fds:
            held.close()
        os.setsid()                     # like a worker torchrun starts: a session of its own
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (*_FORWARDED, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            # intra-op threads as the worker's environment says, not the server's (read when
            # torch loaded); torch is loaded here already (the server preloaded it)
            import torch
            torch.set_num_threads(int(threads))
        sys.argv = ["autohet", *request["argv"]]
        status = main()                 # an elastic worker ends in main() (end_process)
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:               # noqa: BLE001 - printed as the cold worker would
        traceback.print_exc()
        status = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def _request(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """A client's request and its three streams; None (nothing held open) when the client hung
    up or sent something else."""
    fds: list[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while message and not message.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            message += more
        if len(fds) == 3 and message.endswith(b"\n"):
            return json.loads(message), fds
    except (OSError, ValueError):
        pass
    for fd in fds:
        os.close(fd)
    return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve(path: str, parent: int) -> int:
    """The node's fork server: preload, listen on the Unix socket ``path``, write READY to
    stdout, then fork a worker per client until its parent process (`autohet node`, pid
    ``parent``), which it dies with, is gone."""
    die_with_parent(parent)
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}            # child pid -> its client's connection
    server = os.getpid()                                # what each forked worker dies with
    while os.getppid() == parent:       # the parent-death signal's twin, for a clean exit
        for key, _ in events.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                got = _request(conn)
                if got is None:
                    conn.close()
                    continue
                request, fds = got
                pid = os.fork()
                if pid == 0:
                    _become_worker(server, [listener, conn, events, *children.values()],
                                   request, fds)
                for fd in fds:
                    os.close(fd)
                # Registered before the reply: a client that hung up meanwhile (a quick round
                # change) is then seen below, its worker killed and reaped like any other.
                children[pid] = conn
                events.register(conn, selectors.EVENT_READ, pid)
                try:
                    conn.sendall(f"{pid}\n".encode())
                except OSError:
                    _kill(pid)
            else:                       # a client hung up: its worker must not outlive it
                pid = key.data
                try:
                    hung_up = not key.fileobj.recv(1)
                except OSError:
                    hung_up = True
                if pid in children and hung_up:
                    _kill(pid)
                    events.unregister(key.fileobj)
        while children:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            try:
                events.unregister(conn)
            except KeyError:
                pass
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(wait_status)}\n".encode())
            except OSError:
                pass
            conn.close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(sys.argv[2], int(sys.argv[3])))
    sys.exit(client(sys.argv[1:]))
