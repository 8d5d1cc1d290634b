"""Faults during a load: a read failing at the k-th read, files truncated, removed, replaced
or unreadable after indexing, and ranks of a torch.distributed job failing. Each is a
clear LazyLoadError (never a crash or a hang), and the model is as the error says: targets
`loaded` assigned, the others left as they were (on meta, or a real model's values).

Loads that could die of SIGBUS (a mapping of a truncated file) run in a subprocess, so that
a signal shows as a failed test instead of killing pytest; distributed jobs run under a
hard deadline, so that a hang fails instead of hanging CI."""
from __future__ import annotations

import errno
import itertools
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from checkpoints import build_model, model_snapshot, shard_files
from gloo import end_rank, spawn_collecting

READERS = ["pread", "mmap"]
K = 3  # the read that fails


def private_copy(src, dst) -> Path:
    """A real copy (not hard links): these tests truncate and chmod the files."""
    shutil.copytree(src, dst)
    return Path(dst)


def load(directory, model, **kwargs):
    from lazyload import LazyCheckpoint

    return LazyCheckpoint(str(directory)).load_into(model, progress=False, **kwargs)


def every_read(monkeypatch, reader: str, action, name: str | None = None) -> None:
    """Make each read of the reader call `action(item)` first (under a lock: one at a
    time); `name`: the reader method hooked (default its read)."""
    from lazyload.readers import MmapReader, PreadReader

    cls = PreadReader if reader == "pread" else MmapReader
    name = name or ("read_into" if reader == "pread" else "read")
    original = getattr(cls, name)
    lock = threading.Lock()

    def hooked(self, item, *args):
        with lock:
            action(item)
        return original(self, item, *args)

    monkeypatch.setattr(cls, name, hooked)


def fail_at(monkeypatch, reader: str, k: int, action) -> None:
    """Make the reader's k-th read (counted over all threads) call `action(item)` first."""
    count = itertools.count(1)
    every_read(monkeypatch, reader, lambda item: action(item) if next(count) == k else None)


def raise_eio(item):
    raise OSError(errno.EIO, os.strerror(errno.EIO), item.entry.file)


def assert_as_reported(model, error, loaded_values: dict[str, torch.Tensor], before: dict[str, torch.Tensor]):
    """Every target is in `loaded` or `not_loaded`; loaded ones hold the checkpoint's values;
    not loaded ones stay on meta (`before` empty) or keep their previous values, except
    those listed as partly written (a real model's tensors filled in place)."""
    state = dict(model.named_parameters())
    assert error.loaded and error.not_loaded, "the fault should fall in the middle of the load"
    assert sorted(error.loaded + error.not_loaded) == sorted(loaded_values)
    assert set(error.partly_written) <= set(error.not_loaded)
    for name in error.loaded:
        assert torch.equal(state[name].detach(), loaded_values[name]), f"{name}: listed as loaded, values differ"
    for name in error.not_loaded:
        if not before:
            assert state[name].is_meta, f"{name}: not loaded, yet no longer on meta"
        elif name not in error.partly_written:
            assert torch.equal(state[name].detach(), before[name]), f"{name}: not loaded, yet changed"
    msg = str(error)
    assert "not loaded" in msg.lower() or "were not" in msg


@pytest.fixture
def llama(checkpoint):
    directory, config = checkpoint("llama")
    assert len(shard_files(directory)) > 1
    return directory, config


def full_load(directory, config, **kwargs) -> dict[str, torch.Tensor]:
    model = build_model("llama", config, torch.float32)
    load(directory, model, **kwargs)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reader", READERS)
def test_read_fault_at_kth_read_meta_model(llama, reader, monkeypatch):
    """EIO at the k-th read: a ReadError naming the file and tensor; what was fully read is
    assigned, the rest stays on meta; nothing half written looks loaded."""
    from lazyload import ReadError

    directory, config = llama
    kwargs = dict(reader=reader, dtype=torch.bfloat16)  # a cast: every target copied, none mapped
    expected = full_load(directory, config, **kwargs)
    failed_item = []
    fail_at(monkeypatch, reader, K, lambda item: (failed_item.append(item), raise_eio(item)))
    model = build_model("llama", config, torch.float32)
    with pytest.raises(ReadError) as e:
        load(directory, model, **kwargs)
    item = failed_item[0]
    msg = str(e.value)
    assert item.entry.file in msg and repr(item.entry.key) in msg and os.strerror(errno.EIO) in msg, msg
    assert item.target in e.value.not_loaded
    assert not e.value.partly_written  # fresh destinations: nothing of the model was written
    assert_as_reported(model, e.value, expected, {})


