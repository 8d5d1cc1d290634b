"""README's commands are what CI and users run: keep them complete and in step with .ci/run."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[-1]
    assert command.startswith("pip install torch==2.13.0") and command.endswith("python -m pytest")
    assert command in readme


def test_readme_opens_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first = [line.strip() for line in readme.splitlines() if line.startswith("    python3 -m venv")]
    assert len(first) >= 2
    assert first[0].endswith("python examples/load_llama.py")
    assert first[1].endswith("python -m pytest")


def test_the_test_extra_installs_deepspeed_without_building_ops():
    """tests/test_deepspeed.py runs in CI only if the test command installs DeepSpeed, and
    DeepSpeed installs on a machine without CUDA only with DS_BUILD_OPS=0."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("deepspeed") for req in extras["test"])
    command = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert "DS_BUILD_OPS=0 pip install -e '.[test]'" in command
