"""Recovery after losing nodes: own disk, then surviving peers, then S3 - and exactly that order.

Every test saves tiny-two-pipelines (nodes a100 [TP2 stage], h800, h20) with node-local
directories (``{node}`` in the path: one directory per emulated node) and the S3 tier (moto's
real HTTP server), deletes what the lost nodes had, resumes on a plan for the survivors and
checks (1) the resumed run equals the uninterrupted one and (2) the bytes each tier served.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_autohet.checkpoint.manifest import (MANIFEST_FILE, Manifest, committed_steps,
                                                  read_manifest, step_dir_name)
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.checkpoint.recovery_plan import copies_of
from megatron_autohet.checkpoint.state import RNG_KEY
from helpers.dist_utils import RankFailed, run_on_ranks
from helpers.checkpointing import HALF, REL, TOTAL, TWO_PIPELINES as A, survivors_plan, train_job
from helpers.cli import table
from helpers.training import global_batches, plan, rel

PIECE_BYTES = 4096      # the peer exchange's message size here: most tiny chunks cross in pieces


def _train_with_report(rank, world, the_plan, batches, options, exit_interval=None):
    from megatron_autohet.checkpoint import checkpointer as module, recovery

    recovery.EXCHANGE_PIECE_BYTES = PIECE_BYTES

    reports = []
    original = module.Checkpointer.resume

    def resume(self):
        progress = original(self)
        reports.append(self.last_report)
        return progress

    module.Checkpointer.resume = resume
    metrics = train_job(rank, world, the_plan, batches, options, exit_interval)
    report = reports[0]
    return metrics, (report.bytes if report else None)


@pytest.fixture(scope="module")
def full_and_batches():
    a = plan(A)
    batches = global_batches(a, TOTAL)
    return run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions())[0], batches


def _save_half(tmp_path, batches, s3_uri=None, endpoint=None, async_save=False):
    local = str(tmp_path / "local" / "{node}")
    options = CheckpointOptions(local_dir=local, save_interval=HALF, s3_uri=s3_uri,
                                s3_endpoint_url=endpoint, async_save=async_save)
    first = run_on_ranks(4, train_job, plan(A), batches, options, exit_interval=HALF)[0]
    return local, first


def _resume(local, survivors, batches, s3_uri=None, endpoint=None, resume_without_s3=False):
    options = CheckpointOptions(load=local, s3_uri=s3_uri, s3_endpoint_url=endpoint,
                                resume_without_s3=resume_without_s3)
    results = run_on_ranks(survivors.world_size, _train_with_report, survivors, batches, options)
    return results[0][0], [bytes_ for _, bytes_ in results]


def _check_equal(full, first, rest):
    resumed = first + rest
    diffs = [max(rel(x[0], y[0]), rel(x[1], y[1])) for x, y in zip(resumed, full)]
    assert len(resumed) == TOTAL and max(diffs) <= REL, diffs


def _node_dir(local: str, node: str) -> Path:
    return Path(local.replace("{node}", node))


LOSSES = {   # lost node -> the survivors' plan (stage order, layer cuts)
    "h20": (["a100", "h800"], [0, 4, 6]),
    # h20 takes layers 0-2 from its own replicas; the a100 stage takes 2-6 and gets the lost
    # h800's layers 4-6 from h20's replicas over the network
    "h800": (["h20", "a100"], [0, 2, 6]),
}


@pytest.mark.e2e
@pytest.mark.parametrize("lost", list(LOSSES))
def test_one_node_lost_recovers_from_survivors_without_s3(lost, full_and_batches, tmp_path,
                                                          s3_endpoint, s3_uri):
    """Every chunk the lost node held has a copy on a survivor (the other pipeline's replica),
    so nothing is read from S3 although S3 has the step."""
    full, batches = full_and_batches
    endpoint, _ = s3_endpoint
    local, first = _save_half(tmp_path, batches, s3_uri, endpoint)
    shutil.rmtree(_node_dir(local, lost))
    survivors = survivors_plan(*LOSSES[lost])
    rest, per_rank = _resume(local, survivors, batches, s3_uri, endpoint)
    _check_equal(full, first, rest)
    assert sum(b["s3"] for b in per_rank) == 0
    if lost == "h800":
        assert per_rank[0]["peer"] > 0 and per_rank[1]["peer"] > 0, per_rank   # the a100 ranks


@pytest.mark.e2e
def test_corrupt_copy_on_a_peer_is_fetched_again_from_s3(full_and_batches, tmp_path,
                                                         s3_endpoint, s3_uri, capfd):
    """h800 lost: the a100 ranks receive layers 4-6 from h20's replicas. One of those chunks is
    damaged on h20's disk: the receiver finds it, the copy is dropped for every rank, and that
    chunk alone comes from S3 in a second round; training resumes exactly."""
    full, batches = full_and_batches
    endpoint, _ = s3_endpoint
    local, first = _save_half(tmp_path, batches, s3_uri, endpoint)
    shutil.rmtree(_node_dir(local, "h800"))
    step = _node_dir(local, "h20") / step_dir_name(HALF)
    manifest = read_manifest(step)
    bad = max((r for r in manifest.replicas if manifest.files[r.file].node == "h20"
               and ".decoder.layers." in r.key and r.offsets[0] >= 4),
              key=lambda r: r.length)
    assert bad.length > 2 * PIECE_BYTES                    # a chunk of several messages
    raw = bytearray((step / bad.file).read_bytes())
    raw[bad.offset + bad.length // 2] ^= 0x10
    (step / bad.file).write_bytes(bytes(raw))
    survivors = survivors_plan(*LOSSES["h800"])
    rest, per_rank = _resume(local, survivors, batches, s3_uri, endpoint)
    _check_equal(full, first, rest)
    assert sum(b["s3"] for b in per_rank) == bad.length          # that chunk, downloaded once
    assert (f"WARNING: chunk {bad.key} at {bad.offsets} received from rank 2 ({bad.file}) fails "
            "its checksum; not loaded, fetching the chunk elsewhere") in capfd.readouterr().out


@pytest.mark.e2e
def test_a_corrupt_s3_copy_fails_every_rank_together(full_and_batches, tmp_path, s3_endpoint,
                                                     s3_uri):
    """Every disk lost, one chunk damaged in S3: the rank that downloads it (and forwards it to
    its TP peer) finds the damage, and every rank raises the same error naming the object at
    the end of the round; none is left waiting for the chunk (or failing on a closed
    connection)."""
    from megatron_autohet.checkpoint.s3_store import S3Store

    full, batches = full_and_batches
    endpoint, _ = s3_endpoint
    local, _ = _save_half(tmp_path, batches, s3_uri, endpoint)
    manifest = read_manifest(_node_dir(local, "h20") / step_dir_name(HALF))
    for node in ("a100", "h800", "h20"):
        shutil.rmtree(_node_dir(local, node))
    # a chunk of layers 4-6 (saved whole by the TP1 h800 stage), which both TP2 a100 ranks of
    # the survivors' plan need: the lowest downloads it and forwards it
    bad = max((item for item in manifest.items
               if ".decoder.layers." in item.key and item.offsets[0] >= 4),
              key=lambda item: item.length)
    store = S3Store(s3_uri, endpoint_url=endpoint)
    key = f"{step_dir_name(HALF)}/{bad.file}"
    raw = bytearray(store.get_bytes(key))
    raw[bad.offset + bad.length // 2] ^= 0x10
    store.put_bytes(key, bytes(raw))
    survivors = survivors_plan(*LOSSES["h800"])
    with pytest.raises(RankFailed) as failed:
        _resume(local, survivors, batches, s3_uri, endpoint)
    message = (f"JobConfigError: <command line>: field '--load': no checkpoint step in {local} "
               f"or {s3_uri} can be recovered: iteration {HALF}: {store.location.uri(key)}: "
               f"bytes {bad.offset}-{bad.offset + bad.length} ({bad.key}) do not match their "
               "checksum in the manifest")
    reports = str(failed.value).split("--- rank ")[1:]
    assert [r.split(" ", 1)[0] for r in reports] == ["0", "1", "2"]
    assert all(message in r for r in reports), str(failed.value)[-3000:]


@pytest.mark.e2e
def test_a_corrupt_small_file_on_one_node_fails_every_rank_together(
        full_and_batches, tmp_path, s3_endpoint, s3_uri):
    """Every survivor reads the step's small files from its own disk (no collective); h20's
    common.pt is damaged: every rank raises the same error naming that file, at the fetch's
    first all-gather, none is left waiting for the others."""
    full, batches = full_and_batches
    endpoint, _ = s3_endpoint
    local, _ = _save_half(tmp_path, batches, s3_uri, endpoint)
    shutil.rmtree(_node_dir(local, "h800"))
    common = _node_dir(local, "h20") / step_dir_name(HALF) / "common.pt"
    raw = bytearray(common.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    common.write_bytes(bytes(raw))
    with pytest.raises(RankFailed) as failed:
        _resume(local, survivors_plan(*LOSSES["h800"]), batches, s3_uri, endpoint)
    reports = str(failed.value).split("--- rank ")[1:]
    assert [r.split(" ", 1)[0] for r in reports] == ["0", "1", "2"]
    message = (f"JobConfigError: <command line>: field '--load': no checkpoint step in {local} "
               f"or {s3_uri} can be recovered: iteration {HALF}: {common} of iteration {HALF} "
               "does not match its checksum")
    assert all(message in r for r in reports), str(failed.value)[-3000:]


@pytest.mark.e2e
def test_s3_serves_exactly_the_chunks_no_surviving_disk_holds(full_and_batches, tmp_path,
                                                              s3_endpoint, s3_uri):
    full, batches = full_and_batches
    endpoint, _ = s3_endpoint
    local, first = _save_half(tmp_path, batches, s3_uri, endpoint)
    manifest = read_manifest(_node_dir(local, "h800") / step_dir_name(HALF))
    for lost in ("a100", "h20"):
        shutil.rmtree(_node_dir(local, lost))
    survivors = survivors_plan(["h800"])            # one rank: it needs every chunk
    rest, per_rank = _resume(local, survivors, batches, s3_uri, endpoint)
    _check_equal(full, first, rest)
    on_h800 = {name for name, f in manifest.files.items() if f.node == "h800"}
    # everything but the per-rank RNG states (restored only into the plan that saved them)
    lost_only = sum(copies[0].length for copies in copies_of(manifest.items, manifest.replicas)
                    if not any(c.file in on_h800 for c in copies)
                    and not copies[0].key.startswith(RNG_KEY))
    assert lost_only > 0
    assert per_rank[0]["s3"] == lost_only


@pytest.mark.e2e
def test_async_save_and_upload_resume_exactly(full_and_batches, tmp_path, s3_endpoint, s3_uri):
    """--async-save: the step written in the background is the one training had at the save."""
    full, batches = full_and_batches
    endpoint, _ = s3_endpoint
    local, first = _save_half(tmp_path, batches, s3_uri, endpoint, async_save=True)
    assert first == full[:HALF]
    manifest = read_manifest(_node_dir(local, "h20") / step_dir_name(HALF))
    for node in ("a100", "h800", "h20"):            # every disk lost: S3 alone
        shutil.rmtree(_node_dir(local, node))
    rest, per_rank = _resume(local, plan(A), batches, s3_uri, endpoint)
    _check_equal(full, first, rest)
    assert sum(b["own"] for b in per_rank) == 0
    # each chunk downloaded once, by the first rank needing it (then passed on to the others)
    assert sum(b["s3"] for b in per_rank) == sum(item.length for item in manifest.items)


@pytest.mark.e2e
def test_s3_unreachable_at_save_and_at_recovery(full_and_batches, tmp_path, capfd, refused_url,
                                                monkeypatch):
    """S3 down: saves stay local (the upload is reported; the run's last save not reaching S3
    ends the job with status 1, its local step complete) and recovery with complete local
    copies does not need S3 when told so (--autohet-resume-without-s3; without it the job
    stops: tests/checkpoint/test_s3_unreachable.py). No attempt at the listing is repeated here
    (the limit 0)."""
    from megatron_autohet.checkpoint.sources import S3_REACH_ENV

    monkeypatch.setenv(S3_REACH_ENV, "0")
    full, batches = full_and_batches
    dead = refused_url
    with pytest.raises(RankFailed, match="CheckpointStop"):
        _save_half(tmp_path, batches, "s3://autohet-test/down", dead)
    local, first = str(tmp_path / "local" / "{node}"), full[:HALF]
    out, err = capfd.readouterr()
    assert f"WARNING: uploading iteration {HALF} to s3://autohet-test/down failed: " in out
    assert f"the local checkpoint of iteration {HALF} is complete" in out
    assert (f"ERROR: the last checkpoint (iteration {HALF}) did not reach "
            "s3://autohet-test/down: ") in err
    rest, per_rank = _resume(local, plan(A), batches, "s3://autohet-test/down", dead,
                             resume_without_s3=True)
    _check_equal(full, first, rest)
    assert "WARNING: the S3 tier s3://autohet-test/down is unreachable (" in \
        capfd.readouterr().out


@pytest.mark.integration
def test_failed_save_is_reported_and_the_next_interval_saves(full_and_batches, tmp_path, capfd):
    full, batches = full_and_batches
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / f"{step_dir_name(HALF)}.partial").write_text("not a directory")   # blocks step 4
    metrics = run_on_ranks(4, train_job, plan(A), batches,
                           CheckpointOptions(save=str(save), save_interval=HALF))[0]
    assert metrics == full
    out = capfd.readouterr().out
    assert f"WARNING: checkpoint of iteration {HALF} failed: " in out
    assert "training goes on and the next interval saves again" in out
    assert committed_steps(save) == [TOTAL]


def _bigger_tiny(tmp_path: Path) -> tuple[Path, Path]:
    """tiny-two-pipelines with hidden size 192: the data files of the main copies (the first
    pipeline's ranks, about 12 MB each) are above S3Store's 8 MiB multipart threshold. Returns
    the model and plan files."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    model = yaml.safe_load((root / "configs/models/tiny.yaml").read_text())
    model.update(name="tiny-192", hidden_size=192, ffn_hidden_size=768)
    data = yaml.safe_load((root / "configs/plans/tiny-two-pipelines.yaml").read_text())
    data["model"].update(name="tiny-192", hidden_size=192, ffn_hidden_size=768)
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(data))
    return tmp_path / "model.yaml", tmp_path / "plan.yaml"


@pytest.mark.e2e
def test_job_killed_during_its_multipart_upload(tmp_path, s3_endpoint, s3_uri, monkeypatch,
                                                capsys):
    """A real kill during an upload: `autohet train` with the S3 tier gets SIGKILL (launcher and
    every rank) while a multipart upload of step 8 is in flight - moto's server (in this
    process) holds the first part it gets until the job is dead; every file of the step that its
    rank does not upload after the held one is in S3 by then. Step 8 has no manifest in S3,
    `autohet checkpoint ls` shows it incomplete, step 4 loads from S3 alone (every node's disk
    lost) and the resumed job trains iterations 5-8 exactly as the killed one did and uploads
    step 8 completely."""
    import json
    import subprocess
    import sys
    import threading

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import S3Backend, s3_backends

    from megatron_autohet.checkpoint.s3_store import S3Store, parse_s3_uri
    from megatron_autohet.checkpoint.upload import files_to_upload
    from megatron_autohet.cli.main import main as cli
    from megatron_autohet.testing.emulate import kill_tree

    endpoint, bucket = s3_endpoint
    location = parse_s3_uri(s3_uri)
    step8 = location.key(step_dir_name(TOTAL) + "/")
    in_flight, dead = threading.Event(), threading.Event()
    held: list[str] = []
    upload_part = S3Backend.upload_part

    def hold_parts_of_one_step8_file(self, bucket_name, multipart_id, part_id, value):
        # Every part of the first step-8 file a part arrives for, retries included (boto3
        # retries a part whose answer does not come within its read timeout), is held until
        # the job is dead (or the test failed).
        key = self.get_bucket(bucket_name).multiparts[multipart_id].key_name
        if key.startswith(step8) and held in ([], [key]) and not dead.is_set():
            held[:] = [key]
            in_flight.set()
            dead.wait(timeout=600)
        return upload_part(self, bucket_name, multipart_id, part_id, value)

    monkeypatch.setattr(S3Backend, "upload_part", hold_parts_of_one_step8_file)
    model, plan_file = _bigger_tiny(tmp_path)
    root = Path(__file__).resolve().parents[2]
    local = tmp_path / "local" / "{node}"
    metrics = tmp_path / "metrics.jsonl"
    command = [sys.executable, "-m", "megatron_autohet.cli.main", "train",
               "--plan", str(plan_file), "--model", str(model), "--iters", str(TOTAL),
               "--autohet-local-ckpt-dir", str(local), "--save-interval", str(HALF),
               "--load", str(local), "--metrics-jsonl", str(metrics),
               "--data-dir", str(tmp_path / "data"), "--autohet-s3-uri", s3_uri,
               "--autohet-s3-endpoint-url", endpoint]
    node_dir = lambda node: Path(str(local).replace("{node}", node))       # noqa: E731
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    output = tmp_path / "killed-job.log"
    with open(output, "wb") as log:
        job = subprocess.Popen(command, cwd=root, stdout=log, stderr=subprocess.STDOUT)
    try:
        while not in_flight.wait(timeout=0.05):
            assert job.poll() is None, ("the job ended before uploading step 8:\n"
                                        + output.read_text(errors="replace")[-3000:])
        # Step 8 is committed on the disks (the upload follows the local commit). Each rank
        # uploads its files in order, so every file but the held one and those its rank uploads
        # after it reaches S3 while the held one waits (which rank's part arrives first is a
        # race: often rank 0, whose small files come last).
        manifest = read_manifest(node_dir("h20") / step_dir_name(TOTAL))
        held_name = held[0].rsplit("/", 1)[1]
        owner = files_to_upload(manifest, manifest.files[held_name].rank)
        behind_held = owner[owner.index(held_name):]
        others = {location.key(f"{step_dir_name(TOTAL)}/{name}") for rank in range(4)
                  for name in files_to_upload(manifest, rank) if name not in behind_held}
        assert others, "nothing but the held file and those behind it to wait for"
        while not others <= set(backend.get_bucket(bucket).keys.keys()):
            assert job.poll() is None
            dead.wait(timeout=0.05)
        kill_tree(job.pid)
    finally:
        job.wait()
        dead.set()
    assert len(held) == 1 and manifest.files[held[0].rsplit("/", 1)[1]].size > 8 * 2**20
    killed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in killed] == list(range(1, TOTAL + 1))

    store = S3Store(s3_uri, endpoint_url=endpoint)
    assert store.get_bytes(f"{step_dir_name(TOTAL)}/{MANIFEST_FILE}") is None
    assert store.list_steps() == [HALF, TOTAL]
    flag = ("--autohet-s3-endpoint-url", endpoint)
    assert cli(["checkpoint", "ls", s3_uri, *flag]) == 0
    rows = table(capsys.readouterr().out)
    assert [(r["iteration"], r["complete"], r["why incomplete"]) for r in rows] == [
        (str(HALF), "yes", ""), (str(TOTAL), "no", "no manifest: the upload did not finish")]

    for node in ("a100", "h800", "h20"):           # every disk lost: S3 alone
        shutil.rmtree(node_dir(node))
    resumed = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"successfully loaded checkpoint: recovered iteration {HALF}" in resumed.stdout
    assert f"uploaded iteration {TOTAL} to {s3_uri}" in resumed.stdout
    after = [json.loads(line) for line in metrics.read_text().splitlines()][TOTAL:]
    assert [r["iteration"] for r in after] == list(range(HALF + 1, TOTAL + 1))
    assert [(r["lm_loss"], r["grad_norm"], r["learning_rate"]) for r in after] == \
        [(r["lm_loss"], r["grad_norm"], r["learning_rate"]) for r in killed[HALF:]]
    assert cli(["checkpoint", "ls", s3_uri, *flag]) == 0
    rows = table(capsys.readouterr().out)
    assert [(r["iteration"], r["complete"]) for r in rows] == [(str(HALF), "yes"),
                                                               (str(TOTAL), "yes")]
    assert cli(["checkpoint", "verify", s3_uri, *flag, "--iteration", str(TOTAL)]) == 0


