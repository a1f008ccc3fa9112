#!/usr/bin/env bash
# Quick start on a fresh machine: create .venv, install, plan the bundled 3-type fleet
# (A100 + H800 + H20) for GPT-3 1.3B, print and draw the plan (quickstart-out/plan.png) and
# compare it with the baselines (Megatron-LM grid, Whale-style, fastest GPU type alone).
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
OUT="${OUT:-quickstart-out}"
mkdir -p "$OUT"
autohet plan --cluster configs/clusters/a100-h800-h20.yaml --model configs/models/gpt3-1.3b.yaml \
  --global-batch-size 64 --micro-batch-size 1 -o "$OUT/plan.yaml"
autohet show "$OUT/plan.yaml" --figure "$OUT/plan.png"
autohet compare --cluster configs/clusters/a100-h800-h20.yaml --model configs/models/gpt3-1.3b.yaml \
  --global-batch-size 64 --micro-batch-size 1
