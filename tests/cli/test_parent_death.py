"""Nothing a launcher started outlives it (system/parent_death.py): kill -9 of `autohet train`
leaves no rank training, kill -9 of a node's warm fork server leaves no worker, and a client that
hangs up at once neither leaves a worker behind nor takes the fork server down."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_autohet.cli.warm import READY, SOCKET_ENV

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 60          # a hang guard: with the fix they are gone at once


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat")) as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, what: str, within: float = GONE_WITHIN_S) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within} s")
        time.sleep(0.1)


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_autohet_train_ranks_die_with_a_killed_launcher(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan",
         str(ROOT / "configs/plans/tiny-two-pipelines.yaml"), "--model",
         str(ROOT / "configs/models/tiny.yaml"), "--iters", "100000",
         "--data-dir", str(tmp_path / "data"), "--metrics-jsonl", str(tmp_path / "m.jsonl")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        # training: every rank started and the first iteration logged
        wait_until(lambda: (tmp_path / "m.jsonl").is_file()
                   and (tmp_path / "m.jsonl").read_text().strip(), "the first iteration", 300)
        ranks = children_of(launcher.pid)
        assert len(ranks) == 4, ranks
        launcher.kill()
        launcher.wait()
        wait_until(lambda: not any(alive(pid) for pid in ranks), "the ranks' end")
    finally:
        launcher.kill()
        kill_all(ranks)


@pytest.fixture
def fork_server(tmp_path):
    """A warm fork server whose parent is this test process: (its process, its socket)."""
    path = str(tmp_path / "fork.sock")
    server = subprocess.Popen([sys.executable, "-m", "megatron_autohet.cli.warm", "--serve",
                               path, str(os.getpid())], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL)
    assert server.stdout.readline() == READY
    yield server, path
    kill_all([server.pid, *children_of(server.pid)])
    server.wait()


def _watch_argv(tmp_path: Path) -> list[str]:
    """A worker that runs until a signal: `autohet watch` of signals."""
    return ["watch", "--source", "signal", "--notice-file", str(tmp_path / "notice.json")]


def test_a_worker_dies_with_its_killed_fork_server(fork_server, tmp_path):
    server, path = fork_server
    client = subprocess.Popen([sys.executable, "-m", "megatron_autohet.cli.warm",
                               *_watch_argv(tmp_path)], env={**os.environ, SOCKET_ENV: path},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        wait_until(lambda: children_of(server.pid), "the forked worker", 120)
        workers = children_of(server.pid)
        server.kill()
        server.wait()
        wait_until(lambda: not any(alive(pid) for pid in workers), "the worker's end")
        assert client.wait(timeout=GONE_WITHIN_S) == 1         # the server died: so did it
    finally:
        client.kill()
        kill_all(workers)


def test_a_client_that_hangs_up_at_once_leaves_no_worker(fork_server, tmp_path):
    """The client sends its request and hangs up before the reply (a quick round change): the
    server's reply finds the connection closed; the worker it forked is killed and reaped, and
    the server serves the next client."""
    server, path = fork_server
    for _ in range(3):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        request = json.dumps({"argv": _watch_argv(tmp_path), "env": dict(os.environ),
                              "cwd": str(tmp_path)})
        with open(os.devnull, "rb") as null_in, open(os.devnull, "wb") as null_out:
            socket.send_fds(conn, [request.encode() + b"\n"],
                            [null_in.fileno(), null_out.fileno(), null_out.fileno()])
        conn.close()
    time.sleep(1.0)                     # the server forks, replies, finds each client gone
    wait_until(lambda: not children_of(server.pid), "the hung-up clients' workers' end")
    assert server.poll() is None
    shown = subprocess.run([sys.executable, "-m", "megatron_autohet.cli.warm", "show",
                            str(ROOT / "configs/plans/tiny-homogeneous.yaml")],
                           env={**os.environ, SOCKET_ENV: path}, capture_output=True,
                           text=True, timeout=300, check=False)
    assert shown.returncode == 0, shown.stderr
    assert "cold" not in shown.stderr                 # served by the fork server
    assert "tiny-homogeneous" in shown.stdout or "pipeline" in shown.stdout.lower()
