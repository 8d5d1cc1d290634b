"""Where the bytes of a tensor lie in a `torch.save` zip embedded in a larger file (DCP's
`.distcp` files hold one such zip per saved chunk, at the offset and length its metadata
records), found from the zip's own directory and a restricted reading of its `data.pkl`:
no tensor byte is read and no pickled code runs.

torch's zip writer stores every record uncompressed with its data 64-byte aligned from the
start of the zip (padding in the local header's extra field) and sets the data-descriptor
flag, so the local headers carry no sizes: the central directory at the end of the zip
gives each record's size and local header, and the local header of `<archive>/data/0`
where the storage's raw bytes begin. `data.pkl` names the storage's dtype and the tensor's
offset, shape and stride; its unpickler answers only the few globals a saved tensor uses
(`torch._utils._rebuild_tensor_v2`, legacy storage classes, `collections.OrderedDict`)
with stand-ins, and refuses anything else naming it.

A zip that is not torch.save's is refused, never guessed at: every read lies inside the
zip's own bytes; every record is under the one archive directory (as torch.load insists),
once; a local header must name the record the directory points there for; a `byteorder`
record other than `little` (a big-endian machine's save, which torch.load byte-swaps) is
refused, since lazyload reads bytes as they lie; `data.pkl`'s object graph is bounded
(`pickle_bounds`) before it is unpickled, and its sizes, offset and strides must be counts
below 2**63.
"""
from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass

import torch

from ..dtypes import TORCH_DTYPES
from ..errors import CheckpointError
from .pickle_bounds import problem
from .ranges import FileRanges

