"""Each bad input to the GPU catalog, cluster and model loaders gives its exact, clear error.

The loaders read real files (written to tmp_path), so the file name in every message is checked
too: a user must be able to fix the input from the message alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_autohet.errors import ConfigError
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec import load_cluster, load_gpu_catalog, load_model
from megatron_autohet.spec.gpus import DEFAULT_CATALOG

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

GOOD_GPU = {"dense_tflops": 312, "memory_gib": 80, "memory_bandwidth_gbs": 2039,
            "intra_node_bandwidth_gbs": 300}
GOOD_MODEL = {"name": "m", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
              "vocab_size": 512, "seq_length": 64}


def write(tmp_path: Path, name: str, data) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def cluster_file(tmp_path: Path, nodes, **top) -> Path:
    data = {"name": "c", "inter_node_bandwidth_gbs": 25, "nodes": nodes, **top}
    return write(tmp_path, "cluster.yaml", data)


def expect_error(fn, path: Path, message: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(path)
    assert str(info.value) == f"{path}: {message}"
    return info.value


# ---- bundled configs load -------------------------------------------------------------------

def test_bundled_catalog_has_the_required_types():
    catalog = load_gpu_catalog()
    for name in ("A100-40GB", "A100-80GB", "H100", "H800", "H20", "H200", "V100-32GB", "T4",
                 "L4", "A10G", "L40S", "RTX-3090", "RTX-4090"):
        assert name in catalog
    assert catalog["V100-32GB"].bf16 is False and catalog["A100-80GB"].bf16 is True


@pytest.mark.parametrize("path", sorted((CONFIGS / "clusters").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_bundled_clusters_load(path):
    cluster = load_cluster(path)
    assert cluster.world_size == len(cluster.devices()) > 0
    assert [d.rank for d in cluster.devices()] == list(range(cluster.world_size))


@pytest.mark.parametrize("path", sorted((CONFIGS / "models").glob("*.yaml")), ids=lambda p: p.stem)
def test_bundled_models_load(path):
    model = load_model(path)
    assert model.hidden_size % model.num_attention_heads == 0
    assert 1 in model.valid_tp_degrees()


# ---- GPU catalog ----------------------------------------------------------------------------

def test_catalog_file_not_found(tmp_path):
    expect_error(load_gpu_catalog, tmp_path / "nope.yaml",
                 "field '<file>': file not found (allowed: a path to an existing YAML file)")


def test_catalog_not_yaml(tmp_path):
    path = write(tmp_path, "gpus.yaml", "gpus: [unclosed")
    with pytest.raises(ConfigError) as info:
        load_gpu_catalog(path)
    assert str(info.value).startswith(f"{path}: field '<file>': not valid YAML:")


def test_model_file_not_text(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_bytes(b"name: x\n\xff\xfe: 1\n")
    with pytest.raises(ConfigError) as info:
        load_model(path)
    assert str(info.value).startswith(f"{path}: field '<file>': not valid YAML:")


def test_catalog_top_level_not_a_mapping(tmp_path):
    expect_error(load_gpu_catalog, write(tmp_path, "gpus.yaml", "- A100\n"),
                 "field '<top level>': expected a mapping, got list")


def test_catalog_empty(tmp_path):
    expect_error(load_gpu_catalog, write(tmp_path, "gpus.yaml", {"gpus": {}}),
                 "field 'gpus': empty (allowed: at least one GPU type)")


def test_catalog_missing_field(tmp_path):
    entry = dict(GOOD_GPU)
    del entry["memory_gib"]
    expect_error(load_gpu_catalog, write(tmp_path, "gpus.yaml", {"gpus": {"X1": entry}}),
                 "field 'gpus.X1.memory_gib': missing (allowed: a number)")


def test_catalog_wrong_type(tmp_path):
    entry = dict(GOOD_GPU, dense_tflops="fast")
    expect_error(load_gpu_catalog, write(tmp_path, "gpus.yaml", {"gpus": {"X1": entry}}),
                 "field 'gpus.X1.dense_tflops': got 'fast' (str) (allowed: a number)")


def test_catalog_bool_is_not_a_number(tmp_path):
    entry = dict(GOOD_GPU, memory_gib=True)
    expect_error(load_gpu_catalog, write(tmp_path, "gpus.yaml", {"gpus": {"X1": entry}}),
                 "field 'gpus.X1.memory_gib': got True (allowed: a number)")


def test_catalog_negative_bandwidth(tmp_path):
    entry = dict(GOOD_GPU, memory_bandwidth_gbs=-5)
    expect_error(load_gpu_catalog, write(tmp_path, "gpus.yaml", {"gpus": {"X1": entry}}),
                 "field 'gpus.X1.memory_bandwidth_gbs': got -5.0 (allowed: a number > 0)")


def test_catalog_unknown_field(tmp_path):
    entry = dict(GOOD_GPU, tflops=1)
    expect_error(load_gpu_catalog, write(tmp_path, "gpus.yaml", {"gpus": {"X1": entry}}),
                 "field 'gpus.X1.tflops': unknown field (allowed: achieved_efficiency, bf16, "
                 "dense_tflops, intra_node_bandwidth_gbs, memory_bandwidth_gbs, memory_gib, "
                 "notes)")


def test_catalog_entry_not_a_mapping(tmp_path):
    expect_error(load_gpu_catalog, write(tmp_path, "gpus.yaml", {"gpus": {"X1": 312}}),
                 "field 'gpus.X1': expected a mapping, got 312")


def test_custom_catalog_feeds_the_cluster(tmp_path):
    catalog = load_gpu_catalog(write(tmp_path, "gpus.yaml", {"gpus": {"X1": GOOD_GPU}}))
    cluster = load_cluster(cluster_file(tmp_path, [{"name": "n", "gpu": "X1", "gpus": 2}]), catalog)
    assert cluster.gpu_types["X1"].dense_tflops == 312.0
    assert cluster.nodes[0].intra_node_bandwidth_gbs == 300.0   # the catalog's default


# ---- cluster --------------------------------------------------------------------------------

def test_cluster_unknown_gpu_type(tmp_path):
    allowed = ", ".join(sorted(load_gpu_catalog(DEFAULT_CATALOG)))
    expect_error(load_cluster, cluster_file(tmp_path, [{"name": "n", "gpu": "B200", "gpus": 8}]),
                 f"field 'nodes[0].gpu': unknown GPU type 'B200' (allowed: {allowed})")


def test_cluster_missing_gpus(tmp_path):
    expect_error(load_cluster, cluster_file(tmp_path, [{"name": "n", "gpu": "T4"}]),
                 "field 'nodes[0].gpus': missing (allowed: an integer)")


def test_cluster_missing_name(tmp_path):
    path = write(tmp_path, "cluster.yaml", {"inter_node_bandwidth_gbs": 25,
                                            "nodes": [{"name": "n", "gpu": "T4", "gpus": 1}]})
    expect_error(load_cluster, path, "field 'name': missing (allowed: a string)")


def test_cluster_wrong_type(tmp_path):
    expect_error(load_cluster, cluster_file(tmp_path, [{"name": "n", "gpu": "T4", "gpus": "8"}]),
                 "field 'nodes[0].gpus': got '8' (str) (allowed: an integer)")


def test_cluster_float_gpu_count(tmp_path):
    expect_error(load_cluster, cluster_file(tmp_path, [{"name": "n", "gpu": "T4", "gpus": 2.5}]),
                 "field 'nodes[0].gpus': got 2.5 (float) (allowed: an integer)")


def test_cluster_zero_gpus(tmp_path):
    expect_error(load_cluster, cluster_file(tmp_path, [{"name": "n", "gpu": "T4", "gpus": 0}]),
                 "field 'nodes[0].gpus': got 0 (allowed: a number > 0)")


def test_cluster_negative_inter_node_bandwidth(tmp_path):
    path = cluster_file(tmp_path, [{"name": "n", "gpu": "T4", "gpus": 1}],
                        inter_node_bandwidth_gbs=-1)
    expect_error(load_cluster, path,
                 "field 'inter_node_bandwidth_gbs': got -1.0 (allowed: a number > 0)")


def test_cluster_negative_node_bandwidth(tmp_path):
    path = cluster_file(tmp_path, [{"name": "n", "gpu": "T4", "gpus": 1,
                                    "intra_node_bandwidth_gbs": -16}])
    expect_error(load_cluster, path,
                 "field 'nodes[0].intra_node_bandwidth_gbs': got -16.0 (allowed: a number > 0)")


def test_cluster_negative_spot_price(tmp_path):
    path = cluster_file(tmp_path, [{"name": "n", "gpu": "T4", "gpus": 1, "spot_price": -0.1}])
    expect_error(load_cluster, path,
                 "field 'nodes[0].spot_price': got -0.1 (allowed: a number >= 0)")


def test_cluster_duplicate_node_name(tmp_path):
    path = cluster_file(tmp_path, [{"name": "n", "gpu": "T4", "gpus": 1},
                                   {"name": "n", "gpu": "L4", "gpus": 1}])
    expect_error(load_cluster, path,
                 "field 'nodes[1].name': duplicate node name 'n' (allowed: unique node names)")


def test_cluster_duplicate_name_from_count_expansion(tmp_path):
    # count: 2 names the nodes t4-0 and t4-1; a second entry named t4-1 collides.
    path = cluster_file(tmp_path, [{"name": "t4", "gpu": "T4", "gpus": 4, "count": 2},
                                   {"name": "t4-1", "gpu": "T4", "gpus": 4}])
    expect_error(load_cluster, path,
                 "field 'nodes[1].name': duplicate node name 't4-1' (allowed: unique node names)")


def test_cluster_empty_nodes(tmp_path):
    expect_error(load_cluster, cluster_file(tmp_path, []),
                 "field 'nodes': empty (allowed: a list of at least one node)")


def test_cluster_node_not_a_mapping(tmp_path):
    expect_error(load_cluster, cluster_file(tmp_path, ["a100"]),
                 "field 'nodes[0]': expected a mapping, got 'a100'")


def test_cluster_unknown_node_field(tmp_path):
    path = cluster_file(tmp_path, [{"name": "n", "gpu": "T4", "gpus": 1, "gpu_count": 1}])
    expect_error(load_cluster, path,
                 "field 'nodes[0].gpu_count': unknown field (allowed: count, gpu, gpus, "
                 "inter_node_bandwidth_gbs, intra_node_bandwidth_gbs, name, spot_price, zone)")


def test_cluster_count_expands_nodes_and_ranks(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path, [
        {"name": "a", "gpu": "A100-80GB", "gpus": 2},
        {"name": "t4", "gpu": "T4", "gpus": 1, "count": 2, "inter_node_bandwidth_gbs": 5}]))
    assert [n.name for n in cluster.nodes] == ["a", "t4-0", "t4-1"]
    assert [(d.rank, d.node, d.local_rank) for d in cluster.devices()] == [
        (0, "a", 0), (1, "a", 1), (2, "t4-0", 0), (3, "t4-1", 0)]
    assert cluster.link("a", "t4-0").bandwidth_gbs == 5.0    # the slower NIC
    assert cluster.link("a", "a").bandwidth_gbs == 300.0     # the catalog's NVLink figure


# ---- model ----------------------------------------------------------------------------------

def test_model_heads_do_not_divide_hidden(tmp_path):
    path = write(tmp_path, "model.yaml", dict(GOOD_MODEL, num_attention_heads=6))
    expect_error(load_model, path, "field 'num_attention_heads': 6 does not divide hidden_size 64 "
                 "(allowed: a divisor of hidden_size)")


def test_model_query_groups_do_not_divide_heads(tmp_path):
    path = write(tmp_path, "model.yaml", dict(GOOD_MODEL, num_query_groups=3))
    expect_error(load_model, path, "field 'num_query_groups': 3 does not divide "
                 "num_attention_heads 4 (allowed: a divisor of num_attention_heads)")


def test_model_missing_field(tmp_path):
    data = dict(GOOD_MODEL)
    del data["num_layers"]
    expect_error(load_model, write(tmp_path, "model.yaml", data),
                 "field 'num_layers': missing (allowed: an integer)")


def test_model_wrong_type(tmp_path):
    expect_error(load_model, write(tmp_path, "model.yaml", dict(GOOD_MODEL, hidden_size="64")),
                 "field 'hidden_size': got '64' (str) (allowed: an integer)")


def test_model_negative_layers(tmp_path):
    expect_error(load_model, write(tmp_path, "model.yaml", dict(GOOD_MODEL, num_layers=-2)),
                 "field 'num_layers': got -2 (allowed: a number > 0)")


def test_model_bad_position_embedding(tmp_path):
    path = write(tmp_path, "model.yaml", dict(GOOD_MODEL, position_embedding_type="alibi"))
    expect_error(load_model, path, "field 'position_embedding_type': got 'alibi' "
                 "(allowed: learned_absolute, rope)")


def test_model_unknown_field(tmp_path):
    path = write(tmp_path, "model.yaml", dict(GOOD_MODEL, layers=4))
    with pytest.raises(ConfigError) as info:
        load_model(path)
    assert info.value.field == "layers" and info.value.problem == "unknown field"
    assert "num_layers" in info.value.allowed


def test_model_defaults_and_tp_degrees(tmp_path):
    model = load_model(write(tmp_path, "model.yaml", dict(GOOD_MODEL, num_attention_heads=8,
                                                          num_query_groups=2)))
    assert model.ffn_hidden_size == 256 and model.tie_embeddings
    assert model.valid_tp_degrees() == [1, 2]      # query groups (2) bound the TP degree


@pytest.mark.parametrize("changes, tp, problem", [
    ({"num_attention_heads": 8, "num_query_groups": 2}, 4,
     "TP degree 4 does not divide the model's num_query_groups (2)"),
    ({"ffn_hidden_size": 98}, 4, "TP degree 4 does not divide the model's ffn_hidden_size (98)"),
    ({}, 3, "TP degree 3 does not divide the model's num_attention_heads (4)"),
    ({}, 0, "TP degree 0"),
])
def test_tp_degree_check_names_the_dimension_it_does_not_divide(tmp_path, changes, tp, problem):
    model = load_model(write(tmp_path, "model.yaml", dict(GOOD_MODEL, **changes)))
    with pytest.raises(ConfigError) as info:
        model.check_tp_degree(tp, "plan.yaml", "pipelines[0].stages[0].ranks")
    assert str(info.value) == (f"plan.yaml: field 'pipelines[0].stages[0].ranks': {problem} "
                               f"(allowed: a TP degree in {model.valid_tp_degrees(64)})")
    for good in model.valid_tp_degrees(64):
        model.check_tp_degree(good, "plan.yaml", "pipelines[0].stages[0].ranks")


# ---- NaN and infinity -----------------------------------------------------------------------

@pytest.mark.parametrize("text, where", [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf")])
def test_non_finite_numbers_refused_in_every_file(tmp_path, text, where):
    """NaN passes every comparison (``nan <= 0`` is False) and infinity makes every time and
    memory figure meaningless: each loader refuses both with the file and the field."""
    def yaml_with(data: dict, key_path: str) -> str:
        return yaml.safe_dump(data).replace(f"{key_path}: 12345.5", f"{key_path}: {text}")

    catalog = tmp_path / "gpus.yaml"
    catalog.write_text(yaml_with({"gpus": {"X": {**GOOD_GPU, "memory_gib": 12345.5}}},
                                 "memory_gib"))
    expect_error(load_gpu_catalog, catalog, f"field 'gpus.X.memory_gib': got {where} "
                 "(allowed: a finite number)")

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml_with({"name": "c", "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": "a", "gpu": "T4", "gpus": 2, "inter_node_bandwidth_gbs": 12345.5}]},
        "inter_node_bandwidth_gbs"))
    expect_error(load_cluster, cluster, f"field 'nodes[0].inter_node_bandwidth_gbs': got "
                 f"{where} (allowed: a finite number)")

    model = tmp_path / "model.yaml"
    model.write_text(yaml_with({**GOOD_MODEL, "num_layers": 12345.5}, "num_layers"))
    expect_error(load_model, model, f"field 'num_layers': got {where} (float) "
                 "(allowed: an integer)")

    op = {"forward_s": 0.1, "backward_s": 0.2, "activation_bytes": 12345.5,
          "activation_bytes_recompute": 1.0, "param_count": 10}
    profile = tmp_path / "profile.json"
    json_text = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[where]
    profile.write_text(json.dumps({"model": "m", "entries": [
        {"gpu": "T4", "tp": 1, "micro_batch_size": 1, "seq_length": 64,
         "layer": op, "embedding": op, "output": op}]}).replace("12345.5", json_text, 1))
    expect_error(Profile.load, profile, f"field 'entries[0].layer.activation_bytes': got "
                 f"{where} (allowed: a finite number)")
