#!/usr/bin/env bash
# One GPU, about 6 minutes: the GPU tests of transformers' attention paths (padded batches without synchronisation,
# CUDA-graph capture, warmup), the transformers models on our attention against sdpa (bench_hf_models.py) and the
# first step of a fresh process cold / after `flashmoe-science warmup` / sdpa (first_call.py). Logs and JSON under
# $OUT (7 files, flat). transformers is installed from the wheels in .whl/ (carried) where the machine lacks it.
#   bash benchmarks/tools/gpu_hf_attention.sh
source benchmarks/tools/gpu_common.sh
unpack_wheels transformers '.whl/*.whl' /tmp/hf-site first
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"
} > "$OUT/env.txt" 2>&1
timed() { local start=$(date +%s) rc; "$@"; rc=$?; echo "$(( $(date +%s) - start )) s (exit $rc): ${*:3:2}" >> "$OUT/env.txt"; }
timed timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/integrations/test_hf_host_reads_gpu.py \
  tests/test_warmup_gpu.py "tests/integrations/test_hf_gpu.py::test_bf16_error_within_twice_sdpa" \
  -k "not mistral_window and not gemma2_softcap and not mixtral" > "$OUT/tests.log" 2>&1
timed timeout 200 python3 benchmarks/tools/bench_hf_models.py --rounds 3 --steps 6 --out "$OUT" \
  > "$OUT/hf_models.log" 2>&1
timed timeout 170 python3 benchmarks/tools/first_call.py --out "$OUT" > "$OUT/first_call.log" 2>&1
tail -n 30 "$OUT/tests.log" "$OUT/hf_models.log" "$OUT/first_call.log" "$OUT/env.txt"
