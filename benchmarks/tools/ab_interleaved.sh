#!/usr/bin/env bash
# The interleaved A/B of benchmarks/tools/ab_interleaved.py on one GPU, from the repository root: A is the src/ of
# the commit in $AB_BASE (default 7b5f1b8, this tree's base on main), unpacked from ab_base_src.tar if the checkout
# carries one (make it with `git archive 7b5f1b8 src -o ab_base_src.tar`), else by git archive; B is this tree's
# src/. AB_SUITE picks ab_interleaved.py's suite (all, backward, forward, varlen, ragged-decode). Writes ab.json, ab.log and
# gpu.txt under $OUT; about 7 minutes on an H100 for the whole suite (AB_BUDGET_S caps it), 2-3 for `forward`.
set -eu
OUT=${OUT:-/tmp/out}
BASE=${AB_BASE:-7b5f1b8}
mkdir -p "$OUT" /tmp/ab_base
if [ -f ab_base_src.tar ]; then tar -xf ab_base_src.tar -C /tmp/ab_base; else git archive "$BASE" src | tar -x -C /tmp/ab_base; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt" 2>&1 || true
python3 benchmarks/tools/ab_interleaved.py --a /tmp/ab_base/src --b src --suite "${AB_SUITE:-all}" --rounds "${AB_ROUNDS:-4}" --budget-s "${AB_BUDGET_S:-450}" --out "$OUT" \
  2>&1 | tee "$OUT/ab.log"
