"""Preemption notices: each watcher against a fake metadata server speaking its cloud's protocol
(tests/helpers/fake_metadata.py), the notice file, watch(), and `autohet watch` as a real process.

Nothing here asserts on wall-clock time: hanging requests and signals are synchronised with
events and request counts, and timeouts are only there so a broken test fails instead of
hanging.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from email.utils import parsedate_to_datetime
from datetime import datetime, timezone
from pathlib import Path

import pytest

from helpers.fake_metadata import FakeAws, FakeAzure, FakeGcp
from megatron_autohet.cli.main import main
from megatron_autohet.elastic.notices import (AwsWatcher, AzureWatcher, GcpWatcher, Notice,
                                              SignalWatcher, preempt_notice_in, read_notice, watch,
                                              write_notice)
from megatron_autohet.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
AWS_TIME = "2026-11-23T08:22:00Z"
AWS_DEADLINE = datetime(2026, 11, 23, 8, 22, tzinfo=timezone.utc).timestamp()
AZURE_NOT_BEFORE = "Mon, 19 Sep 2016 18:29:47 GMT"
AZURE_DEADLINE = datetime(2016, 9, 19, 18, 29, 47, tzinfo=timezone.utc).timestamp()


@pytest.fixture
def aws():
    with FakeAws() as server:
        yield server


@pytest.fixture
def gcp():
    with FakeGcp() as server:
        yield server


@pytest.fixture
def azure():
    with FakeAzure() as server:
        yield server


# ---- the fakes refuse what the clouds refuse -----------------------------------------------------

def _status(url: str, headers: dict | None = None, method: str = "GET") -> int:
    request = urllib.request.Request(url, headers=headers or {}, method=method,
                                     data=b"" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.unit
def test_fakes_require_the_clouds_headers(aws, gcp, azure):
    assert _status(aws.url + "/latest/api/token", method="PUT") == 400          # no TTL header
    assert _status(aws.url + AwsWatcher.INSTANCE_ACTION) == 401                 # no token
    assert _status(aws.url + AwsWatcher.INSTANCE_ACTION,
                   {"X-aws-ec2-metadata-token": "made-up"}) == 401
    assert _status(gcp.url + GcpWatcher.PATH) == 403
    assert _status(gcp.url + GcpWatcher.PATH, {"Metadata-Flavor": "Google"}) == 200
    assert _status(azure.url + AzureWatcher.EVENTS) == 400
    assert _status(azure.url + AzureWatcher.EVENTS, {"Metadata": "true"}) == 200


# ---- the notice file ---------------------------------------------------------------------------

@pytest.mark.unit
def test_notice_json_round_trip():
    notice = Notice("aws", "preempt", AWS_DEADLINE, AWS_DEADLINE - 118.0,
                    {"action": "terminate", "time": AWS_TIME})
    assert Notice.from_json(notice.to_json()) == notice
    assert notice.seconds_to_deadline == 118.0
    assert json.loads(notice.to_json()) == {
        "source": "aws", "kind": "preempt", "deadline_unix": AWS_DEADLINE,
        "received_unix": AWS_DEADLINE - 118.0, "detail": {"action": "terminate", "time": AWS_TIME}}


@pytest.mark.unit
def test_read_notice_absent_and_malformed(tmp_path):
    path = tmp_path / "notice.json"
    assert read_notice(path) is None
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="notice.json: field '<file>': not JSON"):
        read_notice(path)
    path.write_text(json.dumps({"source": "aws", "kind": "evict", "deadline_unix": None,
                                "received_unix": 1.0, "detail": {}}))
    with pytest.raises(ConfigError, match="field 'kind': got 'evict' .allowed: preempt, "
                                          "rebalance"):
        read_notice(path)
    path.write_text(json.dumps({"source": "aws", "kind": "preempt", "deadline_unix": None}))
    with pytest.raises(ConfigError, match="field 'received_unix': missing"):
        read_notice(path)


@pytest.mark.unit
def test_preempt_notice_is_never_replaced_by_a_rebalance(tmp_path):
    path = tmp_path / "notice.json"
    rebalance = Notice("aws", "rebalance", None, 10.0, {"noticeTime": AWS_TIME})
    preempt = Notice("aws", "preempt", AWS_DEADLINE, 20.0, {"action": "stop"})
    assert write_notice(path, rebalance) == rebalance
    assert write_notice(path, preempt) == preempt             # a preempt replaces a rebalance
    assert write_notice(path, rebalance) == preempt
    assert read_notice(path) == preempt
    assert [p.name for p in tmp_path.iterdir()] == ["notice.json"]   # no temporary file left


# ---- AWS ---------------------------------------------------------------------------------------

@pytest.mark.unit
def test_aws_preempt(aws):
    watcher = AwsWatcher(aws.url)
    assert watcher.poll() is None
    aws.schedule_preemption("terminate", AWS_TIME)
    notice = watcher.poll()
    assert notice == Notice("aws", "preempt", AWS_DEADLINE, notice.received_unix,
                            {"action": "terminate", "time": AWS_TIME})


@pytest.mark.unit
def test_aws_token_is_put_with_ttl_reused_and_renewed_after_401(aws):
    watcher = AwsWatcher(aws.url, token_ttl_s=600)
    assert watcher.poll() is None and watcher.poll() is None
    assert aws.requests[0] == ("PUT", "/latest/api/token")
    assert aws.token_puts == 1                       # one token for both polls
    aws.expire_tokens()
    assert watcher.poll() is None                    # 401, new token, same GET again
    assert aws.token_puts == 2
    aws.schedule_preemption("hibernate", AWS_TIME)
    assert watcher.poll().detail["action"] == "hibernate"


@pytest.mark.unit
def test_aws_token_renewed_before_it_expires(aws):
    now = [1000.0]
    watcher = AwsWatcher(aws.url, token_ttl_s=600, clock=lambda: now[0])
    assert watcher.poll() is None
    before = len(aws.requests)
    now[0] += 600 - 30                               # within a minute of expiry
    assert watcher.poll() is None
    assert aws.requests[before][0] == "PUT"          # renewed first, not after a 401
    assert aws.token_puts == 2


@pytest.mark.unit
def test_aws_rebalance_then_preempt(aws):
    watcher = AwsWatcher(aws.url)
    aws.recommend_rebalance("2026-11-23T08:17:00Z")
    notice = watcher.poll()
    assert (notice.source, notice.kind, notice.deadline_unix, notice.detail) == (
        "aws", "rebalance", None, {"noticeTime": "2026-11-23T08:17:00Z"})
    aws.schedule_preemption("stop", AWS_TIME)
    notice = watcher.poll()
    assert (notice.kind, notice.deadline_unix, notice.detail["action"]) == (
        "preempt", AWS_DEADLINE, "stop")


# ---- GCP ---------------------------------------------------------------------------------------

@pytest.mark.unit
def test_gcp_preempt(gcp):
    watcher = GcpWatcher(gcp.url)
    assert watcher.poll() is None
    gcp.schedule_preemption()
    notice = watcher.poll()
    assert notice == Notice("gcp", "preempt", notice.received_unix + 30.0, notice.received_unix,
                            {"preempted": "TRUE"})


@pytest.mark.unit
def test_gcp_wait_for_change_blocks_until_the_change(gcp):
    watcher = GcpWatcher(gcp.url, wait_s=60)
    assert watcher.poll() is None                    # reads FALSE and its ETag, does not wait
    result = []
    poller = threading.Thread(target=lambda: result.append(watcher.poll()))
    poller.start()
    gcp.wait_until_waiting()
    assert gcp.requests[-1][1] == (f"{GcpWatcher.PATH}?wait_for_change=true&last_etag="
                                   f"{gcp.etag}&timeout_sec=60")
    assert result == [] and poller.is_alive()        # the server has not answered yet
    gcp.schedule_preemption()
    poller.join(timeout=20)
    assert result[0].kind == "preempt" and result[0].source == "gcp"


@pytest.mark.unit
def test_gcp_already_preempted_before_the_first_poll(gcp):
    gcp.schedule_preemption()
    assert GcpWatcher(gcp.url, wait_s=60).poll().kind == "preempt"
    assert gcp.requests == [("GET", GcpWatcher.PATH)]   # no hanging first request


# ---- Azure -------------------------------------------------------------------------------------

@pytest.mark.unit
def test_azure_preempt_for_this_vm_only(azure):
    watcher = AzureWatcher(azure.url)                # name read from the instance metadata
    assert watcher.poll() is None
    azure.schedule_event("Preempt", resources=["other-vm"])
    azure.schedule_event("Freeze", resources=[azure.vm_name])
    azure.schedule_event("Reboot", resources=[azure.vm_name])
    assert watcher.poll() is None
    event_id = azure.schedule_event("Preempt", resources=["other-vm", azure.vm_name],
                                    not_before=AZURE_NOT_BEFORE)
    notice = watcher.poll()
    assert watcher.vm_name == "spot-vm-0"
    assert (notice.source, notice.kind, notice.deadline_unix) == ("azure", "preempt",
                                                                  AZURE_DEADLINE)
    assert notice.detail["EventId"] == event_id and notice.detail["DocumentIncarnation"] == 5


@pytest.mark.unit
def test_azure_vm_name_given(azure):
    watcher = AzureWatcher(azure.url, vm_name="named-vm")
    azure.schedule_event("Preempt", resources=[azure.vm_name])
    assert watcher.poll() is None
    azure.schedule_event("Preempt", resources=["named-vm"])
    assert watcher.poll().kind == "preempt"
    assert not any("compute/name" in path for _, path in azure.requests)


@pytest.mark.unit
def test_rfc1123_parse_matches_the_standard_library():
    assert AZURE_DEADLINE == parsedate_to_datetime(AZURE_NOT_BEFORE).timestamp()


# ---- unreachable servers -----------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("make", [AwsWatcher, GcpWatcher, AzureWatcher],
                         ids=["aws", "gcp", "azure"])
def test_unreachable_metadata_server_is_logged_once(make, refused_url):
    logs = []
    watcher = make(refused_url, timeout_s=0.5, log=logs.append)
    assert watcher.poll() is None and watcher.poll() is None
    assert len(logs) == 1 and logs[0].startswith(f"WARNING: {watcher.source} metadata server")


@pytest.mark.unit
def test_misbehaving_metadata_server_does_not_crash(gcp):
    logs = []
    watcher = GcpWatcher(gcp.url + "/wrong-prefix", log=logs.append)
    assert watcher.poll() is None
    assert "HTTP 404" in logs[0]


# ---- signals -----------------------------------------------------------------------------------

@pytest.mark.integration
def test_signal_watcher():
    watcher = SignalWatcher(("SIGUSR1",), grace_s=45.0, wait_s=20.0)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        notice = watcher.poll()
    finally:
        watcher.close()
    assert notice == Notice("signal", "preempt", notice.received_unix + 45.0,
                            notice.received_unix, {"signal": "SIGUSR1"})
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


@pytest.mark.unit
def test_signal_watcher_needs_the_main_thread():
    errors = []

    def make():
        try:
            SignalWatcher()
        except RuntimeError as err:
            errors.append(str(err))
    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert "main thread" in errors[0]


# ---- watch() -----------------------------------------------------------------------------------

def _join_pollers() -> None:
    """watch() returns without waiting for its pollers (daemon threads, one per source): one in
    the middle of a request finishes it first, and once the test's fake server is gone it would
    log a warning into whichever test runs next. Wait for them to end."""
    for thread in threading.enumerate():
        if thread.name.startswith("notice-"):
            thread.join(timeout=20)
            assert not thread.is_alive(), thread.name


@pytest.mark.unit
def test_watch_rebalance_then_preempt(aws, gcp, tmp_path):
    notice_file, events = tmp_path / "notice.json", tmp_path / "events.jsonl"
    logs, rebalanced = [], threading.Event()

    def log(line):
        logs.append(line)
        if "rebalance" in line:
            rebalanced.set()
    aws.recommend_rebalance()
    result = []
    watcher = threading.Thread(target=lambda: result.append(watch(
        [AwsWatcher(aws.url), GcpWatcher(gcp.url, wait_s=60)], notice_file,
        poll_interval_s=0.02, events_jsonl=events, log=log)))
    watcher.start()
    assert rebalanced.wait(20)
    assert read_notice(notice_file).kind == "rebalance"
    aws.wait_for_requests(len(aws.requests) + 4)     # it polls on after the rebalance
    aws.schedule_preemption("terminate", AWS_TIME)
    watcher.join(timeout=20)
    gcp.schedule_preemption()             # answers GCP's waiting poll, so its thread ends too
    _join_pollers()
    notice = result[0]
    assert (notice.source, notice.kind, notice.deadline_unix) == ("aws", "preempt", AWS_DEADLINE)
    assert read_notice(notice_file) == notice
    assert len(logs) == 2 and logs[0].startswith(" > rebalance recommendation from aws")
    assert logs[1] == (f" > preemption notice from aws: terminate at {AWS_TIME} "
                       f"(in {AWS_DEADLINE - notice.received_unix:.1f} s)")
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(r["event"], r["kind"]) for r in lines] == [("notice", "rebalance"),
                                                         ("notice", "preempt")]
    assert lines[1]["seconds_to_deadline"] == AWS_DEADLINE - notice.received_unix
    assert lines[1]["deadline_unix"] == AWS_DEADLINE and lines[1]["source"] == "aws"


@pytest.mark.unit
def test_watch_returns_none_when_stopped(aws, tmp_path):
    stop = threading.Event()
    stop.set()
    assert watch([AwsWatcher(aws.url)], tmp_path / "n.json", stop=stop) is None
    _join_pollers()
    assert not (tmp_path / "n.json").exists()


# ---- autohet watch -------------------------------------------------------------------------------

def _start_cli(*args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen([sys.executable, "-m", "megatron_autohet.cli.main", "watch",
                                *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    first = process.stdout.readline()
    assert first.startswith(" > watching"), first     # watchers (and signal handlers) are up
    return process


def _finish(process: subprocess.Popen) -> str:
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out
    return out


@pytest.mark.integration
@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_cli_watch_cloud(cloud, request, tmp_path):
    server = request.getfixturevalue(cloud)
    notice_file = tmp_path / "notice.json"
    process = _start_cli("--source", cloud, "--metadata-url", server.url, "--notice-file",
                         notice_file, "--poll-interval", "0.05", "--events-jsonl",
                         tmp_path / "events.jsonl")
    try:
        server.wait_for_requests(len(server.requests) + 3)    # it is polling
        assert not notice_file.exists()
        server.schedule_preemption()
        out = _finish(process)
    finally:
        process.kill()
    notice = read_notice(notice_file)
    assert (notice.source, notice.kind) == (cloud, "preempt")
    assert f" > preemption notice from {cloud}: " in out and f" > wrote {notice_file}" in out
    assert json.loads((tmp_path / "events.jsonl").read_text())["source"] == cloud


@pytest.mark.integration
def test_cli_watch_signal(tmp_path):
    notice_file = tmp_path / "notice.json"
    process = _start_cli("--source", "signal", "--notice-file", notice_file, "--signal-grace",
                         "45")
    try:
        process.send_signal(signal.SIGTERM)
        out = _finish(process)
    finally:
        process.kill()
    notice = read_notice(notice_file)
    assert (notice.source, notice.kind, notice.detail) == ("signal", "preempt",
                                                           {"signal": "SIGTERM"})
    assert notice.deadline_unix == notice.received_unix + 45.0
    assert " > preemption notice from signal: SIGTERM at " in out


@pytest.mark.unit
@pytest.mark.parametrize("argv, message", [
    (["--source", "aws"], "field '--notice-file': missing"),
    (["--notice-file", "{tmp}/n.json"], "field '--source': none given"),
    (["--notice-file", "{tmp}/n.json", "--source", "ibm"],
     "field '--source': 'ibm' is not a source (allowed: aws, gcp, azure, signal"),
    (["--notice-file", "{tmp}/no/such/dir/n.json", "--source", "aws"],
     "field '--notice-file': {tmp}/no/such/dir/n.json: directory"),
    (["--notice-file", "{tmp}/n.json", "--source", "aws", "--poll-interval", "0"],
     "field '--poll-interval': got 0.0 (allowed: a number > 0)"),
    (["--notice-file", "{tmp}/n.json", "--source", "signal", "--signal-grace", "-1"],
     "field '--signal-grace': got -1.0"),
    (["--notice-file", "{tmp}/n.json", "--source", "signal", "--metadata-url", "http://x"],
     "field '--metadata-url': given without a cloud source"),
    (["--notice-file", "{tmp}/n.json", "--source", "aws", "--metadata-url", "169.254.169.254"],
     "field '--metadata-url': '169.254.169.254' (allowed: an http:// or https:// URL)"),
    (["--notice-file", "{tmp}/n.json", "--source", "aws", "--azure-vm-name", "vm"],
     "field '--azure-vm-name': given without --source azure"),
], ids=["no-notice-file", "no-source", "bad-source", "missing-dir", "poll-interval",
        "signal-grace", "url-without-cloud", "url-scheme", "vm-name-without-azure"])
def test_cli_watch_bad_flags(capsys, tmp_path, argv, message):
    rc = main(["watch", *(a.replace("{tmp}", str(tmp_path)) for a in argv)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1
    assert err.startswith("autohet watch: error: <command line>: ")
    assert message.replace("{tmp}", str(tmp_path)) in err


@pytest.mark.unit
def test_cli_watch_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["watch", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--notice-file", "--source", "--metadata-url", "--azure-vm-name",
                 "--poll-interval", "--signal-grace", "--events-jsonl", "(default: 30)"):
        assert text in out
    main([])
    assert "watch" in capsys.readouterr().out


# ---- what a notice file means to `autohet node` ----------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("kind, status", [("preempt", 0), ("rebalance", 3), (None, 3)])
def test_cli_node_status_after_its_agent_failed(kind, status, tmp_path, monkeypatch):
    """`autohet node` exits 0 when its agent ended after a preempt notice (launch_node.sh then
    leaves instead of starting it again); a rebalance recommendation is advice, not a notice:
    the agent's own status. The torchrun agent is replaced by one that fails at once (what it
    does is tested in test_elastic.py)."""
    import torch.distributed.run

    def failed_agent(args):
        raise SystemExit(3)

    monkeypatch.setattr(torch.distributed.run, "run", failed_agent)
    for name in ("AUTOHET_NODE", "AUTOHET_LOCAL_ADDR", "AUTOHET_GPU",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.setenv(name, "")                  # `autohet node` sets them: restored after
    notice = tmp_path / "notice.json"
    if kind is not None:
        write_notice(notice, Notice("aws", kind, None, 1.0, {}))
    assert main(["node", "--rendezvous", "127.0.0.1:29400", "--job-id", "job1", "--nnodes",
                 "1:2", "--node-name", "n1", "--gpu", "H800", "--notice-file", str(notice),
                 "--cold-workers",          # no workers start: a warm fork server would idle
                 "--", "--plan", str(REPO / "configs/plans/tiny-two-pipelines.yaml"),
                 "--model", str(REPO / "configs/models/tiny.yaml"),
                 "--cluster", str(REPO / "configs/clusters/spot-4.yaml"), "--save-interval",
                 "4", "--autohet-local-ckpt-dir", str(tmp_path / "ckpt")]) == status
    assert preempt_notice_in(notice) is (kind == "preempt")
