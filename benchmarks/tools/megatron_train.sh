#!/usr/bin/env bash
# Megatron-core on a GPU machine: the integration's GPU tests (one GPU), then examples/megatron/train_gpt_moe.py, our
# kernels against Megatron-core's local spec in one run (same weights, same batches). From the repository root, with
# Megatron-core 0.19's wheel in .whl/ (the machine has no package index; it needs only torch, numpy, packaging):
#   bash benchmarks/tools/megatron_train.sh 1     # one GPU: GPU tests, then 120 steps per kernel set
#   bash benchmarks/tools/megatron_train.sh 4     # four GPUs (torchrun): data parallel 4, experts over --ep 2 --etp 2
# TRAIN_ARGS adds options of the example (e.g. TRAIN_ARGS="--steps 200 --repeats 2"). Writes flat under $OUT, named
# as benchmarks/results/ names runs: megatron-gpu-tests.log (one GPU) and <gpu>[-x4]-<date>-<commit>-megatron.{json,
# csv,png,log}.
set -uo pipefail
GPUS=${1:-1}
OUT=${OUT:-/tmp/out}
SITE=/tmp/megatron-site
mkdir -p "$OUT" "$SITE"
wheel=$(ls .whl/megatron_core-0.19*-cp312-*.whl 2>/dev/null | head -n 1)
if [ -z "$wheel" ]; then
    echo "no megatron_core 0.19 cp312 wheel in .whl/" >&2
    exit 2
fi
python3 -m zipfile -e "$wheel" "$SITE"  # a wheel is a zip of the installed files (no pip index needed)
export PYTHONPATH=src:$SITE PYTHONUNBUFFERED=1
export FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
work=$(mktemp -d)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
slug=$(echo "${gpu:-unknown}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
if [ "$GPUS" != 1 ]; then slug="$slug-x$GPUS"; fi
stem="$slug-$(date -u +%Y-%m-%d)-$FLASHMOE_COMMIT-megatron"
log="$OUT/$stem.log"
start=$(date +%s)
if [ "$GPUS" = 1 ]; then
    timeout 150 python3 -m pytest -m gpu tests/integrations/test_megatron_gpu.py -q -p no:cacheprovider \
        > "$OUT/megatron-gpu-tests.log" 2>&1
    echo "GPU tests: exit $? after $(( $(date +%s) - start )) s"; tail -n 5 "$OUT/megatron-gpu-tests.log"
    timeout 330 python3 examples/megatron/train_gpt_moe.py --out "$work" --time-limit 120 ${TRAIN_ARGS:-} \
        > "$log" 2>&1
else
    timeout 420 python3 -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
        examples/megatron/train_gpt_moe.py --ep 2 --etp 2 --out "$work" --time-limit 150 ${TRAIN_ARGS:-} > "$log" 2>&1
fi
echo "training: exit $? after $(( $(date +%s) - start )) s"
for ext in json csv png; do
    if [ -f "$work/megatron-train.$ext" ]; then cp "$work/megatron-train.$ext" "$OUT/$stem.$ext"; fi
done
grep -E "^\[(flashmoe|local)\]" "$log" | tail -n 12
tail -n 30 "$log"
