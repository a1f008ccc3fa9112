"""`autohet checkpoint ls / verify` on a real checkpoint (tiny-two-pipelines saved after 2 and 4
of 8 iterations), through cli.main.main([...]): steps listed with their exact iterations and
completeness, every chunk re-hashed, a flipped bit or a cut file named by file, byte range and
key (exit 1), bad input one line (exit 2); the same on S3 (moto's server) after an upload."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.checkpoint import inspect
from megatron_autohet.checkpoint.manifest import (LATEST_FILE, MANIFEST_FILE, read_manifest,
                                                  step_dir_name)
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.checkpoint.s3_store import S3Store
from helpers.dist_utils import run_on_ranks
from helpers.checkpointing import HALF, TOTAL, as_format_1, train_job
from helpers.cli import expect_usage_error, run_cli, table
from helpers.training import OPTIMIZER, PLANS, global_batches, plan

INTERVAL = 2                                # steps 2 and 4
LOCATION_ALLOWED = ("a checkpoint directory (--save or --autohet-local-ckpt-dir; '{node}' in the "
                    "path stands for every node's directory) or s3://BUCKET/PREFIX")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(shared --save directory, node-local template) of one run each, stopped after HALF."""
    a = plan("tiny-two-pipelines")
    batches = global_batches(a, TOTAL)
    root = tmp_path_factory.mktemp("ckpt")
    for options in (CheckpointOptions(save=str(root / "shared"), save_interval=INTERVAL),
                    CheckpointOptions(local_dir=str(root / "nodes" / "{node}"),
                                      save_interval=INTERVAL)):
        run_on_ranks(a.world_size, train_job, a, batches, options, exit_interval=HALF)
    return root / "shared", str(root / "nodes" / "{node}")


