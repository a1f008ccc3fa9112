#!/usr/bin/env bash
# Quick start on a fresh machine: create .venv, install, plan the bundled 3-type fleet
# (A100 + H800 + H20) for GPT-3 1.3B, print and draw the plan (quickstart-out/plan.png) and
# compare it with the baselines (Megatron-LM grid, Whale-style, fastest GPU type alone), train the
# tiny GPT from a plan, then preempt a node of an emulated spot fleet and watch the job go on.
set -euo pipefail
# shellcheck source=scripts/_venv.sh
source "$(dirname "$0")/_venv.sh"
OUT="${OUT:-quickstart-out}"
mkdir -p "$OUT"
autohet plan --cluster configs/clusters/a100-h800-h20.yaml --model configs/models/gpt3-1.3b.yaml \
  --global-batch-size 64 --micro-batch-size 1 -o "$OUT/plan.yaml"
autohet show "$OUT/plan.yaml" --figure "$OUT/plan.png"
autohet compare --cluster configs/clusters/a100-h800-h20.yaml --model configs/models/gpt3-1.3b.yaml \
  --global-batch-size 64 --micro-batch-size 1

# Train from a plan: the same fleet scaled down to 4 local processes (configs/clusters/local-4.yaml;
# CPU + gloo here, one GPU each where there are enough), the tiny GPT, a few iterations on the
# built-in corpus (Python standard-library docstrings as a megatron-core indexed dataset).
autohet plan --cluster configs/clusters/local-4.yaml --model configs/models/tiny.yaml \
  --global-batch-size 8 --micro-batch-size 2 -o "$OUT/tiny-local-4.yaml"
autohet train --plan "$OUT/tiny-local-4.yaml" --model configs/models/tiny.yaml --iters 5 \
  --metrics-jsonl "$OUT/train-metrics.jsonl"
python - "$OUT/train-metrics.jsonl" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
print(f"lm loss: {records[0]['lm_loss']:.4f} (iteration 1) -> {records[-1]['lm_loss']:.4f} "
      f"(iteration {records[-1]['iteration']})")
PY

# The spot user's job: four emulated one-GPU nodes of three types (configs/clusters/spot-4.yaml),
# each its own torchrun agent (`autohet node`), notice watcher and checkpoint directory, train the
# tiny GPT; node2 gets a preemption notice; the job saves, re-plans for the three nodes left,
# recovers and goes on. Prints the events, the bytes each tier served and the losses.
python scripts/spot_demo.py --out "$OUT/spot"
