"""Fingerprints of every Triton and Gluon kernel of the package without building one: each @triton.jit / @gluon.jit
function's JIT cache key (a hash of its source, the source of every jitted function it calls and the values of the
globals it reads), one line per kernel. Two trees with equal lines give the JIT the same kernels to build; with
sass_fingerprints.py (the built SASS of the Gluon kernels) it shows a change that must leave the kernels alone did.

    PYTHONPATH=src python benchmarks/tools/jit_fingerprints.py > before.txt
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import flashmoe_science
from triton.runtime.jit import JITFunction


def kernels() -> dict[str, JITFunction]:
    """Every JIT function defined in a module of the package, by `module.name` (modules and packages whose import
    fails are skipped, with what they hold: a Gluon module on a triton without Gluon, an integration whose engine is
    not installed)."""
    found = {}
    pending = [(flashmoe_science.__path__, "flashmoe_science.")]
    while pending:
        path, prefix = pending.pop()
        for info in pkgutil.iter_modules(path, prefix):
            try:
                module = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - an optional dependency or Gluon missing: not a kernel of this run
                continue
            if info.ispkg:
                pending.append((module.__path__, info.name + "."))
            for name, value in vars(module).items():
                if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                    found[f"{module.__name__}.{name}"] = value
    return found


def main() -> int:
    for name, fn in sorted(kernels().items()):
        print(f"{name} {fn.cache_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
