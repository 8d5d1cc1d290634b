"""`lazyload reshard` / save_sharded never damage their source, never silently replace an
existing checkpoint, and never leave a half-written one: refused outputs are refused before
a byte is written, and a write that fails leaves nothing that looks like a checkpoint."""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from checkpoints import shard_files
from lazyload import LazyCheckpoint, OutputError, ReadError, save_sharded
from lazyload.cli import main


def _hashes(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def source(checkpoint, tmp_path, capsys):
    """A private copy (real bytes, no hard links) of a small sharded checkpoint."""
    directory, _ = checkpoint("llama")
    capsys.readouterr()  # what writing it printed
    return shutil.copytree(directory, tmp_path / "src")


@pytest.mark.parametrize("where", ["itself", "symlink", "inside", "parent"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_reshard_into_its_source_is_refused_and_changes_nothing(source, tmp_path, capsys, where, overwrite):
    out = {"itself": source, "inside": source / "tp2", "parent": tmp_path}.get(where)
    if where == "symlink":
        out = tmp_path / "link"
        out.symlink_to(source, target_is_directory=True)
    before, listing = _hashes(source), sorted(os.listdir(tmp_path))
    code = main(["reshard", str(source), str(out), "--world", "2"] + (["--overwrite"] if overwrite else []))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "source checkpoint" in err, err
    assert _hashes(source) == before and sorted(os.listdir(tmp_path)) == listing
    with pytest.raises(OutputError, match="source checkpoint"):
        save_sharded(LazyCheckpoint(str(source)), out, 2, config=str(source), overwrite=overwrite)
    assert _hashes(source) == before


def test_an_output_that_holds_a_checkpoint_is_refused_unless_overwrite(source, tmp_path, capsys):
    out = tmp_path / "tp2"
    save_sharded(str(source), out, 2)
    written = _hashes(out)
    assert main(["reshard", str(source), str(out), "--world", "4"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "already holds" in err and "--overwrite" in err, err
    with pytest.raises(OutputError, match="overwrite=True"):
        save_sharded(str(source), out, 4)
    assert _hashes(out) == written
    assert main(["reshard", str(source), str(out), "--world", "4", "--overwrite"]) == 0
    assert [p.name for p in out.glob("rank-*")] and all("-of-00004" in p.name for p in out.glob("rank-*"))
    assert sorted(os.listdir(tmp_path)) == ["src", "tp2"]  # no staging or replaced directory left behind
    (tmp_path / "empty").mkdir()
    save_sharded(str(source), tmp_path / "empty", 2)  # an empty directory is a fine destination
    assert (tmp_path / "empty" / "lazyload_sharded.json").is_file()


@pytest.mark.parametrize("existing", [None, "empty", "checkpoint"])
def test_a_write_that_fails_midway_leaves_no_checkpoint(source, tmp_path, existing):
    out = tmp_path / "tp2"
    if existing == "empty":
        out.mkdir()
    elif existing == "checkpoint":
        save_sharded(str(source), out, 2)
    before = _hashes(out) if out.exists() else None
    ckpt = LazyCheckpoint(str(source))
    ckpt.index  # headers read; then the last shard loses its tail, as a failing disk or copy would
    last = shard_files(source)[-1]
    os.truncate(last, last.stat().st_size - 8)
    with pytest.raises(ReadError):  # one file per layer: several rank files complete before it fails
        save_sharded(ckpt, out, 2, config=str(source), max_file_bytes=1,
                     **({"overwrite": True} if existing == "checkpoint" else {}))
    assert (_hashes(out) if out.exists() else None) == before
    assert before is None or existing == "checkpoint" or not os.listdir(out)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and source not in p.parents]
    assert leftovers == [p for p in out.rglob("*") if p.is_file()]
    assert sorted(os.listdir(tmp_path)) == sorted(["src"] + (["tp2"] if existing else []))


def test_resharded_copy_written_through_staging_loads(source, tmp_path):
    out = tmp_path / "nested" / "tp2"  # parents are made, as before
    path = save_sharded(str(source), out, 2)
    assert path == os.path.join(out, "lazyload_sharded.json") and (out / "config.json").is_file()
    ckpt = LazyCheckpoint(str(out))
    want = LazyCheckpoint(str(source))
    assert sorted(ckpt.index.names()) == sorted(want.index.names())
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
