#!/usr/bin/env python
"""Benchmark recovery from losing 1 of 4 emulated nodes, local-first vs. restart-from-S3.

Local-first (own disk, then peers, then S3) against restarting everything from S3, and the
training stall of an asynchronous save.

Setup (needs root and iproute2; never part of the test suite). Four emulated nodes n0..n3, each a
network namespace running one rank (a process, gloo, the runtime's CPU mode), a namespace for
the S3 server (moto's, the one the tests use) and one for the nodes' switch:

* peers: every node has one veth into a Linux bridge (its NIC), shaped with a token-bucket
  filter (``tc qdisc ... tbf``) on both ends at ``--peer-mbit``: a node sends and receives at
  most that rate, however many peers it talks to. gloo runs over it (``GLOO_SOCKET_IFNAME``,
  the rendezvous on n0's address).
* S3: every node has a second veth, straight to the S3 namespace, shaped at ``--s3-mbit`` on
  both ends: S3 bandwidth is a per-node limit (S3 scales out; what bounds a node is its own
  share - client, NIC, connections), so nodes downloading at once do not share one link.
  moto keeps the objects in memory (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``).
* local disks: one directory per node (``--autohet-local-ckpt-dir DIR/{node}``), all on this
  machine's one disk. Before the local-first recovery the checkpoint files are evicted from the
  page cache (``posix_fadvise(DONTNEED)``, our files only), so its local reads are disk reads.

Rates. netem is not in every kernel (not in this development VM's); tbf is, so the links are
slow in bandwidth, not latency. The absolute rates are scaled down to what 2 CPU cores can push
through Python, gloo and moto while also hashing and deserializing (default: S3 100 Mbit/s per
node, peers 1 Gbit/s per node); the RATIO is the realistic part: a GPU node reads S3 at a few
Gbit/s (one client per node; rarely above 5-10 Gbit/s in practice) and reaches other nodes over
25-100 Gbit/s Ethernet or faster InfiniBand, so peers are 10x faster than S3 or more - 10x is the
conservative end. The disk is not scaled (an NVMe reads a few GB/s, about a 25-50 Gbit/s NIC;
this VM's disk reads ~0.5-1 GB/s, i.e. relatively slower than a real one). Every rate used
below is MEASURED, not configured: raw TCP over a peer link and over an S3 link (a timed transfer
between two namespaces), a ranged GET through the product's S3Store from moto on the three
survivors at once (what S3 serves a node, HTTP and moto included), and a cold read of a node's
checkpoint files.

moto. Stock moto 5 copies the WHOLE object for every ranged GET and then slices it (about
0.14 s per GET of a 140 MB object here, whatever the range, in one Python process), a cost real
S3 does not have: it made restart-from-S3 4x slower than its link (79 s against an 18 s floor).
This script's moto process serves a single-range GET by reading only the range
(:func:`serve_single_ranges_in_place`; ``--stock-moto`` turns that off). moto and the product
are unchanged.

Model and plans. A GPT (megatron-core) of ``--layers`` x ``--hidden`` with a ``--vocab``
embedding: by default 45.7 M parameters, 549 MB of fp32 weights + Adam moments, so bytes
dominate (sequence 64, micro-batch 1, so a training step stays cheap). Plan A: two pipelines of
two stages, n0 [layers 0-3) | n1 [3-6) and n2 [0-3) | n3 [3-6). checkpoint/writer.py writes each
chunk's main copy on one node and a replica into every other node directory that holds the
chunk, so losing any one node loses no chunk. The job trains 4 iterations with
``--save-interval 2 --async-save`` (node-local steps, uploaded to S3). Then n3 is lost (its
directory deleted) and the survivors resume on plan B, one pipeline of three stages in the order
n0 [0-2) | n2 [2-4) | n1 [4-6): the order in which every survivor already holds most of what it
will run (a recovery-aware planner's choice), so only layer 3 (main or replica on n1) crosses the
network. Two resumes of the same plan B:

* local-first: the survivors' directories as the save left them (S3 configured, needed for
  nothing);
* restart-everything-from-S3 (the Varuna-style baseline): every local directory deleted, so
  every chunk comes from S3 (recovery.py downloads each once, by the lowest rank needing it, and
  forwards it to the others over the peers).

Both resumes then train one more iteration; the losses must be bit-identical (same plan, same
bytes loaded) and the tiers as expected (no S3 bytes in local-first, no disk bytes in the
baseline), else the run fails.

Reported:

* recovery time: ``recover()`` = ``Checkpointer.resume`` timed on every rank from a barrier, the
  slowest rank (discover and agree; the step's small files; fetch: own-disk reads, S3 downloads
  and the peer exchange at once, DCP's load running alongside; apply to the model). Each resume
  runs ``--repeat`` times (default 3, the page cache evicted before each local-first one) and
  the run with the median time is reported, every run's time and the 1-min load average at its
  start beside it; with ``--background-load N`` both resumes are measured again, as often, with
  N busy processes (a Python busy loop each) running beside them in the same run. Per rank,
  the product's own RecoveryReport gives bytes and seconds per tier and per phase (waiting for
  other ranks at the collectives included); and launch-to-loaded = from starting the processes
  to the slowest rank's end of the resume (imports, process group, model build: the same ~13 s
  for both, so that ratio is smaller).
* floor: max over sources of the bytes that source must move over its measured bandwidth: each
  node's S3 link (bytes it downloaded), each node's NIC in each direction (bytes received from
  peers; bytes sent to them, counted from the recovery plan), and the disk (bytes read from own
  disks; here ONE disk serves all emulated nodes, so its term is their sum - the floor with
  separate disks, as on real nodes, is reported next to it). It assumes all sources work at
  once, as recovery.py's fetch does, and counts no CPU work (hashing, DCP deserializing and
  copying into the model), which the ratio therefore includes.
* bytes per tier: RecoveryReport.bytes summed over the ranks (own disk, peers, S3); the bytes
  that crossed each interface (kernel counters) are in the JSON.
* save stall: the time ``Checkpointer.save`` blocks the training loop, less the time it waits for
  the PREVIOUS save's background write + upload (reported next to it: this job's interval, 2
  iterations, is shorter than one background write + upload, which a real interval is not),
  against the snapshot-to-host time (the copy of every tensor; building the sharded state dict
  on the training thread is shown separately), all from the product's
  Checkpointer.save_times. Also the training step time while a background save runs vs. not
  (2 cores: the writer competes).

* with ``--compare-checksum ALGORITHM`` (e.g. sha256, what steps recorded before xxh3_128): the
  local-first resume also runs with every chunk's checksum in the survivors' manifests rewritten
  to ALGORITHM (the same bytes, hashed here), alternating run by run with the step as saved, at
  each background load: what the checksum costs a recovery, at the same load in the same run.

Targets (from the issue): local-first recover() >= 5x faster than restart-from-S3 and <= 1.3x
its floor on a quiet machine, >= 3x with two busy processes beside it (``--background-load
2``); stall <= 1.5x the snapshot time.

    sudo .venv/bin/python scripts/bench_recovery.py [--peer-mbit 1000] [--s3-mbit 100]
        [--layers 6] [--hidden 768] [--vocab 4096] [--stock-moto] [--repeat 3]
        [--compare-checksum sha256]
        [--background-load N]
        [--json bench-out/bench_recovery.json]

Takes about 3 minutes on 2 quiet cores with ``--repeat 1``; each further repeat adds two
resumes (about 20-40 s), and ``--background-load`` doubles the resumes. Namespaces, processes
and files are removed at the end, on failure and on Ctrl-C/SIGTERM (a leftover from a killed
run is removed by the next run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _netns
from _bench import silence_known_megatron_warnings, write_json

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "ahrec-"
NODES = ("n0", "n1", "n2", "n3")
LOST = "n3"
NODE_NS = {n: f"{PREFIX}{n}" for n in NODES}
FABRIC_NS = f"{PREFIX}fab"          # the nodes' switch (a bridge)
S3_NS = f"{PREFIX}s3"               # the S3 server
BRIDGE = "ahbr"
FABRIC_DEV = {n: f"ahf{i}" for i, n in enumerate(NODES)}       # node side, peers
BRIDGE_PORT = {n: f"ahb{i}" for i, n in enumerate(NODES)}      # switch side
S3_DEV = {n: f"ahs{i}" for i, n in enumerate(NODES)}           # node side, S3
S3_PORT_DEV = {n: f"ahx{i}" for i, n in enumerate(NODES)}      # server side
FABRIC_IP = {n: f"10.213.0.{i + 1}" for i, n in enumerate(NODES)}
S3_NODE_IP = {n: f"10.214.{i}.2" for i, n in enumerate(NODES)}
S3_SERVER_IP = {n: f"10.214.{i}.1" for i, n in enumerate(NODES)}
GLOO_PORT = 29531
S3_HTTP_PORT = 5000
PROBE_PORT = 29532
BUCKET = "autohet-bench"
S3_URI = f"s3://{BUCKET}/recovery"
PROBE_KEY = "probe/blob"
SEED = 1234
SAVE_ITERS, SAVE_INTERVAL = 4, 2
MICRO_BATCH_SIZE, SEQ = 1, 64

# Dummy credentials and nothing from ~/.aws (as megatron_autohet/testing/s3_server.py).
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": "/nonexistent/aws-config",
           "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
           "AWS_EC2_METADATA_DISABLED": "true"}
AWS_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_ENDPOINT_URL",
             "AWS_ENDPOINT_URL_S3")


def model_dict(args) -> dict:
    return dict(name="recovery-bench", num_layers=args.layers, hidden_size=args.hidden,
                num_attention_heads=args.hidden // 64, ffn_hidden_size=4 * args.hidden,
                vocab_size=args.vocab, seq_length=SEQ, num_query_groups=args.hidden // 64,
                gated_linear_unit=False, position_embedding_type="learned_absolute",
                tie_embeddings=True)


def state_bytes(model: dict) -> tuple[int, int]:
    """(parameters, bytes of fp32 weights + both Adam moments) of the GPT."""
    h, f, L = model["hidden_size"], model["ffn_hidden_size"], model["num_layers"]
    layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h      # qkv+proj, fc1+fc2, 2 norms
    params = L * layer + model["vocab_size"] * h + SEQ * h + 2 * h
    return params, 12 * params


def _rank(rank: int, node: str) -> dict:
    return {"rank": rank, "node": node, "local_rank": 0, "gpu": "cpu"}


def plan_a(model: dict) -> dict:
    """Two pipelines of two stages: n0 | n1 and n2 | n3."""
    half = model["num_layers"] // 2
    stages = lambda a, b: [{"ranks": [a], "layers": [0, half]},                      # noqa: E731
                           {"ranks": [b], "layers": [half, model["num_layers"]]}]
    return {"cluster": "netns-4-nodes", "model": model, "micro_batch_size": MICRO_BATCH_SIZE,
            "global_batch_size": 4 * MICRO_BATCH_SIZE, "seq_length": SEQ,
            "ranks": [_rank(r, n) for r, n in enumerate(NODES)],
            "pipelines": [{"num_microbatches": 2, "stages": stages(0, 1)},
                          {"num_microbatches": 2, "stages": stages(2, 3)}]}


SURVIVORS = ("n0", "n2", "n1")      # plan B's stage order (= its rank order)


def plan_b(model: dict) -> dict:
    """The survivors: one pipeline of three stages, n0 | n2 | n1."""
    L = model["num_layers"]
    cuts = [round(i * L / 3) for i in range(4)]
    return {"cluster": "netns-3-nodes", "model": model, "micro_batch_size": MICRO_BATCH_SIZE,
            "global_batch_size": 4 * MICRO_BATCH_SIZE, "seq_length": SEQ,
            "ranks": [_rank(r, n) for r, n in enumerate(SURVIVORS)],
            "pipelines": [{"num_microbatches": 4, "stages": [
                {"ranks": [r], "layers": [cuts[r], cuts[r + 1]]} for r in range(3)]}]}


# ---- processes (every one this script starts; killed by id on exit) ------------------------------

PROCS: list[subprocess.Popen] = []


def spawn(cmd: list[str], ns: str | None = None, env: dict | None = None,
          log: Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` (in namespace ``ns``) in a process group of its own, output to ``log``.
    Not a session of its own: with Linux's autogroup scheduling (on in most distributions) every
    session is one scheduling group, and the groups share the CPU equally, so a node's process
    would get a fixed share however busy the others are - unlike processes on one machine. In
    one session (the busy processes of --background-load included) they compete as one
    machine's processes do."""
    full = (["ip", "netns", "exec", ns] if ns else []) + cmd
    out = open(log, "w") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(full, env=env, stdout=out, stderr=subprocess.STDOUT,
                                process_group=0)
    finally:
        if log:
            out.close()
    PROCS.append(proc)
    return proc


