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
"""
from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .ranges import FileRanges

ALIGNMENT = 64  # torch's zip writer aligns every record's data to 64 bytes from the zip's start
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory (22 bytes; torch writes no comment)
_EOCD64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes, just before the EOCD in a zip64 archive
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes, then name, extra, comment
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes, then name, extra
# What torch (2.x) writes around a chunk's storage: data.pkl and three small records before
# it (data/0's local header ends by byte 640, its data starts at 704), two records, the
# directory and its end after it (the last 561 bytes hold the directory, 873 no tensor byte):
# windows that read all of a chunk's structure and none of its tensor (`windows`).
HEAD = 640
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
    name: str
    method: int
    size: int
    local: int  # local header offset from the zip's start


def _directory(src: FileRanges, base: int, length: int) -> tuple[list[_Record], int]:
    """The zip's central directory records, and the bytes read to find them."""
    path, where = src.path, f"the torch.save zip at byte {base}"
    if length < _EOCD.size:
        raise CheckpointError(f"{path}: {where} is {length} bytes, too short to be a zip; the checkpoint is corrupt.")
    eocd = _EOCD.unpack(src.read(base + length - _EOCD.size, _EOCD.size, where))
    if eocd[0] != 0x06054B50 or eocd[7] != 0:
        raise CheckpointError(f"{path}: {where} does not end with a zip directory record; its recorded length "
                              f"({length} bytes) is wrong or the bytes are not a torch.save zip.")
    count, size, start, read = eocd[4], eocd[5], eocd[6], _EOCD.size
    if 0xFFFFFFFF in (size, start) or count == 0xFFFF:  # zip64: sizes in the zip64 end record
        locator = _EOCD64_LOCATOR.unpack(src.read(base + length - 42, 20, where))
        if locator[0] != 0x07064B50 or locator[2] + _EOCD64.size > length:
            raise CheckpointError(f"{path}: {where} has a broken zip64 directory locator; the checkpoint is corrupt.")
        record = _EOCD64.unpack(src.read(base + locator[2], _EOCD64.size, where))
        count, size, start, read = record[7], record[8], record[9], read + 20 + _EOCD64.size
    if size > _MAX_DIRECTORY or start + size > length:
        raise CheckpointError(f"{path}: {where} has a zip directory of {size} bytes at {start}, outside the zip "
                              "or far larger than a saved tensor's; the checkpoint is corrupt.")
    raw = src.read(base + start, size, where)
    return _records(raw, count, path, where), read + size


def _records(raw: bytes, count: int, path: str, where: str) -> list[_Record]:
    out, pos = [], 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(raw):
            raise CheckpointError(f"{path}: {where} has a truncated zip directory; the checkpoint is corrupt.")
        f = _CENTRAL.unpack_from(raw, pos)
        if f[0] != 0x02014B50:
            raise CheckpointError(f"{path}: {where} has a malformed zip directory entry; the checkpoint is corrupt.")
        name_len, extra_len, comment_len = f[10], f[11], f[12]
        name = raw[pos + 46:pos + 46 + name_len].decode("utf-8", "replace")
        extra = raw[pos + 46 + name_len:pos + 46 + name_len + extra_len]
        size, local = _zip64_values(extra, [f[9], f[8]], f[16])
        out.append(_Record(name, f[4], size[0], local))
        pos += 46 + name_len + extra_len + comment_len
    return out


