"""`autohet plan / compare / show` end to end, in-process through cli.main.main([...]).

Each bundled cluster is planned for a bundled model and the written file is validated by
load_plan (the runtime's loader); compare's JSON is parsed; show's figure is a real PNG. Bad input
must exit 2 with `autohet <cmd>: error: <file>: field '<f>': ...` on stderr and no traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_autohet.cli.main import main
from megatron_autohet.plan import load_plan
from megatron_autohet.spec import load_cluster

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CLUSTERS = sorted((CONFIGS / "clusters").glob("*.yaml"))
GPT = CONFIGS / "models" / "gpt3-1.3b.yaml"
TINY = CONFIGS / "models" / "tiny.yaml"
H3 = CONFIGS / "clusters" / "a100-h800-h20.yaml"
LOCAL4 = CONFIGS / "clusters" / "local-4.yaml"
EXAMPLE_PLAN = CONFIGS / "plans" / "tiny-two-pipelines.yaml"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def expect_usage_error(capsys, argv, message: str) -> None:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert err.strip().splitlines()[-1] == message
    assert "Traceback" not in out + err


# ---- plan -----------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("cluster_file", CLUSTERS, ids=lambda p: p.stem)
def test_plan_each_bundled_cluster(capsys, tmp_path, cluster_file):
    tiny = cluster_file.stem.startswith("local-")   # the CPU-sized fleets plan the tiny model
    model, batch = (TINY, 8) if tiny else (GPT, 64)
    out_file = tmp_path / "plan.yaml"
    rc, out, _ = run_cli(capsys, "plan", "--cluster", cluster_file, "--model", model,
                         "--global-batch-size", batch, "--micro-batch-size", 2 if tiny else 1,
                         "-o", out_file)
    assert rc == 0
    plan = load_plan(out_file)                    # the runtime's loader validates everything
    cluster = load_cluster(cluster_file)
    assert plan.world_size <= cluster.world_size and plan.cluster == cluster.name
    assert plan.global_batch_size == batch
    assert plan.predicted["iteration_time_s"] > 0 and plan.predicted["fits_memory"]
    assert all(s.predicted_time_s > 0 and s.predicted_memory_gib > 0
               for p in plan.pipelines for s in p.stages)
    lines = out.splitlines()
    assert lines[1].split()[:4] == ["pipe", "stage", "ranks", "node"]
    rows = [line for line in lines[3:] if line[:1].isdigit() or line[:1] == " "]
    assert len(rows) >= sum(len(p.stages) for p in plan.pipelines)
    tokens = plan.predicted["tokens_per_s"]
    assert f"{tokens:,.0f} tokens/s" in out
    assert f"wrote {out_file}" in lines[-1]


@pytest.mark.unit
def test_plan_options_reach_the_planner(capsys, tmp_path):
    out_file = tmp_path / "plan.yaml"
    rc, _, _ = run_cli(capsys, "plan", "--cluster", H3, "--model", GPT, "--global-batch-size", 32,
                       "--tp", 4, "--recompute", "on", "-o", out_file)
    assert rc == 0
    plan = load_plan(out_file)
    assert plan.activation_recompute is True
    assert {s.tp for p in plan.pipelines for s in p.stages} == {4}


@pytest.mark.unit
def test_plan_prints_idle_gpus_and_honours_the_memory_headroom(capsys, tmp_path):
    """A 1-GPU T4 node cannot hold a TP-2 group: the plan leaves it idle and says so. The
    headroom reaches the planner: a plan with a 10% headroom fits 90% of every GPU; at 0.999 no
    plan fits (exit 2, the usual one-line error)."""
    cluster = tmp_path / "c.yaml"
    cluster.write_text(yaml.safe_dump({"name": "c", "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": "a", "gpu": "A100-80GB", "gpus": 2}, {"name": "t", "gpu": "T4", "gpus": 1}]}))
    out_file = tmp_path / "plan.yaml"
    rc, out, _ = run_cli(capsys, "plan", "--cluster", cluster, "--model", GPT,
                         "--global-batch-size", 8, "--tp", 2, "-o", out_file)
    assert rc == 0
    assert "idle GPUs (no rank in this plan): 1 x T4" in out
    plan = load_plan(out_file)
    assert plan.predicted["idle_gpus"] == {"T4": 1}
    assert all(s.predicted_memory_gib <= 0.9 * 80 for p in plan.pipelines for s in p.stages)
    rc, _, err = run_cli(capsys, "plan", "--cluster", cluster, "--model", GPT,
                         "--global-batch-size", 8, "--tp", 2, "--memory-headroom", 0.999,
                         "-o", out_file)
    assert rc == 2 and "fits in memory" in err.strip().splitlines()[-1]
    expect_usage_error(capsys, ["plan", "--cluster", cluster, "--model", GPT,
                                "--global-batch-size", 8, "--memory-headroom", 1.5, "-o",
                                out_file],
                       "autohet plan: error: <arguments>: field '--memory-headroom': got 1.5 "
                       "(allowed: a fraction of GPU memory in [0, 1), e.g. 0.1)")


@pytest.mark.unit
def test_the_plan_file_keeps_its_memory_headroom_for_show_and_replan(capsys, tmp_path):
    """A plan made with --memory-headroom 0.5 records it; `autohet show` and `autohet replan`
    judge memory with it (a GPU's usable memory is half of it), not with the default."""
    cluster = tmp_path / "c.yaml"
    nodes = [{"name": "a", "gpu": "A100-80GB", "gpus": 2}, {"name": "b", "gpu": "A100-80GB",
                                                           "gpus": 2}]
    cluster.write_text(yaml.safe_dump({"name": "c", "inter_node_bandwidth_gbs": 25,
                                       "nodes": nodes}))
    out_file = tmp_path / "plan.yaml"
    rc, out, _ = run_cli(capsys, "plan", "--cluster", cluster, "--model", GPT,
                         "--global-batch-size", 8, "--memory-headroom", 0.5, "-o", out_file)
    assert rc == 0 and "/ 40" in out
    assert load_plan(out_file).predicted["memory_headroom"] == 0.5
    rc, out, _ = run_cli(capsys, "show", out_file, "--cluster", cluster)
    assert rc == 0 and "/ 40" in out and "/ 72" not in out
    now = tmp_path / "now.yaml"
    now.write_text(yaml.safe_dump({"name": "c", "inter_node_bandwidth_gbs": 25,
                                   "nodes": nodes[:1]}))
    rc, out, _ = run_cli(capsys, "replan", "--plan", out_file, "--cluster", now, "--model", GPT,
                         "-o", tmp_path / "new.yaml")
    assert rc == 0 and "/ 40" in out
    new = load_plan(tmp_path / "new.yaml")
    assert new.predicted["memory_headroom"] == 0.5
    assert all(s.predicted_memory_gib <= 40 for p in new.pipelines for s in p.stages)


# ---- compare --------------------------------------------------------------------------------

@pytest.mark.integration
def test_compare_json(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "compare", "--cluster", H3, "--model", GPT,
                         "--global-batch-size", 64, "--json", "-o", tmp_path / "ours.yaml")
    assert rc == 0
    data = json.loads(out)                        # stdout is pure JSON
    ours = data["autohet"]["iteration_time_s"]
    assert ours > 0 and data["cluster"] == "a100-h800-h20" and data["model"] == "gpt3-1.3b"
    names = [b["name"] for b in data["baselines"]]
    assert "megatron-lm" in names and "whale" in names
    assert any(name.endswith(" only)") for name in names)   # the fastest type alone
    for b in data["baselines"]:
        assert b["speedup"] == pytest.approx(b["iteration_time_s"] / ours)
        assert b["tokens_per_s"] == pytest.approx(64 * 2048 / b["iteration_time_s"])
    megatron = data["baselines"][names.index("megatron-lm")]
    assert megatron["speedup"] > 1.0               # a single grid cannot balance three types
    # every plan reports the GPUs it leaves unused: the fastest type alone leaves the others
    fastest = next(b for b in data["baselines"] if b["name"].endswith(" only)"))
    assert fastest["idle_gpus"] == {"A100-80GB": 8, "H20": 8}
    assert megatron["idle_gpus"] == {} and isinstance(data["autohet"]["idle_gpus"], dict)
    predicted = load_plan(tmp_path / "ours.yaml").predicted
    assert predicted["iteration_time_s"] == pytest.approx(ours, rel=1e-5)


@pytest.mark.unit
def test_compare_table(capsys):
    rc, out, _ = run_cli(capsys, "compare", "--cluster", LOCAL4, "--model", TINY,
                         "--global-batch-size", 8, "--micro-batch-size", 2)
    assert rc == 0
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["plan", "iteration", "s"]
    assert lines[3].startswith("autohet (ours)") and "1.00x" in lines[3]
    assert any(line.startswith("megatron-lm ") for line in lines)
    assert any(line.startswith("whale ") for line in lines)


# ---- show -----------------------------------------------------------------------------------

@pytest.mark.integration
def test_show_table_and_figure(capsys, tmp_path):
    figure = tmp_path / "plan.png"
    rc, out, _ = run_cli(capsys, "show", EXAMPLE_PLAN, "--figure", figure)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"plan {EXAMPLE_PLAN}: tiny on local-4, 4 GPUs, 2 pipelines")
    assert lines[1].split() == ["pipe", "stage", "ranks", "node", "GPU", "TP", "layers",
                                "micro-batches", "time/mb", "ms", "memory", "GiB"]
    # pipeline 0: stage TP2 on ranks 0-1 (layers 0-3), stage TP1 on rank 2; pipeline 1: rank 3.
    assert lines[3].split()[:8] == ["0", "0", "0-1", "a100", "A100-80GB", "2", "0-3", "3"]
    assert lines[4].split()[:6] == ["1", "2", "h800", "H800", "1", "4-5"]
    assert lines[5].split()[:8] == ["1", "0", "3", "h20", "H20", "1", "0-5", "1"]
    # bundled local-4 found by the plan's cluster name: predictions are computed, not "-";
    # the limit is what a plan may fill: 80 GiB less the default 10% headroom
    assert "predicted iteration time" in out and " / 72" in lines[3]
    data = figure.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.unit
