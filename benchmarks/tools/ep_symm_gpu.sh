#!/usr/bin/env bash
# Expert parallelism over symmetric memory on the GPUs of one host (4 expected): the multi-GPU tests of the exchange
# first (tests/distributed/test_symm_exchange_gpu.py), then the expert-parallel part of the distributed bench (both
# exchanges at 16k tokens per GPU, forward and forward+backward; the 2k-token forward as CUDA-graph replays). The
# bench is skipped when the exchange's correctness case fails. Writes gpu.txt, tests.log, bench.log and the bench's
# JSON and PNG (or its partial JSON if cut short) flat under $OUT; at most 8 minutes (3.5 for the tests, 4.5 for the
# bench). NVLink multicast stays off. Usage, from the repository root:
#   bash benchmarks/tools/ep_symm_gpu.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FLASHMOE_CASE_PROGRESS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/gpu.txt" 2>&1
start=$(date +%s)
timeout 210 python3 -m pytest tests/distributed/test_symm_exchange_gpu.py -q -p no:cacheprovider -rA > "$OUT/tests.log" 2>&1
echo "tests: rc $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/tests.log"
tail -n 25 "$OUT/tests.log"
if grep -q "PASSED.*symm_matches_nccl_and_one_gpu" "$OUT/tests.log"; then
  start=$(date +%s)
  timeout 270 python3 -m torch.distributed.run --nproc-per-node "$GPUS" -m flashmoe_science.cli bench --suite distributed --ops ep-moe \
    --out "$OUT" > "$OUT/bench.log" 2>&1
  echo "bench: rc $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
  tail -n 30 "$OUT/bench.log"
else
  echo "bench skipped: the exchange's correctness case did not pass (tests.log)"
fi
