"""The checkpoint hook of a training job: resume at start, save every ``--save-interval``.

``Checkpointer(options, trainer, scheduler, *, seed, train_args)`` is built on every rank after
the trainer; ``resume()`` returns where training starts (iteration 0 without a checkpoint) and
``after_iteration(iteration)`` saves when the interval says so; ``finish(iteration)`` saves the
last iteration if it was not just saved (Megatron-LM does the same at the end of training).

Finding the step to resume (``resume``): every rank lists the committed steps (a manifest) it can
read - its own local-tier directory and ``--load`` - and the ranks agree on the newest step that
every rank can read (an all-gather), so all ranks load the same step or none does.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from megatron_autohet.checkpoint.manifest import (committed_steps, read_manifest,
                                                  remove_old_steps, step_dir_name)
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.checkpoint.state import (RNG_KEY, TrainingProgress, common_state,
                                               rank_sharded_state_dict, rng_sharded_object)
from megatron_autohet.checkpoint.writer import StepDirs, write_step


def _log(message: str) -> None:
    print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", flush=True)


class Checkpointer:
    def __init__(self, options: CheckpointOptions, trainer, scheduler, *, seed: int,
                 train_args: dict):
        self.options = options
        self.trainer = trainer
        self.scheduler = scheduler
        self.seed = seed
        self.train_args = train_args
        self.plan = trainer.plan
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dirs = self._save_dirs()
        self.last_saved: int | None = None

    def _save_dirs(self) -> StepDirs | None:
        if self.options.local_dir is not None:
            return StepDirs.per_node(self.options.local_dir, self.plan)
        if self.options.save is not None:
            return StepDirs.shared(self.options.save, self.world_size)
        return None

    def _readable_roots(self) -> list[Path]:
        roots = []
        if self.dirs is not None:
            roots.append(self.dirs.root(self.rank))
        if self.options.load is not None:
            roots.append(Path(self.options.load))
        return list(dict.fromkeys(roots))

    # ---- resume ---------------------------------------------------------------------------

    def resume(self) -> TrainingProgress:
        from megatron_autohet.checkpoint.loader import load_step

        start = TrainingProgress(iteration=0, consumed_train_samples=0)
        if self.options.load is None:
            return start
        roots = self._readable_roots()
        mine = {it: root for root in reversed(roots) for it in committed_steps(root)}
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, sorted(mine))
        common = set.intersection(*(set(steps) for steps in everyone))
        if not common:
            if self.rank == 0:
                _log(f"WARNING: no complete checkpoint in {self.options.load}; "
                     "training from scratch")
            return start
        iteration = max(common)
        step_dir = mine[iteration] / step_dir_name(iteration)
        manifest = read_manifest(step_dir)
        if self.rank == 0:
            _log(f"loading checkpoint from {mine[iteration]} at iteration {iteration}")
        progress = load_step(self.trainer, self.scheduler, step_dir, manifest, self.world_size)
        if self.rank == 0:
            _log(f"successfully loaded checkpoint from {mine[iteration]} at iteration "
                 f"{iteration} (saved by a {len(manifest.plan['ranks'])}-rank plan)")
        self.last_saved = progress.iteration
        return progress

    # ---- save -----------------------------------------------------------------------------

    def after_iteration(self, iteration: int) -> None:
        interval = self.options.save_interval
        if self.dirs is not None and interval and iteration % interval == 0:
            self.save(iteration)

    def finish(self, iteration: int) -> None:
        if self.dirs is not None and iteration > 0 and self.last_saved != iteration:
            self.save(iteration)

    def save(self, iteration: int) -> None:
        progress = TrainingProgress(iteration=iteration,
                                    consumed_train_samples=iteration
                                    * self.plan.global_batch_size)
        state_dict = rank_sharded_state_dict(self.trainer)
        state_dict[RNG_KEY] = rng_sharded_object(self.trainer, self.world_size)
        common = common_state(self.trainer, self.scheduler, progress, seed=self.seed,
                              train_args=self.train_args)
        root = self.dirs.root(self.rank)
        if self.rank == 0:
            _log(f"saving checkpoint at iteration {iteration:7d} to {root} in torch_dist format")
        start = time.perf_counter()
        manifest = write_step(state_dict, common, iteration=iteration, plan=self.plan,
                              rank=self.rank, dirs=self.dirs)
        if self.dirs.is_leader(self.rank):
            remove_old_steps(root, self.options.keep)
        self.last_saved = iteration
        if self.rank == 0:
            _log(f"successfully saved checkpoint from iteration {iteration:7d} to {root} "
                 f"({manifest.total_bytes / 2**20:.1f} MiB, {time.perf_counter() - start:.2f} s)")
