"""The pure logic of the emulated cluster (scripts/emulate_cluster.py) and of its benchmark's report
(scripts/bench_emulated.py): fleet YAML -> namespaces, veths, tbf and cgroup quotas, rank ->
(namespace, cgroup), the confining wrapper, clean-up bookkeeping, and the report's arithmetic.
Building the real namespaces needs root: the scripts do that, not the tests."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_emulated as bench  # noqa: E402
import emulate_cluster as emu  # noqa: E402

from megatron_autohet.cost_model import evaluate_plan  # noqa: E402
from megatron_autohet.errors import ConfigError  # noqa: E402
from megatron_autohet.planner.baselines import grid_plan  # noqa: E402
from megatron_autohet.planner.space import Problem, resolve_profile  # noqa: E402
from megatron_autohet.spec import load_model  # noqa: E402

FLEET = emu.EMULATED_DIR / "three-speeds.yaml"
SLOW_LINK = emu.EMULATED_DIR / "three-speeds-slow-link.yaml"


@pytest.mark.unit
def test_cfs_quota_gives_the_share_with_the_smallest_quota():
    for share in (1.0, 0.6, 0.3, 0.15, 0.002):
        period, quota = emu.cfs_quota(share)
        assert quota == emu.QUOTA_US >= 1000 and period <= emu.MAX_PERIOD_US  # kernel's limits
        assert quota / period == pytest.approx(share, rel=1e-3)
    for bad in (0.0, 1.5, 0.001):
        with pytest.raises(ValueError):
            emu.cfs_quota(bad)


@pytest.mark.unit
def test_bundled_fleets_load_with_three_speeds_within_the_cores():
    for path in (FLEET, SLOW_LINK):
        fleet = emu.load_fleet(path, cores=2)
        shares = sorted(fleet.cpu_share.values())
        assert len(set(shares)) == 3
        assert fleet.total_share < 2
    slow, fast = emu.load_fleet(SLOW_LINK, cores=2), emu.load_fleet(FLEET, cores=2)
    assert all(slow.link_mbit(n.name) < fast.link_mbit(n.name) for n in slow.cluster.nodes)
    assert fast.link_mbit("fast") == pytest.approx(0.05 * 8000)   # GB/s -> Mbit/s


@pytest.mark.unit
def test_fleet_refusals_name_the_file_and_field(tmp_path):
    with pytest.raises(ConfigError, match="sum to 1.5 cores"):
        emu.load_fleet(FLEET, cores=1.5)
    shares = tmp_path / "shares.yaml"
    shares.write_text("cpu_share: {EMU-FAST: 0.6, EMU-MID: 0.3}\n")
    with pytest.raises(ConfigError, match=r"nodes\[2\].gpu.*EMU-SLOW.*no CPU share"):
        emu.load_fleet(FLEET, shares_path=shares, cores=2)
    shares.write_text("cpu_share: {EMU-FAST: 1.5, EMU-MID: 0.3, EMU-SLOW: 0.1}\n")
    with pytest.raises(ConfigError, match=r"cpu_share.EMU-FAST.*got 1.5"):
        emu.load_fleet(FLEET, shares_path=shares, cores=2)


@pytest.mark.unit
def test_network_commands_shape_every_node_both_ways_and_leave_loopback_alone():
    fleet = emu.load_fleet(SLOW_LINK, cores=2)
    cmds = emu.network_commands(fleet, prefix="t", queue_ms=7)
    flat = [" ".join(c) for c in cmds]
    nets = emu.node_networks(fleet, prefix="t")
    assert [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]] == (
        ["t-fabric"] + [n.namespace for n in nets])
    assert len({n.address for n in nets}) == len(nets) == len(fleet.cluster.nodes)
    shaped = {}
    for c in cmds:
        if "tbf" in c:
            ns, dev = c[3], c[c.index("dev") + 1]
            shaped[(ns, dev)] = (c[c.index("rate") + 1], c[c.index("latency") + 1])
    for n in nets:
        rate = f"{fleet.link_mbit(n.node)}mbit"
        assert shaped.pop((n.namespace, n.device)) == (rate, "7ms")      # what the node sends
        assert shaped.pop(("t-fabric", n.bridge_port)) == (rate, "7ms")  # what it receives
        assert len(n.device) <= 15 and len(n.bridge_port) <= 15
        assert any(f"addr add {n.address}/24 dev {n.device}" in f for f in flat)
        # the veth exists before it is attached to the bridge and shaped
        veth = flat.index(" ".join(emu._netns.veth_cmd(n.device, n.namespace, n.bridge_port,
                                                       "t-fabric")))
        assert veth < min(i for i, f in enumerate(flat) if n.bridge_port in f and "veth" not in f)
    assert not shaped                        # nothing else is shaped: loopback stays unshaped
    assert flat.index("ip netns exec t-fabric ip link add tbr type bridge") < min(
        i for i, f in enumerate(flat) if "master tbr" in f)


TWO_ZONES = emu.EMULATED_DIR / "two-zones.yaml"


@pytest.mark.unit
def test_two_zones_are_two_bridges_joined_by_one_delayed_rate_limited_link(tmp_path):
    fleet = emu.load_fleet(TWO_ZONES, cores=2)
    cmds = emu.network_commands(fleet, prefix="t", queue_ms=7)
    flat = [" ".join(c) for c in cmds]
    nets = {n.node: n for n in emu.node_networks(fleet, prefix="t")}
    # a bridge per zone, each node's port on its zone's
    assert emu.zone_bridges(fleet, "t") == {"zone-a": "tbr0", "zone-b": "tbr1"}
    for bridge in ("tbr0", "tbr1"):
        assert f"ip netns exec t-fabric ip link add {bridge} type bridge" in flat
    for node, bridge in [("fast", "tbr0"), ("mid", "tbr0"), ("slow", "tbr1")]:
        port = nets[node].bridge_port
        assert f"ip netns exec t-fabric ip link set {port} master {bridge}" in flat
    # one veth pair between the bridges, each end delaying and rate-limiting what it sends:
    # the links section's 0.01 GB/s (80 Mbit/s) and 5 ms
    link = emu.zone_link(fleet, "t")
    assert link.bridges == ("tbr0", "tbr1")
    assert flat.count(" ".join(emu._netns.veth_cmd(link.ends[0], "t-fabric", link.ends[1],
                                                   "t-fabric"))) == 1
    netem = {c[c.index("dev") + 1]: (c[c.index("delay") + 1], c[c.index("rate") + 1])
             for c in cmds if "netem" in c}
    assert netem == {end: ("5.0ms", "80.0mbit") for end in link.ends}
    for end, bridge in zip(link.ends, link.bridges):
        assert f"ip netns exec t-fabric ip link set {end} master {bridge}" in flat
    # the NICs are shaped as without zones
    assert sum("tbf" in c for c in cmds) == 2 * len(nets)
    # a kernel without netem: the link's rate alone, with tbf
    rate_only = emu.network_commands(fleet, prefix="t", queue_ms=7, delay=False)
    assert not any("netem" in c for c in rate_only)
    assert {c[c.index("dev") + 1]: c[c.index("rate") + 1] for c in rate_only
            if "tbf" in c and c[c.index("dev") + 1] in link.ends} == dict.fromkeys(link.ends,
                                                                                 "80.0mbit")
    # three zones would need a link per pair, a loop of bridges: refused in one line
    three = tmp_path / "three.yaml"
    three.write_text(TWO_ZONES.read_text().replace("zone-b: region", "zone-b: region\n  zone-c: "
                                                   "region").replace("gpus: 2, zone: zone-b",
                                                                     "gpus: 2, zone: zone-c")
                     .replace("gpus: 2, zone: zone-a", "gpus: 2, zone: zone-b"))
    with pytest.raises(ConfigError, match="nodes in 3 zones"):
        emu.load_fleet(three, cores=2)
    # a fleet without zones keeps its one bridge and nothing delayed
    plain = emu.load_fleet(SLOW_LINK, cores=2)
    assert emu.zone_bridges(plain, "t") == {None: "tbr"} and emu.zone_link(plain, "t") is None
    assert not any("netem" in c for c in emu.network_commands(plain, prefix="t"))


@pytest.mark.unit
def test_ranks_map_to_their_nodes_namespace_and_a_cgroup_each(tmp_path):
    fleet = emu.load_fleet(FLEET, cores=2)
    default = emu.place_ranks(fleet, prefix="t", cgroup_root=tmp_path)
    devices = fleet.cluster.devices()
    assert [(p.node, p.local_rank, p.gpu) for p in default] == [
        (d.node, d.local_rank, d.gpu) for d in devices]
    nets = {n.node: n for n in emu.node_networks(fleet, prefix="t")}
    # a plan's own rank order: rank 0 on the slow node
    order = [("slow", 1), ("fast", 0), ("mid", 1)]
    placed = emu.place_ranks(fleet, order, prefix="t", cgroup_root=tmp_path)
    assert [p.rank for p in placed] == [0, 1, 2] and {p.world_size for p in placed} == {3}
    for p, (node, local) in zip(placed, order):
        assert (p.node, p.local_rank) == (node, local)
        assert (p.namespace, p.device, p.address) == (nets[node].namespace, nets[node].device,
                                                      nets[node].address)
        assert p.cgroup == tmp_path / "t" / f"rank{p.rank}"
        assert p.quota_us / p.period_us == pytest.approx(fleet.cpu_share[p.gpu], rel=1e-3)
    env = emu.rank_env(placed[2], placed[0], 1234)
    assert env["MASTER_ADDR"] == nets["slow"].address
    assert env["GLOO_SOCKET_IFNAME"] == nets["mid"].device
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == (
        "2", "3", "1", "1234")
    assert env["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ConfigError, match="not a GPU of cluster"):
        emu.place_ranks(fleet, [("fast", 1)], cgroup_root=tmp_path)
    with pytest.raises(ConfigError, match="two ranks"):
        emu.place_ranks(fleet, [("mid", 0), ("mid", 0)], cgroup_root=tmp_path)


@pytest.mark.integration
def test_the_wrapper_puts_the_commands_own_pid_in_the_cgroup(tmp_path):
    """Run the wrapper for real (no namespace, a directory standing in for the cgroup): the pid it
    writes to ``tasks`` is the command's, which exec kept."""
    fleet = emu.load_fleet(FLEET, cores=2)
    p = emu.place_ranks(fleet, prefix="t", cgroup_root=tmp_path)[0]
    p.cgroup.mkdir(parents=True)
    cmd = emu.confined_command(p, [sys.executable, "-c",
                                   "import os; print(os.getpid(), *os.sched_getaffinity(0))"])
    assert cmd[4:7] == ["taskset", "-c", str(p.cpu)]
    assert cmd[7:11] == ["ip", "netns", "exec", p.namespace]     # the namespace after the cgroup
    out = subprocess.run(cmd[:7] + cmd[11:], capture_output=True, text=True, check=True).stdout
    pid, *cpus = out.split()
    assert (p.cgroup / "tasks").read_text().strip() == pid
    assert cpus == [str(p.cpu)]