def test_read_fault_real_model_in_place(llama, monkeypatch):
    """A real model filled in place (same dtype: the pread reader reads straight into its
    tensors): targets not reached keep their values; the one being written when the read
    failed is listed as partly written, in the error and its message."""
    from lazyload import ReadError

    directory, config = llama
    expected = full_load(directory, config, reader="pread")
    model = build_model("llama", config, torch.float32, empty=None)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    failed_item = []
    fail_at(monkeypatch, "pread", K, lambda item: (failed_item.append(item), raise_eio(item)))
    with pytest.raises(ReadError) as e:
        load(directory, model, reader="pread")
    target = failed_item[0].target
    assert target in e.value.partly_written and target in str(e.value)
    assert "Partly written" in str(e.value)
    assert_as_reported(model, e.value, expected, before)


def test_read_fault_in_a_quantized_load_leaves_the_model_as_it_was(llama, monkeypatch):
    """A load that swaps in quantized layers and fails at a read puts the model back: the
    same modules and meta parameters; nothing is listed as loaded."""
    from lazyload import ReadError

    directory, config = llama
    model = build_model("llama", config, torch.float32)
    before = model_snapshot(model)
    fail_at(monkeypatch, "pread", K, raise_eio)
    with pytest.raises(ReadError) as e:
        load(directory, model, reader="pread", quantize="int8")
    assert not e.value.loaded and e.value.not_loaded and "None is kept" in str(e.value), str(e.value)
    assert model_snapshot(model) == before, "the failed load left quantized layers in the model"


# --- files truncated during the load (in a subprocess: SIGBUS would be a signal exit) ---

def _truncate_during_load(say, reader: str, directory: str, dtype: str, method: str = "") -> None:
    """Subprocess body: truncate the file of the k-th read to its header, just before that
    read; print what came out of the load."""
    import lazyload.engine
    from checkpoints import read_header
    from lazyload import ReadError
    from transformers import AutoConfig

    from _pytest.monkeypatch import MonkeyPatch

    patch = MonkeyPatch()
    # One worker: no other thread is copying from the file at the moment it shrinks (that
    # window, during one item's copy, is the one the mmap reader cannot close).
    patch.setattr(lazyload.engine, "_workers", lambda reader: 1)

    seen = set()

    def truncate(item):  # at the first read of a file already read from: open, and mapped (mmap)
        if item.entry.file in seen and not done:
            n, _ = read_header(item.entry.file)
            os.truncate(item.entry.file, 8 + n)
            done.append(item)
        seen.add(item.entry.file)

    done = []
    if method == "populate":  # as on cold storage: mapped targets are paged in by the schedule
        patch.setattr("lazyload.readers.choice.resident_fraction", lambda items: 0.0)
    if method == "warm":  # warm pages: mapped targets need no read; the file shrinks before the run
        import lazyload.executor

        run_schedule = lazyload.executor.run_schedule

        def shrink_first(*args, **kwargs):  # the files are mapped by now (the views are made)
            shard = str(shard_files(directory)[0])
            os.truncate(shard, 8 + read_header(shard)[0])
            return run_schedule(*args, **kwargs)

        patch.setattr(lazyload.executor, "run_schedule", shrink_first)
        patch.setattr("lazyload.readers.choice.resident_fraction", lambda items: 1.0)
    else:
        every_read(patch, reader, truncate, method or None)
    config = AutoConfig.from_pretrained(directory)
    model = build_model("llama", config, torch.float32)
    try:
        load(directory, model, reader=reader, dtype=getattr(torch, dtype))
    except ReadError as exc:
        say("READERROR", exc)
        say("LOADED", len(exc.loaded), "NOT_LOADED", len(exc.not_loaded))
        state = dict(model.named_parameters())
        say("META", bool(exc.not_loaded) and all(state[n].is_meta for n in exc.not_loaded))
        return
    finally:
        patch.undo()
    say("LOADED WITHOUT ERROR")


