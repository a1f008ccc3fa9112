#!/usr/bin/env python3
"""Fingerprints of the plans the planner makes, to prove a refactor leaves them unchanged.

Plans every bundled fleet with every bundled model, the planner benchmark's generated fleets
(scripts/bench_planner.py's ``fleet``) up to 512 GPUs, the cost objective per node and per GPU
on priced fleets, a re-plan of each objective after losing a node, and the exhaustive search
on seeded random small fleets; writes one line per case: its name, the SHA-256 of the plan
(its file's dictionary, keys sorted), the predicted iteration time and how the search ended.

    python scripts/plan_fingerprints.py > before.txt     # at the commit before the change
    python scripts/plan_fingerprints.py > after.txt      # after it
    diff before.txt after.txt                            # no output: the same plans

Every search gets a safety net of SAFETY_NET_S, which no load reaches, so the work budget
alone ends it and both sides may run at any load (``ended`` says how each ended).
About 10 CPU-minutes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_planner import fleet  # noqa: E402

from megatron_autohet.errors import ConfigError  # noqa: E402
from megatron_autohet.planner.replan import replan  # noqa: E402
from megatron_autohet.planner.search import search  # noqa: E402
from megatron_autohet.spec.cluster import load_cluster  # noqa: E402
from megatron_autohet.spec.model import load_model  # noqa: E402
from megatron_autohet.testing.exhaustive import exhaustive_optimum  # noqa: E402
from megatron_autohet.testing.random_fleets import random_case  # noqa: E402


# The wall-clock safety net of every search (a loaded machine cut the default 60 s ones).
SAFETY_NET_S = 3600.0


def digest(plan) -> str:
    return hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def line(name: str, cand) -> str:
    if cand is None:
        return f"{name}: no plan fits"
    ended = getattr(cand, "stopped_by", "")
    return f"{name}: {digest(cand.plan)} {cand.cost.iteration_time_s!r} {ended}"


def attempt(make):
    try:
        return make()
    except ConfigError as err:
        return f"refused ({str(err).splitlines()[0][:80]})"


def emit(name: str, result) -> None:
    print(result if isinstance(result, str) and result.startswith(name)
          else f"{name}: {result}" if isinstance(result, str) else line(name, result), flush=True)


def main() -> None:
    models = {p.stem: load_model(p) for p in sorted((ROOT / "configs/models").glob("*.yaml"))}
    for path in sorted((ROOT / "configs/clusters").glob("*.yaml")):
        cluster = load_cluster(path)
        for name, model in models.items():
            emit(f"bundled {path.stem} {name}",
                 attempt(lambda: search(cluster, model, None, 512, 1, progress=False,
                                           time_limit_s=SAFETY_NET_S)))
    for gpus in (8, 32, 64, 128, 512):
        for name in ("gpt3-1.3b", "llama2-7b"):
            emit(f"bench {gpus} {name}", attempt(lambda: search(
                fleet(gpus), models[name], None, max(64, 2 * gpus), 1, progress=False,
                time_limit_s=SAFETY_NET_S)))
    for gpus, charge in ((64, "per-node"), (256, "per-node"), (64, "per-gpu")):
        cluster = fleet(gpus, priced=True)
        names = [n.name for n in cluster.nodes]
        for name in ("gpt3-1.3b", "llama2-7b"):
            gbs = 2 * gpus
            fastest = search(cluster, models[name], None, gbs, 1, progress=False, charge=charge,
                             time_limit_s=SAFETY_NET_S)
            emit(f"fastest {gpus} {charge} {name}", fastest)
            cheap = search(cluster, models[name], None, gbs, 1, progress=False, objective="cost",
                           min_tokens_per_s=0.6 * fastest.cost.tokens_per_s, charge=charge,
                           time_limit_s=SAFETY_NET_S)
            emit(f"cost {gpus} {charge} {name}", cheap)
            for label, plan in (("throughput", fastest.plan), ("cost", cheap.plan)):
                used = sorted({r.node for r in plan.ranks})
                new = replan(plan, cluster.subset([n for n in names if n != used[0]]),
                             models[name], time_limit_s=SAFETY_NET_S)
                emit(f"replan {label} {gpus} {charge} {name} lost {used[0]}", new)
                print(f"  moves {new.recovery_bytes} note {new.objective_note!r}", flush=True)
    for seed in range(12):
        case = random_case(seed)
        args = (case.cluster, case.model, None, case.global_batch_size, case.micro_batch_size)
        best = attempt(lambda: exhaustive_optimum(*args, **case.space())[1])
        emit(f"exhaustive seed {seed}", best)
        emit(f"search seed {seed}", attempt(lambda: search(*args, progress=False,
                                                           time_limit_s=SAFETY_NET_S,
                                                           **case.space())))


if __name__ == "__main__":
    main()
