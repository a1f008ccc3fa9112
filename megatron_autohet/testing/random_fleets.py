"""Seeded random small planning problems: the planner's optimality is checked on them against the
exhaustive search (tests/planner/test_planner_optimality.py, scripts/bench_planner.py): general ones
(:func:`random_case`), ones where memory decides (:func:`memory_bound_case`), ones where the
order of GPU types along a pipeline and the layer split decide (:func:`odd_case`), 6-GPU
fleets of two catalog types whose layer copies can share a node (:func:`shared_node_case`) and
general ones spread over zones (:func:`zoned_case`).

A case is a fleet of 2-4 GPU types drawn over realistic datasheet ranges (a catalog of its own,
so types the bundled catalog lacks are covered too), at most 16 GPUs in nodes of 1-8 GPUs, every
node with its own intra-node link (PCIe to NVLink) and NIC (1 to 50 GB/s); a GPT of a few
layers; a global batch of a few micro-batches; and the TP degrees and pipeline depth the
exhaustive search can enumerate (at most MAX_TP_GROUPS TP groups). GPU memory is drawn around
what the model needs, so in some cases a type cannot hold the model alone or at all, and the
split (or activation recompute, or leaving a type idle) is decided by memory.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from megatron_autohet.cost_model import DEFAULT_MEMORY_HEADROOM, evaluate_plan
from megatron_autohet.plan import Plan
from megatron_autohet.profiling.estimate import estimate_profile
from megatron_autohet.spec.cluster import Cluster, cluster_from_dict
from megatron_autohet.spec.gpus import GPUType
from megatron_autohet.spec.model import ModelSpec

# The exhaustive search enumerates every arrangement of the TP groups: beyond this many groups a
# case takes minutes.
MAX_TP_GROUPS = 5
MAX_GPUS = 16


@dataclass(frozen=True)
class Case:
    seed: int
    cluster: Cluster
    model: ModelSpec
    global_batch_size: int
    micro_batch_size: int
    tp_degrees: list[int]
    max_stages: int
    activation_recompute: bool | None = None      # None: both searches decide

    def space(self) -> dict:
        """The search space both searches get (keyword arguments)."""
        return {"tp_degrees": self.tp_degrees, "max_stages": self.max_stages,
                "activation_recompute": self.activation_recompute}

    def closed_form_s(self, plan: Plan) -> float:
        """The plan's iteration time with the standard 1F1B warm-up depths: the cost model's
        closed form, which both searches optimise (the HAPT warm-up pass runs after each, on
        its best plan only, so it can turn a plan 0.85% slower into one 6.9% faster or
        slower: odd_case seed 20)."""
        plain = dataclasses.replace(plan, pipelines=[
            dataclasses.replace(pipe, stages=[dataclasses.replace(s, warmup_microbatches=None)
                                              for s in pipe.stages])
            for pipe in plan.pipelines])
        profile = estimate_profile(self.model, self.cluster, self.micro_batch_size,
                                   self.model.seq_length)
        return evaluate_plan(plain, self.cluster, profile, with_timeline=False).iteration_time_s

    def describe(self) -> str:
        nodes = ", ".join(f"{n.name}:{n.gpu}x{n.num_gpus}(intra {n.intra_node_bandwidth_gbs:.0f}, "
                          f"nic {n.inter_node_bandwidth_gbs:.1f})" for n in self.cluster.nodes)
        types = ", ".join(f"{g.name}: {g.dense_tflops:.0f} TF {g.memory_gib:.1f} GiB "
                          f"{g.memory_bandwidth_gbs:.0f} GB/s"
                          for g in self.cluster.gpu_types.values())
        return (f"seed {self.seed}: {self.model.name} L={self.model.num_layers} "
                f"h={self.model.hidden_size} s={self.model.seq_length}, gbs "
                f"{self.global_batch_size} mbs {self.micro_batch_size}, tp {self.tp_degrees}, "
                f"max_stages {self.max_stages}; nodes [{nodes}]; types [{types}]")


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _model(rng: random.Random) -> ModelSpec:
    hidden = rng.choice((1024, 1536, 2048, 2560))
    return ModelSpec(name="gpt-random", num_layers=rng.randint(3, 6), hidden_size=hidden,
                     num_attention_heads=16, ffn_hidden_size=4 * hidden, vocab_size=50257,
                     seq_length=rng.choice((1024, 2048)), num_query_groups=16,
                     tie_embeddings=rng.random() < 0.7)


def _state_gib(model: ModelSpec) -> float:
    """Rough weights + gradients + Adam state of the whole model at TP 1 (the draw's scale)."""
    h = model.hidden_size
    params = model.num_layers * 12 * h * h + model.vocab_size * h
    return params * 18 / 1024 ** 3


def random_case(seed: int) -> Case:
    """The case of this seed (module doc); the same seed gives the same case."""
    rng = random.Random(seed)
    model = _model(rng)
    scale = _state_gib(model)
    types: dict[str, GPUType] = {}
    for i in range(rng.randint(2, 4)):
        # From a T4-class part to an H200-class one; memory from a third of the model's state
        # (only a deep split fits) to several times it.
        name = f"G{i}"
        types[name] = GPUType(name=name, dense_tflops=_log_uniform(rng, 30, 1000),
                              memory_gib=1.5 + scale * _log_uniform(rng, 0.35, 4.0),
                              memory_bandwidth_gbs=_log_uniform(rng, 300, 4800),
                              intra_node_bandwidth_gbs=_log_uniform(rng, 16, 450))
    nodes, gpus = [], 0
    for name, gpu in types.items():             # every type has at least one node
        size = rng.choice((1, 2, 2, 4, 4, 8))
        nodes.append((name, size))
    rng.shuffle(nodes)
    while rng.random() < 0.5:
        nodes.append((rng.choice(list(types)), rng.choice((1, 2, 4))))
    while sum(n for _, n in nodes) > MAX_GPUS:
        nodes = [(g, max(1, n // 2)) for g, n in nodes]
    entries = []
    for i, (gpu, n) in enumerate(nodes):
        entries.append({"name": f"n{i}", "gpu": gpu, "gpus": n,
                        # per node: some nodes of a type have a slower fabric or NIC
                        "intra_node_bandwidth_gbs": types[gpu].intra_node_bandwidth_gbs
                        * rng.choice((1.0, 1.0, 0.5)),
                        "inter_node_bandwidth_gbs": _log_uniform(rng, 1, 50)})
        gpus += n
    cluster = cluster_from_dict({"name": f"random-{seed}", "inter_node_bandwidth_gbs": 25,
                                 "nodes": entries}, catalog=types)
    max_node = max(n.num_gpus for n in cluster.nodes)
    degrees = [t for t in model.valid_tp_degrees(max_node)
               if 0 < sum(n.num_gpus // t for n in cluster.nodes) <= MAX_TP_GROUPS]
    # With 7+ single-GPU nodes no degree qualifies: drop nodes until TP 1 does.
    while not degrees:
        cluster = cluster.subset([n.name for n in cluster.nodes[:-1]])
        degrees = [t for t in model.valid_tp_degrees(max(n.num_gpus for n in cluster.nodes))
                   if 0 < sum(n.num_gpus // t for n in cluster.nodes) <= MAX_TP_GROUPS]
    degrees = rng.sample(degrees, min(2, len(degrees)))
    micro_batch = rng.choice((1, 1, 2))
    microbatches = rng.randint(2, 12)
    return Case(seed, cluster, dataclasses.replace(model, name=f"gpt-random-{seed}"),
                microbatches * micro_batch, micro_batch, sorted(degrees),
                min(4, model.num_layers))


def memory_bound_case(seed: int) -> Case:
    """A case where memory decides the plan: small GPUs (3-4.5 GiB usable) hold a layer or
    two of a 4-layer GPT at micro-batch 4 but never its output layer (the fp32 cross entropy of
    a 50k vocabulary), larger ones (5.5-8 GiB usable) hold the output layer with a few layers
    or, just, the whole model; 2-3 micro-batches, so pipelines run fewer micro-batches than
    stages and keep fewer in flight. TP 1, no recompute: every choice the search has left is
    one memory decides."""
    rng = random.Random(seed)
    usable = 1.0 - DEFAULT_MEMORY_HEADROOM
    small = GPUType("small", rng.uniform(100, 900), rng.uniform(3.0, 4.5) / usable, 2000, 200)
    large = GPUType("large", rng.uniform(100, 900), rng.uniform(5.5, 8.0) / usable, 2000, 200)
    cluster = cluster_from_dict({"name": f"memory-{seed}", "inter_node_bandwidth_gbs": 25,
                                 "nodes": [{"name": "s", "gpu": "small",
                                            "gpus": rng.choice((2, 3, 4))},
                                           {"name": "l", "gpu": "large",
                                            "gpus": rng.choice((1, 2))}]},
                                catalog={"small": small, "large": large})
    model = ModelSpec(name=f"gpt-memory-{seed}", num_layers=4, hidden_size=1024,
                      num_attention_heads=16, ffn_hidden_size=4096, vocab_size=50257,
                      seq_length=2048, num_query_groups=16)
    return Case(seed, cluster, model, 4 * rng.choice((2, 3)), 4, [1], 4, False)


def odd_case(seed: int) -> Case:
    """A case where the order of GPU types along a pipeline and the layer split decide: 2-4
    types with odd GPU counts (1 or 3 each, at most MAX_TP_GROUPS GPUs), as one node per type
    or as one-GPU nodes (each with its own NIC, so a type's GPUs are several pools), TP 1, no
    recompute, a GPT of 7-13 layers (7-10 on five GPUs: more layer splits of a 3-4 stage
    pipeline than the planner enumerates one by one, space.ALL_SPLITS_UP_TO) with GPU memory
    around the model's state (a type may hold a few layers, the model, or nothing), 2-9
    micro-batches."""
    rng = random.Random(seed)
    counts = rng.choice([(1, 1), (1, 3), (3, 1), (1, 1, 1), (3, 1, 1), (1, 3, 1), (1, 1, 3),
                         (1, 1, 1, 1)])
    hidden = rng.choice((1024, 1536, 2048))
    # (five GPUs with 13 layers take the exhaustive search a minute)
    layers = rng.randint(7, 13 if sum(counts) <= 4 else 10)
    model = ModelSpec(name=f"gpt-odd-{seed}", num_layers=layers, hidden_size=hidden,
                      num_attention_heads=16, ffn_hidden_size=4 * hidden, vocab_size=50257,
                      seq_length=rng.choice((1024, 2048)), num_query_groups=16,
                      tie_embeddings=rng.random() < 0.7)
    scale = _state_gib(model)
    types = {f"G{i}": GPUType(name=f"G{i}", dense_tflops=_log_uniform(rng, 30, 1000),
                              memory_gib=1.5 + scale * _log_uniform(rng, 0.4, 3.0),
                              memory_bandwidth_gbs=_log_uniform(rng, 300, 4800),
                              intra_node_bandwidth_gbs=_log_uniform(rng, 16, 450))
             for i in range(len(counts))}
    one_node = rng.random() < 0.5
    nodes = []
    for (name, gpu), count in zip(types.items(), counts):
        for i in range(1 if one_node else count):
            nodes.append({"name": f"n{name}-{i}", "gpu": name, "gpus": count if one_node else 1,
                          "intra_node_bandwidth_gbs": gpu.intra_node_bandwidth_gbs,
                          "inter_node_bandwidth_gbs": _log_uniform(rng, 1, 50)})
    rng.shuffle(nodes)
    cluster = cluster_from_dict({"name": f"odd-{seed}", "inter_node_bandwidth_gbs": 25,
                                 "nodes": nodes}, catalog=types)
    return Case(seed, cluster, model, rng.randint(2, 9), 1, [1], 4, False)


# Catalog GPU types with bf16 (shared_node_case).
CATALOG_TYPES = ("A100-40GB", "A100-80GB", "H100", "H800", "H20", "H200", "L4", "A10G", "L40S",
                 "RTX-4090")


def shared_node_case(seed: int) -> Case:
    """6 GPUs of two catalog types (CATALOG_TYPES) in nodes of 1-4 GPUs, TP 1, a GPT of 4-8
    layers and 2048-4096 hidden, NICs of 3-25 GB/s: a layer's copies in two pipelines can share
    a node (stacks and pairs of pipelines whose sync stays inside it), which the option pruning
    once priced at the NIC (tests/planner/test_option_pruning.py)."""
    rng = random.Random(1000 + seed)
    types = rng.sample(CATALOG_TYPES, 2)
    sizes = rng.choice([(4, 2), (2, 4), (2, 2, 2), (3, 3), (4, 1, 1), (2, 2, 1, 1)])
    nodes = [(types[i % 2] if i < 2 else rng.choice(types), n) for i, n in enumerate(sizes)]
    nic = rng.choice((3.125, 6.25, 12.5, 25.0))
    hidden = rng.choice((2048, 2560, 4096))
    model = ModelSpec(name=f"gpt-shared-{seed}", num_layers=rng.randint(4, 8),
                      hidden_size=hidden, num_attention_heads=32, ffn_hidden_size=4 * hidden,
                      vocab_size=50257, seq_length=rng.choice((1024, 2048)), num_query_groups=32,
                      tie_embeddings=rng.random() < 0.7)
    cluster = cluster_from_dict({"name": f"shared-{seed}", "inter_node_bandwidth_gbs": nic,
                                 "nodes": [{"name": f"n{i}", "gpu": g, "gpus": n}
                                           for i, (g, n) in enumerate(nodes)]})
    return Case(seed, cluster, model, rng.randint(2, 12), 1, [1], 4)


def zoned_case(seed: int) -> Case:
    """:func:`random_case`'s fleet of this seed with its nodes spread over two or three zones
    (every zone holding a node; in one region, or the third zone in another), the links between
    them slower than most NICs (0.1 to 5 GB/s, 1 to 30 ms, $0.01-0.02 per GB): where pipelines
    and gradient-sync groups cross zones decides the plan."""
    case = random_case(seed)
    rng = random.Random(10_000 + seed)
    nodes = list(case.cluster.nodes)
    zones = ["za", "zb", "zc"][:min(len(nodes), rng.choice((2, 2, 3)))]
    placed = zones + [rng.choice(zones) for _ in nodes[len(zones):]]
    rng.shuffle(placed)
    link = {"bandwidth_gbs": _log_uniform(rng, 0.1, 5.0), "latency_ms": _log_uniform(rng, 1, 30),
            "egress_usd_per_gb": rng.choice((0.01, 0.02))}
    cluster = dataclasses.replace(
        case.cluster, nodes=tuple(dataclasses.replace(n, zone=z) for n, z in zip(nodes, placed)))
    data = {"name": cluster.name, "inter_node_bandwidth_gbs": 25,
            "zones": {z: ("r2" if z == "zc" and rng.random() < 0.5 else "r1") for z in zones},
            "links": {"inter_zone": link, "inter_region": dict(link, bandwidth_gbs=link[
                "bandwidth_gbs"] / 2, latency_ms=link["latency_ms"] * 3)},
            "nodes": [{"name": n.name, "gpu": n.gpu, "gpus": n.num_gpus, "zone": n.zone,
                       "intra_node_bandwidth_gbs": n.intra_node_bandwidth_gbs,
                       "inter_node_bandwidth_gbs": n.inter_node_bandwidth_gbs}
                      for n in cluster.nodes]}
    return dataclasses.replace(case, cluster=cluster_from_dict(data, catalog=dict(
        case.cluster.gpu_types)))
