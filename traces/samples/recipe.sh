#!/usr/bin/env bash
# The recipe that made the committed sample traces (one per workload kind, each well under 1 MB).
# Run from the repository root: bash traces/samples/recipe.sh
set -euo pipefail
out=traces/samples
kvbench trace gen chat         -n 2000 --seed 1 -o $out/chat.parquet
kvbench trace gen agent        -n 1000 --seed 1 -o $out/agent.parquet
kvbench trace gen multimodal   -n 2000 --seed 1 -o $out/multimodal.parquet
kvbench trace gen reasoning    -n 500  --seed 1 -o $out/reasoning.parquet
kvbench trace gen multi-tenant -n 2000 --seed 1 -o $out/multi-tenant.parquet
kvbench trace gen mix          -n 2000 --seed 1 -o $out/mix.parquet
