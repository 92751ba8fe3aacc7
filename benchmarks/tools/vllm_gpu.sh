#!/usr/bin/env bash
# The vLLM plugin on one GPU, after ../shared/peers/vllm/stage.sh's calls installed vLLM 0.26 into /tmp/site:
# registers this checkout's `vllm.general_plugins` entry point (a dist-info beside src, as `pip install -e .` would),
# takes the staging kit's smoke plugin off the CUSTOM slot, then runs what STEPS names, logs under $OUT:
#   tests   the backend's GPU tests (float64 oracle, vLLM-shaped batches) and the MoE plugin's GPU check
#   agree   benchmarks/tools/vllm_generate.py agree (greedy tokens / first-step logprobs against FLASH_ATTN)
#   bench   benchmarks/tools/vllm_generate.py bench with MODELS, BACKENDS, CASES, NAME (KV_CACHE_GIB: the cache's
#           bytes, the same for every backend: the e4m3 cache's case; PROFILE=1: each case's kernels under
#           torch.profiler in $OUT/profile)
#   online  benchmarks/tools/vllm_generate.py online (`vllm serve` under load) with MODELS, BACKENDS, NAME; the
#           server's own imports come as wheels in $SERVE_WHEELS (see the step)
# usage: STEPS=tests,agree bash benchmarks/tools/vllm_gpu.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
site=/tmp/site; ours=/tmp/flashmoe-site
rm -rf "$site"/smoke_backend_plugin-*.dist-info
info="$ours/flashmoe_science-0.1.0.dist-info"; mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: flashmoe-science\nVersion: 0.1.0\n' > "$info/METADATA"
printf '[vllm.general_plugins]\nflashmoe_science = flashmoe_science.integrations.vllm:register\n' > "$info/entry_points.txt"
: > "$info/RECORD"
export PYTHONPATH="$PWD/src:$ours:$site" PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv | tee "$OUT/env.txt"
python3 -c "import importlib.metadata as m; print('vllm', m.version('vllm'), 'torch', m.version('torch'))" | tee -a "$OUT/env.txt"
status=0
for step in ${STEPS//,/ }; do
  t0=$(date +%s)
  case $step in
    tests)
      python3 -m pytest -q -m gpu tests/integrations/test_vllm_metadata.py -x 2>&1 | tail -15 | tee "$OUT/tests.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      if [ -f tests/integrations/gpu_vllm_moe.py ]; then
        timeout 300 python3 tests/integrations/gpu_vllm_moe.py > "$OUT/moe.log" 2>&1 || status=1
        grep -E "PASS|FAIL|Error" "$OUT/moe.log" | tail -12
      fi ;;
    agree)
      timeout 420 python3 benchmarks/tools/vllm_generate.py agree --out "$OUT" || status=1 ;;
    bench)
      timeout ${BENCH_S:-560} python3 benchmarks/tools/vllm_generate.py bench --out "$OUT" --models "${MODELS:-llama8b}" \
        --backends "${BACKENDS:-flashmoe,flashmoe-attn,vllm-fa3,vllm-triton}" --cases "${CASES:-prefill,decode}" \
        --name "${NAME:-run}" ${KV_CACHE_GIB:+--kv-cache-gib "$KV_CACHE_GIB"} ${PROFILE:+--profile "$OUT/profile"} \
        || status=1 ;;
    online)
      # `vllm serve` imports what the offline staging kit leaves out (uvicorn, watchfiles,
      # prometheus_fastapi_instrumentator, model_hosting_container_standards with jmespath and supervisor): carried as
      # wheels in $SERVE_WHEELS (default .whl) and installed beside vLLM
      wheels=${SERVE_WHEELS:-.whl}
      if ls "$wheels"/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$wheels"/*.whl
      fi
      timeout ${BENCH_S:-560} python3 benchmarks/tools/vllm_generate.py online --out "$OUT" --models "${MODELS:-llama8b}" \
        --backends "${BACKENDS:-flashmoe,vllm-fa3}" --name "${NAME:-run}" || status=1 ;;
  esac
  echo "step $step: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
done
exit $status
