"""Seeded random small planning problems: the planner's optimality is checked on them against the
exhaustive search (tests/test_planner_optimality.py, scripts/bench_planner.py).

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

from megatron_autohet.cost_model import DEFAULT_MEMORY_HEADROOM
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
