"""megatron-autohet: heterogeneous, preemptible GPT training on megatron-core.

Package layout follows the data flow (docs/architecture.md has one line per module):

    spec/        GPU catalog, cluster and model descriptions (YAML -> dataclasses, validated)
    profiling/   per-layer costs: measured on the local device, or estimated from the catalog
    cost_model   iteration time and memory of a plan (pure functions)
    planner/     SCIP plan search and the baselines it is compared with
    plan         the plan dataclass and its YAML file: the contract with the runtime
    layout/      torch-free: rank roles and sync groups, parameter names and TP shards, main owners
    data/        the built-in corpus and deterministic global batches through megatron's GPTDataset
    runtime/     parallel_state from a plan, stage model, hetero P2P, schedules, grad sync,
                 optimizer (AdamW + Megatron's LR schedule), the trainer
    checkpoint/  layout-independent checkpoints (megatron-core torch_dist files + manifest),
                 local tier and S3 tier, loading into any plan
    job          a training job on a process group: options, precision, data + trainer +
                 checkpointer, the one assembly both launchers use
    elastic/     spot fleets: notices, stop requests, membership, the elastic worker
    launch       `autohet train`'s ranks: checks, local process launch, the per-rank worker
    cli/         the `autohet` command
    megatron/    glue for Megatron-LM's pretrain_gpt.py (an adapter at the edge, like cli/)
    testing/     oracles for tests and benchmarks; product code never imports it
    known_warnings  megatron-core's known-benign warnings, ignored in every process we start
    system/      torch-free process helpers any layer may use (a free port, dying with the parent)

Imports go up this list, never down, function-local ones included, except that plan, layout/,
data/ and runtime/ come before profiling/ in the import order: the plan's dataclasses and its
parameter layout are what the cost model and the planner build, and the profiler measures
runtime/'s layers. A function-local import only keeps an optional or heavy dependency (torch
at `autohet` start-up, megatron-core, pyscipopt, boto3, matplotlib) out of its module's import,
with a comment saying so. tests/test_import_graph.py checks both rules and that the graph, with
function-local imports, has no cycle.

Nothing in spec/, cost_model, planner/ or plan imports torch or megatron; nothing in layout/ does
at import time (ParamLayout imports torch only to concatenate shards).
"""

__version__ = "0.1.0"
