"""Hostile torch.save zips and pickles: a torch DCP checkpoint's `.metadata` and chunks,
`.pt` files and Megatron's `common.pt`, written by `dcp.save` / `torch.save` and then edited
byte by byte here. Each is a CheckpointError naming the file while indexing, with work
bounded by the input:

- pickles whose object graph multiplies (pickle's memo and DUP: an 81-byte tuple of 2**40
  leaves), nests a million deep or puts an object at a memo index of billions are refused
  before anything unpickles them, in `.metadata`, in a chunk's `data.pkl` and in a `.pt`
  (locally and over HTTP);
- integers too long to print in a chunk's pickle, nesting that would overflow a walk;
- zips that are not torch.save's: a local header naming another record, a record outside
  the archive's directory, a record outside the chunk's bytes, broken zip64 fields;
- big-endian archives (torch.load byte-swaps them; with meta storages torch 2.13 crashes);
- chunks whose storage shares bytes (one zip named by every chunk: indexing read its
  directory once per chunk);
- `torch._inductor` named as a dtype is refused without importing it.

Cases that hang, exhaust memory or crash the process on an unguarded reader run in a
subprocess with 3 GiB of address space and a timeout, so that such a failure is a failed
test here."""
from __future__ import annotations

import io
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazyload import CheckpointError, LazyCheckpoint
from remote_servers import RangeServer

GRAPH = b")" + b"2\x86" * 40  # EMPTY_TUPLE, then (DUP, TUPLE2) x 40: 81 bytes, a tuple of 2**40 leaves
# The same through the memo (torch.load's unpickler has no DUP): put, get, TUPLE2, x 40, at
# memo index 400 (one the pickle does not use).
MEMO_GRAPH = b")" + (b"r\x90\x01\x00\x00" + b"j\x90\x01\x00\x00" + b"\x86") * 40
DEEP = b")" + b"\x85" * 1_000_000  # a million nested one-item tuples (hashing one overflows the C stack)
MEMORY = 3 << 30  # the subprocess's address space
WEIGHT, OTHER, BIAS = "hostile_weight", "hostile_other", "hostile_bias"


# ----------------------------------------------------------------------------- files


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """`dcp/`: dcp.save of two 8x8 tensors and a bias; `model.pt`: torch.save of the same."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("hostile_torch")
    state = {WEIGHT: torch.arange(64.0).reshape(8, 8), OTHER: -torch.arange(64.0).reshape(8, 8),
             BIAS: torch.arange(8.0)}
    dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
    torch.save(state, root / "model.pt")
    return root


def copy_dcp(base: Path, directory: Path) -> Path:
    shutil.copytree(base / "dcp", directory)
    return directory


def read_metadata(directory: Path):
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)


def write_metadata(directory: Path, metadata, text: str | None = None, ops: bytes = b"") -> None:
    """The metadata pickled back; `text`: the string whose pickle opcodes `ops` replace (in
    a pickle without frames, which give their lengths: the unpickler reads one without)."""
    raw = pickle.dumps(metadata, protocol=4)
    (directory / ".metadata").write_bytes(raw if text is None else with_ops(unframed(raw), text, ops))


def unframed(raw: bytes) -> bytes:
    """A protocol 4 pickle without its FRAME opcodes (each 9 bytes)."""
    frames = [pos for op, _, pos in pickletools.genops(raw) if op.name == "FRAME"]
    return b"".join(raw[a:b] for a, b in zip([0] + [pos + 9 for pos in frames], frames + [len(raw)]))


def with_ops(raw: bytes, text: str, ops: bytes) -> bytes:
    """`raw` with the one pickled string `text` (any of pickle's encodings) replaced by `ops`."""
    data = text.encode()
    forms = [b"\x8c" + bytes([len(data)]) + data, b"X" + struct.pack("<I", len(data)) + data]
    found = [(raw.find(form), form) for form in forms if raw.count(form) == 1]
    assert len(found) == 1, (text, [raw.count(form) for form in forms])
    at, form = found[0]
    return raw[:at] + ops + raw[at + len(form):]


def storage_of(metadata, fqn: str):
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


def chunk_of(directory: Path, metadata, fqn: str) -> bytes:
    info = storage_of(metadata, fqn)
    with open(directory / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def replace_chunk(directory: Path, fqn: str, raw: bytes, after: bytes = b"") -> None:
    """The chunk of `fqn` replaced by the zip `raw`, appended to its file (then `after`)."""
    metadata = read_metadata(directory)
    info = storage_of(metadata, fqn)
    with open(directory / info.relative_path, "ab") as f:
        info.offset, info.length = f.seek(0, 2), len(raw)
        f.write(raw + after)
    write_metadata(directory, metadata)


def records_of(raw: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        return [(info.filename, z.read(info)) for info in z.infolist()]


def stored_zip(records: list[tuple[str, bytes]], edit=None) -> bytes:
    """A zip of `records` laid out as torch.save lays one out: stored, each record's data
    64-byte aligned by padding its local header's extra field, the directory after them.
    `edit(name, entry)` may change a record's directory entry (a dict) before it is written."""
    out, entries = bytearray(), []
    for name, data in records:
        encoded, local = name.encode(), len(out)
        pad = -(local + 30 + len(encoded) + 4) % 64
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # torch's padding field ("FB")
        crc = zlib.crc32(data)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(data), len(data), len(encoded),
                           len(extra)) + encoded + extra + data
        entries.append({"name": encoded, "crc": crc, "compressed": len(data), "size": len(data), "local": local,
                        "extra": b"", "comment": b""})
    start = len(out)
    for (name, _), e in zip(records, entries):
        if edit is not None:
            edit(name, e)
        out += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, e["crc"], e["compressed"],
                           e["size"], len(e["name"]), len(e["extra"]), len(e["comment"]), 0, 0, 0, e["local"])
        out += e["name"] + e["extra"] + e["comment"]
    return bytes(out + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(out) - start,
                                   start, 0))


