#!/usr/bin/env bash
# GPT-6L with backend="inductor" under a few torch._inductor.config patches (issue 4 exploration):
#   bash scripts/inductor_knobs.sh      (writes $OUT/knobs_*.md)
set -u
OUT=${OUT:-device_out}
mkdir -p "$OUT"
for patch in '{}' '{"combo_kernels": true}' '{"loop_ordering_after_fusion": true}'; do
  tag=$(echo "$patch" | tr -dc 'a-z_' | head -c 40)
  echo "== patches $patch"
  STEPGRAPH_INDUCTOR_PATCHES="$patch" python3 -m stepgraph.bench --cases gpt6l --variants stepgraph[inductor] \
    --stepgraph-backends inductor --out "$OUT/knobs_${tag:-default}" 2>&1 | grep -E "^\| gpt6l|Error" | tail -3
done
