"""Every command README.md tells a user to run on a CPU runs as written: each line of its ```bash blocks that starts
with `flashmoe-science ` or `python examples/` and ends neither with `# GPU` nor with `# long` (the published runs'
reproduction, an hour of CPU time; a shell loop is not run either), in README order, in one temporary folder
(later commands read what earlier ones wrote, e.g. a trained model), each expected to exit 0. Lines that install
(`pip`) or test (`pytest`) are not run. `flashmoe-science` runs as `python -m flashmoe_science.cli` from this
checkout's src/, so no installed entry point is needed. Minutes on a CPU: marked slow. The commands run in a
background thread from the end of collection on (tests/readme_chain.py), while the other tests run."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import readme_chain

ROOT = Path(__file__).resolve().parents[1]
COMMAND_TIMEOUT_S = 1200  # per command: generous for a loaded 2-core CI machine
PREFIXES = ("flashmoe-science ", "python examples/")
SKIPPED_SUFFIXES = ("# GPU", "# long")


def readme_commands(text: str) -> list[str]:
    """The runnable lines of the ```bash blocks of ``text``, in order (see the module docstring)."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.splitlines():
            line = line.strip()
            if (line.startswith(PREFIXES) and not line.endswith(SKIPPED_SUFFIXES)
                    and not re.search(r"\b(pip|pytest)\b", line)):
                commands.append(line)
    return commands


def argv_of(command: str) -> list[str]:
    """The command as this interpreter runs it: comments dropped, `flashmoe-science` as the module, `python` as
    sys.executable with the example's path made absolute."""
    words = shlex.split(command, comments=True)
    if words[0] == "flashmoe-science":
        return [sys.executable, "-m", "flashmoe_science.cli", *words[1:]]
    return [sys.executable, str(ROOT / words[1]), *words[2:]]


def test_readme_commands_are_found():
    text = "\n".join(["```bash", 'pip install -e ".[cli]" && flashmoe-science bench', "flashmoe-science info",
                      "flashmoe-science bench decode   # GPU", "python examples/train.py --device cpu  # seconds",
                      "flashmoe-science supercon baselines --ours runs/tc  # long",
                      "pytest", "```", "```python", "flashmoe-science info", "```"])
    assert readme_commands(text) == ["flashmoe-science info", "python examples/train.py --device cpu  # seconds"]
    assert argv_of("python examples/train.py --device cpu  # seconds")[1:] == [str(ROOT / "examples/train.py"),
                                                                                "--device", "cpu"]


README_COMMANDS = readme_commands((ROOT / "README.md").read_text())
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))


@pytest.mark.slow
@pytest.mark.parametrize("command", [pytest.param(command, marks=pytest.mark.readme_command(
    argv_of(command), ENV, COMMAND_TIMEOUT_S)) for command in README_COMMANDS])
def test_readme_command_runs(command, request):
    outcome = readme_chain.outcome(request)
    if outcome.returncode is None:
        pytest.fail(f"`{command}` ran past {COMMAND_TIMEOUT_S} s:\n{outcome.output[-3000:]}")
    assert outcome.returncode == 0, f"`{command}` exited {outcome.returncode}:\n{outcome.output[-4000:]}"
