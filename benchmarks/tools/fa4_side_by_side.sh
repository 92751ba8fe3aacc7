#!/usr/bin/env bash
# Ours, FlashAttention-4 and cuDNN side by side on one GPU, then Nsight Compute on the backward (and forward) of ours
# and FA4 at D=64/128, L=16k. Run from the repo root on the GPU machine after FA4 is staged (../shared/peers/fa4):
#   source /tmp/fa4/install-on-device.sh && bash benchmarks/tools/fa4_side_by_side.sh
# Writes under $OUT (flat): bench JSON/markdown, bench.log, ncu.txt. Each step is time-boxed; what finished stays.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
{ nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__)"
  python -c "import importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
SHAPES=${SHAPES:-1x16x16384x128,1x16x16384x64,2x16x8192x128}
timeout "${BENCH_S:-150}" python -m flashmoe_science.cli bench --shapes "$SHAPES" --backends flashmoe,fa4,sdpa-cudnn \
  --pass fwd,bwd --rounds "${ROUNDS:-1}" --no-plot --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -40 "$OUT/bench.log"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats"
profile() {  # backend B H L D causal: every kernel of the profiled (third) round
  local tag="$1-D$5-L$4-c$6"
  echo "=== $tag" >> "$OUT/ncu.txt"
  timeout "${NCU_S:-45}" "$NCU" $SECTIONS --profile-from-start off \
    --launch-count "${COUNT:-8}" --csv --page details \
    python benchmarks/tools/profile_attention_peers_ncu.py "$@" >> "$OUT/ncu.txt" 2>&1
  echo "rc=$? $tag" >> "$OUT/ncu.txt"
}
if [ -n "$NCU" ]; then
  profile flashmoe 1 16 16384 128 0
  profile fa4 1 16 16384 128 0
  [ "${MORE_NCU:-0}" = 1 ] && { profile flashmoe 1 16 16384 64 0; profile fa4 1 16 16384 64 0; }
else
  echo "no ncu on this machine" > "$OUT/ncu.txt"
fi
grep -c . "$OUT/ncu.txt"; ls -la "$OUT"
