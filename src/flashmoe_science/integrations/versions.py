"""The releases of each framework an integration builds on: stated here once, and checked.

Each integration reaches into its framework's internals (or subclasses its classes), so it supports the releases it
was tested on. pyproject.toml's extras pin the same ranges (tests/test_versions.py checks that they agree); the
runtime checks (`require`), the tests' skip rules (`unsupported`'s line as the reason) and ``flashmoe-science info``
(`status`) read them from here. Imports neither torch nor an integration: the vLLM plugin reads it as vLLM loads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Integration:
    distribution: str  # the name pip installs it by
    specifier: str  # the supported releases, as pip writes them
    extra: str  # the extra of pyproject.toml that installs them
    purpose: str  # what builds on them

    @property
    def requirement(self) -> str:
        return f"{self.distribution}{self.specifier}"


INTEGRATIONS = {
    "transformers-cb": Integration("transformers", ">=5.24,<5.26", "serve",
                                   "transformers' continuous-batching and serving internals (the e4m3 KV cache, "
                                   "`flashmoe-science serve`)"),
    "torchtitan": Integration("torchtitan", "==0.3.0", "torchtitan",
                              "flashmoe_science.integrations.torchtitan and examples/torchtitan"),
    "megatron": Integration("megatron-core", ">=0.19,<0.20", "megatron",
                            "flashmoe_science.integrations.megatron and examples/megatron"),
    "vllm": Integration("vllm", ">=0.26,<0.27", "vllm", "the vLLM plugin (flashmoe_science.integrations.vllm)"),
    "sglang": Integration("sglang", ">=0.5.17,<0.6", "sglang",
                          "the SGLang plugin (flashmoe_science.integrations.sglang)"),
}


def integration(name: str) -> Integration:
    if name not in INTEGRATIONS:
        raise ValueError(f"name must be one of {', '.join(INTEGRATIONS)}, got {name!r}")
    return INTEGRATIONS[name]


def installed(distribution: str) -> str | None:
    """The installed release of ``distribution``; None if it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def contains(specifier: str, version: str) -> bool:
    """Whether ``version`` is within ``specifier`` (pre-releases of a supported release included)."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion
    except ImportError:  # pip brings packaging; without it, the clauses used above (==, >=, <) on release numbers
        return all(_clause_holds(clause.strip(), version) for clause in specifier.split(","))
    try:
        return SpecifierSet(specifier).contains(version, prereleases=True)
    except InvalidVersion:
        return False


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _clause_holds(clause: str, version: str) -> bool:
    operator, bound = re.match(r"(==|>=|<)\s*(.+)", clause).groups()
    have, want = _release(version), _release(bound)
    width = max(len(have), len(want))
    have, want = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
    return {"==": have == want, ">=": have >= want, "<": have < want}[operator]


def unsupported(name: str) -> str | None:
    """None where the integration ``name``'s framework is installed at a supported release; else one line saying
    what is installed, what is supported and the pip command that installs it."""
    entry = integration(name)
    version = installed(entry.distribution)
    if version is None:
        return (f"{entry.distribution} is not installed; {entry.purpose} supports {entry.requirement} "
                f"(pip install \"flashmoe-science[{entry.extra}]\")")
    if contains(entry.specifier, version):
        return None
    return (f"installed: {entry.distribution} {version}; {entry.purpose} supports {entry.requirement} "
            f"(pip install \"{entry.requirement}\")")


def require(name: str) -> None:
    """A RuntimeError with `unsupported`'s line unless the integration ``name``'s framework is at a supported
    release."""
    reason = unsupported(name)
    if reason is not None:
        raise RuntimeError(reason)


def oldest(name: str) -> str:
    """The requirement of the oldest supported release of the integration ``name``'s framework (what CI tests beside
    the newest): ``transformers==5.24``."""
    entry = integration(name)
    for clause in entry.specifier.split(","):
        operator, bound = re.match(r"(==|>=|<)\s*(.+)", clause.strip()).groups()
        if operator in ("==", ">="):
            return f"{entry.distribution}=={bound}"
    raise ValueError(f"{entry.requirement} states no lower bound")


def status(name: str) -> str:
    """``flashmoe-science info``'s line: the installed release and whether it is in range."""
    entry = integration(name)
    version = installed(entry.distribution)
    if version is None:
        return f"not installed (supported: {entry.requirement})"
    verdict = "in range" if contains(entry.specifier, version) else "OUT OF RANGE, supported"
    return f"{entry.distribution} {version} ({verdict}: {entry.specifier})"
