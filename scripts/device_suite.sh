#!/usr/bin/env bash
# Every GPU test, the GPU corpus and the benchmarks in one call, for the device machine:
#   bash scripts/device_suite.sh            (writes under $OUT, or ./device_out)
# Parts can be switched off to fit one command's time limit: TESTS_ON=0, CORPUS=0, BENCH=0,
# BENCH_DDP=0, BENCH_FSDP2=0. Only the multi-GPU part (2+ GPUs; ~5 min on 2 H100s): the DDP
# and FSDP2 benchmarks, then the 2-rank tests over NCCL (MULTI_BUDGET s in all, default 420):
#   MULTI=1 bash scripts/device_suite.sh
set -u -o pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export STEPGRAPH_TEST_CUDA=1 PYTHONPATH=.
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}   # (NGPU=2 with --device cpu args: a CPU dry run)
TIMEOUT=""; python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT="--timeout ${TEST_TIMEOUT:-180}"
# Seconds a part may run: its own limit, and with MULTI=1 no more than what is left of
# MULTI_BUDGET (counted from the script's start), so a hung collective cannot eat the command.
BUDGET=100000; [ "${MULTI:-0}" = 1 ] && BUDGET=${MULTI_BUDGET:-420}
limit() { local l=$((BUDGET - SECONDS)); [ "$1" -lt "$l" ] && l=$1; [ "$l" -lt 20 ] && l=20; echo "$l"; }
# Data-parallel (issues 7, 19), 2 ranks over NCCL: eager DDP vs stepgraph DDP, eager FSDP2 vs
# stepgraph FSDP2.
multi_gpu_benches() {
  if [ "$NGPU" -lt 2 ]; then echo "multi-GPU benchmarks skipped: $NGPU GPU(s)" | tee "$OUT/bench_multi_skipped.txt"; return; fi
  if [ "${BENCH_DDP:-1}" = 1 ]; then
    timeout -k 10 "$(limit "${BENCH_DDP_LIMIT:-150}")" python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m stepgraph.bench_ddp \
      --out "$OUT" ${BENCH_DDP_ARGS:-} 2>&1 | grep -v "^\*\*\*\|OMP_NUM" | tee "$OUT/bench_ddp.txt"
  fi
  if [ "${BENCH_FSDP2:-1}" = 1 ]; then
    timeout -k 10 "$(limit "${BENCH_FSDP2_LIMIT:-210}")" python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m stepgraph.bench_fsdp2 \
      --out "$OUT" ${BENCH_FSDP2_ARGS:---steps 50} 2>&1 | grep -v "^\*\*\*\|OMP_NUM" | tee "$OUT/bench_fsdp2.txt"
  fi
}
if [ "${MULTI:-0}" = 1 ]; then
  # The measurements first; then test_distributed's and test_fsdp2's 2-rank scenarios, over NCCL
  # on 2 GPUs (STEPGRAPH_TEST_CUDA=1), in what is left of the budget.
  multi_gpu_benches
  timeout -s INT "$(limit "${MULTI_TESTS_LIMIT:-240}")" python3 -m pytest -v tests/test_distributed.py tests/test_fsdp2.py $TIMEOUT \
    -p no:cacheprovider -rfEs --tb=short --durations=10 2>&1 | tee "$OUT/pytest_multi.txt" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|s call"
  echo "multi-GPU part: ${SECONDS}s" | tee -a "$OUT/device.txt"
  exit 0
fi
# The GPU tests (the CPU-only files skip on a GPU run or repeat the CI's work).
GPU_TESTS="tests/test_cuda.py tests/test_cuda_loops.py tests/test_cuda_sdpa.py tests/test_cuda_live.py
 tests/test_cuda_segments.py tests/test_cuda_accumulators.py tests/test_cuda_collectives.py tests/test_cuda_rnn.py
 tests/test_api.py tests/test_footguns.py tests/test_pyvalues.py tests/test_host_reads.py tests/test_inductor.py tests/test_inductor_verify.py
 tests/test_partial.py tests/test_partial_hooks.py tests/test_inductor_segments.py tests/test_cuda_moved_args.py
 tests/test_library_calls.py tests/test_numpy_args.py tests/test_host_prologue.py tests/test_cleanrl_idioms.py
 tests/test_constant_folding.py tests/test_to_host_outputs.py tests/test_dynamic_slice.py tests/test_optimizer_counters.py
 tests/test_cuda_integrations.py tests/test_optimizer_state_dict.py tests/test_cuda_early_refusal.py
 tests/test_formatted_numbers.py tests/test_arg_objects.py tests/test_library_module_state.py tests/test_moving_factories.py"
# Files that time or size themselves run alone, after the rest (which share the GPU, one file per
# pytest-xdist worker: JOBS=1 runs them one by one).
SERIAL_TESTS="tests/test_cuda_fsdp2.py"
if [ "${TESTS_ON:-1}" = 1 ]; then
  # -v streams one line per test (xdist reports failures only at the end); a test that hangs
  # fails after TEST_TIMEOUT s instead of eating the command's limit (pytest-timeout).
  PAR=""; [ "${JOBS:-6}" -gt 1 ] && python3 -c "import xdist" 2>/dev/null && PAR="-n ${JOBS:-6} --dist loadfile -p no:benchmark"
  PAR="$PAR $TIMEOUT"
  timeout -s INT "${TESTS_LIMIT:-3000}" python3 -m pytest -v ${TESTS:-$GPU_TESTS} $PAR -p no:cacheprovider -rfEs --tb=short --durations=15 2>&1 \
    | tee "$OUT/pytest.txt" | grep -E "FAILED|ERROR|passed|failed" | tail -n 60
  [ -z "${TESTS:-}" ] && [ "${SERIAL:-1}" = 1 ] && python3 -m pytest -q -s $SERIAL_TESTS -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_serial.txt" | tail -n 20
fi
if [ "${CORPUS:-1}" = 1 ]; then
  python3 -m clients --device cuda 2>&1 | tee "$OUT/corpus_cuda_fp32.txt" | tail -n 30
  python3 -m clients --device cuda --amp bf16 2>&1 | tee "$OUT/corpus_cuda_bf16.txt" | tail -n 30
fi
if [ "${BENCH:-1}" = 1 ]; then
  python3 -m stepgraph.bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
  python3 scripts/bench_segments.py 2>&1 | tee "$OUT/bench_segments.txt"
  python3 -m stepgraph.bench_integrations --out "$OUT/bench_integrations.md" 2>&1 | tee "$OUT/bench_integrations.txt"
fi
multi_gpu_benches
