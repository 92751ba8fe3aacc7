"""The supported releases (`integrations.versions`): pyproject.toml's extras pin the ranges it states, its check
without packaging agrees with packaging's, and its lines say what is installed, what is supported and how to get it."""

import re
from pathlib import Path

import pytest

from flashmoe_science.integrations import versions

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")
specifiers = pytest.importorskip("packaging.specifiers")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


@pytest.mark.parametrize("name", list(versions.INTEGRATIONS))
def test_each_extra_pins_the_range_versions_states(name):
    entry = versions.INTEGRATIONS[name]
    extra = pyproject()["project"]["optional-dependencies"][entry.extra]
    pins = [requirements.Requirement(line) for line in extra]
    pins = [pin for pin in pins if pin.name == entry.distribution]
    assert len(pins) == 1, f"the {entry.extra} extra should name {entry.distribution} once: {extra}"
    assert pins[0].specifier == specifiers.SpecifierSet(entry.specifier), (
        f"pyproject's {entry.extra} extra pins {pins[0]}, integrations/versions.py states {entry.requirement}")


def test_the_vllm_plugin_is_an_entry_point():
    plugins = pyproject()["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"flashmoe_science": "flashmoe_science.integrations.vllm:register"}


@pytest.mark.parametrize("version", ["5.23.9", "5.24.0", "5.24", "5.25.3", "5.25.0rc1", "5.26.0", "5.26.0.dev0",
                                     "6.0", "0.3.0", "0.3.1", "0.19.2", "0.20.0", "0.5.17", "0.5.16", "0.6.0"])
@pytest.mark.parametrize("specifier", sorted({entry.specifier for entry in versions.INTEGRATIONS.values()}))
def test_the_check_without_packaging_agrees_with_packaging(specifier, version):
    """The fallback compares release numbers: a pre-release counts as its release, as packaging counts it with
    prereleases=True (which also refuses a pre-release of an excluded bound: 5.26.0.dev0 for <5.26)."""
    plain = all(versions._clause_holds(clause.strip(), version) for clause in specifier.split(","))
    assert plain == versions.contains(specifier, version)


def test_lines_name_the_release_the_range_and_the_command(monkeypatch):
    releases = {"transformers": "5.26.0", "torchtitan": "0.3.0"}
    monkeypatch.setattr(versions, "installed", releases.get)
    assert versions.unsupported("torchtitan") is None
    versions.require("torchtitan")
    line = versions.unsupported("transformers-cb")
    assert "\n" not in line and line.startswith("installed: transformers 5.26.0; transformers' continuous-batching")
    assert line.endswith('supports transformers>=5.24,<5.26 (pip install "transformers>=5.24,<5.26")')
    with pytest.raises(RuntimeError, match="installed: transformers 5.26.0; .* supports transformers>=5.24,<5.26"):
        versions.require("transformers-cb")
    assert 'pip install "flashmoe-science[megatron]"' in versions.unsupported("megatron")
    assert versions.status("torchtitan") == "torchtitan 0.3.0 (in range: ==0.3.0)"
    assert versions.status("transformers-cb") == "transformers 5.26.0 (OUT OF RANGE, supported: >=5.24,<5.26)"
    assert versions.status("vllm") == "not installed (supported: vllm>=0.26,<0.27)"
    with pytest.raises(ValueError, match="name must be one of"):
        versions.unsupported("jax")


def test_the_oldest_release_is_the_lower_bound():
    assert versions.oldest("transformers-cb") == "transformers==5.24"
    assert versions.oldest("torchtitan") == "torchtitan==0.3.0"
    assert versions.oldest("megatron") == "megatron-core==0.19"
    for name, entry in versions.INTEGRATIONS.items():
        assert versions.contains(entry.specifier, versions.oldest(name).partition("==")[2])


# how README.md names the releases of an integration's framework: "TorchTitan 0.3.0", "Megatron-core 0.19", ...
README_NAMES = {"torchtitan": "TorchTitan", "megatron": "Megatron-core", "vllm": "vLLM", "sglang": "SGLang"}


def test_the_readme_names_releases_in_the_ranges_versions_states():
    readme = (PYPROJECT.parent / "README.md").read_text()
    named = 0
    for name, words in README_NAMES.items():
        for release in re.findall(rf"\b{words} (\d+(?:\.\d+)+)", readme):
            named += 1
            entry = versions.INTEGRATIONS[name]
            assert versions.contains(entry.specifier, release), (
                f"README.md names {words} {release}; integrations/versions.py states {entry.requirement}")
    assert named >= 3
