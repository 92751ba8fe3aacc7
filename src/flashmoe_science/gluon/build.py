"""Offline Gluon builds for any CUDA target, without a GPU: compile a kernel on meta tensors (``compile_offline``),
read its SASS (``offline_sass``) and count its register spills against a budget (``spill_count``, ``spill_budget``).
The CI's build tests and ``benchmarks/tools/sass_fingerprints.py`` use them; nothing here names an architecture."""

from __future__ import annotations

import torch
import triton

from flashmoe_science.gluon.compat import on_tuned_triton


def compile_offline(fn, args, constexprs: dict, *, arch: int, options: dict):
    """``triton.compile`` of the Gluon kernel ``fn`` for CUDA compute capability ``arch`` (90 for sm_90) without a
    GPU (meta tensors are enough), specialised as the JIT would specialise these arguments (16-byte aligned pointers,
    integers divisible by 16 unless ``do_not_specialize`` names them) and launched with ``options`` (num_warps,
    maxnreg, ...); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = fn.arg_names
    values = dict(zip(names, args))
    signature = {n: ("constexpr" if n in constexprs else mangle_type(values[n])) for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    # integers the kernel leaves unspecialised (do_not_specialize, by name or position) get no divisibility either
    plain = {names[n] if isinstance(n, int) else n for n in getattr(fn, "do_not_specialize", ()) or ()}
    # no attributes on constexprs: triton 3.7+ numbers the attributes over the kernel's runtime arguments only
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, v in values.items() if n not in constexprs and (
        isinstance(v, torch.Tensor) or (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0
                                        and n not in plain))}
    src = GluonASTSource(fn, signature, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))


def offline_sass(compiled) -> str | None:
    """The SASS of a compiled kernel (``compile_offline``'s), by the cuobjdump that ships with triton; None where this
    triton has none."""
    import os
    import subprocess
    import tempfile

    from triton import knobs

    cuobjdump = os.path.join(os.path.dirname(knobs.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, timeout=120).stdout


# LDL/STL instructions a build of another triton release may add to a kernel's tuned count: their register
# allocators spill where 3.6's did not (measured on 3.7.1-3.9.0: +41 in the fused SwiGLU dh, +153 in the D=256
# causal forward on 3.9, at the work-item boundary). That costs some speed there (unmeasured: the H200 runs 3.6), not
# correctness; a collapse into the main loops (thousands) still fails the build tests.
UNTUNED_SPILL_SLACK = 256


def spill_count(sass: str) -> int:
    """Local-memory loads and stores (LDL, STL) in a kernel's SASS: register spills."""
    import re

    return len(re.findall(r"\b(?:LDL|STL)\b", sass))


def sass_loops(sass: str) -> list[dict]:
    """The loops of a kernel's SASS that issue HGMMAs, smallest first: a backward branch closes the loop [its target,
    the branch]. Each as start and end address, its instruction count and its HGMMA, MUFU.EX2, LDL and STL counts
    (an attention forward's key-tile loop is the one with both products' HGMMAs: head_dim/16 + block_n/16). Each
    instruction is read once: a loop's counts are differences of running counts over the address-sorted text."""
    import bisect
    import itertools
    import re

    ops = ("HGMMA", "MUFU.EX2", "LDL", "STL")
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    ordered = sorted(lines, key=lambda line: line[0])
    addresses = [a for a, _ in ordered]
    running = {op: list(itertools.accumulate((bool(re.search(r"\b%s\b" % re.escape(op), t)) for _, t in ordered),
                                             initial=0)) for op in ops}
    loops = []
    for address, text in lines:
        branch = re.search(r"\bBRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            first, last = bisect.bisect_left(addresses, start), bisect.bisect_right(addresses, address)
            count = {op: running[op][last] - running[op][first] for op in ops}
            if count["HGMMA"]:
                loops.append(dict(start=start, end=address, instructions=last - first, **count))
    return sorted(loops, key=lambda loop: loop["instructions"])


def spill_budget(tuned: int = 0) -> int:
    """The spills a build test allows: ``tuned`` on the triton the kernels were tuned on (compat.TUNED_TRITON),
    ``tuned + UNTUNED_SPILL_SLACK`` on other releases."""
    return tuned if on_tuned_triton() else tuned + UNTUNED_SPILL_SLACK
