"""The adaptive re-planning benchmark's pure parts (scripts/bench_adapt.py) and the emulator's
quota change of a running rank (scripts/emulate_cluster.py set_share, --set-share). The bench
itself builds an emulated fleet as root and runs for minutes: it is not run here (its --quick
takes longer than a test may)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_adapt as bench  # noqa: E402
import emulate_cluster as emu  # noqa: E402

from megatron_autohet.plan import load_plan  # noqa: E402
from megatron_autohet.plan_switch import describe_plan  # noqa: E402
from megatron_autohet.planner.adapt import AdaptDecision  # noqa: E402

PLAN = REPO / "configs" / "plans" / "tiny-two-pipelines.yaml"
U = 2.0 ** -24


def records(times_ms, losses=None, gbs=8):
    losses = losses or [1.0 + i for i in range(len(times_ms))]
    return [{"iteration": i + 1, "elapsed_ms": t, "lm_loss": v, "global_batch_size": gbs}
            for i, (t, v) in enumerate(zip(times_ms, losses))]


@pytest.mark.unit
def test_set_share_rewrites_the_quota_for_the_share(tmp_path):
    assert emu.set_share(tmp_path, 0.15) == (13333, 2000)
    assert (tmp_path / "cpu.cfs_period_us").read_text() == "13333"
    assert (tmp_path / "cpu.cfs_quota_us").read_text() == "2000"
    emu.set_share(tmp_path, 0.3)
    assert (tmp_path / "cpu.cfs_period_us").read_text() == "6667"


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0 or not (emu.CGROUP_CPU_ROOT / "cpu.cfs_quota_us").exists(),
                    reason="needs root and cgroup v1's cpu controller")
def test_set_share_changes_a_real_cgroup_with_a_process_in_it(tmp_path):
    """A real cgroup holding a running process: the kernel takes the new period at once (what
    a straggler in the middle of a job needs)."""
    group = emu.CGROUP_CPU_ROOT / f"ahtest-{os.getpid()}"
    group.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (group / "tasks").write_text(str(proc.pid))
        emu.set_share(group, 0.3)
        emu.set_share(group, 0.15)
        assert (group / "cpu.cfs_period_us").read_text().strip() == "13333"
        assert (group / "cpu.cfs_quota_us").read_text().strip() == "2000"
        assert str(proc.pid) in (group / "cgroup.procs").read_text().split()
    finally:
        proc.kill()
        proc.wait()
        for _ in range(50):
            if not (group / "cgroup.procs").read_text().split():
                break
        group.rmdir()


@pytest.mark.unit
def test_set_share_command_line_changes_running_ranks_or_refuses_in_one_line(tmp_path, capsys):
    rank1 = emu.rank_cgroup("pfx", 1, tmp_path)
    rank1.mkdir(parents=True)
    emu.write_quota(rank1, 6667, 2000)
    assert emu.set_shares_cli(["1=0.15"], "pfx", [], tmp_path) == 0
    assert (rank1 / "cpu.cfs_period_us").read_text() == "13333"
    assert "rank 1: 0.15 of a core" in capsys.readouterr().out
    for values, problem in [(["2=0.15"], "rank 2 has no cgroup"), (["1"], "RANK=SHARE"),
                            (["1=3"], "RANK=SHARE"), (["x=0.1"], "RANK=SHARE")]:
        assert emu.set_shares_cli(values, "pfx", [], tmp_path) == 2
        err = capsys.readouterr().err
        assert problem in err and "--set-share" in err and err.count("\n") == 1
    assert emu.set_shares_cli(["1=0.15"], "pfx", ["echo"], tmp_path) == 2
    assert "given with a command" in capsys.readouterr().err
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "emulate_cluster.py"),
                           "--set-share", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "RANK=SHARE" in done.stderr


@pytest.mark.unit
def test_rank_env_names_the_nodes_address_for_a_switchs_store(tmp_path):
    fleet = emu.load_fleet(emu.EMULATED_DIR / "three-speeds.yaml", cores=2)
    placed = emu.place_ranks(fleet, prefix="t", cgroup_root=tmp_path)
    env = emu.rank_env(placed[3], placed[0], 1234)
    assert env["AUTOHET_LOCAL_ADDR"] == placed[3].address != placed[0].address


@pytest.mark.unit
def test_switches_and_decisions_are_read_from_the_products_own_lines():
    """The lines the job prints: planner/adapt.py's decision line made by its own code (a
    changed wording fails here), plan_switch's switch line as it printed it in the bench's runs,
    without and with the switch's parts timed."""
    plan = describe_plan(load_plan(PLAN))
    switched = (f"adapt: switched plans after iteration 40: {plan} -> {plan}; state saved in "
                "2.26 s, recovered 175.0 MiB (local disks 175.0, peers 0.0, S3 0.0); new process "
                "group 1.56 s, model, optimizer, recovery and iteration 41 7.67 s; 11.50 s from "
                "the stop to iteration 41 trained")
    timed = (f"adapt: switched plans after iteration 40: {plan} -> {plan}; state saved in "
             "2.26 s; new process group 1.56 s, model and optimizer 3.00 s, recovery 1.00 s, "
             "iteration 41 3.67 s; 11.50 s from the stop to iteration 41 trained; later switches "
             "priced at 11.50 s plus the state they move across nodes")
    decision = AdaptDecision((31, 40), True, "+9.0% amortised gain held two windows", 1.2, 0.9,
                             0.25, 30.0, 10, 80, 0.09).line()
    keep = AdaptDecision((21, 30), False, "gain seen in one window: it must hold for a second",
                         1.2, 0.9, 0.25, 30.0, 10, 90, 0.09).line()
    console = f"noise\n [t] {keep}\n [t] {decision}\n [t] {switched}\n [t] {switched}\n"
    found = bench.switches(console)
    assert [s["iteration"] for s in found] == [40]          # two ranks' copies: one switch
    assert found[0]["stop_to_trained_s"] == 11.5 and found[0]["plans"] == f"{plan} -> {plan}"
    assert bench.switches(timed) == found
    assert bench.decisions(console) == [
        {"window": [21, 30], "switch": False,
         "why": "gain seen in one window: it must hold for a second"},
        {"window": [31, 40], "switch": True, "why": "+9.0% amortised gain held two windows"}]