@pytest.mark.unit
def test_cpus_are_packed_so_no_cpu_carries_more_than_a_core():
    assert emu.assign_cpus([0.6, 0.3, 0.3, 0.15, 0.15], 2) == [0, 1, 1, 0, 1]
    assert emu.assign_cpus([0.5, 0.5, 0.5, 0.5], 2) == [0, 1, 0, 1]
    fleet = emu.load_fleet(FLEET, cores=2)
    placed = emu.place_ranks(fleet, cores=2)
    load = {}
    for p in placed:
        load[p.cpu] = load.get(p.cpu, 0.0) + p.quota_us / p.period_us
    assert set(load) == {0, 1} and max(load.values()) <= 1.0
    # a plan's subset keeps every GPU on its CPU
    sub = emu.place_ranks(fleet, [("slow", 1), ("fast", 0)], cores=2)
    assert [p.cpu for p in sub] == [placed[4].cpu, placed[0].cpu]


@pytest.mark.unit
def test_ledger_tears_down_newest_first_each_once_despite_errors():
    ledger = emu.Ledger()
    for entry in [("netns", "a"), ("cgroup", "g"), ("cgroup", "g/r0"), ("process", "42")]:
        ledger.add(*entry)
    seen = []

    def remove(kind, name):
        seen.append((kind, name))
        if kind == "cgroup" and name == "g/r0":
            raise OSError("busy")

    errors = ledger.teardown(remove)
    assert seen == [("process", "42"), ("cgroup", "g/r0"), ("cgroup", "g"), ("netns", "a")]
    assert errors == ["cgroup g/r0: busy"]
    assert ledger.teardown(remove) == [] and len(seen) == 4


