"""README's commands are what CI and users run: keep them complete and in step with .ci/run."""
import os
import re
import sys
from pathlib import Path

import pytest

from gloo import run_job

ROOT = Path(__file__).resolve().parent.parent


def ci_test_command() -> str:
    """The line of .ci/run that installs and runs the main suite, then the vLLM step."""
    return next(line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.startswith("pip install torch==2.13.0"))


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = ci_test_command()
    assert command.endswith("python -m pytest && tests/in_vllm/run.sh")
    assert command in readme


def test_ci_runs_the_vllm_step_last():
    """After the main suite, CI runs the vLLM cases in their own venv (tests/in_vllm/run.sh),
    on its last line: a failure anywhere in the chain is the script's exit status."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == ci_test_command() and ci[-1].endswith("&& tests/in_vllm/run.sh")
    assert os.access(ROOT / "tests" / "in_vllm" / "run.sh", os.X_OK)


def test_every_error_class_is_exported_and_in_the_error_reference():
    """Each LazyLoadError subclass is `lazyload.<Name>` (the lazy package import gives the
    class itself) and README's "Errors" section names it."""
    import inspect

    import lazyload
    from lazyload import errors

    readme = (ROOT / "README.md").read_text()
    reference = readme[readme.index("### Errors"):readme.index("#### Failures")]
    names = [n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.LazyLoadError)]
    assert "ExchangeError" in names and "RemoteError" in names
    for name in names:
        assert name in lazyload.__all__ and getattr(lazyload, name) is getattr(errors, name), name
        assert f"`{name}`" in reference or f"`lazyload.{name}`" in reference, f"the error reference lacks {name}"


def test_readme_opens_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first = [line.strip() for line in readme.splitlines() if line.startswith("    python3 -m venv")]
    assert len(first) >= 2
    assert first[0].endswith("python examples/load_llama.py")
    assert first[1].endswith("python -m pytest && tests/in_vllm/run.sh")


def test_the_test_extra_installs_deepspeed_without_building_ops():
    """tests/test_deepspeed.py runs in CI only if the test command installs DeepSpeed, and
    DeepSpeed installs on a machine without CUDA only with DS_BUILD_OPS=0."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("deepspeed") for req in extras["test"])
    assert "DS_BUILD_OPS=0 pip install -e '.[test]'" in ci_test_command()


CPU_TORCH = "pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu && "


def test_both_commands_install_torchs_cpu_build():
    """PyPI's torch 2.13.0 is a CUDA build on Linux (several GB); PyTorch's CPU index has
    2.13.0+cpu, which pip prefers with the pin."""
    readme = (ROOT / "README.md").read_text()
    first = [line.strip() for line in readme.splitlines() if line.startswith("    python3 -m venv")][:2]
    assert all(CPU_TORCH in command for command in first), first
    assert "download.pytorch.org/whl/cu" in readme  # and how to get a CUDA build instead


def test_every_install_line_names_this_distribution():
    """`lazyload` on PyPI is an unrelated 2015 project: this one is `torch-lazyload` (imported
    as lazyload), installed from the clone (`-e .`) or, for extras, by its own name."""
    tomllib = pytest.importorskip("tomllib")
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == "torch-lazyload"
    readme = (ROOT / "README.md").read_text()
    installs = re.findall(r"pip install ([^`\n&;]*)", readme)
    assert installs
    for args in installs:
        for word in re.findall(r"'?([\w.-]+)(?:\[[\w,-]+\])?'?", args):
            assert word != "lazyload", f"`pip install {args}` installs PyPI's unrelated lazyload"


def _readme_block(first_line: str) -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    return next(b for b in blocks if b.startswith(first_line))


def test_the_readme_tp_script_runs_under_torchrun(checkpoint, tmp_path):
    """README's tensor-parallel script, as written there, at world 2 on CPU (gloo)."""
    directory, _ = checkpoint("llama")
    script = tmp_path / "tp_load.py"
    script.write_text(_readme_block("# tp_load.py\n"))
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    proc = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(script), str(directory)], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.search(r"^next token: \d+$", proc.stdout, re.M), proc.stdout
    assert "lazyload: rank 0/2" in proc.stdout