def _zip64_values(extra: bytes, sizes: list[int], local: int) -> tuple[list[int], int]:
    """(uncompressed, compressed) sizes and the local header offset, from the zip64 extra
    field for those the 32-bit fields mark as 0xFFFFFFFF."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4))
            sizes = [next(values) if s == 0xFFFFFFFF else s for s in sizes]
            local = next(values) if local == 0xFFFFFFFF else local
            break
        pos += 4 + length
    return sizes, local


def _data_start(src: FileRanges, base: int, record: _Record) -> int:
    """Where the record's data begins, counted from the zip's start (after its local header)."""
    f = _LOCAL.unpack(src.read(base + record.local, _LOCAL.size, f"the zip record {record.name}"))
    if f[0] != 0x04034B50:
        raise CheckpointError(f"{src.path}: the zip record {record.name!r} at byte {base + record.local} has no local "
                              "header; the checkpoint is corrupt.")
    return record.local + _LOCAL.size + f[9] + f[10]


def locate(src: FileRanges, base: int, length: int) -> StoredTensor:
    """The one tensor of the torch.save zip at [base, base + length) of `src`'s file."""
    path = src.path
    records, read = _directory(src, base, length)
    by_name = {r.name.split("/", 1)[-1]: r for r in records}  # "<archive>/data.pkl" -> "data.pkl"
    pkl, data = by_name.get("data.pkl"), by_name.get("data/0")
    where = f"the torch.save zip at byte {base}"
    if pkl is None or data is None or sum(name.startswith("data/") for name in by_name) != 1:
        raise CheckpointError(f"{path}: {where} is not one saved tensor (records {[r.name for r in records][:8]}); "
                              "lazyload reads chunks written by torch.distributed.checkpoint's FileSystemWriter.")
    for record in (pkl, data):
        if record.method != 0:
            raise CheckpointError(f"{path}: {where}: record {record.name!r} is compressed (zip method "
                                  f"{record.method}); lazyload reads torch.save's stored (uncompressed) records. "
                                  "Save the checkpoint without compression.")
    if pkl.size > _MAX_PICKLE:
        raise CheckpointError(f"{path}: {where}: its data.pkl is {pkl.size} bytes, not one tensor's.")
    pkl_start = _data_start(src, base, pkl)
    tensor = _unpickle(src.read(base + pkl_start, pkl.size, where), path, where)
    data_start = _data_start(src, base, data)
    if data_start % ALIGNMENT:
        raise CheckpointError(f"{path}: {where}: its storage is not {ALIGNMENT}-byte aligned in the zip (at "
                              f"{data_start}); not torch.save's layout, so lazyload does not guess where its bytes are.")
    dtype, numel, offset, shape, stride = tensor
    itemsize = dtype.itemsize
    if data.size != numel * itemsize or data_start + data.size > length:
        raise CheckpointError(f"{path}: {where}: its storage record holds {data.size} bytes, but data.pkl describes "
                              f"{numel} elements of {dtype} (or the record runs past the zip); the checkpoint is corrupt.")
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    if offset < 0 or any(s < 0 for s in stride) or offset + span > numel:
        raise CheckpointError(f"{path}: {where}: the tensor (offset {offset}, shape {list(shape)}, stride "
                              f"{list(stride)}) does not lie within its storage of {numel} elements; corrupt.")
    start = base + data_start + offset * itemsize
    n = 1
    for d in shape:
        n *= d
    header = read + 2 * _LOCAL.size + pkl.size
    return StoredTensor(dtype, tuple(shape), tuple(stride), start, start + n * itemsize, header)


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
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.path}: {self.where}: its data.pkl names {module}.{name}, which a saved tensor "
                              "does not need; lazyload does not run pickled code. The chunk is not a plain tensor.")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[2] == "0"
                and isinstance(pid[1], torch.dtype) and isinstance(pid[4], int)):
            raise CheckpointError(f"{self.path}: {self.where}: its data.pkl refers to a storage other than "
                                  f"'data/0' ({str(pid)[:100]}); not one saved tensor.")
        return _Storage(pid[1], pid[4])


def _unpickle(raw: bytes, path: str, where: str) -> tuple:
    """(dtype, storage elements, storage offset, shape, stride) of the pickled tensor."""
    try:
        obj = _TensorUnpickler(raw, path, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # any malformed pickle
        raise CheckpointError(f"{path}: {where}: its data.pkl cannot be read ({str(exc)[:200]}); corrupt.") from None
    ok = (isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "tensor" and isinstance(obj[1], _Storage)
          and isinstance(obj[2], int) and all(isinstance(v, int) for v in obj[3] + obj[4])
          and len(obj[3]) == len(obj[4]))
    if not ok:
        raise CheckpointError(f"{path}: {where}: its data.pkl does not hold one tensor; the chunk is not a saved "
                              "tensor.")
    storage = obj[1]
    return storage.dtype, storage.numel, obj[2], obj[3], obj[4]
