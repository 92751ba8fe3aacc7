#!/usr/bin/env bash
# `flashmoe-science serve` on one GPU in at most 4 minutes: GPU tests, then one `serve-bench` of a random
# Qwen3-like dense model and a random Qwen3-MoE-like model (prompts of 128..2048 tokens, 128 new tokens,
# concurrency 1, 8, 64): ours with the model-dtype KV cache, ours with the e4m3 KV cache, and transformers' SDPA,
# each served by transformers' OpenAI-compatible app with continuous batching and loaded by the openai client. The
# servers start together and are loaded one at a time, model by model (dense first; the MoE SDPA server last).
# The GPU tests run while the servers start; the loads begin when both are done.
# Writes under $OUT (flat, 6 files): env.txt (versions, step times), tests.log, bench.log, serve.json (or
# serve.partial.json if the time ran out: what was measured), serve.png, servers.tgz (the servers' own logs).
#
# Run from the repo root on 1 GPU, carrying .whl (the transformers 5.24 wheel and its dependencies in .whl/, the
# serving wheels in .whl/serve: fastapi, uvicorn, openai, starlette, httpx and theirs; cp312, manylinux):
#   bash benchmarks/tools/serve_gpu.sh
# The wheels are unpacked (a wheel is a zip of the installed tree; no pip, no index) into /tmp/serve-site, put on
# PYTHONPATH after src: a consistent set whatever the machine has; torch and triton are the machine's.
# Each step's time limit comes from one deadline (TOTAL_S, default 230 s from the start).
# Options (environment; the defaults are the run above):
#   MODELS=qwen3-dense,qwen3-moe  BACKENDS=flashmoe,transformers-sdpa  KV_CACHE_DTYPES=auto,e4m3  NAME=qwen3-dense-moe
#   CONCURRENCY=1,8,64  REQUESTS=2,8,64  PROMPT_TOKENS=128:2048  NEW_TOKENS=128  (serve-bench's options)
#   CACHE_TOKENS=163840, or CACHE_GIB=G (every server's cache in memory: the e4m3 servers then hold twice the tokens)
#     or CACHE_GIB=G1,G2 (one per model in MODELS' order: the same share of each model's workload)
#   GPU_TESTS="tests/integrations/test_serving_gpu.py" (pytest's arguments, -m gpu added), TESTS_S=100 (their limit)
# The e4m3 cache's case, ours only, on long prompts, each model's cache in bytes that hold about half of 64 streams'
# tokens in bf16 and all of them in e4m3 (docs/serving.md):
#   BACKENDS=flashmoe CONCURRENCY=8,64 REQUESTS=16,128 PROMPT_TOKENS=2048:3840 CACHE_GIB=4,1 NAME=qwen3-e4m3-long \
#     GPU_TESTS="tests/attention/test_flash_attn_varlen_gpu.py -k paged" bash benchmarks/tools/serve_gpu.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${TOTAL_S:-230} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
python3 -c "import glob, zipfile
wheels = sorted(glob.glob('.whl/*.whl')) + sorted(glob.glob('.whl/serve/*.whl'))
[zipfile.ZipFile(w).extractall('/tmp/serve-site') for w in wheels if 'megatron' not in w]"
export PYTHONPATH=src:/tmp/serve-site PYTHONUNBUFFERED=1
FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)}
export FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-unknown}
WORK=$(mktemp -d)
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton, transformers, fastapi, uvicorn, openai as o
print(torch.__version__, triton.__version__, transformers.__version__, fastapi.__version__, uvicorn.__version__,
      o.__version__, '(torch triton transformers fastapi uvicorn openai)')"
  echo "set-up: $(( ${TOTAL_S:-230} - $(left) )) s"
} > "$OUT/env.txt" 2>&1

# the GPU tests run while the servers start (compilations, CUDA-graph captures); no server is loaded before they end
start=$(date +%s)
( timeout -k 5 "${TESTS_S:-100}" python3 -m pytest -m gpu ${GPU_TESTS:-tests/integrations/test_serving_gpu.py} -q \
    -p no:cacheprovider > "$OUT/tests.log" 2>&1
  status=$?
  echo "tests: $(( $(date +%s) - start )) s, status $status" >> "$OUT/env.txt" ) &
tests=$!

python3 - "$WORK" <<'EOF'
import sys
import transformers
folder = sys.argv[1]
dense = transformers.Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=4096)
moe = transformers.Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                  num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
                                  moe_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
                                  max_position_embeddings=4096)
for name, config in (("qwen3-dense", dense), ("qwen3-moe", moe)):
    open(f"{folder}/{name}.json", "w").write(config.to_json_string())
EOF

# the workload (smaller values make a CPU dry run: CONCURRENCY=1,2 REQUESTS=2 PROMPT_TOKENS=8:32 NEW_TOKENS=4 ...)
start=$(date +%s)
models=$(for name in $(echo "${MODELS:-qwen3-dense,qwen3-moe}" | tr , ' '); do echo "$WORK/$name.json"; done)
timeout -k 20 $(( $(left) - 25 )) python3 -m flashmoe_science.cli serve-bench $models \
  --name "${NAME:-qwen3-dense-moe}" --backends "${BACKENDS:-flashmoe,transformers-sdpa}" \
  --kv-cache-dtypes "${KV_CACHE_DTYPES:-auto,e4m3}" --concurrency "${CONCURRENCY:-1,8,64}" \
  --requests "${REQUESTS:-2,8,64}" --prompt-tokens "${PROMPT_TOKENS:-128:2048}" --new-tokens "${NEW_TOKENS:-128}" \
  $( [ -n "${CACHE_GIB:-}" ] && echo --cache-gib "$CACHE_GIB" || echo --cache-tokens "${CACHE_TOKENS:-163840}" ) \
  --out "$WORK/bench" --after-pid $tests > "$OUT/bench.log" 2>&1
status=$?
wait $tests
echo "serve-bench: $(( $(date +%s) - start )) s, status $status" >> "$OUT/env.txt"
for f in "$WORK"/bench/*; do
  case $f in
    *.partial.json) cp "$f" "$OUT/serve.partial.json" ;;
    *.json|*.png)   cp "$f" "$OUT/serve.${f##*.}" ;;
  esac
done
tar czf "$OUT/servers.tgz" -C "$WORK/bench" $(cd "$WORK/bench" && ls *.log 2>/dev/null)
grep -E "tokens/s|ready|exited|stopped|Error" "$OUT/bench.log" | cut -c1-250 | tail -n 40
tail -n 5 "$OUT/tests.log"
cat "$OUT/env.txt"