@pytest.mark.e2e
def test_two_savers_racing_for_one_step_commit_it_once(s3_endpoint, s3_uri, tmp_path):
    """The second manifest write for a step finds the first and backs off (IfNoneMatch)."""
    from megatron_autohet.checkpoint.manifest import FileRecord

    endpoint, _ = s3_endpoint

    def race(rank, world):
        from megatron_autohet.checkpoint.s3_store import S3Store
        from megatron_autohet.checkpoint.upload import upload_step

        store = S3Store(s3_uri, endpoint_url=endpoint)
        results = []
        for saver in ("first", "second"):
            step = tmp_path / saver
            step.mkdir()
            for name in (".metadata", "common.pt", "metadata.json"):
                (step / name).write_text(saver)
            manifest = Manifest(iteration=TOTAL, items=[], plan={"saver": saver}, files={
                name: FileRecord(name, len(saver), 0, "n") for name in
                (".metadata", "common.pt", "metadata.json")})
            results.append(upload_step(store, manifest, step, rank=0, keep=2).committed)
        stored = store.get_bytes(f"{step_dir_name(TOTAL)}/{MANIFEST_FILE}")
        return results, Manifest.from_json(stored, "s3").plan

    results, stored_plan = run_on_ranks(1, race)[0]
    assert results == [True, False]
    assert stored_plan == {"saver": "first"}