@pytest.fixture
def shared(saved, tmp_path) -> Path:
    """A copy of the shared directory this test may damage."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[0], copy)
    return copy


def largest_item(step: Path):
    return max(read_manifest(step).items, key=lambda i: i.length)


def chunk_count(manifest, names) -> int:
    return sum(len(manifest.items_in(n)) for n in names if manifest.files[n].digest is None)


def ok_line(where, manifest, names, bytes_checked) -> str:
    return (f"> {where}: OK; checked {chunk_count(manifest, names)} chunks in {len(names)} files "
            f"({bytes_checked / 2**20:.1f} MiB)")


# ---- ls ---------------------------------------------------------------------------------------

@pytest.mark.integration
def test_ls_shows_committed_steps_and_a_partial_one(capsys, shared):
    partial = shared / (step_dir_name(6) + ".partial")
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * 100)
    manifest = read_manifest(shared / step_dir_name(HALF))
    rc, out, _ = run_cli(capsys, "checkpoint", "ls", shared)
    assert rc == 0
    rows = table(out)
    assert [(r["iteration"], r["complete"], r["latest"]) for r in rows] == [
        ("2", "yes", ""), ("4", "yes", "yes"), ("6", "no", "")]
    listed = len(manifest.files)
    assert [r["files"] for r in rows] == [f"{listed}/{listed}"] * 2 + ["1/-"]
    assert rows[1]["saved by plan"] == "4 ranks, 2 pipelines, local-4"
    assert rows[1]["where"] == str(shared / step_dir_name(HALF))
    assert rows[2]["why incomplete"] == "no manifest: a save in progress or interrupted (.partial)"

    rc, out, _ = run_cli(capsys, "checkpoint", "ls", shared, "--json")
    steps = json.loads(out)
    assert steps[1] == {
        "where": str(shared / step_dir_name(HALF)), "iteration": HALF, "complete": True,
        "files_present": listed, "files_listed": listed, "bytes_present": manifest.total_bytes,
        "bytes_listed": manifest.total_bytes, "world_size": 4, "pipelines": 2,
        "cluster": "local-4", "nodes_served": ["a100", "h20", "h800"], "latest": True,
        "reason": None}
    assert steps[2]["complete"] is False and steps[2]["bytes_present"] == 100


@pytest.mark.integration
def test_ls_reports_a_missing_or_short_file_as_incomplete(capsys, shared):
    step = shared / step_dir_name(HALF)
    (step / "__3_0.distcp").unlink()            # rank 3 is the only rank of node h20
    with open(step / "__1_0.distcp", "r+b") as f:
        f.truncate(1000)
    size = read_manifest(step).files["__1_0.distcp"].size
    rows = table(run_cli(capsys, "checkpoint", "ls", shared)[1])
    assert rows[1]["complete"] == "no"
    assert rows[1]["why incomplete"] == (f"__1_0.distcp has 1000 bytes, the manifest lists "
                                         f"{size}; __3_0.distcp missing")


@pytest.mark.integration
def test_ls_expands_node_template_to_every_node_directory(capsys, saved):
    _, template = saved
    rc, out, _ = run_cli(capsys, "checkpoint", "ls", template)
    assert rc == 0
    rows = table(out)
    nodes = ["a100", "h20", "h800"]
    assert [(r["where"], r["iteration"], r["complete"], r["latest"]) for r in rows] == [
        (str(Path(template.replace("{node}", n)) / step_dir_name(it)), str(it), "yes",
         "yes" if it == HALF else "") for n in nodes for it in (INTERVAL, HALF)]
    assert [r["data of nodes"] for r in rows] == [n for n in nodes for _ in (1, 2)]
    for row, node in zip(rows[1::2], nodes):      # a node's directory holds its ranks' files
        step = Path(row["where"])
        held = sum(1 for f in step.iterdir() if f.name != MANIFEST_FILE)
        assert row["files"] == f"{held}/{len(read_manifest(step).files)}"


# ---- verify -----------------------------------------------------------------------------------

@pytest.mark.integration
def test_verify_passes_on_a_good_step(capsys, shared):
    step = shared / step_dir_name(HALF)
    manifest = read_manifest(step)
    rc, out, _ = run_cli(capsys, "checkpoint", "verify", shared)
    assert rc == 0
    assert out.splitlines() == [ok_line(step, manifest, list(manifest.files),
                                        manifest.total_bytes)]
    rc, out, _ = run_cli(capsys, "checkpoint", "verify", shared, "--iteration", INTERVAL)
    assert rc == 0 and out.startswith(f"> {shared / step_dir_name(INTERVAL)}: OK;")


@pytest.mark.integration
def test_verify_each_node_directory_checks_only_its_files(capsys, saved):
    _, template = saved
    rc, out, _ = run_cli(capsys, "checkpoint", "verify", template)
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 3
    for line, node in zip(lines, ["a100", "h20", "h800"]):
        step = Path(template.replace("{node}", node)) / step_dir_name(HALF)
        manifest = read_manifest(step)
        here = sorted(f.name for f in step.iterdir() if f.name != MANIFEST_FILE)
        elsewhere = len(manifest.files) - len(here)
        assert line == (ok_line(step, manifest, here, sum((step / n).stat().st_size
                                                          for n in here))
                        + f"; {elsewhere} data files of other nodes' ranks are not kept here")


@pytest.mark.integration
@pytest.mark.parametrize("written_by", ["this version", "a version before xxh3_128"])
def test_verify_names_a_flipped_bit_by_file_range_and_key(capsys, shared, written_by):
    """Caught by the step's own checksum: xxh3_128, or SHA-256 in a format-1 manifest (which
    verifies as it is before the bit flips)."""
    step = shared / step_dir_name(HALF)
    if written_by != "this version":
        as_format_1(step)
        assert run_cli(capsys, "checkpoint", "verify", shared)[0] == 0
    item = largest_item(step)
    path = step / item.file
    raw = bytearray(path.read_bytes())
    raw[item.offset + item.length // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    rc, out, _ = run_cli(capsys, "checkpoint", "verify", shared)
    assert rc == 1
    lines = out.splitlines()
    assert lines[:-1] == [f"{path}: bytes {item.offset}-{item.offset + item.length} "
                          f"({item.key}): checksum mismatch"]
    assert lines[-1].startswith(f"> {step}: 1 problem(s); checked ")


def flip_in_every_item(data: bytes, items) -> bytes:
    raw = bytearray(data)
    for item in items:
        raw[item.offset + item.length - 1] ^= 0x01
    return bytes(raw)


@pytest.mark.integration
def test_verify_hashes_every_chunk(capsys, shared):
    """One damaged byte in each chunk of a file: each chunk is reported, none is skipped."""
    step = shared / step_dir_name(HALF)
    name = largest_item(step).file
    items = sorted(read_manifest(step).items_in(name), key=lambda i: i.offset)
    (step / name).write_bytes(flip_in_every_item((step / name).read_bytes(), items))
    rc, out, _ = run_cli(capsys, "checkpoint", "verify", shared)
    assert rc == 1
    assert out.splitlines()[:-1] == [f"{step / name}: bytes {i.offset}-{i.offset + i.length} "
                                     f"({i.key}): checksum mismatch" for i in items]


@pytest.mark.integration
def test_verify_reports_a_truncated_file_and_a_missing_one(capsys, shared):
    step = shared / step_dir_name(HALF)
    manifest = read_manifest(step)
    item = largest_item(step)
    path = step / item.file
    cut = item.offset + 10
    path.write_bytes(path.read_bytes()[:cut])
    (step / "common.pt").unlink()
    rc, out, _ = run_cli(capsys, "checkpoint", "verify", shared)
    assert rc == 1
    cut_items = sorted((i for i in manifest.items_in(item.file) if i.offset + i.length > cut),
                       key=lambda i: i.offset)
    assert cut_items[0] == item
    whole = manifest.items_in(item.file)
    end = max(i.offset + i.length for i in whole)
    assert out.splitlines()[:-1] == [      # the cut file is one line, not one per chunk
        f"{path}: truncated at byte {cut} of {end}: {len(cut_items)} of its {len(whole)} "
        f"chunks cut short or missing (from {item.key})", f"{step / 'common.pt'}: missing file"]


@pytest.mark.integration
def test_verify_bad_input_is_one_line_and_exit_2(capsys, shared, tmp_path):
    prefix = "autohet checkpoint: error: <command line>: field"
    expect_usage_error(capsys, ["checkpoint", "verify", tmp_path / "nope"],
                       f"{prefix} 'DIR_OR_S3URI': {tmp_path / 'nope'}: no such directory "
                       f"(allowed: {LOCATION_ALLOWED})")
    expect_usage_error(capsys, ["checkpoint", "verify", shared, "--iteration", 3],
                       f"{prefix} '--iteration': no committed step 3 in {shared} "
                       f"(allowed: one of 2, 4)")
    (tmp_path / "empty").mkdir()
    expect_usage_error(capsys, ["checkpoint", "verify", tmp_path / "empty"],
                       f"{prefix} 'DIR_OR_S3URI': {tmp_path / 'empty'}: no committed step (an "
                       f"iter_NNNNNNN with autohet-manifest.json) (allowed: {LOCATION_ALLOWED})")
    expect_usage_error(capsys, ["checkpoint", "ls", tmp_path / "{node}" / "x"],
                       f"{prefix} 'DIR_OR_S3URI': no directory matches "
                       f"{tmp_path / '{node}' / 'x'} (allowed: {LOCATION_ALLOWED})")
    expect_usage_error(capsys, ["checkpoint", "verify", "s3://UPPER/x"],
                       f"{prefix} 'DIR_OR_S3URI': 'UPPER' in 's3://UPPER/x' is not a valid bucket "
                       "name (allowed: 3-63 characters: lowercase letters, digits, '.' and '-', "
                       "starting and ending with a letter or digit, no '..', not an IP address)")
    expect_usage_error(capsys, ["checkpoint", "ls", shared, "--autohet-s3-endpoint-url",
                                "http://127.0.0.1:1"],
                       f"{prefix} '--autohet-s3-endpoint-url': given with the local directory "
                       f"{shared} (allowed: only with an s3:// location)")


@pytest.mark.integration
def test_commands_start_without_torch_or_boto3(shared):
    """The CLI must answer at once: no torch/megatron-core, no boto3 for a local directory."""
    code = ("import sys; from megatron_autohet.cli.main import main; "
            f"rc = main(['checkpoint', 'verify', {str(shared)!r}]); "
            "print(rc, sorted(m for m in ('torch', 'megatron.core', 'boto3') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.splitlines()[-1] == "0 []"


# ---- S3 ---------------------------------------------------------------------------------------

def upload_step(store: S3Store, step: Path, iteration: int) -> None:
    """What the S3 tier uploads: data files, then the manifest (the commit), then latest."""
    names = sorted(f.name for f in step.iterdir() if f.name != MANIFEST_FILE) + [MANIFEST_FILE]
    for name in names:
        store.upload_file(step / name, f"{step_dir_name(iteration)}/{name}")
    store.put_bytes(LATEST_FILE, str(iteration).encode())


@pytest.mark.e2e
def test_s3_ls_and_verify(capsys, saved, s3_endpoint, s3_uri, tmp_path, monkeypatch):
    endpoint = s3_endpoint[0]
    store = S3Store(s3_uri, endpoint_url=endpoint)
    step = saved[0] / step_dir_name(HALF)
    manifest = read_manifest(step)
    upload_step(store, step, HALF)
    store.upload_file(step / "__0_0.distcp", f"{step_dir_name(6)}/__0_0.distcp")  # no manifest
    flag = ("--autohet-s3-endpoint-url", endpoint)

    rows = table(run_cli(capsys, "checkpoint", "ls", s3_uri, *flag)[1])
    assert [(r["iteration"], r["complete"], r["latest"], r["where"]) for r in rows] == [
        ("4", "yes", "yes", f"{s3_uri}/{step_dir_name(HALF)}"),
        ("6", "no", "", f"{s3_uri}/{step_dir_name(6)}")]
    assert rows[1]["why incomplete"] == "no manifest: the upload did not finish"

    rc, out, _ = run_cli(capsys, "checkpoint", "verify", s3_uri, *flag)
    assert rc == 0
    assert out.splitlines() == [ok_line(f"{s3_uri}/{step_dir_name(HALF)}", manifest,
                                        list(manifest.files), manifest.total_bytes)]

    # One damaged byte in every chunk of one object, another object cut short; small windows so
    # that ranged GETs cover several chunks, one chunk, or a chunk larger than the window.
    monkeypatch.setattr(inspect, "S3_WINDOW", 64 * 1024)
    name = largest_item(step).file
    damaged = sorted(manifest.items_in(name), key=lambda i: i.offset)
    (tmp_path / name).write_bytes(flip_in_every_item((step / name).read_bytes(), damaged))
    store.upload_file(tmp_path / name, f"{step_dir_name(HALF)}/{name}")
    other = next(n for n in sorted(manifest.files) if n != name
                 and manifest.files[n].digest is None)
    cut_items = sorted(manifest.items_in(other), key=lambda i: i.offset)[-2:]
    (tmp_path / other).write_bytes((step / other).read_bytes()[:cut_items[0].offset + 1])
    store.upload_file(tmp_path / other, f"{step_dir_name(HALF)}/{other}")
    rc, out, _ = run_cli(capsys, "checkpoint", "verify", s3_uri, *flag, "--iteration", HALF)
    assert rc == 1
    where = f"{s3_uri}/{step_dir_name(HALF)}"
    expected = {name: [f"{where}/{name}: bytes {i.offset}-{i.offset + i.length} ({i.key}): "
                       "checksum mismatch" for i in damaged],
                other: [f"{where}/{other}: truncated at byte {cut_items[0].offset + 1} of "
                        f"{cut_items[-1].offset + cut_items[-1].length}: 2 of its "
                        f"{len(manifest.items_in(other))} chunks cut short or missing (from "
                        f"{cut_items[0].key})"]}
    assert out.splitlines()[:-1] == [line for n in sorted(expected) for line in expected[n]]

    expect_usage_error(capsys, ["checkpoint", "verify", s3_uri, *flag, "--iteration", 6],
                       f"autohet checkpoint: error: <command line>: field '--iteration': no "
                       f"committed step 6 in {s3_uri} (allowed: one of 4)")


@pytest.mark.e2e
def test_s3_unreachable_endpoint_is_one_line_and_exit_2(capsys, s3_endpoint, s3_uri,
                                                         refused_url):
    url = refused_url
    rc, out, err = run_cli(capsys, "checkpoint", "ls", s3_uri, "--autohet-s3-endpoint-url", url)
    assert rc == 2 and "Traceback" not in out + err
    assert err.strip().splitlines() == [
        f"autohet checkpoint: error: <command line>: field 'DIR_OR_S3URI': S3 get "
        f"{s3_uri}/{LATEST_FILE} failed: Could not connect to the endpoint URL: "
        f"\"{url}/{s3_uri.removeprefix('s3://')}/{LATEST_FILE}\""]


# ---- convert -------------------------------------------------------------------------------------

@pytest.mark.integration
def test_convert_adopts_a_torch_dist_step_and_keeps_its_bytes(capsys, shared, tmp_path):
    """Our own steps are torch_dist steps in stock Megatron-LM's layout, so `convert` must take
    one as it takes stock's (tests/megatron/test_megatron_interop.py runs a real stock one): every
    chunk of the copy hashes as the original manifest says, and `verify` passes on the result."""
    out = tmp_path / "adopted"
    step = shared / step_dir_name(HALF)
    original = {item.region: item.digest for item in read_manifest(step).items}
    (step / MANIFEST_FILE).unlink()                     # as stock writes a step: no manifest
    rc, stdout, _ = run_cli(capsys, "checkpoint", "convert", shared, out)
    assert rc == 0 and stdout.startswith(f"converted iteration {HALF} of {shared}")
    converted = read_manifest(out / step_dir_name(HALF))
    assert {item.region: item.digest for item in converted.items} == original
    assert run_cli(capsys, "checkpoint", "verify", out)[0] == 0
    assert (out / LATEST_FILE).read_text() == str(HALF)


@pytest.mark.unit
def test_convert_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    missing = tmp_path / "nothing"
    expect_usage_error(capsys, ["checkpoint", "convert", missing, tmp_path / "out"],
                       f"autohet checkpoint: error: <command line>: field 'STOCK_DIR': {missing}: "
                       "no such directory")


def _megatron_looking(root: Path, files: dict[str, bytes]) -> Path:
    """A --save directory naming step 10, whose step holds ``files``."""
    step = root / step_dir_name(10)
    step.mkdir(parents=True)
    (root / LATEST_FILE).write_text("10")
    for name, data in files.items():
        (step / name).write_bytes(data)
    return step


@pytest.mark.unit
@pytest.mark.parametrize("metadata_json, problem", [
    (b"{not json", "metadata.json: not JSON ("),
    (b"[1, 2]", "metadata.json: sharded_backend None"),
    (json.dumps({"sharded_backend": "torch_dist"}).encode(),
     ".metadata: not a torch DCP index (")])
def test_convert_refuses_garbage_under_the_right_names_in_one_line(capsys, tmp_path,
                                                                  metadata_json, problem):
    """Every file name a torch_dist step has, holding garbage: one line naming the file, exit 2
    (it was a JSONDecodeError or UnpicklingError traceback, exit 1)."""
    step = _megatron_looking(tmp_path / "save", {
        ".metadata": b"\x80\x04garbage", "common.pt": b"garbage", "metadata.json": metadata_json,
        "__0_0.distcp": b"garbage"})
    rc, out, err = run_cli(capsys, "checkpoint", "convert", tmp_path / "save", tmp_path / "out")
    assert rc == 2 and "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autohet checkpoint: error: <command line>: field 'STOCK_DIR': "
                               f"{step}/{problem}"), lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_convert_refuses_a_step_of_ours_it_need_not_convert(capsys, tmp_path):
    step = _megatron_looking(tmp_path / "save", {MANIFEST_FILE: b"{}"})
    expect_usage_error(capsys, ["checkpoint", "convert", tmp_path / "save", tmp_path / "out"],
                       "autohet checkpoint: error: <command line>: field 'STOCK_DIR': "
                       f"{step}: a megatron-autohet step already (it has its {MANIFEST_FILE}) "
                       "(allowed: `autohet train --load` it as it is)")


@pytest.mark.unit
def test_a_converted_steps_layout_is_said_as_far_as_its_args_record_it():
    from megatron_autohet.checkpoint.convert import describe_layout

    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
            "world_size")
    assert describe_layout(dict(zip(keys, (2, 1, 2, 4)))) == "TP2 x PP1 x DP2, 4 ranks"
    assert describe_layout(dict(zip(keys, (1, 2, None, None)))) == "TP1 x PP2"
    assert describe_layout(dict.fromkeys(keys)) == "no parallel layout recorded in its args"


# ---- autohet train --load: the resume is checked before any process starts --------------------

@pytest.mark.e2e
def test_resume_with_another_schedule_or_global_batch_is_refused(capsys, shared):
    """megatron-core's scheduler would take the checkpoint's values and ignore the flags."""
    from megatron_autohet.cli.train import check_resume
    from megatron_autohet.plan import load_plan

    step = shared / step_dir_name(HALF)
    train = ["train", "--plan", PLANS / "tiny-two-pipelines.yaml",
             "--model", PLANS.parents[0] / "models" / "tiny.yaml", "--iters", TOTAL,
             "--load", shared]
    expect_usage_error(capsys, train + ["--lr", "1e-3"],
                       "autohet train: error: <command line>: field '--lr': this run's "
                       f"learning-rate schedule has max_lr 0.001, {step} was trained with 0.003 "
                       "(allowed: the checkpoint's flags (the schedule continues where it "
                       "stopped), or --override-opt-param-scheduler (this run's schedule, from "
                       "the checkpoint's sample count on) or --use-checkpoint-opt-param-scheduler "
                       "(the checkpoint's schedule))")
    other_batch = PLANS / "tiny-three-pipelines.yaml"
    expect_usage_error(capsys, train[:2] + [other_batch] + train[3:],
                       "autohet train: error: <command line>: field '--plan': global batch 12, "
                       f"but {step} was trained with 8 (allowed: a plan with the checkpoint's "
                       "global batch (a resume continues the same sequence of global batches))")
    same = CheckpointOptions(load=str(shared))
    check_resume(same, load_plan(PLANS / "tiny-homogeneous.yaml"), OPTIMIZER, TOTAL)  # accepted


@pytest.mark.unit
@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_read_item_hashes_a_chunk_block_by_block(monkeypatch, tmp_path, algorithm):
    """A chunk read in blocks smaller than itself: its bytes, and whether they match, cut
    short or differ, as a whole-chunk hash of the algorithm its digest names says (sha256:
    steps written before xxh3_128)."""
    import hashlib

    import xxhash

    from megatron_autohet.checkpoint.manifest import ItemRecord

    monkeypatch.setattr(inspect, "READ_BLOCK", 7)
    data = bytes(range(200)) * 3
    path = tmp_path / "data"
    path.write_bytes(data)
    whole = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}[algorithm](data[50:150])
    item = ItemRecord(key="w", offsets=(0,), sizes=(100,), file="data", offset=50, length=100,
                      digest=f"{algorithm}:{whole.hexdigest()}")
    with open(path, "rb") as f:
        raw, problem = inspect.read_item(f, item)
        assert (bytes(raw), problem) == (data[50:150], None)
        other = ItemRecord(**{**item.__dict__, "offset": 51})
        assert inspect.read_item(f, other)[1] == inspect.MISMATCH
        cut = ItemRecord(**{**item.__dict__, "offset": len(data) - 30})
        raw, problem = inspect.read_item(f, cut)
        assert (bytes(raw), problem) == (data[-30:], inspect.TRUNCATED)
