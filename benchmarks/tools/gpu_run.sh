#!/usr/bin/env bash
# GPU tests, benchmarks, sweeps and profiles in one run on a GPU machine: each step logs under $OUT/run/, and the
# folder is packed into $OUT/run.tgz at the end (one file to copy back). Usage: bash benchmarks/tools/gpu_run.sh STEP [STEP ...]
#   tests      GPU pytest (pytest -m gpu) for everything present; testsall: without -x. WORKERS=N spreads either over N
#              pytest-xdist processes on the one GPU (the image has xdist; the builds then compile in parallel)
#   sweep      forward tile sweep (benchmarks/tools/sweep_attention_forward_tiles.py)
#   bench      flashmoe-science bench (full) ; benchq: --quick ; benchbwd: fwd+bwd
#   moe        MoE GPU tests + bench moe
#   sweepbwd   backward tile sweep (benchmarks/tools/sweep_attention_backward_tiles.py) ; sweepmoe: MoE GEMM sweep (benchmarks/tools/sweep_moe_gemm_tiles.py)
#   maskmods   the mask_mod GPU tests (Triton kernels and the sm_90 forward) + bench --suite mask-mods (forward and backward)
#   sanitize   compute-sanitizer over benchmarks/tools/sanitize_kernels.py: memcheck on every case, racecheck and
#              synccheck on the sm_90 ones ($SAN_S seconds a tool, default 300), then racecheck on
#              benchmarks/tools/racecheck_probe.py (race-free kernels of the same handoffs: what the tool reports there
#              is the tool's, not a kernel's)
#   profile    ncu of the sm_90 forward (benchmarks/tools/profile_attention_forward_ncu.py $PROFILE_ARGS: B H L D CAUSAL BLOCK_N STAGES)
set -u
export PYTHONPATH=src:benchmarks/tools PYTHONUNBUFFERED=1
export FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
OUTDIR=${OUT:-/tmp/out}/run
mkdir -p "$OUTDIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUTDIR/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda, torch.backends.cudnn.version())" >> "$OUTDIR/gpu.txt"
for step in "$@"; do
  start=$(date +%s)
  case $step in
    tests)    python3 -m pytest -m gpu ${TESTS:-tests} -q -x -n ${WORKERS:-0} --timeout=600 -p no:cacheprovider 2>&1 | tail -n 60 > "$OUTDIR/tests.log" ;;
    testsall) python3 -m pytest -m gpu tests -q -n ${WORKERS:-0} --timeout=600 -p no:cacheprovider 2>&1 | tail -n 120 > "$OUTDIR/tests.log" ;;
    sweep)    python3 benchmarks/tools/sweep_attention_forward_tiles.py --out "$OUTDIR" > "$OUTDIR/sweep.log" 2>&1 ;;
    bench)    python3 -m flashmoe_science.cli bench --out "$OUTDIR" > "$OUTDIR/bench.log" 2>&1 ;;
    benchq)   python3 -m flashmoe_science.cli bench --quick --out "$OUTDIR" > "$OUTDIR/bench.log" 2>&1 ;;
    benchbwd) python3 -m flashmoe_science.cli bench --pass fwd,bwd --out "$OUTDIR" > "$OUTDIR/bench.log" 2>&1 ;;
    moe)      python3 -m pytest -m gpu tests/moe -q --timeout=600 -p no:cacheprovider > "$OUTDIR/moe_tests.log" 2>&1;
              python3 -m flashmoe_science.cli bench moe --out "$OUTDIR" > "$OUTDIR/moe_bench.log" 2>&1 ;;
    maskmods) python3 -m pytest -m gpu tests/attention/test_mods_sm90_gpu.py tests/attention/test_mods_gpu.py -q \
                  --timeout=600 -p no:cacheprovider > "$OUTDIR/maskmods_tests.log" 2>&1;
              python3 -m flashmoe_science.cli bench --suite mask-mods --rounds ${ROUNDS:-3} \
                  --out "$OUTDIR" > "$OUTDIR/maskmods_bench.log" 2>&1 ;;
    sweepbwd) python3 benchmarks/tools/sweep_attention_backward_tiles.py --out "$OUTDIR" > "$OUTDIR/sweep_bwd.log" 2>&1 ;;
    sweepmoe) python3 benchmarks/tools/sweep_moe_gemm_tiles.py --out "$OUTDIR" > "$OUTDIR/sweep_moe.log" 2>&1 ;;
    sanitize) for tool in memcheck racecheck synccheck; do
                cases=""; [ $tool = memcheck ] || cases="packed-d64 packed-gqa-d128 packed-d128-bwd mods-hopper score-mods-hopper"
                PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_S:-300} compute-sanitizer --tool $tool \
                  --target-processes all --print-limit 20 python3 benchmarks/tools/sanitize_kernels.py $cases \
                  > "$OUTDIR/sanitize_$tool.log" 2>&1
              done
              # the same report on two race-free kernels of the same patterns (mbarrier-guarded handoffs)
              timeout ${SAN_S:-300} compute-sanitizer --tool racecheck --print-limit 20 \
                python3 benchmarks/tools/racecheck_probe.py > "$OUTDIR/sanitize_racecheck_probe.log" 2>&1 ;;
    profile)  ncu --clock-control none --launch-skip 1 --launch-count 3 -k regex:attention_forward \
                  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
                  python3 benchmarks/tools/profile_attention_forward_ncu.py ${PROFILE_ARGS:-32 16 512 128 0 128 2} > "$OUTDIR/ncu.log" 2>&1 ;;
    *)        echo "unknown step $step" ;;
  esac
  echo "step $step: $(( $(date +%s) - start )) s" | tee -a "$OUTDIR/steps.txt"
done
tar czf "${OUT:-/tmp/out}/run.tgz" -C "${OUT:-/tmp/out}" run
for f in "$OUTDIR"/*.log; do echo "== $f"; tail -n 25 "$f"; done