@pytest.mark.unit
def test_stale_resources_are_only_this_prefixes_children_before_parents(tmp_path):
    parent = tmp_path / "t"
    found = emu.stale_resources("t", ["t-n0", "t-fabric", "tx-n0", "other"],
                                [parent / "rank1", parent, tmp_path / "u" / "rank0"], tmp_path)
    assert found == [("cgroup", str(parent / "rank1")), ("cgroup", str(parent)),
                     ("netns", "t-n0"), ("netns", "t-fabric")]


# ---- the report's arithmetic ---------------------------------------------------------------------

@pytest.mark.unit
def test_iteration_and_phase_times_take_the_latest_rank():
    assert bench.iteration_times([[1.0, 2.0], [1.5, 1.0]]) == [1.5, 2.0]
    marks = [{"schedule": 1.0, "sync": 1.2, "norm": 1.25, "optimizer": 1.3},
             {"schedule": 1.1, "sync": 1.15, "norm": 1.3, "optimizer": 1.4}]
    phases = bench.phase_times(marks)
    assert phases == pytest.approx({"schedule": 1.1, "sync": 0.1, "norm": 0.1, "optimizer": 0.1})
    assert bench.relative_error(1.1, 1.0) == pytest.approx(0.1)


@pytest.mark.unit
def test_speedups_compare_ours_with_each_baseline():
    plans = [{"name": bench.OURS, "predicted_s": 1.0, "measured_s": 1.2},
             {"name": "megatron-lm", "predicted_s": 2.5, "measured_s": 2.4},
             {"name": "whale", "predicted_s": 1.1, "measured_s": 1.1}]
    rows = {r["baseline"]: r for r in bench.speedup_rows(plans)}
    assert rows["megatron-lm"]["predicted_speedup"] == pytest.approx(2.5)
    assert rows["megatron-lm"]["measured_speedup"] == pytest.approx(2.0)
    assert rows["megatron-lm"]["speedup_error"] == pytest.approx(0.25)
    assert rows["megatron-lm"]["ours_measured_faster"]
    assert not rows["whale"]["ours_measured_faster"]