def kill_all() -> None:
    for proc in PROCS:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)     # its own group: it and its children
            except ProcessLookupError:
                pass
            proc.wait()
    PROCS.clear()


def wait_all(procs: list[subprocess.Popen], timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            time.sleep(3)                  # let the others print their side of the failure
            for i, log in enumerate(logs):
                if log.exists():
                    tail = log.read_text(errors="replace")[-3000:]
                    print(f"---- {what}, process {i}, exit {procs[i].poll()}:\n{tail}",
                          file=sys.stderr)
            raise SystemExit(f"{what}: " + (f"processes {failed} failed" if failed else
                                            f"did not finish within {timeout:.0f} s"))
        time.sleep(0.2)
    if any(p.returncode for p in procs):
        for i, log in enumerate(logs):
            if procs[i].returncode and log.exists():
                print(f"---- {what}, process {i}:\n{log.read_text(errors='replace')[-3000:]}",
                      file=sys.stderr)
        raise SystemExit(f"{what}: exit codes {[p.returncode for p in procs]}")


# ---- the emulated cluster ------------------------------------------------------------------------

def net_up(peer_mbit: float, s3_mbit: float, queue_ms: float) -> None:
    net_down()
    for ns in (*NODE_NS.values(), FABRIC_NS, S3_NS):
        _netns.add_namespace(ns)
    _netns.add_bridge(BRIDGE, FABRIC_NS)
    for node, ns in NODE_NS.items():
        _netns.add_veth(FABRIC_DEV[node], ns, BRIDGE_PORT[node], FABRIC_NS)
        _netns.attach_to_bridge(BRIDGE_PORT[node], BRIDGE, FABRIC_NS)
        _netns.address_up(FABRIC_DEV[node], ns, FABRIC_IP[node])
        _netns.shape(FABRIC_DEV[node], ns, peer_mbit, queue_ms)                # node -> switch
        _netns.shape(BRIDGE_PORT[node], FABRIC_NS, peer_mbit, queue_ms)        # switch -> node
        _netns.add_veth(S3_DEV[node], ns, S3_PORT_DEV[node], S3_NS)
        _netns.address_up(S3_DEV[node], ns, S3_NODE_IP[node])
        _netns.address_up(S3_PORT_DEV[node], S3_NS, S3_SERVER_IP[node])
        _netns.shape(S3_DEV[node], ns, s3_mbit, queue_ms)                      # uploads
        _netns.shape(S3_PORT_DEV[node], S3_NS, s3_mbit, queue_ms)              # downloads


def net_down() -> None:
    # Deleting a namespace deletes its ends of the veths, and so the pairs, and the bridge.
    for ns in (*NODE_NS.values(), FABRIC_NS, S3_NS):
        _netns.delete_namespace(ns)


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in AWS_UNSET}
    env.update(AWS_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def start_moto(tmp: Path, probe_bytes: int, stock: bool) -> subprocess.Popen:
    ready = tmp / "moto.ready"
    env = clean_env({"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(8 * 2**30)})   # keep objects in RAM
    proc = spawn([sys.executable, __file__, "--moto", "--result", str(ready),
                  "--nbytes", str(probe_bytes)] + (["--stock-moto"] if stock else []),
                 ns=S3_NS, env=env, log=tmp / "moto.log")
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the moto S3 server did not start:\n"
                             + (tmp / "moto.log").read_text(errors="replace")[-2000:])
        time.sleep(0.2)
    return proc


def serve_single_ranges_in_place() -> None:
    """Make moto serve a single-range GET (``Range: bytes=A-B``, what recovery.py sends) by
    reading only those bytes. Stock moto 5 reads (copies) the WHOLE object for every ranged GET
    and then slices it: about 0.14 s per GET of a 140 MB object on this machine, whatever the
    range, all in one Python process - a cost real S3 does not have, which would make
    restart-from-S3 look several times slower than its link. Patched in this script's moto
    process only (``--stock-moto`` turns it off); moto and the product are unchanged."""
    import re
    import threading

    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    whole = FakeKey.value
    local = threading.local()

    class Lazy:
        """What get_object returns as the body of a ranged GET: moto's range handling asks
        for len() and one slice."""

        def __init__(self, key):
            self.key = key

        def __len__(self):
            return self.key.size

        def __bool__(self):
            return self.key.size > 0

        def __getitem__(self, part: slice) -> bytes:
            with self.key.lock:
                self.key._value_buffer.seek(part.start)
                return self.key._value_buffer.read(part.stop - part.start)

    FakeKey.value = property(lambda key: Lazy(key) if getattr(local, "ranged", False)
                             else whole.fget(key), whole.fset)
    get_object = S3Response.get_object

    def ranged_get_object(self):
        local.ranged = re.fullmatch(r"bytes=\d+-\d+", self.headers.get("range") or "") is not None
        try:
            return get_object(self)
        finally:
            local.ranged = False

    S3Response.get_object = ranged_get_object


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def moto_main(args) -> None:
    """In the S3 namespace: moto's server on every interface, the bucket, the probe object."""
    import logging

    import boto3
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    if not args.stock_moto:
        serve_single_ranges_in_place()
    server = ThreadedMotoServer(ip_address="0.0.0.0", port=S3_HTTP_PORT, verbose=False)
    server.start()
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{S3_HTTP_PORT}").create_bucket(
        Bucket=BUCKET)
    # written in-process, not over a link: only the probe's GETs should cross the links
    s3_backends[DEFAULT_ACCOUNT_ID]["aws"].put_object(BUCKET, PROBE_KEY, os.urandom(args.nbytes))
    Path(args.result).write_text("ready")
    while True:
        time.sleep(3600)


# ---- measured rates ------------------------------------------------------------------------------

def probe_sink(args) -> None:
    """Accept one connection, read --nbytes, write the payload rate (bytes/s)."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((args.host, PROBE_PORT))
        srv.listen(1)
        Path(args.result + ".listening").write_text("")
        conn, _ = srv.accept()
        buf = bytearray(2**20)
        view = memoryview(buf)
        got = conn.recv_into(view)
        start = time.perf_counter()
        first = got
        while got < args.nbytes:
            n = conn.recv_into(view)
            if not n:
                break
            got += n
        elapsed = time.perf_counter() - start
        Path(args.result).write_text(json.dumps({"bytes": got - first, "seconds": elapsed}))


def probe_source(args) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((args.host, PROBE_PORT), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    block = bytes(2**20)
    sent = 0
    with conn:
        while sent < args.nbytes:
            conn.sendall(block)
            sent += len(block)


def tcp_rate(tmp: Path, sink_ns: str, sink_ip: str, source_ns: str, nbytes: int, tag: str) -> float:
    """Payload bytes/s of one TCP stream from source_ns to sink_ns (at sink_ip)."""
    result = tmp / f"probe-{tag}.json"
    sink = spawn([sys.executable, __file__, "--probe-sink", "--host", sink_ip, "--nbytes",
                  str(nbytes), "--result", str(result)], ns=sink_ns, log=tmp / f"{tag}-sink.log")
    deadline = time.monotonic() + 20
    while not Path(str(result) + ".listening").exists():
        if sink.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"probe {tag}: the sink did not start")
        time.sleep(0.05)
    source = spawn([sys.executable, __file__, "--probe-source", "--host", sink_ip, "--nbytes",
                    str(nbytes)], ns=source_ns, log=tmp / f"{tag}-source.log")
    wait_all([sink, source], 120, f"probe {tag}", [tmp / f"{tag}-sink.log",
                                                    tmp / f"{tag}-source.log"])
    r = json.loads(result.read_text())
    return r["bytes"] / r["seconds"]


def probe_s3(args) -> None:
    """One ranged GET of the probe object through S3Store (the product's client), started at
    --at so that every node downloads at the same time."""
    from megatron_autohet.checkpoint.s3_store import S3Store

    store = S3Store(f"s3://{BUCKET}", endpoint_url=args.endpoint)
    store.get_range(PROBE_KEY, 0, 2**20)           # connection set up, outside the timing
    time.sleep(max(0.0, args.at - time.time()))
    start = time.perf_counter()
    store.get_range(PROBE_KEY, 0, args.nbytes)
    elapsed = time.perf_counter() - start
    Path(args.result).write_text(json.dumps({"bytes": args.nbytes, "seconds": elapsed}))


def s3_rates(tmp: Path, nodes, nbytes: int) -> dict[str, float]:
    """Bytes/s each node gets from S3 with all of them downloading at once."""
    at = time.time() + 8
    procs, logs = [], []
    for node in nodes:
        logs.append(tmp / f"s3probe-{node}.log")
        procs.append(spawn([sys.executable, __file__, "--probe-s3", "--endpoint",
                            f"http://{S3_SERVER_IP[node]}:{S3_HTTP_PORT}", "--nbytes", str(nbytes),
                            "--at", str(at), "--result", str(tmp / f"s3probe-{node}.json")],
                           ns=NODE_NS[node], env=clean_env(), log=logs[-1]))
    wait_all(procs, 180, "S3 probe", logs)
    rates = {}
    for node in nodes:
        r = json.loads((tmp / f"s3probe-{node}.json").read_text())
        rates[node] = r["bytes"] / r["seconds"]
    return rates


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def evict(root: Path) -> None:
    """Drop our checkpoint files (only them) from the page cache."""
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_rate(root: Path) -> float:
    """Bytes/s of a cold sequential read of every file under ``root``."""
    evict(root)
    total, start = 0, time.perf_counter()
    for path in _files(root):
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(8 * 2**20):
                total += len(chunk)
    rate = total / (time.perf_counter() - start)
    evict(root)
    return rate


def manifest_variants(root: Path, algorithm: str) -> dict[str, dict[Path, bytes]]:
    """Every manifest under ``root`` (the node directories) as saved and with each checksum
    rewritten to ``algorithm`` (bytes hashed from whichever node directory holds the file of the
    same step): {"saved": {path: bytes}, algorithm: {path: bytes}}."""
    from megatron_autohet.checkpoint.manifest import HASHERS, MANIFEST_FILE

    manifests = sorted(root.glob(f"*/iter_*/{MANIFEST_FILE}"))
    out: dict[str, dict[Path, bytes]] = {"saved": {}, algorithm: {}}
    for path in manifests:
        raw = path.read_bytes()
        data = json.loads(raw)
        copies = [p.parent for p in manifests if p.parent.name == path.parent.name]

        def digest(name: str, offset: int, length: int | None) -> str:
            where = next(step / name for step in copies if (step / name).is_file())
            with open(where, "rb") as f:
                f.seek(offset)
                return f"{algorithm}:{HASHERS[algorithm](f.read(length)).hexdigest()}"
        for record in data["files"]:
            if record["digest"] is not None:
                record["digest"] = digest(record["name"], 0, None)
        for record in data["items"] + data["replicas"]:
            record["digest"] = digest(record["file"], record["offset"], record["length"])
        out["saved"][path] = raw
        out[algorithm][path] = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
    return out


# ---- one rank (runs inside its node's namespace) -------------------------------------------------

class Batches:
    """Deterministic random global batches (a resumed job sees exactly the same ones)."""

    def __init__(self, plan, count: int):
        import torch

        gen = torch.Generator().manual_seed(SEED)
        rows, seq, vocab = plan.global_batch_size, plan.seq_length, plan.model.vocab_size
        self.batches = []
        for _ in range(count):
            tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
            self.batches.append({"tokens": tokens[:, :-1].contiguous(),
                                 "labels": tokens[:, 1:].contiguous(),
                                 "loss_mask": torch.ones(rows, seq),
                                 "position_ids": torch.arange(seq).expand(rows, seq).contiguous()})

    def batch(self, iteration: int) -> dict:
        return self.batches[iteration]


def _counters(devices: dict[str, str]) -> dict:
    """rx/tx bytes of this namespace's interfaces (ip netns exec mounts the namespace's sysfs)."""
    out = {}
    for name, dev in devices.items():
        base = Path("/sys/class/net") / dev / "statistics"
        out[name] = {k: int((base / f"{k}_bytes").read_text()) for k in ("rx", "tx")}
    return out


def worker(args) -> None:
    silence_known_megatron_warnings()
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron_autohet.checkpoint.checkpointer import Checkpointer
    from megatron_autohet.checkpoint.options import CheckpointOptions
    from megatron_autohet.checkpoint.recovery_plan import OWN, PEER
    from megatron_autohet.plan import plan_from_dict
    from megatron_autohet.runtime.cpu_mode import cpu_mode_required, enable_cpu_mode
    from megatron_autohet.runtime.optimizer import OptimizerSettings, make_lr_scheduler
    from megatron_autohet.runtime.trainer import HeteroTrainer, train_iterations

    if cpu_mode_required():
        enable_cpu_mode()
    node, rank = args.node, args.rank
    plan = plan_from_dict(json.loads(Path(args.plan).read_text()), args.plan)
    dist.init_process_group("gloo", init_method=f"tcp://{FABRIC_IP[NODES[0]]}:{GLOO_PORT}",
                            rank=rank, world_size=plan.world_size, timeout=timedelta(minutes=10))
    resuming = args.worker == "resume"
    total = SAVE_ITERS + (1 if resuming else 0)
    settings = OptimizerSettings(lr=3e-4, min_lr=3e-5, clip_grad=1.0, lr_warmup_iters=1,
                                 lr_decay_style="cosine")
    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=SEED, optimizer=settings)
    # The schedule counts samples, as Megatron-LM's: stepped by the global batch size. Both jobs
    # have the schedule of the whole run (a resume checks that it continues the saved one).
    increment = plan.global_batch_size
    scheduler = make_lr_scheduler(trainer.optimizer, settings, SAVE_ITERS + 1, increment)
    endpoint = f"http://{S3_SERVER_IP[node]}:{S3_HTTP_PORT}"
    if resuming:
        options = CheckpointOptions(load=args.local, s3_uri=S3_URI, s3_endpoint_url=endpoint)
    else:
        options = CheckpointOptions(local_dir=args.local, save_interval=SAVE_INTERVAL,
                                    async_save=True, s3_uri=S3_URI, s3_endpoint_url=endpoint)
    checkpointer = Checkpointer(options, trainer, scheduler, seed=SEED, train_args={})
    devices = {"peer": FABRIC_DEV[node], "s3": S3_DEV[node]}
    out: dict = {"rank": rank, "node": node, "steps": []}

    # Timings of saves and of the resume are the product's own (Checkpointer.save_times,
    # RecoveryReport); only the calls of this loop are wrapped: a training step (its time and
    # loss) and the resume (a barrier first, the interfaces' byte counters around it).
    original_step = trainer.train_step

    def timed_step(batch):
        start = time.perf_counter()
        metrics = original_step(batch)
        out["steps"].append({"seconds": time.perf_counter() - start, "loss": metrics.loss,
                             "background_save": checkpointer._writer is not None
                             and checkpointer._writer.is_alive()})
        return metrics

    trainer.train_step = timed_step
    original_resume = checkpointer.resume

    def timed_resume():
        dist.barrier()
        before = _counters(devices)
        out["resume_started"] = time.time()
        start = time.perf_counter()
        progress = original_resume()
        out["resume_s"] = time.perf_counter() - start
        out["resume_ended"] = time.time()
        after = _counters(devices)
        out["iface_bytes"] = {name: {k: after[name][k] - before[name][k] for k in ("rx", "tx")}
                              for name in devices}
        out["iteration"] = progress.iteration
        report = checkpointer.last_report
        out["report"] = ({"bytes": report.bytes, "seconds": report.seconds}
                         if report is not None else None)
        if report is not None:
            out["sent_peer_bytes"] = report.sent_bytes
            out["exchange_s"] = report.seconds.get(PEER)
            out["verify_local_s"] = report.seconds.get(OWN)
        return progress

    checkpointer.resume = timed_resume
    dist.barrier()
    if not resuming:
        job_before = _counters(devices)
    train_iterations(trainer, Batches(plan, total), scheduler, train_iters=total,
                     scheduler_increment=increment, log=False, checkpointer=checkpointer)
    if not resuming:
        after = _counters(devices)
        out["iface_bytes"] = {name: {k: after[name][k] - job_before[name][k]
                                     for k in ("rx", "tx")} for name in devices}
    checkpointer.wait()
    out["saves"] = [{"iteration": t.iteration, "blocked_s": t.blocked_s,
                     "waited_previous_s": t.waited_s, "copy_s": t.snapshot_s,
                     "build_s": t.build_s} for t in checkpointer.save_times]
    out["background"] = [{"iteration": t.iteration, "write_s": t.write_s,
                          "upload_s": t.upload_s or 0.0} for t in checkpointer.save_times]
    out["failed_saves"] = checkpointer.failed_saves + checkpointer.failed_uploads
    dist.barrier()
    dist.destroy_process_group()
    Path(args.result).write_text(json.dumps(out))


# ---- the driver ----------------------------------------------------------------------------------

def run_job(tmp: Path, kind: str, plan: dict, nodes, local: str, timeout: float) -> tuple:
    """Start one rank per node (rank i in nodes[i]'s namespace); the per-rank results and the
    wall time at launch."""
    plan_path = tmp / f"plan-{kind}.json"
    plan_path.write_text(json.dumps(plan))
    procs, logs = [], []
    launched = time.time()
    for rank, node in enumerate(nodes):
        logs.append(tmp / f"{kind}-{node}.log")
        env = clean_env({"GLOO_SOCKET_IFNAME": FABRIC_DEV[node],
                         "MASTER_ADDR": FABRIC_IP[nodes[0]], "MASTER_PORT": str(GLOO_PORT),
                         "RANK": str(rank), "WORLD_SIZE": str(len(nodes))})
        procs.append(spawn([sys.executable, __file__, "--worker", "resume" if "resume" in kind
                            else "save", "--rank", str(rank), "--node", node, "--plan",
                            str(plan_path), "--local", local, "--result",
                            str(tmp / f"{kind}-{node}.json")],
                           ns=NODE_NS[node], env=env, log=logs[-1]))
    wait_all(procs, timeout, f"{kind} job", logs)
    results = [json.loads((tmp / f"{kind}-{node}.json").read_text()) for node in nodes]
    return results, launched, logs


def summarize_resume(results: list[dict], launched: float, rates: dict) -> dict:
    per_rank, terms = [], {}
    for r in results:
        node, b = r["node"], r["report"]["bytes"]
        sent = r.get("sent_peer_bytes", 0)
        per_rank.append({"rank": r["rank"], "node": node, "bytes": b, "sent_peer_bytes": sent,
                         "seconds": r["report"]["seconds"], "recover_s": r["resume_s"],
                         "exchange_s": r.get("exchange_s"),
                         "verify_local_s": r.get("verify_local_s"), "iface_bytes": r["iface_bytes"],
                         "launch_to_loaded_s": r["resume_ended"] - launched})
        terms[f"S3 -> {node}"] = b["s3"] / rates["s3"][node]
        terms[f"peers -> {node}"] = b["peer"] / rates["peer"]
        terms[f"{node} -> peers"] = sent / rates["peer"]
        terms[f"disk {node}"] = b["own"] / rates["disk"]
    # On real nodes every disk is its own; here the emulated nodes share this machine's one disk.
    separate = max(terms.items(), key=lambda t: t[1])
    terms["disk, shared by the emulated nodes"] = (sum(r["report"]["bytes"]["own"]
                                                       for r in results) / rates["disk"])
    bottleneck, floor = max(terms.items(), key=lambda t: t[1])
    recover_s = max(r["resume_s"] for r in results)
    return {"iteration": results[0]["iteration"],
            "recover_s": recover_s,
            "launch_to_loaded_s": max(r["resume_ended"] for r in results) - launched,
            "floor_s": floor, "floor_bottleneck": bottleneck,
            "recover_over_floor": recover_s / floor if floor else None,
            "floor_separate_disks_s": separate[1], "floor_separate_disks_bottleneck": separate[0],
            "floor_terms_s": terms,
            "bytes": {k: sum(r["report"]["bytes"][k] for r in results)
                      for k in ("own", "peer", "s3")},
            "loss_after": [s["loss"] for s in results[0]["steps"]],
            "per_rank": per_rank}


def summarize_save(results: list[dict]) -> dict:
    saves = []
    for i, first in enumerate(results[0]["saves"]):
        ranks = [dict(r["saves"][i], stall_s=r["saves"][i]["blocked_s"]
                      - r["saves"][i]["waited_previous_s"]) for r in results]
        for s in ranks:
            s["stall_over_copy"] = s["stall_s"] / s["copy_s"]
        worst = max(range(len(ranks)), key=lambda k: ranks[k]["stall_over_copy"])
        saves.append({"iteration": first["iteration"], "worst_rank": worst, **ranks[worst],
                      "per_rank": ranks})
    steps = [[s["seconds"] for s in r["steps"]] for r in results]
    # the slowest rank per iteration; the first iteration (warm-up) is left out
    slowest = [max(r["steps"][i]["seconds"] for r in results)
               for i in range(1, len(results[0]["steps"]))]
    busy = [any(r["steps"][i]["background_save"] for r in results)
            for i in range(1, len(results[0]["steps"]))]
    mean = lambda xs: sum(xs) / len(xs) if xs else None                    # noqa: E731
    background = [[dict(b, rank=r["rank"]) for b in r["background"]] for r in results]
    return {"saves": saves,
            "failed_saves": sorted({i for r in results for i in r["failed_saves"]}),
            "background_per_save": [{"iteration": per[0]["iteration"],
                                     "write_s": max(b["write_s"] for b in per),
                                     "upload_s": max(b.get("upload_s", 0.0) for b in per)}
                                    for per in zip(*background)],
            "background_per_rank": background,
            "step_s_per_rank": steps,
            "step_s_no_background_mean": mean([t for t, b in zip(slowest, busy) if not b]),
            "step_s_during_background_mean": mean([t for t, b in zip(slowest, busy) if b]),
            "iface_bytes": {r["node"]: r["iface_bytes"] for r in results}}


COMMAND_ARGS = ("peer_mbit", "s3_mbit", "queue_ms", "layers", "hidden", "vocab", "probe_mb",
                "stock_moto", "repeat", "background_load", "compare_checksum")


# A busy process beside the resumes (--background-load): one core's worth of CPU demand.
BUSY_LOOP = [sys.executable, "-c", "while True: pass"]


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        PROCS.remove(proc)


def median_run(runs: list[dict]) -> dict:
    """The run with the median recover() time (its details stand for the measurement), with
    every run's time beside it."""
    ordered = sorted(runs, key=lambda r: r["recover_s"])
    return dict(ordered[len(ordered) // 2], recover_s_runs=[r["recover_s"] for r in runs],
                load_average_1min_runs=[r["load_average_1min"] for r in runs])


def run(args) -> dict:
    model = model_dict(args)
    params, nbytes = state_bytes(model)
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=args.workdir))
    local = str(tmp / "local" / "{node}")
    node_dir = lambda n: Path(local.replace("{node}", n))                     # noqa: E731
    load_before = os.getloadavg()[0]
    moto_cpu = {}
    try:
        print(f"[1/6] network: {len(NODES)} node namespaces, a switch at {args.peer_mbit:g} "
              f"Mbit/s per node, S3 (moto) at {args.s3_mbit:g} Mbit/s per node", flush=True)
        net_up(args.peer_mbit, args.s3_mbit, args.queue_ms)
        moto = start_moto(tmp, args.probe_mb * 2**20, args.stock_moto)
        print("[2/6] measuring the links", flush=True)
        probe = args.probe_mb * 2**20
        rates = {
            "peer": tcp_rate(tmp, NODE_NS["n2"], FABRIC_IP["n2"], NODE_NS["n1"],
                             probe * max(1, round(args.peer_mbit / args.s3_mbit)), "peer"),
            "s3_link_tcp": tcp_rate(tmp, NODE_NS["n0"], S3_NODE_IP["n0"], S3_NS, probe,
                                    "s3link"),
            "s3": s3_rates(tmp, SURVIVORS, probe)}
        print(f"[3/6] save job: plan A on {', '.join(NODES)}, {SAVE_ITERS} iterations, "
              f"--save-interval {SAVE_INTERVAL} --async-save, node-local dirs + S3", flush=True)
        cpu = cpu_seconds(moto.pid)
        saved, save_launched, _ = run_job(tmp, "save", plan_a(model), NODES, local, args.timeout)
        moto_cpu["save_job"] = cpu_seconds(moto.pid) - cpu
        save = summarize_save(saved)
        save["job_s"] = time.time() - save_launched
        if save["failed_saves"]:
            raise SystemExit(f"saves/uploads failed at iterations {save['failed_saves']}")
        disk_bytes = {n: sum(p.stat().st_size for p in _files(node_dir(n))) for n in NODES}
        rates["disk"] = disk_rate(node_dir("n1"))
        loads = [0] + ([args.background_load] if args.background_load else [])
        # with --compare-checksum: the manifests as saved and rewritten (before n3's files go)
        variants = (manifest_variants(tmp / "local", args.compare_checksum)
                    if args.compare_checksum else {"saved": {}})

        def resumes(kind: str, checksums: list[str]) -> dict:
            """``kind``'s resume, ``--repeat`` times at each background load, with the manifests
            of each of ``checksums`` (a key of ``variants``) in turn: {(load, checksums):
            median}."""
            out = {}
            for busy in loads:
                runs: dict[str, list] = {c: [] for c in checksums}
                for _, checksum in ((r, c) for r in range(args.repeat) for c in checksums):
                    for path, raw in variants[checksum].items():
                        if path.exists():           # the lost node's are gone
                            path.write_bytes(raw)
                    if kind == "resume-local":
                        evict(tmp / "local")
                    hogs = [spawn(BUSY_LOOP) for _ in range(busy)]
                    load_average = os.getloadavg()[0]
                    cpu = cpu_seconds(moto.pid)
                    try:
                        results, launched, _ = run_job(tmp, kind, plan_b(model), SURVIVORS,
                                                       local, args.timeout)
                    finally:
                        stop(hogs)
                    moto_cpu.setdefault(f"{kind} job" + (f" +{busy}" if busy else ""),
                                        []).append(cpu_seconds(moto.pid) - cpu)
                    runs[checksum].append(dict(summarize_resume(results, launched, rates),
                                               load_average_1min=load_average))
                    print(f"      {kind}, {busy} busy processes beside it"
                          + ("" if checksum == "saved" else f", {checksum} checksums")
                          + f": recover() {runs[checksum][-1]['recover_s']:.2f} s (1-min load "
                          f"average {load_average:.1f})", flush=True)
                out.update({(busy, c): median_run(r) for c, r in runs.items()})
            return out

        print(f"[4/6] lost {LOST}; local-first resume on the survivors' plan "
              f"({' | '.join(SURVIVORS)}), {args.repeat} times"
              + (f", then as often with {args.background_load} busy processes beside it"
                 if args.background_load else ""), flush=True)
        shutil.rmtree(node_dir(LOST))
        compared = resumes("resume-local", list(variants))
        local_first = {busy: compared[busy, "saved"] for busy in loads}
        print("[5/6] restart-everything-from-S3: every local directory deleted, same plan",
              flush=True)
        for n in SURVIVORS:
            shutil.rmtree(node_dir(n))
        from_s3 = {busy: median for (busy, _), median in resumes("resume-s3", ["saved"]).items()}
    finally:
        kill_all()
        net_down()
        shutil.rmtree(tmp, ignore_errors=True)
    print("[6/6] done; namespaces, processes and files removed", flush=True)
    for busy in loads:
        for name, res in (("local-first", local_first[busy]), ("restart-from-S3", from_s3[busy])):
            if res["iteration"] != SAVE_ITERS:
                raise SystemExit(f"{name} resumed iteration {res['iteration']}, not {SAVE_ITERS}")
        if local_first[busy]["loss_after"] != from_s3[busy]["loss_after"]:
            raise SystemExit(f"the two resumes trained differently: "
                             f"{local_first[busy]['loss_after']} vs {from_s3[busy]['loss_after']}")
        if local_first[busy]["bytes"]["s3"] or from_s3[busy]["bytes"]["own"]:
            raise SystemExit(f"unexpected tiers: local-first {local_first[busy]['bytes']}, "
                             f"restart-from-S3 {from_s3[busy]['bytes']}")
    background = args.background_load
    return {"command": {k: v for k, v in vars(args).items() if k in COMMAND_ARGS},
            "model": model, "params": params, "state_bytes": nbytes,
            "plans": {"A": plan_a(model), "B": plan_b(model)}, "lost": LOST,
            "links": {"peer_mbit": args.peer_mbit, "s3_mbit": args.s3_mbit,
                      "queue_ms": args.queue_ms, "configured_ratio": args.peer_mbit / args.s3_mbit,
                      "measured_Bps": rates,
                      "measured_ratio": rates["peer"] / min(rates["s3"].values()),
                      "moto_ranged_gets": "stock (whole object copied per GET)"
                      if args.stock_moto else "patched to read only the range"},
            "node_dir_bytes_after_save": disk_bytes,
            "moto_cpu_s": moto_cpu,
            "save": save, "repeat": args.repeat,
            "local_first": local_first[0], "restart_from_s3": from_s3[0],
            "speedup_recover": from_s3[0]["recover_s"] / local_first[0]["recover_s"],
            "speedup_launch_to_loaded": (from_s3[0]["launch_to_loaded_s"]
                                         / local_first[0]["launch_to_loaded_s"]),
            "background_load": background and {
                "busy_processes": background, "local_first": local_first[background],
                "restart_from_s3": from_s3[background],
                "speedup_recover": (from_s3[background]["recover_s"]
                                    / local_first[background]["recover_s"])},
            "compare_checksum": args.compare_checksum and {
                "algorithm": args.compare_checksum,
                "local_first": {busy: compared[busy, args.compare_checksum] for busy in loads}},
            "losses_identical": True,
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}}


