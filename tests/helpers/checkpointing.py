"""What the checkpoint tests share: one training job with a Checkpointer (the loop `autohet
train` runs), the plans after a node is lost, and the run lengths of the resume proofs."""

from __future__ import annotations

import pytest

from megatron_autohet.plan import plan_from_dict
from megatron_autohet.runtime.mixed_precision import MASTER_KEY
from megatron_autohet.spec.precision import FP32

from helpers.training import OPTIMIZER, SEED, plan


TOTAL, HALF = 8, 4         # iterations of a run; where the resume proofs stop and resume
REL = 1e-6                 # another layout sums in another order


TWO_PIPELINES = "tiny-two-pipelines"     # nodes a100 (a TP2 stage), h800, h20


def survivors_plan(nodes: list[str], cuts: list[int] | None = None):
    """A one-pipeline plan over the surviving nodes of TWO_PIPELINES, one stage per node in the
    order given, split at ``cuts``; the a100 node keeps its TP2 stage."""
    data = plan(TWO_PIPELINES).to_dict()
    ranks = [r for r in data["ranks"] if r["node"] in nodes]
    for new, r in enumerate(ranks):
        r["rank"] = new
    groups = {}
    for r in ranks:
        groups.setdefault(r["node"], []).append(r["rank"])
    stage_ranks = [groups[n] for n in nodes]
    cuts = cuts or ([0, 4, 6] if len(stage_ranks) == 2 else [0, 6])
    data["ranks"] = ranks
    data["pipelines"] = [{"num_microbatches": 4, "stages": [
        {"ranks": ranks_, "layers": [cuts[i], cuts[i + 1]]}
        for i, ranks_ in enumerate(stage_ranks)]}]
    return plan_from_dict(data, f"<survivors {nodes}>")


def one_node_lost():
    """tiny-two-pipelines without its H20 node: one pipeline [TP2 on a100 | TP1 on h800]."""
    data = plan("tiny-two-pipelines").to_dict()
    data["ranks"] = data["ranks"][:3]
    data["pipelines"] = [dict(data["pipelines"][0], num_microbatches=4)]
    return plan_from_dict(data, "<one node lost>")


class Batches:
    def __init__(self, batches):
        self.batches = batches

    def batch(self, iteration):
        return self.batches[iteration]


def train_job(rank, world, the_plan, batches, options, exit_interval=None, precision=FP32,
              total=TOTAL, masters=None, stop=None, distributed_optimizer=False, dropout=0.0,
              draws=False, fused_optimizer=None):
    """One job: resume per ``options``, train to ``total`` (or the exit interval, or ``stop``);
    the metrics (loss, grad norm, learning rate per iteration), then with ``masters`` (any dict)
    this rank's master weights at the end, with ``draws`` how many full initial tensors this
    rank drew (runtime/init.py ``initial_value``). ``fused_optimizer``: HeteroTrainer's (None:
    its choice for the device)."""
    import megatron_autohet.runtime.init as init
    from megatron_autohet.checkpoint.checkpointer import Checkpointer
    from megatron_autohet.runtime.optimizer import make_lr_scheduler
    from megatron_autohet.runtime.trainer import HeteroTrainer, train_iterations

    drawn = []
    if draws:                   # in this rank's process only (run_on_ranks forks one per rank)
        original_value = init.initial_value

        def counted(layout, *args):
            drawn.append(layout.global_name)
            return original_value(layout, *args)
        init.initial_value = counted
    # Built as autohet train builds it: without initial weights when it has a checkpoint to load
    # (so every resume proof holds for that path).
    trainer = HeteroTrainer(the_plan, the_plan.model, rank=rank, seed=SEED, optimizer=OPTIMIZER,
                            precision=precision, distributed_optimizer=distributed_optimizer,
                            hidden_dropout=dropout, attention_dropout=dropout,
                            initialize=options.load is None, fused_optimizer=fused_optimizer)
    # the kernel torch will run: fused only where asked (on a CPU the default is foreach)
    assert trainer.optimizer.param_groups[0]["fused"] == (True if fused_optimizer else None)
    if draws and options.load is not None:       # its weights come from the load, not before
        with pytest.raises(RuntimeError, match="initialize=False"):
            trainer.train_step(batches[0])
    scheduler = make_lr_scheduler(trainer.optimizer, OPTIMIZER, total, the_plan.global_batch_size)
    checkpointer = Checkpointer(options, trainer, scheduler, seed=SEED, train_args={})
    metrics = []
    original = trainer.train_step

    def recording_step(batch):
        step = original(batch)
        metrics.append((step.loss, step.grad_norm, trainer.optimizer.param_groups[0]["lr"]))
        return step

    trainer.train_step = recording_step
    train_iterations(trainer, Batches(batches), scheduler, train_iters=stop or total,
                     scheduler_increment=the_plan.global_batch_size, log=False,
                     checkpointer=checkpointer,
                     exit_interval=exit_interval)
    result = [metrics]
    if masters is not None:
        if trainer.masters is not None:
            held = trainer.masters.by_name
        else:       # the distributed optimizer's master shards, gathered (a collective)
            held = {name: states[MASTER_KEY]
                    for name, states in trainer.optimizer.param_states().items()}
        result.append({trainer.layouts[name].global_name: (trainer.layouts[name], m.clone())
                       for name, m in held.items()})
    if draws:
        result.append(len(drawn))
    return tuple(result) if len(result) > 1 else metrics


def as_format_1(*steps) -> None:
    """Rewrite the manifest of a step (every copy of it: ``steps``, directories of the same step)
    as versions before xxh3_128 wrote it: format version 1, each checksum bare SHA-256 hex under
    "sha256", hashed here from the bytes on disk (a data file from the first copy holding it)."""
    import hashlib
    import json

    from megatron_autohet.checkpoint.manifest import MANIFEST_FILE

    def sha256(name: str, offset: int = 0, length: int | None = None) -> str:
        path = next(step / name for step in steps if (step / name).is_file())
        raw = path.read_bytes()
        return hashlib.sha256(raw[offset:None if length is None else offset + length]).hexdigest()

    data = json.loads((steps[0] / MANIFEST_FILE).read_bytes())
    for record in data["files"]:
        record["sha256"] = None if record.pop("digest") is None else sha256(record["name"])
    for record in data["items"] + data["replicas"]:
        del record["digest"]
        record["sha256"] = sha256(record["file"], record["offset"], record["length"])
    data["format_version"] = 1
    for step in steps:
        (step / MANIFEST_FILE).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
