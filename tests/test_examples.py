"""Every example runs as a user runs it (`python examples/X.py`, `torchrun ... examples/X.py`),
at its own small size, exits 0 (each checks its result against transformers and exits non-zero
otherwise) and leaves no temporary directory behind."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gloo import run_job

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]  # --standalone: a free port
# How each example is run; tests/test_example_tp.py and tests/test_two_nodes.py run tp_torchrun.py.
COMMANDS = {
    "load_llama.py": ([sys.executable], "logits identical to from_pretrained: True"),
    "quantized.py": ([sys.executable], "kept layers dequantize exactly to the dequantized load: True"),
    "reshard.py": ([*TORCHRUN, "--nproc-per-node", "2"], "[rank 1] OK: world 1"),
}


def run_example(name: str, prefix: list[str], tmp_path: Path) -> str:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    proc = run_job([*prefix, str(EXAMPLES / name)], env=env, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exit {proc.returncode}:\n{output[-6000:]}"
    left = [p.name for p in tmp.iterdir() if p.name.startswith(("lazyload", ".lazyload"))]
    assert not left, f"{name} left temporary directories behind: {left}"
    return proc.stdout


def test_every_example_is_run_here():
    assert {p.name for p in EXAMPLES.glob("*.py")} == {*COMMANDS, "tp_torchrun.py"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_example_runs_as_documented(name, tmp_path):
    prefix, says = COMMANDS[name]
    assert says in run_example(name, prefix, tmp_path)


@pytest.mark.slow
def test_reshard_example_at_world_4(tmp_path):
    """The world-4 copy at world 4: each rank reads its own file (33 s on 2 cores)."""
    out = run_example("reshard.py", [*TORCHRUN, "--nproc-per-node", "4"], tmp_path)
    assert all(f"[rank {r}] OK: world 1" in out for r in range(4)), out
