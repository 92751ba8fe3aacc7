#!/usr/bin/env bash
# The SGLang plugin on one GPU, after the SGLang staging kit's call installed SGLang 0.5.17 into /tmp/sgsite:
# registers this checkout's `sglang.srt.plugins` entry point (a dist-info beside src, as `pip install -e .` would),
# then runs what STEPS names, logs under $OUT:
#   tests   tests/integrations/gpu_sglang_backend.py ${CHECK:-all} (float64 oracle on SGLang-shaped batches; tokens and
#           first-step logprobs against SGLang's triton backend in sglang.Engine)
#   bench   benchmarks/tools/sglang_generate.py bench with MODELS, BACKENDS, CASES, NAME
# usage: STEPS=tests,bench bash benchmarks/tools/sglang_gpu.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
site=/tmp/sgsite; ours=/tmp/flashmoe-sgsite
info="$ours/flashmoe_science-0.1.0.dist-info"; mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: flashmoe-science\nVersion: 0.1.0\n' > "$info/METADATA"
printf '[sglang.srt.plugins]\nflashmoe_science = flashmoe_science.integrations.sglang:register\n' > "$info/entry_points.txt"
: > "$info/RECORD"
export PYTHONPATH="$PWD/src:$ours:$site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       TVM_FFI_CACHE_DIR=/tmp/sgjit SGLANG_IS_FLASHINFER_AVAILABLE=false TOKENIZERS_PARALLELISM=false
export PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):/usr/local/cuda/bin:$PATH"
export FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv | tee "$OUT/env.txt"
python3 -c "import importlib.metadata as m; print('sglang', m.version('sglang'), 'torch', m.version('torch'))" | tee -a "$OUT/env.txt"
status=0
for step in ${STEPS//,/ }; do
  t0=$(date +%s)
  case $step in
    tests)
      timeout ${TESTS_S:-400} python3 tests/integrations/gpu_sglang_backend.py ${CHECK:-all} > "$OUT/sglang-tests.log" 2>&1 || status=1
      grep -E "passed|failed|agree|engine up|PASS|FAIL|Error" "$OUT/sglang-tests.log" | tail -20 ;;
    bench)
      timeout ${BENCH_S:-560} python3 benchmarks/tools/sglang_generate.py bench --out "$OUT" \
        --models "${MODELS:-llama8b}" --backends "${BACKENDS:-flashmoe,sglang-triton}" \
        --cases "${CASES:-prefill,decode}" --name "${NAME:-run}" || status=1 ;;
  esac
  echo "step $step: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
done
exit $status