def test_show_warmup_column_only_for_hapt_depths(capsys, tmp_path):
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    raw["pipelines"][0]["stages"][0]["warmup_microbatches"] = 3     # standard is 1
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(raw))
    rc, out, _ = run_cli(capsys, "show", plan_file)
    assert rc == 0
    lines = out.splitlines()
    assert lines[1].split()[:9] == ["pipe", "stage", "ranks", "node", "GPU", "TP", "layers",
                                    "micro-batches", "warm-up"]
    assert lines[3].split()[8] == "3" and lines[4].split()[6] == "0"    # stage 1: last, 0
    assert lines[5].split()[8] == "0"                                   # one-stage pipeline
    assert "warm-up" not in run_cli(capsys, "show", EXAMPLE_PLAN)[1]


@pytest.mark.unit
def test_figure_groups_pipelines_only_with_identical_timelines():
    """Two copies of an [A100 | H800] pipeline on local-8 draw one timeline; a different 1F1B
    warm-up depth on one of them changes its timeline, so it gets its own."""
    from megatron_autohet.cli.show import identical_pipelines
    from megatron_autohet.cost_model import evaluate_plan
    from megatron_autohet.plan import plan_from_dict
    from megatron_autohet.planner.space import resolve_profile

    cluster = load_cluster(CONFIGS / "clusters" / "local-8.yaml")
    tiny = yaml.safe_load(EXAMPLE_PLAN.read_text())["model"]
    ranks = [{"rank": d.rank, "node": d.node, "local_rank": d.local_rank, "gpu": d.gpu}
             for d in cluster.devices()]

    def pipe(a100, h800):
        return {"num_microbatches": 4, "stages": [
            {"ranks": [a100], "layers": [0, 3]}, {"ranks": [h800], "layers": [3, 6]}]}

    raw = {"cluster": "local-8", "model": tiny, "micro_batch_size": 2, "global_batch_size": 16,
           "seq_length": 64, "ranks": ranks[:1] + ranks[1:2] + ranks[4:6],
           "pipelines": [pipe(0, 2), pipe(1, 3)]}
    for i, r in enumerate(raw["ranks"]):
        r["rank"] = i
    plan = plan_from_dict(raw)
    profile = resolve_profile(cluster, plan.model, None, plan.micro_batch_size, plan.seq_length)
    assert identical_pipelines(evaluate_plan(plan, cluster, profile)) == [[0, 1]]
    raw["pipelines"][1]["stages"][0]["warmup_microbatches"] = 3
    plan = plan_from_dict(raw)
    assert identical_pipelines(evaluate_plan(plan, cluster, profile)) == [[0], [1]]


