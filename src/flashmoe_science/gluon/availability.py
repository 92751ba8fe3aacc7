"""Whether the Gluon sm_90 kernels can run on this triton, and the one rule for when one does not build.

Gluon is Triton's experimental layer: a triton after the tested range (``TESTED_TRITON``; compat maps the
names that moved within it) may fail to import or to build a kernel. A user's training step must not fail for that:
with ``backend="auto"`` the first failure is recorded, one warning names the triton version and the fallback, and
from then on every call takes the portable Triton kernels (attention forward and backward, the MoE GEMMs).
``backend="hopper"`` raises ``GluonUnavailable`` instead. Builds fail before anything is launched, so a fallback
recomputes from untouched inputs. Only Triton's compilation fails a build (``is_build_failure``): an error of the
host code around a launch propagates unchanged and leaves the Gluon kernels on. A build that carries a user's
function (a ``mask_mod``) and fails is that function's failure, not this triton's: the kernels stay on, and that
function alone is refused by the Gluon kernels from then on (``function_refusal``).

The planners ask ``plan_time_reason`` before planning a Gluon kernel: on a triton outside the tested range it builds
one kernel offline, once per process (a few seconds), so a Gluon layer that no longer builds is found at plan time
and every plan, the first included, declines the Gluon kernels with the reason. Inside the tested range the
offline build tests vouch for the kernels and nothing is built; a variant that still fails at its launch runs the
fallback its plan carries (``backends.choose``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

TESTED_TRITON = ("3.6", "3.9")  # oldest and newest release whose Gluon builds the offline sm_90 tests cover
_failure: str | None = None  # why the Gluon kernels are off in this process (the first build failure)
_probed = False  # whether plan_time_reason built its kernel in this process
_function_failures: dict[object, str] = {}  # user functions whose Gluon builds failed, and why (run_gluon's user_fn)


class GluonUnavailable(RuntimeError):
    """A Gluon sm_90 kernel cannot run on this triton (backend="hopper" was asked for)."""


def _build_errors() -> tuple[type[BaseException], ...]:
    """The error types of Triton's compilation, the same on triton 3.6 to 3.9: the front end's CompilationError (its
    subclasses CompileTimeAssertionFailure and UnsupportedLanguageConstruct included; it wraps whatever a @gluon.jit
    body raises, a Gluon name or construct this triton lacks among them), ptxas's PTXASError, OutOfResources (shared
    memory, registers, threads: checked when the built kernel loads)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    return CompilationError, OutOfResources, PTXASError


def is_build_failure(error: BaseException) -> bool:
    """Whether ``error`` is a kernel's build failing on this triton: one of ``_build_errors()``, or anything raised
    inside ``triton.compile`` (an MLIR pass of the Gluon lowering fails with a RuntimeError). An error of the host
    code around the launch (ours, or Triton's argument binding) is not one, whatever its type."""
    if isinstance(error, _build_errors()):
        return True
    from triton.compiler import compiler

    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is compiler.compile.__code__:
            return True
        tb = tb.tb_next
    return False


@functools.lru_cache(maxsize=None)
def _import_error() -> str | None:
    """Why the Gluon layer (compat and the shared sm_90 blocks) does not import on this triton, or None."""
    try:
        import flashmoe_science.gluon.sm90  # noqa: F401
    except Exception as error:  # any failure here means: no Gluon kernels on this triton
        return f"{type(error).__name__}: {error}"
    return None


def triton_version() -> str | None:
    try:
        from triton import __version__
    except ImportError:
        return None
    return __version__


def in_tested_range(version: str) -> bool:
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    low, high = (tuple(int(p) for p in v.split(".")) for v in TESTED_TRITON)
    return low <= release <= high


def unavailable_reason() -> str | None:
    """Why the Gluon kernels are not taken in this process (the Gluon layer does not import, or a kernel failed to
    build earlier), or None when they may run."""
    return _failure or _import_error()


