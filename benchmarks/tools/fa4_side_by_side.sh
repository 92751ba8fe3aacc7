#!/usr/bin/env bash
# Ours, FlashAttention-4 and cuDNN side by side on one GPU. Run from the repo root on the GPU machine after FA4 is
# staged (../shared/peers/fa4):
#   source /tmp/fa4/install-on-device.sh && bash benchmarks/tools/fa4_side_by_side.sh
#       the dense bench at SHAPES, then Nsight Compute on the backward and forward of ours and FA4 at NCU_SHAPES
#       (default D=128, L=16k; D=64 too with MORE_NCU=1): bench.log, ncu.txt and the bench JSON.
#   source /tmp/fa4/install-on-device.sh && bash benchmarks/tools/fa4_side_by_side.sh --publish
#       the runs published with FA4 in them, each ours beside FA4 in one process, ROUNDS (2) rounds, no profiler:
#       the varlen suite (flashmoe-varlen beside fa4-varlen and the others on its ragged and packed batches, causal
#       and not; <stem>-varlen-fa4.json, varlen.log), then the dense FlashAttention-3 grid at D=64/128
#       (PUBLISH_SHAPES; flashmoe, fa4, sdpa-cudnn, forward and backward; <stem>-fa4.json, bench.log). At most
#       VARLEN_S + DENSE_S = 390 s, about 5 minutes on an H200.
# Writes under $OUT (flat, at most 6 files): env.txt and the above. Each step is time-boxed; what finished stays (a
# bench cut short leaves its records in <name>.partial.json).
here=$(cd "$(dirname "$0")" && pwd)
peer_path=${PYTHONPATH:-}  # install-on-device.sh's FlashAttention-4 folders: gpu_common.sh resets PYTHONPATH
source "$here/gpu_common.sh"
export PYTHONPATH=$PYTHONPATH${peer_path:+:$peer_path}
{ nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__)"
  python -c "import importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# bench SUFFIX LOG SECONDS ARGS...: `flashmoe-science bench ARGS` time-boxed, its JSON (or, cut short, its partial
# JSON) moved into $OUT as <gpu>-<date>-<commit>-SUFFIX[.partial].json
bench() {
  local suffix=$1 log=$2 seconds=$3 folder
  shift 3
  folder=$(mktemp -d)
  timeout "$seconds" python -m flashmoe_science.cli bench "$@" --no-plot --out "$folder" > "$OUT/$log" 2>&1
  echo "bench $suffix rc=$?"; tail -30 "$OUT/$log"
  for file in "$folder"/*.json; do
    [ -e "$file" ] || continue
    local name=${file##*/}
    case $name in
      *.partial.json) mv "$file" "$OUT/${name%.partial.json}-$suffix.partial.json" ;;
      *) mv "$file" "$OUT/${name%.json}-$suffix.json" ;;
    esac
  done
}

if [ "${1:-}" = --publish ]; then
  # the FlashAttention-3 grid (B·L = 16384, H·D = 2048) at D=128 and 64, L = 512 and 2048..16384, and H=16, L=16k at
  # both head dims (the published grid); L=1024 and D=256 are 8 more shapes, ~1.7x the time: add them through
  # PUBLISH_SHAPES with DENSE_S to match
  PUBLISH_SHAPES=${PUBLISH_SHAPES:-1x16x16384x128,1x16x16384x64,32x16x512x128,8x16x2048x128,4x16x4096x128,2x16x8192x128,32x32x512x64,8x32x2048x64,4x32x4096x64,2x32x8192x64,1x32x16384x64}
  if [ "${VARLEN_S:-180}" != 0 ]; then  # VARLEN_S=0: the dense grid alone
    bench varlen-fa4 varlen.log "${VARLEN_S:-180}" --suite varlen --rounds "${ROUNDS:-2}"
  fi
  bench fa4 bench.log "${DENSE_S:-210}" --shapes "$PUBLISH_SHAPES" --backends flashmoe,fa4,sdpa-cudnn \
    --pass fwd,bwd --rounds "${ROUNDS:-2}"
  ls -la "$OUT"
  exit 0
fi

SHAPES=${SHAPES:-1x16x16384x128,1x16x16384x64,2x16x8192x128}
bench fa4 bench.log "${BENCH_S:-150}" --shapes "$SHAPES" --backends flashmoe,fa4,sdpa-cudnn --pass fwd,bwd \
  --rounds "${ROUNDS:-1}"
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
# NCU_SHAPES: "B H L D causal" entries separated by ';', each profiled for ours and FA4
NCU_SHAPES=${NCU_SHAPES:-"1 16 16384 128 0"}
[ "${MORE_NCU:-0}" = 1 ] && NCU_SHAPES="$NCU_SHAPES;1 16 16384 64 0"
if [ -n "$NCU" ]; then
  IFS=';' read -ra ncu_shapes <<< "$NCU_SHAPES"
  for shape in "${ncu_shapes[@]}"; do
    profile flashmoe $shape
    profile fa4 $shape
  done
else
  echo "no ncu on this machine" > "$OUT/ncu.txt"
fi
grep -c . "$OUT/ncu.txt"; ls -la "$OUT"