def _measured(name, predicted, measured, sync=0.0):
    return {"name": name, "predicted_s": predicted, "measured_s": measured,
            "error": bench.relative_error(predicted, measured),
            "terms": {"sync": {"predicted_s": sync, "measured_s": sync}}}


@pytest.mark.unit
def test_variant_rows_pair_each_twin_with_its_plan_against_the_targets():
    plans = [_measured(bench.OURS, 1.0, 1.05), _measured("whale", 2.0, 2.0, sync=0.5),
             _measured("whale" + bench.OVERLAP, 1.7, 1.6), _measured("grid", 3.0, 3.0, sync=1.0),
             _measured("grid" + bench.OVERLAP, 2.9, 2.5),
             _measured(bench.INTERLEAVED_OURS, 0.9, 1.0)]
    rows = bench.variant_rows(plans)
    overlap = {r["plan"]: r for r in rows if r["kind"] == "overlap"}
    # whale hid 0.4 s of its 0.5 s sync (80%): met; grid 0.5 s of 1.0 s (50%): not
    assert overlap["whale"]["hidden_s"] == pytest.approx(0.4)
    assert overlap["whale"]["target_met"] and not overlap["grid"]["target_met"]
    (interleave,) = [r for r in rows if r["kind"] == "interleave"]
    # the forced v=2 twin: faster than ours, predicted 10% low: within the target's 10%
    assert (interleave["interleaved"], interleave["flat"]) == (bench.INTERLEAVED_OURS, bench.OURS)
    assert not interleave["planner_chose_interleaving"] and interleave["target_met"]
    # where the planner chose interleaving, ours is the interleaved side of the pair
    chose = bench.variant_rows([_measured(bench.OURS, 1.0, 1.2),
                                _measured(bench.FLAT_OURS, 1.1, 1.1)])
    assert chose[0]["interleaved"] == bench.OURS and chose[0]["planner_chose_interleaving"]
    assert not chose[0]["target_met"]          # slower than the one-chunk plan, 17% off


