#!/usr/bin/env bash
# Stages SGLang for the GPU machine as the SGLang kit does (KIT, default ../shared/peers/sglang: its stage.sh, one
# device call of about 44 MiB), keeping what flashinfer needs to JIT-compile its norm: `sgl_kernel.rmsnorm` calls
# it, and it compiles at the engine's first CUDA-graph capture from the sources in flashinfer's wheel, which the
# kit's repack.py drops whole (`flashinfer/data/`). Kept: flashinfer's headers, csrc's top-level sources and its
# vendored CCCL (libcudacxx, cub, thrust), the include closure of `norm.cu` and `flashinfer_norm_binding.cu`.
# Run in the repository root; then the calls stage.sh prints, and benchmarks/tools/sglang_gpu.sh.
set -eu
kit=$(cd "${KIT:-../shared/peers/sglang}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$kit"/. "$work"/
chmod -R u+w "$work"
python3 - "$work/repack.py" <<'PY'
import sys

path = sys.argv[1]
text = open(path).read()
plain = "def dropped(name: str) -> bool:\n    return name.startswith(DROP)"
if plain not in text:
    sys.exit(f"sglang_stage.sh: {path} no longer has the dropped() it patches: read it and update this script")
keep = '''KEEP = ("flashinfer/data/include/", "flashinfer/data/cccl/libcudacxx/", "flashinfer/data/cccl/cub/",
        "flashinfer/data/cccl/thrust/")


def dropped(name: str) -> bool:
    if name.startswith(KEEP) or (name.startswith("flashinfer/data/csrc/") and name.count("/") == 3):
        return False
    return name.startswith(DROP)'''
open(path, "w").write(text.replace(plain, keep))
PY
bash "$work/stage.sh"
