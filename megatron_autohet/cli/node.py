"""`autohet node`: run this node's part of an elastic job (a torchrun agent with tuned settings).

Every node of a spot fleet runs this (scripts/launch_node.sh does, at boot). It starts
torch.distributed.elastic's agent - the same engine as ``torchrun`` - with one worker per GPU
running ``autohet train --elastic`` and the arguments after ``--``. Settings that differ from
torchrun's defaults, and why:

* the rendezvous store is hosted by ``autohet rendezvous``, not by an agent (``is_host=false``):
  an agent that hosts it takes the whole job down when its node is preempted;
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the agents' store shared with the workers, the
  first restart after a node loss fails to connect its process groups;
* ``last_call_timeout=1``, a keep-alive every second, a 0.1 s monitor interval and
  ``--loss-timeout`` (20 s by default, rendezvous setting ``loss_timeout``): a member of the
  round whose keep-alive every other agent saw unchanged for that long, and still at several
  polls over the last 2 s of it, is lost (elastic/liveness.py), and torch's own keep-alive expiry
  (``keep_alive_max_attempt``) is one second later, so the next round forms at once. torchrun's
  c10d default expires a node after 15 s on one reading; at 3 s (what this used) live nodes
  of a loaded machine that got no CPU for 3 s were declared lost over and over, an agent's own
  lapse included - each false loss costs a new round and up to a save interval;
* many restarts: every preemption uses one on every surviving node;
* the rendezvous backend ``autohet-c10d`` (megatron_autohet/elastic/rendezvous.py): torchrun's
  c10d rendezvous, but an agent whose round fails (its join timeout while it waits as a standby
  node, a round's rank 0 reclaimed before it published the workers' store) joins the next round,
  where torchrun's agent would exit and close the rendezvous for the whole job; and a member of
  the round lost without notice (its keep-alive lapsed for ``--loss-timeout``, confirmed) makes
  every agent kill its workers (SIGKILL: they are blocked in a collective with the lost node's)
  and start the next round, where torchrun's agents wait for their workers to fail (up to the
  process group's timeout, 10 minutes by default);
* warm workers (megatron_autohet/cli/warm.py): the node first starts a fork server that
  imports what a worker imports, and enters the rendezvous once it is ready; every worker of
  every round is then a fork of it, so a restart - a join above all - does not wait for Python,
  torch and megatron-core to load in each new process (``--cold-workers``: torchrun's fresh
  interpreters).

When the job is over, every agent ends: the nodes of its last round once their workers are done,
a standby node (never admitted, or waiting for the next round) when it finds the rendezvous
closed - which is the job's end, not a failure: exit status 0. A job that stopped for good (its
checkpoint saves failed: the last one, or --autohet-max-failed-saves in a row) ends every agent
with one line saying why and which steps are complete where, exit status 76 (EXIT_STOPPED),
instead of torchrun restarting its workers.

SIGTERM to this process (a supervisor stopping the node, Kubernetes without a watcher in the
pod, launch_node.sh's clean-up) is a preemption notice when the node has ``--notice-file``: it is
written there with ``--signal-grace`` seconds to its deadline, and the node leaves as it would
on the watcher's notice - its workers save, hand their files to the nodes that stay and stop,
the others re-plan in-process. Without a notice file torchrun handles it: the workers get
SIGTERM and stop, and the others see the node lost. torchrun's workers, the warm fork server
and its workers die with this process however it ends (system/parent_death.py).

The node's name and GPU type reach the workers as ``AUTOHET_NODE`` / ``AUTOHET_GPU``. When this
node got a preemption notice (``--notice-file`` holds one when the agent ends; a rebalance
recommendation is no preemption), the command exits 0 so a launcher loop knows not to start it
again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from megatron_autohet.cli.train import node_job
from megatron_autohet.cli.warm import READY, SOCKET_ENV
from megatron_autohet.elastic.liveness import (DEFAULT_LOSS_TIMEOUT_S, MIN_LOSS_TIMEOUT_S,
                                               check_loss_timeout, rdzv_conf)
from megatron_autohet.elastic.notices import (SIGNAL_GRACE_S, SignalWatcher, describe,
                                              preempt_notice_in, write_notice)
from megatron_autohet.errors import ConfigError, positive
from megatron_autohet.system.parent_death import PARENT_PID_ENV


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "node", help="run this node's torchrun agent of an elastic job",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rendezvous", required=True, metavar="HOST:PORT",
                   help="where `autohet rendezvous` runs")
    p.add_argument("--job-id", required=True, help="the job's name: one per job")
    p.add_argument("--nnodes", required=True, metavar="MIN:MAX",
                   help="nodes the job needs to start, and at most uses (torchrun's --nnodes)")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="G",
                   help="GPUs (workers) on this node (default 1)")
    p.add_argument("--node-name", default=None,
                   help="this node's name, stable across restarts (default: the hostname)")
    p.add_argument("--gpu", default=None,
                   help="GPU type (a catalog key; default: detected from the CUDA device name)")
    p.add_argument("--local-addr", default=None,
                   help="address other nodes reach this one at (default: the hostname's)")
    p.add_argument("--notice-file", default=None,
                   help="the preemption-notice file of this node (as given to `autohet watch` "
                        "and `autohet train --autohet-notice-file`)")
    p.add_argument("--signal-grace", type=float, default=None, metavar="SECONDS",
                   help="with --notice-file: SIGTERM to this process is a preemption notice "
                        "whose deadline is this many seconds after it (default "
                        f"{SIGNAL_GRACE_S:g}, Kubernetes' terminationGracePeriodSeconds)")
    p.add_argument("--loss-timeout", type=float, default=DEFAULT_LOSS_TIMEOUT_S,
                   metavar="SECONDS",
                   help="a node whose keep-alive (one a second) the others see unchanged this "
                        "long is lost without notice: every node kills its workers and the job "
                        "goes on from its last save (default "
                        f"{DEFAULT_LOSS_TIMEOUT_S:g}; at least {MIN_LOSS_TIMEOUT_S:g}). Shorter "
                        "finds a dead node sooner; but a live node that gets no CPU (or no "
                        "network to the rendezvous) this long is declared lost too, and a false "
                        "loss costs as much as a real one: a new round and up to a save "
                        "interval. Give every node of a job the same value")
    p.add_argument("--cold-workers", action="store_true",
                   help="start each worker in a fresh Python interpreter, as torchrun does "
                        "(default: forks of this node's warm fork server, imports done)")
    p.add_argument("--max-restarts", type=int, default=1000,
                   help="restarts of this node's workers before the agent gives up "
                        "(default 1000: each preemption uses one)")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="-- then the `autohet train` arguments (--elastic implied), checked "
                        "here and handed to the workers as a job file")
    p.set_defaults(func=run)


def torchrun_argv(args: argparse.Namespace, rdzv_backend: str,
                  worker_args: list[str]) -> list[str]:
    # SIGTERM is this process's own where it becomes a notice (module doc): torchrun's handler
    # would replace the notice's.
    handled = ("" if args.notice_file else "SIGTERM,") + "SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    argv = ["--nnodes", args.nnodes, "--nproc-per-node", str(args.nproc_per_node),
            "--rdzv-backend", rdzv_backend, "--rdzv-endpoint", args.rendezvous,
            "--rdzv-id", args.job_id, "--rdzv-conf", rdzv_conf(args.loss_timeout),
            "--max-restarts", str(args.max_restarts), "--monitor-interval", "0.1",
            "--signals-to-handle", handled]
    if args.local_addr:
        argv += ["--local-addr", args.local_addr]
    entry = "megatron_autohet.cli.main" if args.cold_workers else "megatron_autohet.cli.warm"
    return argv + ["-m", entry, *worker_args]


def run(args: argparse.Namespace) -> int:
    job = node_job(args.train_args)     # bad training arguments: one line, before anything starts
    # torch: not at `autohet` start-up
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from megatron_autohet.elastic.rendezvous import EXIT_STOPPED, ENDPOINT_ENV, JobStopped
    from megatron_autohet.elastic.rendezvous import close as close_rendezvous
    from megatron_autohet.elastic.rendezvous import register as register_rendezvous

    if args.signal_grace is not None:
        if not args.notice_file:
            raise ConfigError("<command line>", "--signal-grace", "given without --notice-file",
                              "with --notice-file (SIGTERM becomes a notice written there)")
        positive(args.signal_grace, "--signal-grace")
    check_loss_timeout(args.loss_timeout)
    if args.nproc_per_node < 1:
        raise ConfigError("<command line>", "--nproc-per-node", f"got {args.nproc_per_node}",
                          "GPUs on this node, >= 1")
    os.environ["AUTOHET_NODE"] = args.node_name or socket.gethostname()
    # Where the others reach this node's workers (a store after an in-process re-plan).
    os.environ["AUTOHET_LOCAL_ADDR"] = args.local_addr or socket.gethostname()
    if args.gpu is not None:
        os.environ["AUTOHET_GPU"] = args.gpu
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ[ENDPOINT_ENV] = args.rendezvous      # a worker that stops the job says so there
    # torchrun's workers die with this agent (system/parent_death.py); the process is the
    # node's for good, so its environment keeps it
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    if args.notice_file:
        sigterm_as_notice(args.notice_file, args.signal_grace or SIGNAL_GRACE_S)
    server = None if args.cold_workers else start_fork_server()
    spare = {server[0].pid} if server else set()
    job_dir = tempfile.mkdtemp(prefix="autohet-node-job-")
    argv = torchrun_argv(args, register_rendezvous(notice_file=args.notice_file,
                                                   stop_workers=lambda: kill_children(spare)),
                         job.write(job_dir))
    status = 0
    try:
        while True:
            try:
                torchrun(get_args_parser().parse_args(argv))
                break
            except DistStoreError as err:
                # A store read that timed out after the rendezvous (a round's agent died before
                # the workers' ranks were assigned): not the job's end - the next round.
                said = str(err).strip().splitlines()
                print("autohet node: a rendezvous round failed after it completed (DistStoreError"
                      + (f": {said[0]}" if said else "") + "); joining the next round",
                      file=sys.stderr, flush=True)
        if not (args.notice_file and preempt_notice_in(args.notice_file)):
            close_rendezvous()        # this node's workers finished the job
    except RendezvousClosedError:
        print(f"autohet node: {os.environ['AUTOHET_NODE']}: the job's rendezvous is closed: the "
              "job has ended", file=sys.stderr)
    except JobStopped as stopped:
        print(f"autohet node: {os.environ['AUTOHET_NODE']}: the job stopped for good: {stopped}",
              file=sys.stderr)
        status = EXIT_STOPPED
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    except Exception as err:            # noqa: BLE001 - the agent's failure, already logged
        print(f"autohet node: the torchrun agent ended: {type(err).__name__}: {err}",
              file=sys.stderr)
        status = 1
    finally:
        if server is not None:
            stop_fork_server(*server)
        shutil.rmtree(job_dir, ignore_errors=True)
    if args.notice_file and preempt_notice_in(args.notice_file):
        print(f"autohet node: {os.environ['AUTOHET_NODE']} left the job after its preemption "
              "notice", file=sys.stderr)
        return 0
    return status


def sigterm_as_notice(notice_file: str, grace_s: float) -> None:
    """From now on SIGTERM to this process writes a preemption notice to ``notice_file`` (module
    doc), unless one is there already (a cloud's, whose deadline stands), from a thread that
    lives as long as the process; the handler is installed here, in the main thread, as Python
    requires."""
    watcher = SignalWatcher(("SIGTERM",), grace_s=grace_s, wait_s=1.0)
    name = os.environ["AUTOHET_NODE"]

    def write_when_signalled() -> None:
        notice = None
        while notice is None:
            notice = watcher.poll()
        if preempt_notice_in(notice_file):
            said = f"the preemption notice already in {notice_file} stands"
        else:
            write_notice(notice_file, notice)
            said = f"{describe(notice)}, written to {notice_file}"
        print(f"autohet node: {name}: SIGTERM: {said}; its workers save and leave",
              file=sys.stderr, flush=True)
    threading.Thread(target=write_when_signalled, daemon=True, name="sigterm-notice").start()


def start_fork_server():
    """This node's warm fork server, ready (its imports done) when this returns: (process, its
    socket's directory). None when it failed to start: the workers then start cold."""
    where = tempfile.mkdtemp(prefix="autohet-warm-")
    path = os.path.join(where, "fork.sock")
    server = subprocess.Popen([sys.executable, "-m", "megatron_autohet.cli.warm", "--serve",
                               path, str(os.getpid())], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL)
    said = server.stdout.readline()
    if said != READY:
        print(f"autohet node: the warm fork server did not start (status {server.wait()}): "
              "workers start cold", file=sys.stderr)
        os.environ.pop(SOCKET_ENV, None)
        shutil.rmtree(where, ignore_errors=True)
        return None
    os.environ[SOCKET_ENV] = path         # torchrun's workers inherit it: the client finds it
    return server, where


def stop_fork_server(server, where: str) -> None:
    server.terminate()
    server.wait()
    shutil.rmtree(where, ignore_errors=True)


def kill_children(spare: set[int]) -> None:
    """SIGKILL this process's children but ``spare`` (the fork server): torchrun's workers, each
    with its process group (torchrun starts each in a session of its own). A warm worker goes
    with its client: the fork server kills it when the client's connection drops."""
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in spare:
            continue
        try:
            with open(os.path.join(entry.path, "stat")) as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            if parent == me:
                pid = int(entry.name)
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):      # gone meanwhile
            continue