@pytest.mark.unit
def test_read_records_keeps_iterations_and_drops_validation_lines():
    text = "\n".join(json.dumps(r) for r in records([100, 200])) + "\n" + json.dumps(
        {"iteration": 2, "validation_lm_loss": 3.0}) + "\n"
    assert [r["iteration"] for r in bench.read_records(text)] == [1, 2]


@pytest.mark.unit
def test_rates_are_the_batch_over_the_median_and_windows_count_from_the_event():
    recs = records([900, 1000, 1000, 1000, 500, 500, 5000, 500, 500, 500])
    assert bench.rate(recs, 1, 4) == pytest.approx(8.0)              # median 1 s, 8 samples
    assert bench.rate(recs, 5, 10) == pytest.approx(16.0)
    assert bench.rate(recs, 11, 12) is None
    assert bench.rate(recs, 6, 7, skip=(7,)) == pytest.approx(16.0)   # a switch's first left out
    windows = bench.window_rates(recs, 4)
    assert [(w["first"], w["last"]) for w in windows] == [(1, 4), (5, 8), (9, 10)]
    assert bench.windows_until(windows, 0, lambda v: v >= 15) == 2
    assert bench.windows_until(windows, 4, lambda v: v >= 15) == 1
    assert bench.windows_until(windows, 0, lambda v: v >= 99) is None
    assert bench.won_back(10.0, 14.0, 15.0) == pytest.approx(0.8)
    assert bench.won_back(10.0, 14.0, 9.0) is None
    assert bench.overhead(records([50, 50, 100, 100]), records([50, 50, 101, 101])) == \
        pytest.approx(0.01)
    # the windows' own time after warm-up: 3 ms of 400 (a record without the field: none)
    windowed = records([50, 50, 100, 100, 100, 100])
    windowed[3]["window_ms"], windowed[5]["window_ms"], windowed[1]["window_ms"] = 1.0, 2.0, 40
    assert bench.window_cost(windowed) == pytest.approx(3.0 / 400)