def run_here(*args: str, prefix: list[str] = ()) -> subprocess.CompletedProcess:
    """This file as a script (see the end), in a subprocess; `prefix`: a command wrapping it."""
    return subprocess.run([*prefix, sys.executable, __file__, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


SCENARIOS = {  # name -> (subprocess function, its arguments after the checkpoint copy)
    "truncate-pread": ("truncate", "pread", "float32"),
    "truncate-mmap": ("truncate", "mmap", "bfloat16"),  # a cast: every target copied
    "truncate-mapped": ("truncate", "mmap", "float32", "populate"),  # targets are views of the file
    "truncate-warm-views": ("truncate", "mmap", "float32", "warm"),  # views of cached pages, no read at all
    "permission": ("permission",),
}


@pytest.fixture(scope="module")
def scenarios(checkpoint, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Every scenario in one subprocess (importing torch and transformers once), each on a
    private copy of the checkpoint: name -> (its output, the subprocess's stderr). As root
    the subprocess runs without the capabilities that bypass file permissions (so that a
    file without read permission is EACCES to it too)."""
    base = tmp_path_factory.mktemp("faults")
    args = []
    for name in SCENARIOS:
        args += [name, str(private_copy(checkpoint("llama")[0], base / name))]
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without util-linux setpriv: cannot drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search"
        prefix = [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}"]
    done = run_here(*args, prefix=prefix)
    if done.returncode != 0:  # SIGBUS shows here as -7: the scenarios that ran before still count
        print(done.stderr[-3000:])
    outputs = {name: "" for name in SCENARIOS}
    for line in done.stdout.splitlines():
        name, _, text = line.partition(" ")
        outputs[name] += text + "\n"
    return {name: (out, f"exit {done.returncode}: {done.stderr[-3000:]}") for name, out in outputs.items()}


@pytest.mark.parametrize("name", ["truncate-pread", "truncate-mmap"])
def test_file_truncated_during_load(scenarios, name):
    """A file truncated (to its header) just before a read from it, once open (and mapped,
    mmap): a ReadError, not a short tensor or a SIGBUS; what was read before is loaded."""
    out, err = scenarios[name]
    assert "READERROR" in out, out + err
    assert "truncated" in out or "changed since it was indexed" in out, out
    assert "LOADED 0 " not in out, out  # a file already read from: what came from it is loaded


@pytest.mark.parametrize("name", ["truncate-mapped", "truncate-warm-views"])
def test_mapped_views_of_a_truncated_file(scenarios, name):
    """Mapped targets (same dtype on CPU: views of the file), paged in after the file shrank
    (cold) or only checked at the end (warm): a ReadError, and the views are not assigned
    (a model holding them would be SIGBUS on its first forward)."""
    out, err = scenarios[name]
    assert "READERROR" in out and "changed since it was indexed" in out, out + err
    assert "META True" in out, out


def test_populate_read_reports_pages_beyond_end_of_file(tmp_path):
    """The kernel fact the mmap reader relies on: MADV_POPULATE_READ over pages beyond the
    end of a file that shrank is EFAULT, not SIGBUS."""
    import ctypes

    from lazyload.system import MADV_POPULATE_READ, PAGE, madvise_checked

    path = tmp_path / "f"
    path.write_bytes(b"x" * 4 * PAGE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 4 * PAGE, access=mmap.ACCESS_COPY) as mapping:
        first = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(first)
        whole = madvise_checked(address, 4 * PAGE, MADV_POPULATE_READ)
        os.truncate(path, PAGE)
        beyond = madvise_checked(address, 4 * PAGE, MADV_POPULATE_READ)
        within = madvise_checked(address, PAGE, MADV_POPULATE_READ)
        del first  # no buffer export may outlive the mapping
    if whole == errno.EINVAL:
        pytest.skip("kernel older than 5.14: no MADV_POPULATE_READ (the size check alone protects)")
    assert (whole, beyond, within) == (0, errno.EFAULT, 0)


# --- files removed, replaced, modified, unreadable after indexing ---

@pytest.mark.parametrize("reader", READERS)
def test_file_removed_after_indexing(llama, tmp_path, reader):
    from lazyload import LazyCheckpoint, ReadError

    directory, config = llama
    directory = private_copy(directory, tmp_path / "ckpt")
    ckpt = LazyCheckpoint(str(directory))
    ckpt.keys()
    gone = shard_files(directory)[-1]
    os.remove(gone)
    model = build_model("llama", config, torch.float32)
    with pytest.raises(ReadError, match="No such file") as e:
        ckpt.load_into(model, reader=reader, progress=False)
    assert str(gone) in str(e.value)
    state = dict(model.named_parameters())
    assert all(state[n].is_meta for n in e.value.not_loaded)
    assert all(not state[n].is_meta for n in e.value.loaded)


@pytest.mark.parametrize("change", ["replaced", "grown", "touched"])
@pytest.mark.parametrize("reader", READERS)
def test_file_changed_after_indexing(llama, tmp_path, reader, change):
    """Size, inode and mtime are checked when a file is opened: any change is a ReadError
    telling to re-run, before a byte of that file is read."""
    from lazyload import LazyCheckpoint, ReadError

    directory, config = llama
    directory = private_copy(directory, tmp_path / "ckpt")
    ckpt = LazyCheckpoint(str(directory))
    ckpt.keys()
    shard = shard_files(directory)[0]
    if change == "replaced":  # same bytes, another file (a copy renamed over it)
        shutil.copy2(shard, tmp_path / "new")
        os.replace(tmp_path / "new", shard)
    elif change == "grown":
        with open(shard, "ab") as f:
            f.write(b"\0" * 16)
    else:
        stat = os.stat(shard)
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    model = build_model("llama", config, torch.float32)
    with pytest.raises(ReadError, match="changed since it was indexed") as e:
        ckpt.load_into(model, reader=reader, progress=False)
    assert str(shard) in str(e.value) and "re-run" in str(e.value)
    state = dict(model.named_parameters())
    assert all(state[n].is_meta for n in e.value.not_loaded)


def _permission_denied(say, directory: str) -> None:
    """Subprocess body (as an unprivileged user): index, lose read permission, load."""
    from lazyload import LazyCheckpoint, ReadError
    from transformers import AutoConfig

    ckpt = LazyCheckpoint(directory)
    ckpt.keys()
    shard = shard_files(directory)[0]
    os.chmod(shard, 0)
    model = build_model("llama", AutoConfig.from_pretrained(directory), torch.float32)
    try:
        ckpt.load_into(model, reader="pread", progress=False)
    except ReadError as exc:
        meta = all(p.is_meta for n, p in model.named_parameters() if n in exc.not_loaded)
        say("READERROR", exc, "META", meta)
        return
    say("LOADED WITHOUT ERROR")


def test_permission_denied(scenarios):
    """EACCES on open, after indexing: a ReadError naming the file; the model as it says."""
    out, err = scenarios["permission"]
    assert "READERROR" in out and "Permission denied" in out and "META True" in out, out + err
    assert "model-00001-of-" in out, out


# --- failing ranks under torch.distributed (gloo) ---

def _expect_failure(rank, world, failing, run, mine_type, rank_timeout=60.0):
    """On the failing rank `run()` raises `mine_type`; every other rank gets a
    RankFailedError naming the failing rank and its error, and its model is not made
    runnable (still on meta)."""
    from lazyload import RankFailedError

    try:
        model = run(rank_timeout)
    except RankFailedError as exc:
        assert rank != failing, f"rank {rank}: RankFailedError on the failing rank itself: {exc}"
        assert failing in exc.ranks and f"rank {failing}" in str(exc), str(exc)
        assert exc.ranks[failing].startswith(mine_type.__name__), exc.ranks  # its own error, by type
        return exc
    except mine_type as exc:
        assert rank == failing, f"rank {rank}: {type(exc).__name__} on a rank that should not fail: {exc}"
        return exc
    raise AssertionError(f"rank {rank}: the load succeeded (model {type(model).__name__}) though rank {failing} failed")


def _dist_cases(rank, world, directory, corrupt, faulty):
    import torch.distributed as dist
    from lazyload import CheckpointError, LazyCheckpoint, RankFailedError, ReadError
    from lazyload.readers import PreadReader
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    last = world - 1

    def load_meta(path, **kwargs):
        def run(rank_timeout):
            model = build_model("llama", config, torch.float32)
            LazyCheckpoint(path).load_into(model, rank, world, progress=False, rank_timeout=rank_timeout, **kwargs)
            return model
        return run

    # One rank's file is corrupt: found while planning, before any rank changes its model.
    exc = _expect_failure(rank, world, 1, load_meta(corrupt if rank == 1 else directory), CheckpointError)
    if rank != 1:
        assert "'planned'" in str(exc) and "CheckpointError" in str(exc)
    dist.barrier()

    # Rank `faulty` fails mid-load (EIO at its 3rd read): the others have read everything,
    # and stop before making their models runnable.
    original = PreadReader.read_into

    def failing_read(self, item, out, _count=itertools.count(1)):
        if next(_count) == K:
            raise_eio(item)
        return original(self, item, out)

    if rank == faulty:
        PreadReader.read_into = failing_read
    models, before = [], []

    def run(rank_timeout):
        model = build_model("llama", config, torch.float32)
        models.append(model)
        before.append(model_snapshot(model))
        LazyCheckpoint(directory).load_into(model, rank, world, progress=False, reader="pread",
                                            rank_timeout=rank_timeout)
        return model

    try:
        exc = _expect_failure(rank, world, faulty, run, ReadError)
    finally:
        PreadReader.read_into = original
    if rank != faulty:
        assert "'read'" in str(exc) and "ReadError" in str(exc) and os.strerror(errno.EIO) in str(exc), str(exc)
    else:  # the model is put back whole: nothing of it counts as loaded
        assert not exc.loaded and exc.not_loaded and "None is kept" in str(exc), str(exc)
    # on every rank the model is as it was: not made parallel, every parameter the same meta one
    assert model_snapshot(models[0]) == before[0], f"rank {rank}: the failed load left the model changed"
    dist.barrier()

    # A rank that never reports (it did not call load_into): the others give up after
    # rank_timeout and name it. Last: from here on the ranks' load counts differ.
    if rank != last:
        started = time.monotonic()
        with pytest.raises(RankFailedError, match=f"rank {last}: did not report within 2 s") as e:
            load_meta(directory)(2.0)
        assert last in e.value.ranks and time.monotonic() - started < 60
    dist.barrier()


def _dist_worker(rank, world, init_file, directory, corrupt, faulty, errors):
    import torch.distributed as dist

    os.environ["LAZYLOAD_PROGRESS"] = "0"
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _dist_cases(rank, world, directory, corrupt, faulty)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        dist.destroy_process_group()
        raise
    end_rank()


DEADLINE = 240  # seconds for a whole job: a hang fails the test instead of hanging CI


def _spawn(world, directory, corrupt, faulty, tmp_path):
    """The job; a rank that hangs fails the test within DEADLINE, with every rank's stacks."""
    spawn_collecting(_dist_worker, (world, str(tmp_path / "pg"), str(directory), str(corrupt), faulty), world,
                     timeout=DEADLINE)


def corrupt_copy(directory, dst) -> Path:
    """The checkpoint with its first shard's header length garbled."""
    dst = private_copy(directory, dst)
    with open(shard_files(dst)[0], "r+b") as f:
        f.write((2**40).to_bytes(8, "little"))
    return dst


@pytest.mark.parametrize("world,faulty", [
    (2, 0),  # the rank failing mid-load hosts the store: it must outlive the others' reads
    (4, 3),  # a middle rank corrupt, the last one failing mid-load
])
def test_failing_rank_reaches_every_rank(llama, tmp_path, world, faulty):
    """Rank 1's file is corrupt; then rank `faulty` fails mid-load; then the last rank
    never calls load_into: every other rank raises RankFailedError naming it, in bounded
    time, and no model is made runnable."""
    directory = llama[0]
    _spawn(world, directory, corrupt_copy(directory, tmp_path / "corrupt"), faulty, tmp_path)


if __name__ == "__main__":  # the scenarios: name directory name directory ...
    for name, directory in zip(sys.argv[1::2], sys.argv[2::2]):
        kind, *rest = SCENARIOS[name]

        def say(*words, _name=name):  # each output line starts with its scenario's name
            print(_name, *(str(w).replace("\n", " ") for w in words), flush=True)

        if kind == "truncate":
            _truncate_during_load(say, rest[0], directory, *rest[1:])
        else:
            _permission_denied(say, directory)
