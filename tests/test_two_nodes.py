"""One torchrun job as two nodes on this machine: two agents (`--nnodes 2`, node ranks 0 and
1) meeting at a c10d rendezvous on localhost, two ranks each. Every rank loads its share of
a world-4 tensor-parallel model (KV heads replicated over pairs of ranks), each node's ranks
count as one host (LOCAL_WORLD_SIZE 2: they share its page cache), and all four generate the
world-1 tokens (examples/tp_torchrun.py checks that and exits non-zero otherwise)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gloo import JOB_TIMEOUT

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tp_torchrun.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_two_ranks_generate_the_world1_tokens(tmp_path):
    sys.path.insert(0, str(EXAMPLE.parent))
    from tp_torchrun import write_example_checkpoint

    checkpoint = write_example_checkpoint(str(tmp_path / "ckpt"))
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    port = _free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", f"lazyload-{port}", str(EXAMPLE), checkpoint],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path) for node in (0, 1)]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=JOB_TIMEOUT)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for agent in agents:
            agent.kill()
        rest = [agent.communicate()[0] for agent in agents[len(outputs):]]  # the documented way after a kill
        pytest.fail(f"the two-node job still runs after {JOB_TIMEOUT:.0f} s (a hang); its output:\n"
                    + "\n".join(out[-4000:] for out in outputs + rest))
    finally:
        for agent in agents:
            agent.kill()
    text = "\n".join(outputs)
    assert all(a.returncode == 0 for a in agents), f"exits {[a.returncode for a in agents]}:\n{text[-8000:]}"
    nodes = dict(re.findall(r"^\[rank (\d)\] node (\d), ranks on this node: 2$", text, re.M))
    assert sorted(nodes) == ["0", "1", "2", "3"], f"not every rank is one of two on its node:\n{text[-4000:]}"
    assert sorted(nodes.values()) == ["0", "0", "1", "1"], nodes
    tokens = dict(re.findall(r"^\[rank (\d)\] world 4 tokens: (\[[\d, ]+\])$", text, re.M))
    assert sorted(tokens) == ["0", "1", "2", "3"] and len(set(tokens.values())) == 1, tokens
    assert f"OK: all 4 ranks generated the world-1 tokens {tokens['0']}" in text
