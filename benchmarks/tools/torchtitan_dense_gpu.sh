#!/usr/bin/env bash
# One GPU, about 6 minutes (at most 8.8): the TorchTitan GPU tests (one synchronisation per training step of a
# Llama on our attention), then TorchTitan's dense Llama job, ours against its Flex defaults, 3 interleaved repeats
# of 100 steps with the first step of a fresh process on an empty Triton cache (ours and Flex's) and after
# `warmup` (benchmarks/tools/torchtitan_dense.py). The job's text is written from the installed docstrings while
# the tests run. Logs and JSON under $OUT (6 files, flat). torchtitan 0.3.0 and the packages it needs beyond the
# machine's are unpacked from the wheels in .whl/titan/ (carried; 2.7 MB) where the machine lacks them.
#   bash benchmarks/tools/torchtitan_dense_gpu.sh          # STEPS, REPEATS, DEADLINE (s), TITAN_FLAGS to change
source benchmarks/tools/gpu_common.sh
unpack_wheels torchtitan '.whl/titan/*.whl' /tmp/titan-site last
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton, importlib.metadata as m
print(torch.__version__, triton.__version__, m.version('torchtitan'))"
  nproc
} > "$OUT/env.txt" 2>&1
CORPUS=/tmp/titan-corpus.txt
python3 -c "
import sys; sys.path.insert(0, 'examples/torchtitan')
import torch_compat; torch_compat.install()
from pathlib import Path
from local_text import LocalTextDataLoader, write_docstring_corpus
write_docstring_corpus(Path('$CORPUS'), LocalTextDataLoader.Config().max_chars)" >> "$OUT/env.txt" 2>&1 &
CORPUS_PID=$!
timed() {
  local start=$(date +%s) rc; "$@"; rc=$?; echo "$(( $(date +%s) - start )) s (exit $rc): ${*:3:3}" >> "$OUT/env.txt"
}
timed timeout 70 python3 -m pytest -m gpu -q -p no:cacheprovider tests/integrations/test_torchtitan_gpu.py \
  > "$OUT/tests.log" 2>&1
timed wait $CORPUS_PID
timed timeout $(( ${DEADLINE:-420} + 30 )) python3 benchmarks/tools/torchtitan_dense.py --out "$OUT" \
  --steps "${STEPS:-100}" --repeats "${REPEATS:-3}" --deadline "${DEADLINE:-420}" --corpus "$CORPUS" \
  -- ${TITAN_FLAGS:-} > "$OUT/driver.log" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/env.txt" 2>&1
tail -n 12 "$OUT/tests.log"; tail -n 30 "$OUT/driver.log"; cat "$OUT/env.txt"
