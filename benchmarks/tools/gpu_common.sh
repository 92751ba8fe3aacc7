# Sourced from the repository root by this folder's GPU scripts: $OUT made, PYTHONPATH and FLASHMOE_COMMIT set, and
# `unpack_wheels` for packages the GPU machine lacks (it has no package index).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:benchmarks/tools PYTHONUNBUFFERED=1
COMMIT=$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
export FLASHMOE_COMMIT=${FLASHMOE_COMMIT:-$COMMIT}

# unpack_wheels MODULE GLOB DIR first|last: where MODULE does not import, the wheels matching GLOB unpacked into DIR
# (a wheel is a zip of the installed tree, unpacked as pip --target would, without pip or an index), DIR put first
# or last on PYTHONPATH (last: the machine's own packages win where both have one).
unpack_wheels() {
  python3 -c "import $1" 2>/dev/null && return 0
  python3 -c "import glob, sys, zipfile
for wheel in glob.glob(sys.argv[1]): zipfile.ZipFile(wheel).extractall(sys.argv[2])" "$2" "$3"
  if [ "$4" = first ]; then PYTHONPATH=$3:$PYTHONPATH; else PYTHONPATH=$PYTHONPATH:$3; fi
  export PYTHONPATH
}
