#!/usr/bin/env bash
# `flashmoe-science serve` on one GPU: its GPU tests, then `serve-bench` (ours against transformers' SDPA, each served
# by transformers' OpenAI-compatible app with continuous batching, loaded by the openai client) on a random
# Qwen3-like dense model and a random Qwen3-MoE-like model: prompts of 128..2048 tokens, 128 new tokens,
# concurrency 1, 8, 64. Writes under $OUT (flat): env.txt, tests.log, bench.log, serve-<model>.json/.png per model,
# servers.tgz (the servers' own logs).
#
# Run from the repo root on 1 GPU (about 5 minutes; at most 8.5: each step has a timeout), with the serving wheels
# carried in .whl/serve (6.7 MB):
#   carry .whl ; command: bash benchmarks/tools/serve_gpu.sh
# The wheels (cp312, manylinux), downloaded on a machine with network:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 -d .whl/serve fastapi==0.165.0 uvicorn==0.54.0 openai==3.57.0 \
#     starlette==1.10.0 httpx
# They go to a folder put first on PYTHONPATH (a consistent set, whatever the machine has); torch and transformers
# (5.24.x) are the machine's.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null)}
export FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-unknown}
if ls .whl/serve/*.whl >/dev/null 2>&1; then
  python3 -m pip install --no-index --no-deps --quiet --target /tmp/serve-site .whl/serve/*.whl
  export PYTHONPATH=src:/tmp/serve-site
fi
WORK=$(mktemp -d)
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton, transformers, fastapi, uvicorn, openai as o
print(torch.__version__, triton.__version__, transformers.__version__, fastapi.__version__, uvicorn.__version__,
      o.__version__, '(torch triton transformers fastapi uvicorn openai)')"
} > "$OUT/env.txt" 2>&1

start=$(date +%s)
timeout 120 python3 -m pytest -m gpu tests/serving tests/integrations/test_serving_gpu.py -q -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1
status=$?
echo "tests: $(( $(date +%s) - start )) s, status $status" >> "$OUT/env.txt"

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

# the workload (smaller values make a CPU dry run: CONCURRENCY=1,2 PROMPT_TOKENS=8:32 NEW_TOKENS=4 ...)
CONCURRENCY=${CONCURRENCY:-1,8,64} PROMPT_TOKENS=${PROMPT_TOKENS:-128:2048} NEW_TOKENS=${NEW_TOKENS:-128}
for model in ${MODELS:-qwen3-dense qwen3-moe}; do
  start=$(date +%s)
  timeout ${BENCH_TIMEOUT:-180} python3 -m flashmoe_science.cli serve-bench "$WORK/$model.json" --name "$model" \
    --concurrency "$CONCURRENCY" --prompt-tokens "$PROMPT_TOKENS" --new-tokens "$NEW_TOKENS" \
    --cache-tokens ${CACHE_TOKENS:-163840} --out "$WORK/$model" >> "$OUT/bench.log" 2>&1
  status=$?
  echo "$model: $(( $(date +%s) - start )) s, status $status" >> "$OUT/bench.log"
  for f in "$WORK/$model"/*; do
    case $f in
      *.partial.json) cp "$f" "$OUT/serve-$model.partial.json" ;;
      *.json|*.png)   cp "$f" "$OUT/serve-$model.${f##*.}" ;;
    esac
  done
done
tar czf "$OUT/servers.tgz" -C "$WORK" $(cd "$WORK" && ls -d */*.log 2>/dev/null)
grep -E "tokens/s|ready|exited|status|Error" "$OUT/bench.log" | tail -n 40
tail -n 5 "$OUT/tests.log"