def plan_time_reason(kernel: str, build: Callable[[], object]) -> str | None:
    """``unavailable_reason()``, after building ``kernel`` offline with ``build`` (no launch, no GPU needed) where
    this triton is outside TESTED_TRITON and nothing was built yet in this process: a failure is recorded then (one
    warning) and returned, so the plan asking declines the Gluon kernels before any launch. Any error of ``build``
    counts: it runs no call's arguments, only code the build tests pass on the tested releases (importing the
    kernel module, its host-side Gluon layouts, ``triton.compile``), so what fails there is this triton's."""
    global _probed
    reason = unavailable_reason()
    version = triton_version()
    if reason is None and not _probed and version is not None and not in_tested_range(version):
        _probed = True
        try:
            build()
        except Exception as error:
            reason = record_failure(kernel, error)
    return reason


def _summary(error: BaseException) -> str:
    """A build error in one line: its type and the last line of its message (Triton's point at the failing code)."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1][:300]}"


def record_failure(kernel: str, error: BaseException) -> str:
    """Turn the Gluon kernels off for this process after ``kernel`` failed to build; warns once. Returns the reason."""
    global _failure
    reason = f"the Gluon sm_90 {kernel} kernel does not build on triton {triton_version()} ({_summary(error)})"
    if _failure is None:
        _failure = reason
        tested = "-".join(TESTED_TRITON)
        warnings.warn(f"flashmoe_science: {reason}; backend='auto' runs the portable Triton kernels instead from now "
                      f"on (attention and MoE; the Gluon kernels are tested on triton {tested}, backend='hopper' "
                      "raises)", RuntimeWarning, stacklevel=3)
    return reason


def function_refusal(fn) -> str | None:
    """Why the Gluon kernels refuse the user's function ``fn`` (its build failed in this process), or None."""
    return _function_failures.get(fn)


def _record_function_failure(kernel: str, fn, error: BaseException) -> str:
    functions = fn if isinstance(fn, tuple) else (fn,)
    name = " and ".join(getattr(getattr(f, "fn", f), "__name__", repr(f)) for f in functions)
    reason = f"{name} does not build in the Gluon sm_90 {kernel} ({_summary(error)})"
    if fn not in _function_failures:
        _function_failures[fn] = reason
        warnings.warn(f"flashmoe_science: {reason}; backend='auto' runs the portable Triton kernels for it from now "
                      "on (the other calls keep the Gluon kernels)", RuntimeWarning, stacklevel=3)
    return reason


def run_gluon(kernel: str, launch: Callable[[], object], strict: bool = False, user_fn=None) -> bool:
    """Run ``launch`` (a Gluon kernel's launch) unless the Gluon kernels are off. True when it ran; False when they
    are off or it failed to build (``is_build_failure``; recorded, one warning): the caller then runs its Triton
    kernel. With ``strict`` (backend="hopper") raises GluonUnavailable instead of returning False. Any other error
    of the launch propagates unchanged and leaves the Gluon kernels on. ``user_fn``: the user's function (a mask_mod),
    or tuple of functions, the build carries; a failed build is recorded against it alone (`function_refusal`)."""
    reason = unavailable_reason() or (function_refusal(user_fn) if user_fn is not None else None)
    if reason is None:
        try:
            launch()
            return True
        except Exception as error:
            if not is_build_failure(error):
                raise
            reason = (_record_function_failure(kernel, user_fn, error) if user_fn is not None
                      else record_failure(kernel, error))
    if strict:
        raise GluonUnavailable(f"backend='hopper': {reason}")
    return False


def describe() -> str:
    """One line for ``flashmoe-science info``."""
    reason = unavailable_reason()
    tested = "-".join(TESTED_TRITON)
    if reason is not None:
        return f"off: {reason}; backend='auto' runs the portable Triton kernels"
    if not in_tested_range(triton_version()):
        return (f"triton {triton_version()} is outside the tested range {tested}: the Gluon kernels are tried, and "
                "backend='auto' falls back to the portable Triton kernels (one warning) if one does not build")
    return f"available (triton {triton_version()}, tested {tested}; a build failure would fall back to Triton)"