@pytest.mark.e2e
def test_job_killed_while_writing_a_step_resumes_from_the_previous_one(tmp_path):
    """A real kill: `autohet train` (every rank) gets SIGKILL while step 8 is being written.
    Nothing of step 8 is loaded; the restarted job resumes at step 4 and trains iterations 5-8
    exactly as the killed job had (the same plan: bit-identical)."""
    import json
    import subprocess
    import sys
    import time

    from megatron_autohet.testing.emulate import kill_tree

    root = Path(__file__).resolve().parents[2]
    local = tmp_path / "local" / "{node}"
    metrics = tmp_path / "metrics.jsonl"
    command = [sys.executable, "-m", "megatron_autohet.cli.main", "train",
               "--plan", str(root / "configs/plans/tiny-two-pipelines.yaml"),
               "--model", str(root / "configs/models/tiny.yaml"), "--iters", str(TOTAL),
               "--autohet-local-ckpt-dir", str(local), "--save-interval", str(HALF),
               "--load", str(local), "--metrics-jsonl", str(metrics),
               "--data-dir", str(tmp_path / "data")]
    writing = Path(str(local).replace("{node}", "a100")) / f"{step_dir_name(TOTAL)}.partial"
    job = subprocess.Popen(command, cwd=root, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        while not writing.exists() and job.poll() is None:
            time.sleep(0.002)
        kill_tree(job.pid)                                 # the launcher and every rank
    finally:
        job.wait()
    killed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in killed] == list(range(1, TOTAL + 1))
    for node in ("a100", "h800", "h20"):
        assert committed_steps(Path(str(local).replace("{node}", node))) == [HALF]

    resumed = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"successfully loaded checkpoint: recovered iteration {HALF}" in resumed.stdout
    after = [json.loads(line) for line in metrics.read_text().splitlines()][TOTAL:]
    assert [r["iteration"] for r in after] == list(range(HALF + 1, TOTAL + 1))
    assert [(r["lm_loss"], r["grad_norm"], r["learning_rate"]) for r in after] == \
        [(r["lm_loss"], r["grad_norm"], r["learning_rate"]) for r in killed[HALF:]]