@pytest.mark.unit
def test_losses_must_match_bit_for_bit_on_one_layout_then_within_the_bound():
    ref = records([1] * 6, [2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    run = records([1] * 6, [2.0, 2.0, 2.0, 2.0 * (1 + 4 * U), 2.0 * (1 + 8 * U), 2.0])
    ok = bench.compare_losses(run, ref, 3, 4)     # iteration 4: 1 x 4 micro-batches x u allowed
    assert ok["equivalent"] and ok["max_over_bound"] == pytest.approx(1.0)
    assert not bench.compare_losses(run, ref, 4, 4)["equivalent"]       # 4 is not bitwise
    assert not bench.compare_losses(run, ref, 3, 2)["equivalent"]       # bound halved
    twice = bench.compare_losses(run + run[-1:], ref, 3, 4)
    assert not twice["equivalent"] and not twice["once_each"]
    assert not bench.compare_losses(run, ref[:4] + ref[5:], 3, 4)["equivalent"]   # one missing
    shorter = bench.compare_losses(run, ref[:4], 3, 4)      # compared over the reference's
    assert shorter["equivalent"] and shorter["iterations"] == 4
    assert bench.compare_losses(run, ref[:2], 3, 4)["bitwise_until"] == 2   # what was compared


@pytest.mark.unit
def test_the_wrong_profile_swaps_two_types_entries_only():
    profile = {"model": "m", "entries": [{"gpu": "EMU-FAST", "tp": 1}, {"gpu": "EMU-MID", "tp": 1},
                                         {"gpu": "EMU-SLOW", "tp": 1}]}
    swapped = bench.swap_profile_types(profile, "EMU-FAST", "EMU-MID")
    assert [e["gpu"] for e in swapped["entries"]] == ["EMU-MID", "EMU-FAST", "EMU-SLOW"]
    assert [e["gpu"] for e in profile["entries"]][0] == "EMU-FAST"        # not changed in place


@pytest.mark.unit
def test_flags_quick_presets_and_refusals(capsys):
    quick = bench.parse_args(["--quick", "--iters", "50"])
    assert quick.iters == 50 and quick.window == bench.QUICK["window"]
    assert quick.scenarios == ["a", "b", "c"]
    full = bench.parse_args(["--scenarios", "b"])
    assert full.iters == 300 and full.window == 20 and full.scenarios == ["b"]
    for argv, flag in [(["--scenarios", "a,d"], "--scenarios"), (["--window", "0"], "--window"),
                       (["--slow-at", "50", "--restore-at", "40"], "--restore-at"),
                       (["--straggler", "mid"], "--straggler")]:
        with pytest.raises(SystemExit) as stop:
            bench.parse_args(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith(f"bench_adapt: error: {flag}")
        assert err.count("\n") == 1


@pytest.mark.unit
def test_a_shorter_reference_keeps_the_runs_learning_rate_schedule(tmp_path):
    """A reference run stopped early must train on the same schedule (its length is --iters),
    or its losses differ from the second iteration on."""
    full = bench.train_args(PLAN, "m.yaml", 110, 5, "replan", tmp_path, tmp_path / "data")
    short = bench.train_args(PLAN, "m.yaml", 110, 5, "off", tmp_path, tmp_path / "data", 55)
    assert full[full.index("--iters") + 1] == short[short.index("--iters") + 1] == "110"
    assert short[short.index("--exit-interval") + 1] == "55" and "--exit-interval" not in full
    assert short[short.index("--autohet-adapt") + 1] == "off"
    assert "--save" in full and "--autohet-measure-window" in full
    # the adapting run prices its re-plans in the emulated catalog; off prices nothing
    assert full[full.index("--gpu-catalog") + 1] == str(emu.DEFAULT_CATALOG)
    assert "--gpu-catalog" not in short


@pytest.mark.unit
def test_the_search_processes_leave_the_ranks_cgroups_for_the_host(tmp_path):
    """search_to_host moves the processes running planner/adapt_process.py, and only them,
    from a rank's cgroup (here a directory holding its cgroup.procs) to the root's."""
    rank, root = tmp_path / "rank0", tmp_path / "root"
    rank.mkdir()
    root.mkdir()
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    search = subprocess.Popen(sleep + [bench.SEARCH_MODULE])
    other = subprocess.Popen(sleep + ["megatron_autohet.cli.main"])
    try:
        (rank / "cgroup.procs").write_text(f"{other.pid}\n{search.pid}\n999999999\n")
        assert bench.search_to_host([rank, tmp_path / "gone"], root) == 1
        assert (root / "cgroup.procs").read_text() == str(search.pid)
    finally:
        for proc in (search, other):
            proc.kill()
            proc.wait()
