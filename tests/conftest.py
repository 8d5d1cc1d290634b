"""Shared fixtures: small real checkpoints written once per session by transformers'
save_pretrained (see checkpoints.py), cached under pytest's session temp directory."""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

# Test modules import the helpers as `from checkpoints import ...` (tests/ has no
# __init__.py; pytest's default "prepend" import mode puts this directory on sys.path
# when it loads this conftest, the line below makes that explicit for other modes).
sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("LAZYLOAD_PROGRESS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")


@pytest.fixture(scope="session", autouse=True)
def _forkserver():
    """Where a collected test spawns ranks, their forkserver (see gloo.py) starts with the first
    test, under pytest's capture: the ranks write where a test's output is captured."""
    if "gloo" in sys.modules:
        sys.modules["gloo"].start_forkserver()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(arch, dtype="fp32", *, base=False, **config_overrides) -> (dir, config).

    Written once per distinct argument set per session; tests must not modify the files
    (copy them with checkpoints.copy_checkpoint first)."""
    from checkpoints import write_checkpoint

    cache: dict = {}

    def get(arch: str, dtype: str = "fp32", *, base: bool = False, **overrides):
        key = (arch, dtype, base, tuple(sorted(overrides.items())))
        if key not in cache:
            name = f"{arch}-{dtype}" + ("-base" if base else "") + "".join(
                f"-{k}{v}" for k, v in sorted(overrides.items()))
            directory = tmp_path_factory.mktemp(name, numbered=True)
            cache[key] = write_checkpoint(arch, dtype, directory, base=base, **overrides)
        return cache[key]

    return get