@pytest.mark.e2e
def test_sigterm_with_exit_signal_handler_saves_the_iteration_in_flight(tmp_path):
    """`autohet train --exit-signal-handler` (Megatron-LM's flag): SIGTERM to the launcher
    reaches every rank through torchrun's agent; they stop after the same iteration, save it (no
    periodic save is due) and exit. The restarted job resumes exactly there and logs what an
    uninterrupted run logs (same plan: bit-identical)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    iters = 16
    base = [sys.executable, "-m", "megatron_autohet.cli.main", "train",
            "--plan", str(root / "configs/plans/tiny-two-pipelines.yaml"),
            "--model", str(root / "configs/models/tiny.yaml"), "--iters", str(iters),
            "--data-dir", str(tmp_path / "data")]
    reference = tmp_path / "reference.jsonl"
    done = subprocess.run(base + ["--metrics-jsonl", str(reference)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    local = tmp_path / "local" / "{node}"
    metrics = tmp_path / "metrics.jsonl"
    command = base + ["--autohet-local-ckpt-dir", str(local), "--save-interval", "1000",
                      "--load", str(local), "--metrics-jsonl", str(metrics),
                      "--exit-signal-handler"]
    job = subprocess.Popen(command, cwd=root, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    while job.poll() is None and (not metrics.exists() or
                                  len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.01)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 128 + signal.SIGTERM
    stopped = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = stopped[-1]["iteration"]
    assert 3 <= last < iters
    for node in ("a100", "h800", "h20"):
        assert committed_steps(Path(str(local).replace("{node}", node))) == [last]

    resumed = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"successfully loaded checkpoint: recovered iteration {last}" in resumed.stdout
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    expected = [json.loads(line) for line in reference.read_text().splitlines()]
    assert [r["iteration"] for r in logged] == list(range(1, iters + 1))
    assert [(r["lm_loss"], r["grad_norm"], r["learning_rate"]) for r in logged] == \
        [(r["lm_loss"], r["grad_norm"], r["learning_rate"]) for r in expected]


@pytest.mark.unit
def test_a_region_no_chunk_holds_is_found_before_anything_is_fetched():
    """recovery_plan.uncovered: the wanted regions the manifest's chunks leave (partly) open;
    recovery fails a step with any, so a load never leaves part of a tensor unwritten."""
    from megatron_autohet.checkpoint.manifest import ItemRecord
    from megatron_autohet.checkpoint.recovery_plan import Wanted, uncovered

    def chunk(key, offsets, sizes):
        return ItemRecord(key, offsets, sizes, "f.distcp", 0, 1, "xxh3_128:" + "0" * 32)

    items = [chunk("w", (0, 0), (2, 4)), chunk("w", (2, 0), (2, 4)), chunk("rng", None, None)]
    whole, lower, obj = Wanted("w", (0, 0), (4, 4)), Wanted("w", (1, 2), (3, 2)), \
        Wanted("rng", None, None)
    assert uncovered(items, [whole, lower, obj]) == []
    assert uncovered(items[1:], [whole, lower, obj]) == [whole, lower]
    assert uncovered(items[:2], [whole, obj]) == [obj]
    assert uncovered(items, [Wanted("w", (0, 0), (5, 4))]) == [Wanted("w", (0, 0), (5, 4))]


@pytest.mark.unit
def test_each_chunk_comes_from_the_first_tier_that_has_it():
    """recovery_plan.assign_sources asks the tiers in order (checkpoint/sources.py): own disk,
    then a peer (the fewest bytes assigned, then the lowest rank; on a fleet across zones the
    zone's first: test_recovery_zones.py), then the object store, whose chunk is downloaded
    once, by the lowest rank, and forwarded."""
    from megatron_autohet.checkpoint.manifest import ItemRecord
    from megatron_autohet.checkpoint.recovery_plan import ChunkUnavailable, assign_sources
    from megatron_autohet.checkpoint.sources import OWN, PEER, S3

    def chunk(key, file, length):
        return ItemRecord(key, (0,), (length,), file, 0, length, "xxh3_128:" + "0" * 32)

    items = [chunk("a", "a.distcp", 10), chunk("b", "b.distcp", 20), chunk("c", "c.distcp", 30)]
    replica = chunk("a", "a-replica.distcp", 10)       # chunk 0's copy on rank 2's disk
    present = {0: {"a.distcp"}, 1: {"b.distcp"}, 2: {"a-replica.distcp"}, 3: set()}
    needed = {0: [0, 1, 2], 1: [0], 3: [0, 2]}

    def plan():
        return [(f.rank, f.index, f.source, f.copy.file, f.peer)
                for f in assign_sources(items, [replica], needed, present, True)]

    assert plan() == [(0, 0, OWN, "a.distcp", None), (0, 1, PEER, "b.distcp", 1),
                      (0, 2, S3, "c.distcp", None),
                      (1, 0, PEER, "a.distcp", 0),               # rank 0: 0 bytes so far
                      (3, 0, PEER, "a-replica.distcp", 2),       # rank 0 has 10 by now
                      (3, 2, S3, "c.distcp", 0)]                 # rank 0 downloads, forwards
    with pytest.raises(ChunkUnavailable, match="c.distcp"):
        assign_sources(items, [replica], needed, present, False)


def _train_reading_two_chunks_at_once(rank, world, the_plan, batches, options):
    """A resume in which the first two own-disk chunk reads of each rank wait for each other:
    it completes only if two reads run at the same time (a single reader thread would wait
    for a second read that never starts, until the barrier's timeout breaks it). The readers
    run at the process's CPU priority (a lowered one starved them beside busy processes)."""
    import os
    import threading

    from megatron_autohet.checkpoint import recovery

    recovery.VERIFY_THREADS = 2
    both = threading.Barrier(2, timeout=120)
    calls = []
    original = recovery.read_item

    def read_item(f, item):
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == \
            os.getpriority(os.PRIO_PROCESS, os.getpid()), "a chunk reader runs niced"
        calls.append(item)
        if len(calls) <= 2:
            both.wait()
        return original(f, item)

    recovery.read_item = read_item
    return train_job(rank, world, the_plan, batches, options)


@pytest.mark.e2e
def test_own_disk_chunks_are_read_and_verified_in_parallel(full_and_batches, tmp_path):
    full, batches = full_and_batches
    local, first = _save_half(tmp_path, batches)
    rest = run_on_ranks(4, _train_reading_two_chunks_at_once, plan(A), batches,
                        CheckpointOptions(load=local))[0]
    _check_equal(full, first, rest)


def _resume_through_flaky_s3(rank, world, the_plan, batches, options, broken_step):
    """Resume with the first attempt at every S3 read of this rank failing (an S3Error, as a
    500 that boto3's own retries did not get past), and every read of ``broken_step``'s files
    failing. (Per request, not every n-th call: the chunk reads run in threads.)"""
    import threading

    from megatron_autohet.checkpoint.s3_store import S3Error, S3Store

    tried, lock = set(), threading.Lock()

    def flaky(original):
        def read(self, key, *args):
            with lock:
                first = (key, args) not in tried
                tried.add((key, args))
            if first or (broken_step is not None
                         and key.startswith(step_dir_name(broken_step) + "/")):
                raise S3Error("get", self.location.uri(key), "An error occurred (500) when "
                              "calling the GetObject operation", "500")
            return original(self, key, *args)
        return read
    S3Store.get_bytes = flaky(S3Store.get_bytes)
    S3Store.get_range = flaky(S3Store.get_range)
    return _train_with_report(rank, world, the_plan, batches, options)


@pytest.mark.e2e
@pytest.mark.parametrize("broken", [False, True])
def test_s3_errors_at_recovery_are_retried_and_a_broken_step_falls_back(
        full_and_batches, tmp_path, s3_endpoint, s3_uri, capfd, broken):
    """Every disk lost, S3 alone: a transient error on every read's first attempt is retried per
    request and the resume is exact; a step S3 never gives is given up in one WARNING line, as a
    corrupt copy would be, and the next older one resumes exactly."""
    full, batches = full_and_batches
    endpoint, _ = s3_endpoint
    local = str(tmp_path / "local" / "{node}")
    options = CheckpointOptions(local_dir=local, save_interval=HALF // 2, s3_uri=s3_uri,
                                s3_endpoint_url=endpoint)
    first = run_on_ranks(4, train_job, plan(A), batches, options, exit_interval=HALF)[0]
    for node in ("a100", "h800", "h20"):
        shutil.rmtree(_node_dir(local, node))
    capfd.readouterr()
    resume = CheckpointOptions(load=local, s3_uri=s3_uri, s3_endpoint_url=endpoint)
    results = run_on_ranks(4, _resume_through_flaky_s3, plan(A), batches, resume,
                           HALF if broken else None)
    rest = results[0][0]
    out = capfd.readouterr().out
    if broken:
        _check_equal(full, first[:HALF // 2], rest)
        warnings = [line for line in out.splitlines() if "WARNING" in line]
        assert len(warnings) == 1, warnings
        assert (f"WARNING: cannot recover iteration {HALF} (" in warnings[0]
                and f"falling back to iteration {HALF // 2}" in warnings[0])
    else:
        _check_equal(full, first, rest)
        assert "WARNING" not in out
