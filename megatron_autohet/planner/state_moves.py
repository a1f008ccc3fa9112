"""How many bytes of training state a change of plan moves across nodes: pure, torch-free.

After a preemption the job restarts under a new plan and every rank loads its shards from the
last checkpoint (checkpoint/recovery.py): from its own node's disk when the chunk is there, else
from a peer node or S3. This module predicts the bytes that have to cross nodes, so the re-planner
can prefer plans that keep state where it already is.

Where the state is: every rank of the previous plan holds, for the layers of its stage (plus the
word embedding on first stages and, when tied, last stages; the position table on first stages;
the final norm and an untied output layer on last stages), its TP shard of every parameter with
its Adam state, and its node's checkpoint directory keeps all of it (main chunks and replicas:
checkpoint/writer.py writes per node). A node of the new fleet with the same name is the same
machine, with the same files.

What moves: a rank of the new plan needs its own TP shard of everything its stage holds. Element
ranges along the parameter's partition dimension that some previous-plan rank on the same node
held are free (a TP2 shard on a node that held the TP4 shards 0 and 1 of the same layer needs
nothing; one that held only shard 0 needs the other half); the rest crosses nodes. A
TP-replicated parameter is free when any rank on the node held the piece. Each rank loads for
itself, so two ranks of one node needing the same missing chunk count it twice, as recovery
fetches it (a peer sends it to each). Word-embedding rows past the previous plan's padded
vocabulary were never saved and are not counted.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from megatron_autohet.layout.params import (ParamLayout, layer_param_layouts,
                                            non_layer_param_layouts)
from megatron_autohet.plan import Plan
from megatron_autohet.spec.model import ModelSpec

# What a checkpoint stores per parameter: the fp32 weight and Adam's exp_avg and exp_avg_sq
# (checkpoint/state.py: the model's tensors and optimizer.state.<moment>.<param>).
CHECKPOINT_BYTES_PER_PARAM = 12

Shard = tuple[int, int]            # (TP degree, TP rank)
Piece = int | str                  # a global layer index, or a non-layer holder kind


def padded_vocab(plan: Plan) -> int:
    """The plan's embedding rows: one padding for every TP degree in it (as the runtime pads)."""
    return plan.model.padded_vocab_size({s.tp for p in plan.pipelines for s in p.stages})


def _stage_pieces(plan: Plan, pipeline: int, stage: int) -> list[Piece]:
    """What a stage holds (layout/topology.py's holders): its layers, and the non-layer kinds."""
    stages = plan.pipelines[pipeline].stages
    first, last = stage == 0, stage == len(stages) - 1
    pieces: list[Piece] = [layer for start, end in stages[stage].chunks   # every model chunk
                           for layer in range(start, end)]
    if first or (last and plan.model.tie_embeddings):
        pieces.append("word_embeddings")
    if first and plan.model.position_embedding_type == "learned_absolute":
        pieces.append("position_embeddings")
    if last:
        pieces.append("post_process")
    return pieces


def _layouts(model: ModelSpec, vocab: int) -> dict[str, list[ParamLayout]]:
    # Every layer has the same shapes: layer 0's layouts stand for all of them.
    return {"layer": layer_param_layouts(model, 0), **non_layer_param_layouts(model, vocab)}


def _uncovered(need: list[tuple[int, int]], have: list[tuple[int, int]]) -> int:
    """How many indices of the ranges ``need`` no range of ``have`` covers."""
    total = 0
    for a, b in need:
        covered, reach = 0, a
        for lo, hi in sorted((max(lo, a), min(hi, b)) for lo, hi in have):
            if hi > max(lo, reach):
                covered += hi - max(lo, reach)
                reach = hi
        total += b - a - covered
    return total


class StateMap:
    """Where a plan left its state: per node, per piece, the TP shards its ranks held. Built once
    per previous plan; :meth:`bytes_by_node` then prices any number of new plans (results are
    memoised per (piece kind, shards held, shard needed), which every layer shares)."""

    def __init__(self, previous: Plan, model: ModelSpec):
        self.model = model
        self.vocab = padded_vocab(previous)
        held: dict[str, dict[Piece, set[Shard]]] = defaultdict(lambda: defaultdict(set))
        for p, pipe in enumerate(previous.pipelines):
            for s, stage in enumerate(pipe.stages):
                pieces = _stage_pieces(previous, p, s)
                for tp_rank, rank in enumerate(stage.ranks):
                    node = held[previous.ranks[rank].node]
                    for piece in pieces:
                        node[piece].add((stage.tp, tp_rank))
        self.held = {node: {piece: frozenset(shards) for piece, shards in pieces.items()}
                     for node, pieces in held.items()}
        self.layouts = _layouts(model, self.vocab)
        self._missing: dict[tuple, int] = {}

    def bytes_by_node(self, new: Plan) -> dict[str, int]:
        """Bytes each node of ``new`` receives from other nodes (every node of ``new`` listed)."""
        vocab = padded_vocab(new)
        layouts = _layouts(self.model, vocab)
        out = {info.node: 0 for info in new.ranks}
        for p, pipe in enumerate(new.pipelines):
            for s, stage in enumerate(pipe.stages):
                pieces = _stage_pieces(new, p, s)
                for tp_rank, rank in enumerate(stage.ranks):
                    node = new.ranks[rank].node
                    held = self.held.get(node, {})
                    for piece in pieces:
                        kind = "layer" if isinstance(piece, int) else piece
                        have = held.get(piece, frozenset())
                        key = (kind, have, stage.tp, tp_rank, vocab)
                        if key not in self._missing:
                            self._missing[key] = self._missing_bytes(
                                self.layouts[kind], layouts[kind], have, (stage.tp, tp_rank))
                        out[node] += self._missing[key]
        return out

    @staticmethod
    def _missing_bytes(old: list[ParamLayout], new: list[ParamLayout], have: frozenset[Shard],
                       need: Shard) -> int:
        params = 0
        for old_layout, new_layout in zip(old, new):
            numel = 1
            for n in old_layout.full_shape:
                numel *= n
            if old_layout.partition_dim is None:
                params += 0 if have else numel
                continue
            length = old_layout.full_shape[old_layout.partition_dim]
            tp, tp_rank = need
            wanted = [(a, min(b, length)) for a, b in dataclasses.replace(
                new_layout, tp_rank=tp_rank, tp_size=tp).shard_ranges() if a < length]
            held = [r for t, k in have for r in dataclasses.replace(
                old_layout, tp_rank=k, tp_size=t).shard_ranges()]
            params += numel // length * _uncovered(wanted, held)
        return params * CHECKPOINT_BYTES_PER_PARAM


def recovery_bytes_by_node(previous: Plan, new: Plan, model: ModelSpec) -> dict[str, int]:
    """Bytes of training state each node of ``new`` must receive from other nodes to load the
    state ``previous`` left behind (module doc)."""
    return StateMap(previous, model).bytes_by_node(new)


def recovery_bytes(previous: Plan, new: Plan, model: ModelSpec) -> int:
    """Bytes of training state that cross nodes when ``new`` loads what ``previous`` saved."""
    return sum(recovery_bytes_by_node(previous, new, model).values())
