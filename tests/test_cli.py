"""`lazyload inspect` on a real checkpoint: what it prints comes from the headers alone."""
import subprocess
import sys

from checkpoints import header_bytes, shard_files, tensor_bytes


def test_inspect_prints_tensors_files_layers_and_total(checkpoint):
    directory, config = checkpoint("llama")
    out = subprocess.run([sys.executable, "-m", "lazyload.cli", "inspect", str(directory)],
                         capture_output=True, text=True, check=True).stdout
    files = shard_files(directory)
    total = tensor_bytes(files)
    assert "total: " in out and f"({total} bytes)" in out
    assert f"headers read: {header_bytes(files)} bytes" in out
    for f in files:
        assert f.name in out
    assert f"model.layers.{{0...{config.num_hidden_layers - 1}}}.self_attn.q_proj.weight" in out
    assert "model.layers.0 " in out and "(outside layers)" in out


def test_inspect_names_a_missing_path(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lazyload.cli", "inspect", str(tmp_path / "nowhere")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "nowhere" in result.stderr and "no such file" in result.stderr