def test_the_readme_own_model_script_runs(checkpoint, tmp_path):
    """README's 'Your own model' script, as written there, on a real checkpoint; it prints
    len(ckpt), len(ckpt.files) and ckpt.total_bytes, which the reference documents."""
    directory, _ = checkpoint("llama")
    code = _readme_block("import torch\nfrom transformers import AutoConfig")
    assert 'path = "path/to/checkpoint"' in code
    script = tmp_path / "own_model.py"
    script.write_text(code.replace('path = "path/to/checkpoint"', f"path = {str(directory)!r}"))
    proc = run_job([sys.executable, str(script)], env=dict(os.environ, LAZYLOAD_PROGRESS="0"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from lazyload import LazyCheckpoint

    ckpt = LazyCheckpoint(directory)
    assert f"{len(ckpt)} tensors in {len(ckpt.files)} files, {ckpt.total_bytes} bytes" in proc.stdout
    assert "of load_into (no imports, no model construction" in proc.stdout  # what `seconds` covers
    assert "peak RSS of the whole process during it" in proc.stdout
    readme = (ROOT / "README.md").read_text()
    reference = readme[readme.index("## Reference"):]
    assert all(f"`{name}`" in reference for name in ("len(ckpt)", "ckpt.files", "ckpt.total_bytes"))


@pytest.mark.parametrize("call", ['lazyload.load_model("path/to/checkpoint")',
                                  'lazyload.load_model("path/to/checkpoint", quantize="int8")'])
def test_the_readme_load_model_scripts_run(checkpoint, tmp_path, call):
    """README's load_model use cases, as written there, on a real checkpoint."""
    directory, _ = checkpoint("llama")
    code = next(b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
                if b.startswith("import lazyload\n") and call in b)
    script = tmp_path / "use.py"
    script.write_text(code.replace("path/to/checkpoint", str(directory)))
    proc = run_job([sys.executable, str(script)], env=dict(os.environ, LAZYLOAD_PROGRESS="0"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lazyload: rank 0/1" in proc.stdout
    assert ("quantized" in proc.stdout) == ("quantize=" in call), proc.stdout


def _run_sync_script(name: str, ranks: int, directory, tmp_path):
    script = tmp_path / name
    script.write_text(_readme_block(f"# {name}\n"))
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    proc = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    str(script), str(directory)], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow  # a torchrun job of its own; tests/test_sync.py's "colocated" case runs the same path by default
def test_the_readme_colocated_sync_runs_under_torchrun(checkpoint, tmp_path):
    """README's colocated WeightSync script, as written there, at 2 ranks on CPU (gloo):
    each rank copies its slices from its own FSDP2 shard and receives the rest."""
    directory, _ = checkpoint("llama")
    out = _run_sync_script("colocated_sync.py", 2, directory, tmp_path)
    found = re.findall(r"^rank (\d): (\d+) B copied here, (\d+) B received$", out, re.M)
    assert sorted(r for r, _, _ in found) == ["0", "1"] and all(int(a) > 0 and int(b) > 0 for _, a, b in found), out


@pytest.mark.slow  # a 4-rank torchrun job; tests/test_sync.py's "trainer-server" case runs the same path by default
def test_the_readme_trainer_server_sync_runs_under_torchrun(checkpoint, tmp_path):
    """README's trainer/server WeightSync script at 4 ranks: trainers send, servers receive,
    twice, and the server runs."""
    directory, _ = checkpoint("llama")
    out = _run_sync_script("weight_sync.py", 4, directory, tmp_path)
    sent = re.findall(r"^rank ([01]) step \d: sent (\d+) B, received 0 B", out, re.M)
    received = re.findall(r"^rank ([23]) step \d: sent 0 B, received (\d+) B", out, re.M)
    assert len(sent) == 4 and len(received) == 4 and all(int(n) > 0 for _, n in sent + received), out
    assert len(re.findall(r"^rank [23]: next token \d+$", out, re.M)) == 2, out