def print_table(result: dict) -> None:
    mb = lambda b: b / 1e6                                                 # noqa: E731
    mbit = lambda bps: bps * 8 / 1e6                                       # noqa: E731
    links, rates = result["links"], result["links"]["measured_Bps"]
    m = result["model"]
    print(f"model: {m['num_layers']} layers x hidden {m['hidden_size']}, vocab {m['vocab_size']}: "
          f"{result['params'] / 1e6:.1f} M params, {mb(result['state_bytes']):.0f} MB of fp32 "
          "weights + Adam moments; node directories after the save: "
          + ", ".join(f"{n} {mb(b):.0f}" for n, b in result["node_dir_bytes_after_save"].items())
          + " MB (2 steps kept, main chunks + replicas)")
    s3 = ", ".join(f"{n} {mbit(r):.0f}" for n, r in rates["s3"].items())
    print(f"links, configured -> measured: peers {links['peer_mbit']:g} -> "
          f"{mbit(rates['peer']):.0f} Mbit/s per node (raw TCP); S3 {links['s3_mbit']:g} -> "
          f"{mbit(rates['s3_link_tcp']):.0f} Mbit/s raw TCP, ranged GET from moto, 3 nodes at "
          f"once: {s3} Mbit/s; peers:S3 = {links['measured_ratio']:.1f}:1; local disk (cold "
          f"read) {mb(rates['disk']):.0f} MB/s; moto ranged GETs {links['moto_ranged_gets']}")
    stages = result["plans"]["B"]["pipelines"][0]["stages"]
    print(f"lost {result['lost']}; survivors' plan, one pipeline: "
          + " | ".join(f"{SURVIVORS[s['ranks'][0]]} layers [{s['layers'][0]},{s['layers'][1]})"
                       for s in stages)
          + f"; 1-min load average {result['load_average_1min']['before']:.1f} before, "
          f"{result['load_average_1min']['after']:.1f} after")
    print()
    busy = result["background_load"]
    rows = [("local-first", result["local_first"]),
            ("restart-from-S3", result["restart_from_s3"])]
    if busy:
        rows += [(f"local-first +{busy['busy_processes']}", busy["local_first"]),
                 (f"from-S3 +{busy['busy_processes']}", busy["restart_from_s3"])]
    print(f"recover(): median of {result['repeat']} runs each (+N: N busy processes beside it); "
          "load = 1-min load average when the median run started")
    print(f"{'recovery':<18} {'recover() s':>11} {'runs s':>18} {'load':>5} "
          f"{'launch->loaded s':>16} {'floor s':>8} "
          f"{'/floor':>7} {'own MB':>8} {'peer MB':>8} {'S3 MB':>8}  floor's bottleneck")
    for name, r in rows:
        runs = "/".join(f"{t:.2f}" for t in r["recover_s_runs"])
        print(f"{name:<18} {r['recover_s']:>11.2f} {runs:>18} {r['load_average_1min']:>5.1f} "
              f"{r['launch_to_loaded_s']:>16.2f} "
              f"{r['floor_s']:>8.2f} {r['recover_over_floor']:>7.2f} {mb(r['bytes']['own']):>8.1f} "
              f"{mb(r['bytes']['peer']):>8.1f} {mb(r['bytes']['s3']):>8.1f}  "
              f"{r['floor_bottleneck']} (separate disks: {r['floor_separate_disks_s']:.2f} s, "
              f"{r['floor_separate_disks_bottleneck']})")
    for name, key in (("local-first", "local_first"), ("restart-from-S3", "restart_from_s3")):
        print(f"  {name} per rank (s): " + "; ".join(
            f"{p['node']} " + " ".join(f"{k} {v:.2f}" for k, v in p["seconds"].items())
            + f" (verifying local chunks {p['verify_local_s'] or 0:.2f})"
            for p in result[key]["per_rank"]))
    lf = result["local_first"]
    print(f"local-first is {result['speedup_recover']:.1f}x faster in recover() (target >= 5x), "
          f"{result['speedup_launch_to_loaded']:.1f}x launch-to-loaded; local-first / floor "
          f"{lf['recover_over_floor']:.2f} (target <= 1.3; "
          f"{lf['recover_s'] / lf['floor_separate_disks_s']:.2f} against separate disks); "
          f"restart-from-S3 / floor {result['restart_from_s3']['recover_over_floor']:.2f}; "
          f"the next iteration's loss is identical after both: {result['losses_identical']}; "
          "moto CPU s: " + ", ".join(f"{k} " + ("/".join(f"{x:.1f}" for x in v)
                                                if isinstance(v, list) else f"{v:.1f}")
                                     for k, v in result["moto_cpu_s"].items()))
    if busy:
        print(f"with {busy['busy_processes']} busy processes beside it local-first is "
              f"{busy['speedup_recover']:.1f}x faster in recover() (target >= 3x)")
    compare = result["compare_checksum"]
    if compare:
        saved = {0: lf, **({busy["busy_processes"]: busy["local_first"]} if busy else {})}
        for load, r in compare["local_first"].items():
            runs = "/".join(f"{t:.2f}" for t in r["recover_s_runs"])
            print(f"local-first{f' +{load}' if load else ''} with {compare['algorithm']} chunk "
                  f"checksums (alternating with the step as saved): recover() {r['recover_s']:.2f}"
                  f" s (runs {runs}) = {r['recover_over_floor']:.2f}x its floor; as saved "
                  f"{saved[load]['recover_s']:.2f} s = {saved[load]['recover_over_floor']:.2f}x; "
                  "verifying local chunks " + ", ".join(
                      f"{p['node']} {p['verify_local_s'] or 0:.2f}" for p in r["per_rank"]))
    print()
    save = result["save"]
    print(f"{'async save':<10} {'blocked s':>10} {'waited prev s':>14} {'stall s':>8} "
          f"{'snapshot s':>11} {'stall/snap':>11} {'build dict s':>13}  (the rank with the highest "
          "stall/snapshot; then stall/snapshot of every rank)")
    for s in save["saves"]:
        print(f"iter {s['iteration']:<5} {s['blocked_s']:>10.3f} {s['waited_previous_s']:>14.2f} "
              f"{s['stall_s']:>8.3f} {s['copy_s']:>11.3f} {s['stall_over_copy']:>11.2f} "
              f"{s['build_s']:>13.3f}  "
              + " ".join(f"{r['stall_over_copy']:.2f}" for r in s["per_rank"]))
    quiet, during = save["step_s_no_background_mean"], save["step_s_during_background_mean"]
    print("stall = blocked - waited for the previous save; snapshot = the copy to host memory "
          "(state.snapshot); build dict = rank_sharded_state_dict, on the training thread too; "
          "background per save (slowest rank): "
          + ", ".join(f"iter {b['iteration']}: write {b['write_s']:.1f} s + upload "
                      f"{b['upload_s']:.1f} s" for b in save["background_per_save"])
          + (f"; training step {quiet:.2f} s without a background save, {during:.2f} s during one"
             if quiet and during else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer-mbit", type=float, default=1000.0,
                        help="each node's link to the others (both directions)")
    parser.add_argument("--s3-mbit", type=float, default=100.0,
                        help="each node's link to S3 (both directions)")
    parser.add_argument("--queue-ms", type=float, default=20.0,
                        help="longest a packet may wait in a shaped link's queue")
    parser.add_argument("--layers", type=int, default=6, help="transformer layers (even)")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (multiple of 64)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--probe-mb", type=int, default=24,
                        help="MiB per rate probe (the peer probe sends peer/S3 times more)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per job, seconds")
    parser.add_argument("--workdir", default=None,
                        help="where the node directories go (default: the system temp dir)")
    parser.add_argument("--json", default=str(ROOT / "bench-out" / "bench_recovery.json"),
                        help="where to write the results (default bench-out/, gitignored)")
    for hidden in ("--rank", "--node", "--plan", "--local", "--result", "--host", "--endpoint"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("save", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each resume; the median is reported (default 3)")
    parser.add_argument("--background-load", type=int, default=0, metavar="N",
                        help="also measure both resumes (as often) with N busy processes "
                             "beside them, in the same run (default 0: not)")
    parser.add_argument("--compare-checksum", default=None, metavar="ALGORITHM",
                        help="also resume local-first with every chunk checksum rewritten to "
                             "ALGORITHM (e.g. sha256), alternating with the step as saved")
    parser.add_argument("--stock-moto", action="store_true",
                        help="serve ranged GETs as moto does (copying the whole object each time)")
    for mode in ("--moto", "--probe-sink", "--probe-source", "--probe-s3"):
        parser.add_argument(mode, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.rank = int(args.rank)
        worker(args)
        return
    for flag, fn in (("moto", moto_main), ("probe_sink", probe_sink),
                     ("probe_source", probe_source), ("probe_s3", probe_s3)):
        if getattr(args, flag):
            fn(args)
            return
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("needs root and iproute2 (ip, tc) to build the emulated nodes")
    if args.layers % 2 or args.layers < 4 or args.hidden % 64:
        raise SystemExit("--layers must be even and >= 4, --hidden a multiple of 64")
    if args.repeat < 1 or args.background_load < 0:
        raise SystemExit("--repeat must be >= 1 and --background-load >= 0")
    from megatron_autohet.checkpoint.manifest import HASHERS
    if args.compare_checksum not in (None, *HASHERS):
        raise SystemExit(f"--compare-checksum: got {args.compare_checksum!r} (allowed: "
                         f"{', '.join(HASHERS)})")
    # Ctrl-C raises KeyboardInterrupt, SIGTERM SystemExit: either way run()'s finally cleans up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)   # even if started with it ignored
    result = run(args)
    print_table(result)
    write_json(result, args.json)


if __name__ == "__main__":
    main()
