#!/usr/bin/env bash
# Copies what docs/allocation.md cites from a measure.sh output directory into the repository:
#   bash scripts/alloc/collect.sh runs/alloc-default docs/results/alloc/default-carrydrop
# The report, the per-run curves (alloc_curves.json: enough to redo the table), the plots, the
# fixed target, the wall/CPU time of every run, the base SFT run's summary and one resolved
# config per policy (seed 1), not the checkpoints or traces.
set -euo pipefail
src=$1 dst=$2
mkdir -p "$dst/configs"
cp "$src"/alloc_report.md "$src"/alloc_report.csv "$src"/alloc_curves.json \
   "$src"/acc_vs_rollouts.svg "$src"/acc_vs_time.svg "$src"/target.txt "$src"/times.txt "$dst"/
cp "$src/base/summary.json" "$dst/base_summary.json"
for d in "$src"/*-s1; do
  cp "$d/config.toml" "$dst/configs/$(basename "${d%-s1}").toml"
done
awk -F'[:,]' '{gsub(/ s user/, "", $3); u += $3} END {printf "total CPU time (user): %.0f s over %d runs\n", u, NR}' \
  "$dst/times.txt"
