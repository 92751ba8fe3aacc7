"""Read a cubin's SASS without a GPU: the cuobjdump that ships with triton, and the instruction counts that matter
for these kernels (warpgroup MMAs, TMA copies, spills, SFU exp2s, barriers)."""

import subprocess
import tempfile

import triton

SASS_OPS = ("HGMMA", "HMMA", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "UTMALDG", "UTMASTG", "LDL", "STL",
            "MUFU.EX2", "BAR.SYNC", "SYNCS")


def cuobjdump(cubin: bytes, *flags: str) -> str:
    tool = triton.__path__[0] + "/backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, timeout=120).stdout


def sass_counts(cubin: bytes) -> tuple[str, dict]:
    """(the SASS text, {instruction: count} plus the resource line: registers, stack, shared memory)."""
    sass = cuobjdump(cubin, "-sass")
    counts = {op: sass.count(op) for op in SASS_OPS}
    usage = cuobjdump(cubin, "-res-usage")
    counts["res"] = " ".join(line.strip() for line in usage.splitlines() if "REG" in line)
    return sass, counts