@pytest.mark.unit
def test_variant_plans_twin_the_syncing_plans_and_cut_ours_into_two_chunks():
    """--variants' plans: an overlapped twin of each plan with a predicted sync, our plan in 2
    chunks per stage where the planner chose one; both valid, the overlap twin's prediction at
    most the plan's."""
    fleet = emu.load_fleet(FLEET, cores=2)
    c4 = replace(fleet.cluster, nodes=tuple(replace(n, num_gpus=1) if n.name == "slow" else n
                                            for n in fleet.cluster.nodes))
    model = load_model(emu.EMULATED_DIR / "emu-gpt.yaml")
    profile = resolve_profile(c4, model, None, 2, model.seq_length)
    problem = Problem(c4, model, profile, 16, 2, model.seq_length)
    plans = [(bench.OURS, grid_plan(problem, 1, 4, 1, [8], False)),
             ("dp", grid_plan(problem, 1, 2, 2, [4, 4], False))]
    costs = {n: evaluate_plan(p, c4, profile) for n, p in plans}
    settings = type("Args", (), {"micro_batch_size": 2, "time_limit": 20.0})
    twins = dict(bench.variant_plans(plans, costs, type("Fleet", (), {"cluster": c4}), model,
                                     profile, 16, settings))
    assert set(twins) == {bench.OURS + bench.OVERLAP, "dp" + bench.OVERLAP,
                          bench.INTERLEAVED_OURS}
    for name, plan in plans:
        twin = twins[name + bench.OVERLAP]
        assert twin.overlap_grad_reduce and not plan.overlap_grad_reduce
        assert evaluate_plan(twin, c4, profile).iteration_time_s <= costs[name].iteration_time_s
    v2 = twins[bench.INTERLEAVED_OURS]
    v2.validate()
    assert [p.virtual_stages for p in v2.pipelines] == [2]
    assert [s.num_layers for s in v2.pipelines[0].stages] == [
        s.num_layers for s in plans[0][1].pipelines[0].stages]


