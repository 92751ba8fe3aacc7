"""The tests' skip rule for an integration's framework: a test of an integration skips, with
`integrations.versions.unsupported`'s line as its reason, where the installed release is outside the supported range
(a newer release on the index never fails a test)."""

import pytest

from flashmoe_science.integrations import versions


def supported(name: str):
    """A mark that skips a test unless the integration ``name``'s framework is installed at a supported release."""
    reason = versions.unsupported(name)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def skip_module_unless_supported(name: str) -> None:
    """The same rule for a whole test module, before it imports the integration (which refuses other releases)."""
    reason = versions.unsupported(name)
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
