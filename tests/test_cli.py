"""`lazyload inspect` on a real checkpoint: what it prints comes from the headers alone; the
CLI's arguments, help, and its failures (one line, exit 2)."""
import json
import shutil
import subprocess
import sys

import pytest

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


@pytest.fixture
def llama(checkpoint, capsys):
    """The small llama checkpoint's directory, with what writing it printed cleared from capsys."""
    directory, _ = checkpoint("llama")
    capsys.readouterr()
    return directory


def _one_line_error(capsys, code) -> str:
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("lazyload"), err
    return err


def test_inspect_and_plan_take_a_url_as_the_api_does(llama, tmp_path, capsys):
    from remote_servers import RangeServer

    from lazyload.cli import main

    directory = llama
    shutil.copytree(directory, tmp_path / "root" / "ckpt")
    local = {}
    for command in (["inspect"], ["plan", "--world", "2"]):
        assert main([command[0], str(directory)] + command[1:]) == 0
        local[command[0]] = capsys.readouterr().out.split("\n", 1)[1]  # after the line naming the path
    with RangeServer(str(tmp_path / "root")) as server:
        url = server.url + "/ckpt/"
        assert main(["inspect", url]) == 0
        assert capsys.readouterr().out.split("\n", 1)[1].replace("(headers read", "") == local["inspect"].replace(
            "(headers read", "")
        assert main(["plan", url, "--world", "2", "--config", str(directory)]) == 0
        assert capsys.readouterr().out.split("\n", 1)[1] == local["plan"]
        assert main(["plan", url, "--world", "2"]) == 0  # config.json from the store, beside the files
        assert capsys.readouterr().out.split("\n", 1)[1] == local["plan"]


def test_version_and_help_for_every_argument(capsys):
    from lazyload import __version__
    from lazyload.cli import build_parser, main

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"lazyload {__version__}"
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"lazyload {name} {action.dest}: no help"
    assert "s3://" in commands["inspect"].format_help() and "repo id" in commands["plan"].format_help()


def test_max_file_bytes_takes_units(llama, tmp_path, capsys):
    from lazyload.cli import byte_count, main

    assert [byte_count(t) for t in ("4096", "500MB", "1GB", "2GiB", "1.5 kib")] == [4096, 5 * 10**8, 10**9,
                                                                                      2 * 2**30, 1536]
    directory = llama
    assert main(["reshard", str(directory), str(tmp_path / "cut"), "--world", "2", "--max-file-bytes", "40KB"]) == 0
    sizes = [p.stat().st_size for p in (tmp_path / "cut").glob("rank-00000-*")]
    assert len(sizes) > 1 and all(s < 40_000 + 70_000 for s in sizes)  # cut between layers, past 40 kB
    assert "'1XB' is no size" in _one_line_error(capsys, main(["reshard", str(directory), str(tmp_path / "x"),
                                                               "--world", "2", "--max-file-bytes", "1XB"]))


def test_plan_for_a_world_that_cannot_split_lists_those_that_can(llama, capsys):
    from lazyload.cli import main

    directory = llama  # 4 attention heads
    err = _one_line_error(capsys, main(["plan", str(directory), "--world", "16"]))
    assert err.strip().endswith("Worlds that work (of 1 to 16): 1, 2, 4."), err


def test_plan_of_one_shard_is_an_error_unless_asked_for(llama, capsys):
    from lazyload.cli import main

    directory = llama
    first = str(shard_files(directory)[0])
    err = _one_line_error(capsys, main(["plan", first, "--world", "2"]))
    assert "--single-file" in err and "pass the directory" in err
    assert main(["plan", first, "--world", "2", "--single-file", "--config", str(directory)]) == 0
    assert "model tensors missing from the checkpoint" in capsys.readouterr().out


def test_failures_are_one_line_and_exit_2(llama, tmp_path, capsys):
    from lazyload.cli import main

    directory = llama
    assert "--world" in _one_line_error(capsys, main(["plan", str(directory)]))
    assert "no JSON object" in _one_line_error(capsys, main(["reshard", str(directory), str(tmp_path / "o"),
                                                             "--world", "2", "--plan", "{oops"]))
    # A config with another MLP width: the many-line ShapeMismatchError, on one line.
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    err = _one_line_error(capsys, main(["reshard", str(directory), str(tmp_path / "o"), "--world", "2",
                                        "--config", str(tmp_path)]))
    assert "differ in shape" in err and "mlp.up_proj.weight" in err and not (tmp_path / "o").exists()


def _init_fails(self, module):
    raise RuntimeError("this init needs real weights")


def _init_computes_nothing(self, module):
    pass


@pytest.mark.parametrize("init", [_init_fails, _init_computes_nothing])
def test_plan_refuses_meta_buffers_as_load_into_does(llama, capsys, monkeypatch, init):
    """A preview runs what the load computes before reading (the rotary `inv_freq` on meta,
    computed by the model's `_init_weights`): an init that fails, or that leaves the buffer
    unset, fails `lazyload plan` with load_into's own MetaBufferError."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
    from lazyload import LazyCheckpoint, MetaBufferError
    from lazyload.cli import main
    from lazyload.stored import meta_model

    directory = llama
    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", init)
    model = meta_model(AutoConfig.from_pretrained(directory))  # the model `lazyload plan` builds
    with pytest.raises(MetaBufferError) as e:
        LazyCheckpoint(str(directory)).load_into(model, strict=False, missing="keep", progress=False)
    assert all(p.is_meta for p in model.parameters()) and model.model.rotary_emb.inv_freq.is_meta
    capsys.readouterr()
    err = _one_line_error(capsys, main(["plan", str(directory), "--world", "2"]))
    assert err.strip() == f"lazyload: error: {e.value}", (err, str(e.value))


def test_inspect_into_a_closed_pipe_prints_no_traceback(checkpoint):
    directory, _ = checkpoint("llama")
    child = subprocess.Popen([sys.executable, "-m", "lazyload.cli", "inspect", str(directory)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # as `| head` does once it has its lines; long before the child prints
    err = child.stderr.read().decode()
    assert child.wait() == 0 and err == "", err


def test_plan_names_the_default_moe_split_and_each_rank_reads_its_experts(checkpoint, capsys):
    """`lazyload plan` plans as load_into does: a Mixtral whose TP plan leaves the experts
    whole (transformers 5.25) gets whole experts per rank, and says so; each rank reads
    about half the checkpoint, not all of its experts."""
    from checkpoints import default_experts

    from lazyload.cli import main

    directory, config = checkpoint("mixtral")
    assert main(["plan", str(directory), "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{directory}: world 2 ({default_experts(config)} plan)" in out.splitlines()
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    total = tensor_bytes(shard_files(directory))
    assert len(rows) == 2 and all(int(row[1].replace(",", "")) < 0.6 * total for row in rows), (rows, total)