@pytest.mark.unit
def test_plan_summary_reprices_the_cost_models_pipeline():
    """Fed the predicted stage compute as if measured, the repriced pipeline is the cost model's
    own; measured compute 10% slower on one stage moves it the way the 1F1B formula says."""
    fleet = emu.load_fleet(FLEET, cores=2)
    model = load_model(emu.EMULATED_DIR / "emu-gpt.yaml")
    profile = resolve_profile(fleet.cluster, model, None, 2, model.seq_length)
    problem = Problem(fleet.cluster, model, profile, 16, 2, model.seq_length)
    plan = grid_plan(problem, 1, 5, 1, [8], False)
    cost = evaluate_plan(plan, fleet.cluster, profile)
    predicted = bench.predicted_figures(cost)
    stage_compute = [{"compute_s": s["compute_s"]} for s in predicted["stages"]]
    iters = [[cost.iteration_time_s] * 3] * plan.world_size
    marks = [[{"schedule": cost.pipeline_time_s, "sync": cost.pipeline_time_s,
               "norm": cost.pipeline_time_s, "optimizer": cost.iteration_time_s}]
             * plan.world_size] * 3
    summary = bench.plan_summary("x", predicted, iters, marks, stage_compute, [8])
    assert summary["error"] == pytest.approx(0.0)
    assert summary["terms"]["pipeline"]["repriced_s"] == pytest.approx(cost.pipeline_time_s)
    assert summary["terms"]["pipeline"]["measured_s"] == pytest.approx(cost.pipeline_time_s)
    slowest = max(range(len(stage_compute)), key=lambda i: predicted["stages"][i]["compute_s"]
                  + predicted["stages"][i]["p2p_s"])
    stage_compute[slowest] = {"compute_s": 1.1 * stage_compute[slowest]["compute_s"]}
    summary = bench.plan_summary("x", predicted, iters, marks, stage_compute, [8])
    extra = 0.1 * predicted["stages"][slowest]["compute_s"]
    assert summary["terms"]["pipeline"]["repriced_s"] == pytest.approx(
        cost.pipeline_time_s + 8 * extra)
    # measured as repriced: the error is all compute, none left with the in-run compute
    marks = [[dict(m, schedule=cost.pipeline_time_s + 8 * extra) for m in it] for it in marks]
    iters = [[cost.iteration_time_s + 8 * extra] * 3] * plan.world_size
    summary = bench.plan_summary("x", predicted, iters, marks, stage_compute, [8])
    assert summary["error"] < -0.01
    assert summary["error_with_in_run_compute"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.unit
def test_error_contributions_add_up_to_the_error():
    summary = {"predicted_s": 1.0, "measured_s": 1.3, "terms": {
        "pipeline": {"predicted_s": 0.8, "repriced_s": 0.9, "measured_s": 1.0},
        "sync": {"predicted_s": 0.1, "measured_s": 0.15},
        "norm": {"predicted_s": 0.0, "measured_s": 0.05},
        "optimizer": {"predicted_s": 0.1, "measured_s": 0.08}}}
    parts = bench.error_contributions(summary)
    assert parts == pytest.approx({"compute": -0.1, "schedule": -0.1,
                                   "sync": -0.05, "norm": -0.05, "optimizer": 0.02,
                                   "rest": -0.02})
    assert sum(parts.values()) == pytest.approx(-0.3)


@pytest.mark.unit
def test_mean_profile_averages_the_gpus_of_a_type():
    from megatron_autohet.profiling.profile import OpCost, Profile, ProfileEntry
    from megatron_autohet.spec.precision import FP32

    def profile(gpu, t):
        op = OpCost(t, 2 * t, 10.0, 1.0, 5, "measured")
        p = Profile("m", precision=FP32)           # measured on a CPU
        p.add(ProfileEntry(gpu, 1, 2, 128, op, op, op))
        return p

    merged = bench.mean_profile([profile("A", 1.0), profile("A", 3.0), profile("B", 5.0)])
    assert merged.precision == FP32
    a, b = merged.get("A", 1, 2, 128), merged.get("B", 1, 2, 128)
    assert (a.layer.forward_s, a.layer.backward_s, a.output.forward_s) == (2.0, 4.0, 2.0)
    assert a.layer.activation_bytes == 10.0 and a.layer.source == "measured"
    assert b.embedding.forward_s == 5.0


@pytest.mark.unit
def test_effective_shares_are_cpu_over_wall_per_type():
    plans = [{"stages": [{"gpu": "A", "measured_compute_s": 1.0, "measured_compute_cpu_s": 0.6},
                         {"gpu": "B", "measured_compute_s": 2.0, "measured_compute_cpu_s": 0.3}]},
             {"stages": [{"gpu": "A", "measured_compute_s": 1.0, "measured_compute_cpu_s": 0.5},
                         {"gpu": "A", "measured_compute_s": 2.0, "measured_compute_cpu_s": 1.4}]}]
    assert bench.effective_shares(plans) == pytest.approx({"A": 0.6, "B": 0.15})


@pytest.mark.unit
def test_an_idle_gpu_keeps_computing_until_the_plans_ranks_arrive():
    import threading

    import torch.distributed as dist

    store, arrived, calls = dist.HashStore(), threading.Event(), []

    def busy():
        calls.append(1)
        if len(calls) == 3:
            arrived.set()

    idle = threading.Thread(target=bench.store_barrier, args=(store, "done", 2, busy), daemon=True)
    idle.start()
    assert arrived.wait(60)                   # still computing: the plan's rank has not arrived
    bench.store_barrier(store, "done", 2)     # the plan's rank: no busy work, leaves at once
    idle.join(60)
    assert not idle.is_alive() and len(calls) >= 3


@pytest.mark.integration
def test_stopping_a_session_kills_a_child_that_outlives_its_parent(tmp_path):
    # the session's leader ends on SIGTERM; its child ignores SIGTERM (as a rank's busy child)
    pid_file = tmp_path / "child.pid"
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "c = subprocess.Popen([sys.executable, '-c', 'import signal, sys, time; "
         "signal.signal(signal.SIGTERM, signal.SIG_IGN); open(sys.argv[1], \"w\").write(\"x\"); "
         "time.sleep(600)', sys.argv[1]]); "
         f"open({str(pid_file)!r} + '.c', 'w').write(str(c.pid)); time.sleep(600)",
         str(pid_file)], start_new_session=True)
    for _ in range(200):
        if pid_file.exists() and Path(f"{pid_file}.c").exists():
            break
        time.sleep(0.05)
    assert pid_file.exists(), "the child did not start"     # it ignores SIGTERM from here
    child = int(Path(f"{pid_file}.c").read_text())
    emu._stop_session(leader, grace_s=2.0)
    assert leader.poll() is not None
    for _ in range(100):            # a killed process is gone once its parent (init) reaps it
        if not Path(f"/proc/{child}").exists() or \
                Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the child {child} outlived the session's stop")
