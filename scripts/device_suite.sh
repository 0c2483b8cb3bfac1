#!/usr/bin/env bash
# Every GPU test and the benchmark in one call, for the device machine:
#   bash scripts/device_suite.sh            (writes under $OUT, or ./device_out)
set -u -o pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
python3 -m pytest -q ${TESTS:-tests} -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest.txt" | tail -n 40
[ "${BENCH:-1}" = 1 ] && python3 -m stepgraph.bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
# Data-parallel (issue 7): with 2+ GPUs, eager DDP vs stepgraph DDP over NCCL.
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "${BENCH_DDP:-1}" = 1 ] && [ "$NGPU" -ge 2 ]; then
  python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m stepgraph.bench_ddp --out "$OUT" ${BENCH_DDP_ARGS:-} 2>&1 | grep -v "^\*\*\*\|OMP_NUM" | tee "$OUT/bench_ddp.txt"
fi