@pytest.mark.unit
def test_show_without_a_known_cluster(capsys, tmp_path):
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    raw["cluster"] = "my-own-fleet"
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(raw))
    figure = tmp_path / "plan.png"
    rc, out, _ = run_cli(capsys, "show", plan_file, "--figure", figure)
    assert rc == 0
    assert "no prediction stored in the plan (pass --cluster to compute one)" in out
    assert figure.stat().st_size > 5_000          # the layout panel alone


@pytest.mark.unit
def test_show_recomputes_a_planned_file(capsys, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    assert run_cli(capsys, "plan", "--cluster", LOCAL4, "--model", TINY, "--global-batch-size", 8,
                   "--micro-batch-size", 2, "-o", plan_file)[0] == 0
    stored = load_plan(plan_file).predicted["tokens_per_s"]
    rc, out, _ = run_cli(capsys, "show", plan_file, "--cluster", LOCAL4)
    assert rc == 0 and f"{stored:,.0f} tokens/s" in out


@pytest.mark.integration
def test_plan_for_the_distributed_optimizer(capsys, tmp_path):
    """--use-distributed-optimizer is recorded in the plan, priced by the cost model (less
    memory per GPU than the same plan without it) and shown."""
    import dataclasses

    from megatron_autohet.cost_model import evaluate_plan
    from megatron_autohet.planner.space import resolve_profile

    plan_file = tmp_path / "plan.yaml"
    assert run_cli(capsys, "plan", "--cluster", H3, "--model", GPT, "--global-batch-size", 64,
                   "--time-limit", 5, "--use-distributed-optimizer", "-o", plan_file)[0] == 0
    plan = load_plan(plan_file)
    assert plan.use_distributed_optimizer
    assert yaml.safe_load(plan_file.read_text())["use_distributed_optimizer"] is True
    cluster = load_cluster(H3)
    profile = resolve_profile(cluster, plan.model, None, plan.micro_batch_size, plan.seq_length)
    sharded = evaluate_plan(plan, cluster, profile)
    assert plan.predicted["peak_memory_gib"] == round(sharded.peak_memory_gib, 3)
    whole = evaluate_plan(dataclasses.replace(plan, use_distributed_optimizer=False), cluster,
                          profile)
    assert sharded.peak_memory_gib < whole.peak_memory_gib
    rc, out, _ = run_cli(capsys, "show", plan_file)
    assert rc == 0 and "distributed optimizer" in out


# ---- bad input: exit 2, one clear line --------------------------------------------------------

@pytest.mark.unit
def test_unknown_gpu_type_in_cluster(capsys, tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("name: c\ninter_node_bandwidth_gbs: 25\n"
                   "nodes:\n  - {name: n, gpu: B200, gpus: 8}\n")
    rc, _, err = run_cli(capsys, "plan", "--cluster", bad, "--model", GPT,
                         "--global-batch-size", 8, "-o", tmp_path / "p.yaml")
    assert rc == 2
    assert err.startswith(f"autohet plan: error: {bad}: field 'nodes[0].gpu': unknown GPU type "
                          f"'B200' (allowed: A100-40GB, ")
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.unit
def test_batch_not_a_multiple_of_micro_batch(capsys, tmp_path):
    expect_usage_error(capsys, ["plan", "--cluster", H3, "--model", GPT, "--global-batch-size", 10,
                                "--micro-batch-size", 4, "-o", tmp_path / "p.yaml"],
                       "autohet plan: error: <command line>: field '--global-batch-size': 10 is "
                       "not a multiple of --micro-batch-size 4 (allowed: a multiple of the "
                       "micro-batch size)")


@pytest.mark.unit
def test_negative_batch(capsys, tmp_path):
    expect_usage_error(capsys, ["compare", "--cluster", H3, "--model", GPT,
                                "--global-batch-size", -8],
                       "autohet compare: error: <command line>: field '--global-batch-size': "
                       "got -8 (allowed: a number > 0)")


@pytest.mark.unit
def test_tp_that_does_not_divide_heads(capsys, tmp_path):
    expect_usage_error(capsys, ["plan", "--cluster", H3, "--model", GPT, "--global-batch-size", 8,
                                "--tp", 3, "-o", tmp_path / "p.yaml"],
                       "autohet plan: error: <command line>: field '--tp': TP degree 3 does not "
                       "divide the model's num_attention_heads (16) (allowed: a TP degree in "
                       "[1, 2, 4, 8, 16])")


@pytest.mark.unit
def test_output_in_a_missing_directory_fails_before_the_search(capsys, tmp_path):
    out = tmp_path / "none" / "p.yaml"
    expect_usage_error(capsys, ["plan", "--cluster", H3, "--model", GPT, "--global-batch-size", 8,
                                "-o", out],
                       f"autohet plan: error: <command line>: field '--output': {out}: directory "
                       f"{tmp_path / 'none'} does not exist (allowed: a file in an existing "
                       "directory)")


@pytest.mark.unit
def test_sequence_longer_than_the_learned_position_table(capsys, tmp_path):
    expect_usage_error(capsys, ["compare", "--cluster", H3, "--model", GPT,
                                "--global-batch-size", 8, "--seq-length", 4096],
                       "autohet compare: error: <command line>: field '--seq-length': 4096 > the "
                       "model's seq_length 2048 (learned position embeddings) (allowed: at most "
                       "2048, or a model with rope positions)")


@pytest.mark.unit
def test_show_figure_in_an_unknown_format(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "show", EXAMPLE_PLAN, "--figure", tmp_path / "plan.xyz")
    assert rc == 2
    assert err.startswith(f"autohet show: error: <command line>: field '--figure': "
                          f"{tmp_path / 'plan.xyz'}: unknown image format (allowed: a name "
                          "ending in ")
    assert ".png" in err and "Traceback" not in err


@pytest.mark.unit
@pytest.mark.parametrize("text, error", [
    ("model: llama2-7b\nentries: []\n", "field 'model': profile is for 'llama2-7b', the model "
     "is 'gpt3-1.3b' (allowed: a profile of 'gpt3-1.3b')"),
    ("model: gpt3-1.3b\nprecision: fp8\nentries: []\n", "field 'precision': got 'fp8' "
     "(allowed: bf16, fp32)"),
    # the runtime cannot train in fp16 (no loss scaler): no plan is priced for it
    ("model: gpt3-1.3b\nprecision: fp16\nentries: []\n", "field 'precision': got 'fp16': "
     "not built (fp16 needs a dynamic loss scaler, which this runtime does not have) (allowed: "
     "bf16, fp32)")])
def test_bad_profile_file(capsys, tmp_path, text, error):
    profile = tmp_path / "p.yaml"
    profile.write_text(text)
    expect_usage_error(capsys, ["plan", "--cluster", H3, "--model", GPT, "--global-batch-size", 8,
                                "--profile", profile, "-o", tmp_path / "plan.yaml"],
                       f"autohet plan: error: {profile}: {error}")


@pytest.mark.unit
def test_missing_model_file(capsys, tmp_path):
    expect_usage_error(capsys, ["compare", "--cluster", H3, "--model", tmp_path / "none.yaml",
                                "--global-batch-size", 8],
                       f"autohet compare: error: {tmp_path / 'none.yaml'}: field '<file>': file "
                       f"not found (allowed: a path to an existing YAML file)")


@pytest.mark.unit
def test_show_invalid_plan(capsys, tmp_path):
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    raw["pipelines"][1]["num_microbatches"] = 2
    bad = tmp_path / "plan.yaml"
    bad.write_text(yaml.safe_dump(raw))
    expect_usage_error(capsys, ["show", bad],
                       f"autohet show: error: {bad}: field 'global_batch_size': 8 != "
                       f"micro_batch_size 2 x 5 micro-batches (allowed: 10)")


@pytest.mark.unit
def test_show_plan_on_the_wrong_cluster(capsys):
    expect_usage_error(capsys, ["show", EXAMPLE_PLAN, "--cluster", H3],
                       f"autohet show: error: {H3}: field 'name': cluster 'a100-h800-h20', the "
                       f"plan was made for 'local-4' (allowed: the cluster the plan was made for "
                       f"('local-4'))")


@pytest.mark.unit
def test_help_of_every_command(capsys):
    for command in ("plan", "compare", "show", "profile"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert "(default:" in capsys.readouterr().out
    assert main([]) == 2
    out = capsys.readouterr().out
    for command in ("plan", "compare", "show", "profile"):
        assert command in out
