"""examples/tp_torchrun.py under a real torchrun (2 ranks, gloo): it exits 0 (its own check:
every rank's greedy tokens equal from_pretrained's at world 1) and both ranks print the same tokens."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from gloo import run_job

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tp_torchrun.py"


def test_tp_torchrun_example_two_ranks(tmp_path):
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(EXAMPLE)]  # --standalone: a free port
    proc = run_job(cmd, env=env, cwd=tmp_path)  # a hang fails with the ranks' output
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{output[-6000:]}"
    tokens = dict(re.findall(r"^\[rank (\d)\] world 2 tokens: (\[[\d, ]+\])$", proc.stdout, re.M))
    assert sorted(tokens) == ["0", "1"], f"not every rank printed its tokens:\n{proc.stdout[-4000:]}"
    assert tokens["0"] == tokens["1"], f"ranks disagree: {tokens}"
    assert f"OK: all 2 ranks generated the world-1 tokens {tokens['0']}" in proc.stdout