def rezipped(records: list[tuple[str, bytes]], changes: dict[str, bytes]) -> list[tuple[str, bytes]]:
    return [(name, changes.get(name.split("/", 1)[1], data)) for name, data in records]


def big_endian(records: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The archive as torch.save writes it on a big-endian machine (float32 storages)."""
    def swapped(data: bytes) -> bytes:
        return np.frombuffer(data, dtype="<i4").byteswap().tobytes()

    return [(name, b"big" if name.endswith("/byteorder") else swapped(data) if "/data/" in name else data)
            for name, data in records]


def long4(n: int) -> bytes:
    """LONG4: the integer `n` in pickle's opcodes."""
    data = n.to_bytes(n.bit_length() // 8 + 1, "little", signed=True)
    return b"\x8b" + struct.pack("<i", len(data)) + data


def index(path) -> None:
    LazyCheckpoint(str(path)).index


def refused(path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        index(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_the_unedited_files_index(base):
    """The files every case starts from are read as they are (so each refusal is the edit's)."""
    for path in (base / "dcp", base / "model.pt"):
        assert sorted(LazyCheckpoint(str(path)).keys()) == sorted([WEIGHT, OTHER, BIAS])


# ------------------------------------------------- cases an unguarded reader dies of


def metadata_path_graph(base, directory):
    """Every real `.metadata` pickles a PosixPath (its checkpoint_id): its part is the graph."""
    directory = copy_dcp(base, directory)
    metadata = read_metadata(directory)
    metadata.storage_meta.checkpoint_id = Path("hostile_path_part")
    write_metadata(directory, metadata, "hostile_path_part", GRAPH)
    return directory


def metadata_memo_index(base, directory):
    """A path part memoized at index 1.3e9 (LONG_BINPUT, 5 bytes): the C unpickler grows its
    memo array to that, zero-filled (20 GB)."""
    directory = copy_dcp(base, directory)
    metadata = read_metadata(directory)
    metadata.storage_meta.checkpoint_id = Path("hostile_path_part")
    write_metadata(directory, metadata, "hostile_path_part", b"\x8c\x01x" + b"r" + struct.pack("<I", 1_300_000_000))
    return directory


def metadata_deep_key(base, directory):
    """A tensor's fqn, a key of state_dict_metadata, is a million-deep tuple."""
    directory = copy_dcp(base, directory)
    write_metadata(directory, read_metadata(directory), BIAS, DEEP)
    return directory


def chunk_pid_graph(base, directory):
    """The chunk's data.pkl names its storage with the graph for a key."""
    directory = copy_dcp(base, directory)
    records = records_of(chunk_of(directory, read_metadata(directory), WEIGHT))
    pkl = dict(records)["archive/data.pkl"]
    replace_chunk(directory, WEIGHT, stored_zip(rezipped(records, {"data.pkl": with_ops(pkl, "0", GRAPH)})))
    return directory


def pt_graph(base, directory):
    """A `.pt` whose data.pkl names a storage with the graph for a key (torch.load hashes it)."""
    records = records_of((base / "model.pt").read_bytes())
    pkl = dict(records)["model/data.pkl"]
    directory.mkdir()
    (directory / "model.pt").write_bytes(stored_zip(rezipped(records, {"data.pkl": with_ops(pkl, "0", MEMO_GRAPH)})))
    return directory / "model.pt"


def pt_big_endian(base, directory):
    """A `.pt` as a big-endian machine saves it."""
    directory.mkdir()
    (directory / "model.pt").write_bytes(stored_zip(big_endian(records_of((base / "model.pt").read_bytes()))))
    return directory / "model.pt"


def megatron_common_big_endian(base, directory):
    """A Megatron torch_dist directory (the DCP one and Megatron's metadata.json) whose
    common.pt, read from its bytes, is big-endian."""
    directory = copy_dcp(base, directory)
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (directory / "common.pt").write_bytes(stored_zip(big_endian(records_of((base / "model.pt").read_bytes()))))
    return directory


def metadata_inductor(base, directory):
    """`.metadata` naming torch._inductor where a dtype is (getattr(torch, ...) imports it)."""
    directory = copy_dcp(base, directory)
    write_metadata(directory, read_metadata(directory), "float32", b"\x8c\x09_inductor")
    return directory


def chunk_inductor(base, directory):
    """A chunk's data.pkl naming torch._inductor where its storage class is."""
    directory = copy_dcp(base, directory)
    records = records_of(chunk_of(directory, read_metadata(directory), WEIGHT))
    pkl = dict(records)["archive/data.pkl"].replace(b"ctorch\nFloatStorage\n", b"ctorch\n_inductor\n")
    replace_chunk(directory, WEIGHT, stored_zip(rezipped(records, {"data.pkl": pkl})))
    return directory


ISOLATED = {  # case -> (how its file is made, what the refusal says); the crashing ones last
    "metadata-path-graph": (metadata_path_graph, "expand to more than"),
    "http-metadata-path-graph": (metadata_path_graph, "expand to more than"),
    "chunk-pid-graph": (chunk_pid_graph, "expand to more than"),
    "pt-graph": (pt_graph, "expand to more than"),
    "metadata-memo-index": (metadata_memo_index, "memo index 1300000000"),
    "metadata-inductor": (metadata_inductor, "names the class torch._inductor"),
    "chunk-inductor": (chunk_inductor, "names torch._inductor"),
    "metadata-deep-key": (metadata_deep_key, "nests objects more than 100 deep"),
    "pt-big-endian": (pt_big_endian, "big-endian (its byteorder record says b'big')"),
    "megatron-common-big-endian": (megatron_common_big_endian, "big-endian (its byteorder record says b'big')"),
}


@pytest.fixture(scope="module")
def isolated(base, tmp_path_factory) -> dict[str, str]:
    """Every ISOLATED case indexed in one subprocess: case -> what it printed (its error's
    type and message, and whether torch._inductor was imported by then), or how the
    subprocess ended where it printed nothing."""
    root = tmp_path_factory.mktemp("isolated")
    with RangeServer(str(root)) as server:
        args = []
        for case, (make, _) in ISOLATED.items():
            path = make(base, root / case)
            if case.startswith("http-"):
                path = f"{server.url}/{case}/"
            args += [case, str(path)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        try:
            done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=120,
                                  env=env)
            out, ended = done.stdout, f"exit {done.returncode}: {done.stderr[-2000:]}"
        except subprocess.TimeoutExpired as exc:
            out, ended = exc.stdout or "", "still running after 120 s (killed)"
    out = out.decode() if isinstance(out, bytes) else out
    printed = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    return {case: printed.get(case, f"nothing printed; the subprocess {ended}") for case in ISOLATED}


@pytest.mark.parametrize("case", list(ISOLATED))
def test_refused_without_hang_crash_or_import(isolated, case):
    outcome = isolated[case]
    assert outcome.startswith("CheckpointError: ") and ISOLATED[case][1] in outcome, outcome
    assert "torch._inductor imported" not in outcome


# ------------------------------------------------------------------ in this process


def test_integer_too_long_to_print_in_a_chunk(base, tmp_path):
    """The chunk's data.pkl gives its storage offset as a 5,000-digit integer."""
    directory = copy_dcp(base, tmp_path / "ckpt")
    records = records_of(chunk_of(directory, read_metadata(directory), WEIGHT))
    pkl = dict(records)["archive/data.pkl"]
    assert pkl.count(b"QK\x00") == 1  # BINPERSID (the storage), then the offset 0
    pkl = pkl.replace(b"QK\x00", b"Q" + long4(10 ** 5000))
    replace_chunk(directory, WEIGHT, stored_zip(rezipped(records, {"data.pkl": pkl})))
    refused(directory, WEIGHT, "__0_0.distcp", "counts below 2**63")


def test_deep_nesting_in_a_pt(base, tmp_path):
    """The state dict 3,000 dicts deep (a walk of it would be a RecursionError)."""
    records = records_of((base / "model.pt").read_bytes())
    pkl = dict(records)["model/data.pkl"]  # PROTO, the state dict, STOP
    nested = pkl[:2] + b"}X\x01\x00\x00\x00k" * 3000 + pkl[2:-1] + b"s" * 3000 + b"."  # {"k": {"k": ...}}
    (tmp_path / "model.pt").write_bytes(stored_zip(rezipped(records, {"data.pkl": nested})))
    refused(tmp_path / "model.pt", "model.pt", "nests objects more than 100 deep")


def _edit_chunk(base, tmp_path, records_edit=None, edit=None, after=b"") -> Path:
    directory = copy_dcp(base, tmp_path / "ckpt")
    records = records_of(chunk_of(directory, read_metadata(directory), WEIGHT))
    records = records_edit(records) if records_edit else records
    replace_chunk(directory, WEIGHT, stored_zip(records, edit), after)
    return directory


def _data_entry(edit):
    return lambda name, entry: edit(entry) if name == "archive/data/0" else None


@pytest.mark.parametrize("extra", [
    struct.pack("<HHI", 1, 16, 0),  # a zip64 field that says 16 bytes and holds 4
    struct.pack("<HH", 1, 0),  # one that holds no value
])
def test_broken_zip64_fields(base, tmp_path, extra):
    """The size of data/0 is 0xFFFFFFFF (in the zip64 field), which is broken."""
    directory = _edit_chunk(base, tmp_path, edit=_data_entry(lambda e: e.update(size=0xFFFFFFFF, extra=extra)))
    refused(directory, WEIGHT, "lacks the zip64 sizes")


def test_local_header_that_names_another_record(base, tmp_path):
    """data/0's directory entry points at data.pkl's local header: torch.load, too, would
    read the pickle's bytes as the tensor's."""
    def edit(name, entry):
        locals_[name] = entry["local"]
        if name == "archive/data/0":
            entry["local"] = locals_["archive/data.pkl"]

    locals_: dict[str, int] = {}
    refused(_edit_chunk(base, tmp_path, edit=edit), WEIGHT, "does not name the record 'data/0'")


def test_record_outside_the_archive_directory(base, tmp_path):
    """A second data/0 under another directory (torch.load refuses the zip)."""
    evil = ("evil/data/0", torch.full((8, 8), 7.0).numpy().tobytes())
    directory = _edit_chunk(base, tmp_path, records_edit=lambda records: records + [evil])
    refused(directory, WEIGHT, "'evil/data/0' is outside the archive's directory 'archive/'")


def test_record_outside_the_chunk(base, tmp_path):
    """data.pkl's local header lies past the chunk's end (a copy of it, in the file after)."""
    directory = copy_dcp(base, tmp_path / "ckpt")
    records = records_of(chunk_of(directory, read_metadata(directory), WEIGHT))
    size = len(stored_zip(records))

    def edit(name, entry):
        if name == "archive/data.pkl":
            entry["local"] = size

    plain = stored_zip(records)
    with zipfile.ZipFile(io.BytesIO(plain)) as z:
        info = z.getinfo("archive/data.pkl")
    copy = plain[info.header_offset:info.header_offset + 704]  # its local header, name, padding and pickle
    replace_chunk(directory, WEIGHT, stored_zip(records, edit), after=copy)
    refused(directory, WEIGHT, "local header of 'data.pkl'", "lies outside the zip")


def test_big_endian_chunk(base, tmp_path):
    """A chunk saved on a big-endian machine: dcp.load byte-swaps it to the true tensor;
    lazyload, which reads bytes as they lie, refuses it rather than load swapped values."""
    import torch.distributed.checkpoint as dcp

    directory = _edit_chunk(base, tmp_path, records_edit=big_endian)
    state = {WEIGHT: torch.zeros(8, 8)}
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    assert torch.equal(state[WEIGHT], torch.arange(64.0).reshape(8, 8))
    refused(directory, WEIGHT, "big-endian (its byteorder record says b'big')", "does not byte-swap")


def test_two_chunks_in_the_same_bytes(base, tmp_path):
    """hostile_other's storage entry names hostile_weight's bytes (same shape and dtype)."""
    directory = copy_dcp(base, tmp_path / "ckpt")
    metadata = read_metadata(directory)
    index_ = next(i for i in metadata.storage_data if i.fqn == OTHER)
    metadata.storage_data[index_] = storage_of(metadata, WEIGHT)
    write_metadata(directory, metadata)
    refused(directory, ".metadata", OTHER, WEIGHT, "overlapping bytes of '__0_0.distcp'")


# What replaces a value of `.metadata` in the fuzz: opcodes that build, share, nest and
# memoize, and the integers and strings they act on.
PALETTE = [b"2", b"\x85", b"\x86", b"\x87", b")", b"(", b"t", b"l", b"d", b"}", b"s", b"u", b"\x94", b"h\x01",
           b"r\x00\x00\x00\x40", b"0", b"1", b"a", b"e", b"b", b"R", b"\x81", b"N", b"K\x07", b"\x8c\x01x",
           GRAPH, b")" + b"\x85" * 5000, long4(10 ** 3000), long4(-1)]


@settings(max_examples=300, deadline=2000, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.lists(st.sampled_from(PALETTE), min_size=1,
                                                                              max_size=3)), min_size=1, max_size=4))
def test_fuzzed_metadata_only_raises_checkpoint_errors(base, edits):
    """`.metadata` with some of its values (strings, integers) replaced by other opcodes:
    parsed, or a CheckpointError, in bounded time."""
    from lazyload.formats.dcp_metadata import parse_metadata

    raw = unframed((base / "dcp" / ".metadata").read_bytes())
    values = [(pos, op) for op, _, pos in pickletools.genops(raw) if op.name in
              ("SHORT_BINUNICODE", "BININT1", "BININT2", "BININT", "NONE", "EMPTY_TUPLE")]
    for where, ops in sorted({int(w * len(values)): b"".join(ops) for w, ops in edits}.items(), reverse=True):
        pos, op = values[where]
        length = {"BININT1": 2, "BININT2": 3, "BININT": 5, "NONE": 1, "EMPTY_TUPLE": 1}.get(op.name, 2 + raw[pos + 1])
        raw = raw[:pos] + ops + raw[pos + length:]
    try:
        parse_metadata(raw, "fuzzed/.metadata")
    except CheckpointError:
        pass


# ------------------------------------------------------- one zip named by every chunk

COPIES = 100


def one_zip_for_every_chunk(base, directory) -> Path:
    """hostile_weight's chunk rezipped with a directory of almost 1 MiB (15 records with
    64 KiB comments), and 100 more 8x8 tensors whose storage entries all name that zip."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    directory = copy_dcp(base, directory)
    records = records_of(chunk_of(directory, read_metadata(directory), WEIGHT))
    records += [(f"archive/pad/{i}", b"") for i in range(15)]
    padded = stored_zip(records, lambda name, e: e.update(comment=b"c" * 65535) if "/pad/" in name else None)
    replace_chunk(directory, WEIGHT, padded)
    metadata = read_metadata(directory)
    info, meta = storage_of(metadata, WEIGHT), metadata.state_dict_metadata[WEIGHT]
    for i in range(COPIES):
        metadata.state_dict_metadata[f"copy{i}"] = meta
        metadata.storage_data[MetadataIndex(f"copy{i}", meta.chunks[0].offsets)] = info
    write_metadata(directory, metadata)
    return directory


def test_one_zip_for_every_chunk_is_refused_before_reading_it(base, tmp_path, monkeypatch):
    from lazyload.formats import ranges

    directory = one_zip_for_every_chunk(base, tmp_path / "ckpt")
    read, real = [], os.pread
    monkeypatch.setattr(ranges.os, "pread", lambda fd, n, offset: read.append(n) or real(fd, n, offset))
    refused(directory, ".metadata", "overlapping bytes of '__0_0.distcp'")
    assert sum(read) < 1 << 16, sum(read)  # not one directory of the zip


def test_one_zip_for_every_chunk_over_http(base, tmp_path):
    directory = one_zip_for_every_chunk(base, tmp_path / "ckpt")
    with RangeServer(str(tmp_path)) as server:
        refused(f"{server.url}/ckpt/", ".metadata", "overlapping bytes of '__0_0.distcp'")
        sent = server.served()
    assert sent < os.path.getsize(directory / ".metadata") + (1 << 16), sent


if __name__ == "__main__":  # in a subprocess: CASE PATH ...; each case prints "CASE what happened"
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    for case, path in zip(sys.argv[1::2], sys.argv[2::2]):
        try:
            index(path)
            outcome = "indexed"
        except Exception as exc:  # noqa: BLE001 (reported, whatever it is)
            outcome = f"{type(exc).__name__}: {exc}"
        imported = " | torch._inductor imported" if "torch._inductor" in sys.modules else ""
        print(case, outcome.replace("\n", " ")[:2000] + imported, flush=True)
