#!/usr/bin/env bash
# GPT-6L with backend="inductor" under a few torch._inductor.config patches (issue 4 exploration):
#   PRECISION=high bash scripts/inductor_knobs.sh '{}' '{"coordinate_descent_tuning": true}'
# (writes $OUT/knobs_*; default patches: {}, combo_kernels, loop_ordering_after_fusion)
set -u
OUT=${OUT:-device_out}
mkdir -p "$OUT"
[ $# -eq 0 ] && set -- '{}' '{"combo_kernels": true}' '{"loop_ordering_after_fusion": true}'
for patch in "$@"; do
  tag=$(echo "$patch" | tr -dc 'a-z_' | head -c 40)
  echo "== patches $patch"
  STEPGRAPH_INDUCTOR_PATCHES="$patch" python3 -m stepgraph.bench --cases ${CASES:-gpt6l} --variants stepgraph[inductor] \
    --matmul-precision ${PRECISION:-highest} --stepgraph-backends inductor --out "$OUT/knobs_${tag:-default}" 2>&1 | grep -E "^\| (gpt|mlp)|Error" | tail -3
done
