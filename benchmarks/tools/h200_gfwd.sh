#!/bin/bash
# One H200 check of the sm_90 forward's masks: the GPU tests in parallel slices (compile-bound), a warm-up pass of
# the timing script beside them (fills Triton's cache), then the timing alone. Logs under $OUT.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T=${TEST_TIMEOUT:-190}
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
F=tests/attention/test_forward_sm90_masks_gpu.py
i=0
for k in "dense and square and d128" "dense and cross and d128" "varlen and mha and d128" "varlen and gqa and d128" \
         "d64" "d256" "api"; do
  i=$((i+1))
  timeout $T python -m pytest -q -m gpu $F -k "$k" -p no:cacheprovider > $OUT/t$i.txt 2>&1 &
done
if [ -n "$EXTRA_TESTS" ]; then  # e.g. "tests/attention/test_forward_gpu.py -k cross_lengths"
  timeout $T python -m pytest -q -m gpu -p no:cacheprovider $EXTRA_TESTS > $OUT/extra.txt 2>&1 &
fi
timeout $T python benchmarks/tools/bench_fwd_sm90_masks.py ${BENCH_ARGS:---quick} > $OUT/bench_warm.txt 2>&1 &
wait
tail -n 3 $OUT/t*.txt $OUT/extra.txt 2>/dev/null
timeout ${BENCH_TIMEOUT:-95} python benchmarks/tools/bench_fwd_sm90_masks.py ${BENCH_ARGS:---quick} --json $OUT/bench.json > $OUT/bench.txt 2>&1
cat $OUT/bench.txt