ALIGNMENT = 64  # torch's zip writer aligns every record's data to 64 bytes from the zip's start
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory (22 bytes; torch writes no comment)
_EOCD64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes, just before the EOCD in a zip64 archive
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes, then name, extra, comment
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes, then name, extra
# What torch (2.x) writes around a chunk's storage: data.pkl and three small records before
# it (data/0's local header and name end by byte 642, its data starts at 704), two records,
# the directory and its end after it (the last 561 bytes hold the directory, 873 no tensor
# byte): windows that read all of a chunk's structure and none of its tensor (`windows`).
HEAD = 704
TAIL = 640
_MAX_DIRECTORY = 1 << 20  # a saved tensor's zip has a handful of records
_MAX_PICKLE = 1 << 20  # data.pkl of one tensor is a few hundred bytes


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a torch.save zip: its dtype, shape and stride, and the absolute byte
    range of its elements in the file (`start` is the storage's data plus its offset)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    start: int
    end: int
    header_bytes: int  # bytes of zip structure and pickle read to find it

    @property
    def contiguous(self) -> bool:
        expected, step = [], 1
        for n in reversed(self.shape):
            expected.append(step)
            step *= n
        return all(n == 1 or s == e for n, s, e in zip(self.shape, self.stride, reversed(expected)))


def windows(base: int, length: int) -> list[tuple[int, int]]:
    """The byte ranges of the zip at [base, base + length) that `locate` reads, as torch
    lays it out: its head and its tail (a zip laid out otherwise costs a read more)."""
    return [(base, base + min(length, HEAD)), (base + max(0, length - TAIL), base + length)]


@dataclass(frozen=True)
class _Record:
    name: str  # after the archive's directory: "data.pkl", "data/0", "byteorder"
    raw_name: bytes  # as the directory has it, which its local header repeats
    method: int
    size: int
    local: int  # local header offset from the zip's start


class _Zip:
    """One torch.save zip at [base, base + length) of `src`'s file: every read checked to
    lie inside it, and counted."""

    def __init__(self, src: FileRanges, base: int, length: int):
        self.src, self.base, self.length, self.bytes_read = src, base, length, 0
        self.where = f"the torch.save zip at byte {base}"

    def read(self, offset: int, n: int, what: str) -> bytes:
        if offset < 0 or offset + n > self.length:
            raise self.error(f"its {what} (bytes {offset}..{offset + n}) lies outside the zip's {self.length} bytes; "
                             "the checkpoint is corrupt.")
        self.bytes_read += n
        return self.src.read(self.base + offset, n, f"{self.where}'s {what}")

    def error(self, text: str) -> CheckpointError:
        return CheckpointError(f"{self.src.path}: {self.where}: {text}")


def _directory(z: _Zip) -> list[_Record]:
    """The zip's central directory records, each under the one directory torch.save puts
    every record in (torch.load refuses a record outside it)."""
    if z.length < _EOCD.size:
        raise z.error(f"{z.length} bytes are too short to be a zip; the checkpoint is corrupt.")
    eocd = _EOCD.unpack(z.read(z.length - _EOCD.size, _EOCD.size, "zip directory end"))
    if eocd[0] != 0x06054B50 or eocd[7] != 0:
        raise z.error(f"it does not end with a zip directory record; its recorded length ({z.length} bytes) is wrong "
                      "or the bytes are not a torch.save zip.")
    count, size, start = eocd[4], eocd[5], eocd[6]
    if 0xFFFFFFFF in (size, start) or count == 0xFFFF:  # zip64: sizes in the zip64 end record
        locator = _EOCD64_LOCATOR.unpack(z.read(z.length - 42, 20, "zip64 directory locator"))
        record = _EOCD64.unpack(z.read(locator[2], _EOCD64.size, "zip64 directory end"))
        if locator[0] != 0x07064B50 or record[0] != 0x06064B50:
            raise z.error("it has a broken zip64 directory locator; the checkpoint is corrupt.")
        count, size, start = record[7], record[8], record[9]
    if size > _MAX_DIRECTORY:
        raise z.error(f"its zip directory is {size} bytes, far larger than a saved tensor's; the checkpoint is "
                      "corrupt.")
    records = _records(z, z.read(start, size, "zip directory"), count)
    archive = records[0].name.split("/", 1)[0] + "/" if records else ""
    names = set()
    for record in records:
        if not record.name.startswith(archive) or record.name == archive:
            raise z.error(f"its record {record.name[:100]!r} is outside the archive's directory {archive[:100]!r} "
                          "(torch.load refuses it); not a torch.save zip.")
        names.add(record.name)
    if len(names) != len(records):
        raise z.error("it has two records of one name; not a torch.save zip.")
    return [_Record(r.name.removeprefix(archive), r.raw_name, r.method, r.size, r.local) for r in records]


def _records(z: _Zip, raw: bytes, count: int) -> list[_Record]:
    out, pos = [], 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(raw):
            raise z.error("its zip directory is truncated; the checkpoint is corrupt.")
        f = _CENTRAL.unpack_from(raw, pos)
        if f[0] != 0x02014B50:
            raise z.error("its zip directory has a malformed entry; the checkpoint is corrupt.")
        name_len, extra_len, comment_len = f[10], f[11], f[12]
        raw_name = raw[pos + 46:pos + 46 + name_len]
        extra = raw[pos + 46 + name_len:pos + 46 + name_len + extra_len]
        size, local = _zip64_values(z, extra, [f[9], f[8]], f[16])
        out.append(_Record(raw_name.decode("utf-8", "replace"), raw_name, f[4], size[0], local))
        pos += 46 + name_len + extra_len + comment_len
    return out


def _zip64_values(z: _Zip, extra: bytes, sizes: list[int], local: int) -> tuple[list[int], int]:
    """(uncompressed, compressed) sizes and the local header offset, from the zip64 extra
    field for those the 32-bit fields mark as 0xFFFFFFFF."""
    wanted = [s == 0xFFFFFFFF for s in sizes] + [local == 0xFFFFFFFF]
    if not any(wanted):
        return sizes, local
    found = iter(_zip64_field(extra))
    try:
        sizes = [next(found) if want else s for want, s in zip(wanted, sizes)]
        return sizes, next(found) if wanted[2] else local
    except StopIteration:
        raise z.error("a zip directory entry lacks the zip64 sizes it calls for; the checkpoint is corrupt.") from None


def _zip64_field(extra: bytes) -> tuple[int, ...]:
    """The 8-byte values a directory entry's zip64 extra field (tag 1) holds, if any."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            return struct.unpack_from(f"<{min(length, len(extra) - pos - 4) // 8}Q", extra, pos + 4)
        pos += 4 + length
    return ()


def _data_start(z: _Zip, record: _Record) -> int:
    """Where the record's data begins, counted from the zip's start (after its local
    header, which must name the record the directory does), its data checked to lie in
    the zip."""
    f = _LOCAL.unpack(z.read(record.local, _LOCAL.size, f"local header of {record.name!r}"))
    if f[0] != 0x04034B50:
        raise z.error(f"the zip record {record.name!r} at byte {z.base + record.local} has no local header; the "
                      "checkpoint is corrupt.")
    if f[9] != len(record.raw_name) or z.read(record.local + _LOCAL.size, f[9], "record name") != record.raw_name:
        raise z.error(f"the local header at byte {z.base + record.local} does not name the record {record.name!r} "
                      "the zip directory points there for; the checkpoint is corrupt.")
    start = record.local + _LOCAL.size + f[9] + f[10]
    if start + record.size > z.length:
        raise z.error(f"the record {record.name!r} runs past the end of the zip; the checkpoint is corrupt.")
    return start


def byteorder_problem(order: bytes) -> str | None:
    """What keeps lazyload from reading an archive whose byteorder record is `order`
    (torch.save writes the machine's) as its bytes lie, or None: torch.load byte-swaps
    a big-endian archive's storages, lazyload does not."""
    if order == b"little":
        return None
    said = "big-endian" if order == b"big" else "of unknown byte order"
    return (f"it is {said} (its byteorder record says {order[:16]!r}); lazyload reads little-endian tensors as they "
            "lie and does not byte-swap")


def _check_byteorder(z: _Zip, by_name: dict[str, _Record]) -> None:
    record = by_name.get("byteorder")  # none: torch.load reads the archive as little-endian too
    order = b"little" if record is None else b"" if record.method or record.size > 16 else \
        z.read(_data_start(z, record), record.size, "byteorder record")
    why = byteorder_problem(order)
    if why:
        raise z.error(f"{why}. Load it with torch.distributed.checkpoint on this machine and save it again.")


def locate(src: FileRanges, base: int, length: int) -> StoredTensor:
    """The one tensor of the torch.save zip at [base, base + length) of `src`'s file."""
    z = _Zip(src, base, length)
    records = _directory(z)
    by_name = {r.name: r for r in records}
    pkl, data = by_name.get("data.pkl"), by_name.get("data/0")
    if pkl is None or data is None or sum(name.startswith("data/") for name in by_name) != 1:
        raise z.error(f"it is not one saved tensor (records {[r.name[:100] for r in records][:8]}); lazyload reads "
                      "chunks written by torch.distributed.checkpoint's FileSystemWriter.")
    for record in (pkl, data):
        if record.method != 0:
            raise z.error(f"record {record.name!r} is compressed (zip method {record.method}); lazyload reads "
                          "torch.save's stored (uncompressed) records. Save the checkpoint without compression.")
    if pkl.size > _MAX_PICKLE:
        raise z.error(f"its data.pkl is {pkl.size} bytes, not one tensor's.")
    _check_byteorder(z, by_name)
    tensor = _unpickle(z.read(_data_start(z, pkl), pkl.size, "data.pkl"), src.path, z.where)
    data_start = _data_start(z, data)
    if data_start % ALIGNMENT:
        raise z.error(f"its storage is not {ALIGNMENT}-byte aligned in the zip (at {data_start}); not torch.save's "
                      "layout, so lazyload does not guess where its bytes are.")
    dtype, numel, offset, shape, stride = tensor
    itemsize = dtype.itemsize
    if data.size != numel * itemsize:
        raise z.error(f"its storage record holds {data.size} bytes, but data.pkl describes {numel} elements of "
                      f"{dtype}; the checkpoint is corrupt.")
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    if offset + span > numel:
        raise z.error(f"the tensor (offset {offset}, shape {list(shape)}, stride {list(stride)}) does not lie within "
                      f"its storage of {numel} elements; corrupt.")
    start = base + data_start + offset * itemsize
    n = 1
    for d in shape:
        n *= d
    return StoredTensor(dtype, tuple(shape), tuple(stride), start, start + n * itemsize, z.bytes_read)


class _Storage:
    def __init__(self, dtype: torch.dtype, numel: int):
        self.dtype, self.numel = dtype, numel


# Legacy typed storage class names -> dtype (torch's own table, inverted); a dtype without one
# (float8, uint16) is pickled as an UntypedStorage of bytes, its dtype given to _rebuild_tensor_v3.
_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


def _rebuild(storage, offset, size, stride, *_rest):
    return ("tensor", storage, offset, tuple(size), tuple(stride))


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, *_rest):
    if isinstance(storage, _Storage) and storage.dtype == torch.uint8 and isinstance(dtype, torch.dtype):
        storage = _Storage(dtype, storage.numel // dtype.itemsize if dtype.itemsize else -1)
    return ("tensor", storage, offset, tuple(size), tuple(stride))


def _count(value) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, raw: bytes, path: str, where: str):
        super().__init__(io.BytesIO(raw))
        self.path, self.where = path, where

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return torch.uint8
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        raise CheckpointError(f"{self.path}: {self.where}: its data.pkl names {module}.{name}, which a saved tensor "
                              "does not need; lazyload does not run pickled code. The chunk is not a plain tensor.")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[2] == "0"
                and isinstance(pid[1], torch.dtype) and isinstance(pid[4], int)):
            key = pid[2] if isinstance(pid, tuple) and len(pid) > 2 and isinstance(pid[2], str) else "not a name"
            raise CheckpointError(f"{self.path}: {self.where}: its data.pkl refers to a storage other than "
                                  f"'data/0' ({key[:100]!r}); not one saved tensor.")
        return _Storage(pid[1], pid[4])


def _unpickle(raw: bytes, path: str, where: str) -> tuple:
    """(dtype, storage elements, storage offset, shape, stride) of the pickled tensor."""
    why = problem(raw)
    if why:
        raise CheckpointError(f"{path}: {where}: its data.pkl is not one tensor's: {why}; corrupt.")
    try:
        obj = _TensorUnpickler(raw, path, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # any malformed pickle
        raise CheckpointError(f"{path}: {where}: its data.pkl cannot be read ({str(exc)[:200]}); corrupt.") from None
    ok = (isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "tensor" and isinstance(obj[1], _Storage)
          and len(obj[3]) == len(obj[4]) and all(map(_count, (obj[1].numel, obj[2], *obj[3], *obj[4]))))
    if not ok:
        raise CheckpointError(f"{path}: {where}: its data.pkl does not hold one tensor (with sizes, offset and "
                              "strides that are counts below 2**63); the chunk is not a saved tensor.")
    storage = obj[1]
    return storage.dtype, storage.numel, obj[2], obj[3], obj[4]
