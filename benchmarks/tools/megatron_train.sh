#!/usr/bin/env bash
# Megatron-core on a GPU machine: on one GPU first examples/megatron/step_diff.py (one step of the same model, ours
# and the local spec against the local spec in float64, layer by layer: activations, gradients, the optimizer's
# update), then examples/megatron/train_gpt_moe.py, our kernels against Megatron-core's local spec
# (same initial weights, same batches), 100 steps per run, two interleaved repeats of each kernel set in one process
# (flashmoe, local, local, flashmoe), then, on one GPU, the integration's GPU tests in the time left. From the
# repository root, with Megatron-core 0.19's wheel in .whl/ (the machine has no package index; it needs only torch,
# numpy, packaging):
#   bash benchmarks/tools/megatron_train.sh 1     # one GPU
#   bash benchmarks/tools/megatron_train.sh 2     # two GPUs (torchrun): data parallel 2, experts over --ep 2
#   bash benchmarks/tools/megatron_train.sh 4     # four GPUs: data parallel 4, experts over --ep 2 --etp 2
# STEP_DIFF_S (default 120; 0 skips it) bounds the one-step diagnostic (STEP_DIFF_ONLY=1: nothing after it).
# BUDGET_S (default 225) bounds the rest:
# training gets what is left of it after the setup, the GPU tests
# what is left after training (skipped under 40 s, or with GPU_TESTS=0). Every run stops after RUN_S seconds
# (default 60; its record says so). TRAIN_ARGS appends options of the example, later ones winning (e.g.
# TRAIN_ARGS="--steps 200 --repeats 3"). Writes flat under $OUT, named as benchmarks/results/ names runs:
# <gpu>[-xN]-<date>-<commit>-megatron.{json,csv,png,log}; on one GPU also <...>-megatron-step-diff.{json,log} and
# megatron-gpu-tests.log.
set -uo pipefail
GPUS=${1:-1}
OUT=${OUT:-/tmp/out}
BUDGET_S=${BUDGET_S:-225}
start=$(date +%s)
left() { local s=$(( BUDGET_S - ($(date +%s) - start) )); echo $(( s > 1 ? s : 1 )); }  # timeout 0 would not bound
case "$GPUS" in
    1) launch=(python3) parallel=() ;;
    2) launch=(python3 -m torch.distributed.run --standalone --nproc-per-node 2) parallel=(--ep 2) ;;
    4) launch=(python3 -m torch.distributed.run --standalone --nproc-per-node 4) parallel=(--ep 2 --etp 2) ;;
    *) echo "GPUs: 1, 2 or 4, got $GPUS" >&2; exit 2 ;;
esac
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
if [ "$GPUS" = 1 ] && [ "${STEP_DIFF_S:-120}" != 0 ]; then
    # shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
    timeout "${STEP_DIFF_S:-120}" python3 examples/megatron/step_diff.py --steps 100 --warmup 10 ${TRAIN_ARGS:-} \
        --out "$work" > "$OUT/$stem-step-diff.log" 2>&1
    status=$?
    echo "step diff: exit $status after $(( $(date +%s) - start )) s"
    if [ "$status" != 0 ]; then tail -n 30 "$OUT/$stem-step-diff.log"; fi
    if [ -f "$work/megatron-step-diff.json" ]; then cp "$work/megatron-step-diff.json" "$OUT/$stem-step-diff.json"; fi
    grep '^step-diff summary:' "$OUT/$stem-step-diff.log"
    if [ "${STEP_DIFF_ONLY:-0}" = 1 ]; then exit "$status"; fi
    start=$(date +%s)  # BUDGET_S bounds what follows
fi
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
timeout "$(left)" "${launch[@]}" examples/megatron/train_gpt_moe.py "${parallel[@]}" --out "$work" \
    --steps 100 --warmup 10 --repeats 2 --time-limit "${RUN_S:-60}" ${TRAIN_ARGS:-} > "$log" 2>&1
status=$?
echo "training: exit $status after $(( $(date +%s) - start )) s"
if [ "$status" != 0 ]; then tail -n 30 "$log"; fi
for ext in json csv png; do
    if [ -f "$work/megatron-train.$ext" ]; then cp "$work/megatron-train.$ext" "$OUT/$stem.$ext"; fi
done
grep -E "^\[(flashmoe|local)\]" "$log" | tail -n 8
python3 - "$OUT/$stem.json" <<'EOF'
import json, sys
try:
    document = json.load(open(sys.argv[1]))
except OSError:
    sys.exit("no JSON written")
for r in document["records"]:
    print(f"{r['kernels']:9s} repeat {r['repeat']}  {r['steps']} steps  {r['tokens_per_s'] or 0:,.0f} tokens/s  "
          f"MFU {r['mfu_percent'] or 0:.1f}%  final loss {r['final_loss']:.4f}  "
          f"time-limited {r['stopped_by_time_limit']}")
print(json.dumps(document["summary"]))
EOF
if [ "$GPUS" = 1 ] && [ "${GPU_TESTS:-1}" != 0 ]; then
    if [ "$(left)" -ge 40 ]; then
        timeout "$(( $(left) - 5 ))" python3 -m pytest -m gpu tests/integrations/test_megatron_gpu.py -q \
            -p no:cacheprovider > "$OUT/megatron-gpu-tests.log" 2>&1
        echo "GPU tests: exit $? after $(( $(date +%s) - start )) s"; tail -n 5 "$OUT/megatron-gpu-tests.log"
    else
        echo "GPU tests skipped: $(left) s of BUDGET_S=$BUDGET_S left"
    fi
fi
