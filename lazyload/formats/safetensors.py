"""safetensors files: one file, a directory of them (with or without
`model.safetensors.index.json`), an index json, or a list of files. The Index comes from
each file's header; an index json's weight map is checked against the headers. The
catch-all format, asked last: whatever no other format claims is read as safetensors.

Through a URL's storage a directory is a prefix: its index json, else every
`*.safetensors` directly under it where the store can list (S3), else `model.safetensors`
(HTTP cannot list).
"""
from __future__ import annotations

from ..errors import CheckpointError
from ..headers import check_weight_map, weight_map_of
from ..redact import printable
from ..index import INDEX_JSON, CheckpointIndex
from .protocol import CheckpointSource, Format, OpenOptions, Storage

SINGLE_FILE = "model.safetensors"  # the name of a one-file checkpoint, where a folder cannot be listed


def detect(storage: Storage, target) -> CheckpointSource:
    if not isinstance(target, str):
        if not target:
            raise CheckpointError("an empty list of checkpoint files was given; pass at least one .safetensors file.")
        return CheckpointSource("safetensors", list(target))
    if storage.is_dir(target):
        return _directory(storage, target)
    if target.endswith(".index.json"):  # the checkpoint it indexes is meant
        return _indexed(storage, target)
    if target.endswith(".safetensors"):  # a missing one is named by the header read
        return CheckpointSource("safetensors", [target])
    if not storage.exists(target):
        raise CheckpointError(f"{target}: no such file or directory (nor, for a local path, a glob matching files).")
    if target.endswith(".json"):
        raise CheckpointError(f"{target}: a json that lazyload does not know (not a lazyload_sharded.json, a "
                              f"{INDEX_JSON} or a DeepSpeed checkpoint json with 'type' and 'checkpoints'); pass the "
                              "checkpoint's directory or its files.")
    return CheckpointSource("safetensors", [target])


def _directory(storage: Storage, folder: str) -> CheckpointSource:
    index_json = storage.join(folder, INDEX_JSON)
    if storage.exists(index_json):
        return _indexed(storage, index_json)
    listed = storage.list(folder)
    if listed is None:  # HTTP: no listing; a single-file checkpoint has a known name
        return CheckpointSource("safetensors", [storage.join(folder, SINGLE_FILE)])
    files = [storage.join(folder, name) for name in listed if name.endswith(".safetensors")]
    if not files:
        raise CheckpointError(f"{folder}: holds no *.safetensors file and no {INDEX_JSON}; check the path.")
    return CheckpointSource("safetensors", files)


def _indexed(storage: Storage, index_json: str) -> CheckpointSource:
    files = sorted(set(_weight_map(storage, index_json).values()))
    # Locally a missing shard is named against the index json here; a URL's is named by its
    # header GET (checking first would cost a request per file, one after another).
    missing = [] if storage.remote else [f for f in files if not storage.exists(f)]
    if missing:
        raise CheckpointError(f"{index_json} names {missing[0]}, which is missing (or not a regular file).")
    return CheckpointSource("safetensors", files, index_json)


def _weight_map(storage: Storage, index_json: str) -> dict[str, str]:
    """key -> the path of the file the index json says holds it."""
    names = weight_map_of(index_json, storage.read_json(index_json, "index json"))
    for name in set(names.values()):
        if printable(name) != name:  # a control character: it would be one in every message naming the file
            raise CheckpointError(f"{index_json}: names the file {printable(name)!r}, with a control character; "
                                  "no checkpoint file is named so. Fix the index json.")
    folder = storage.dirname(index_json)
    paths = {name: storage.join(folder, name) for name in set(names.values())}  # once per file
    return {key: paths[name] for key, name in names.items()}


def open_index(source: CheckpointSource, storage: Storage, options: OpenOptions = OpenOptions()) -> CheckpointIndex:
    headers = storage.headers(source.files)
    entries = [(e.key, e) for file_entries, _, _ in headers for e in file_entries]
    identities = {path: identity for path, (_, _, identity) in zip(source.files, headers)}
    index = CheckpointIndex.of(source.files, entries, header_bytes_read=sum(start for _, start, _ in headers),
                               description=source.description, identities=identities)
    if source.description is not None:
        check_weight_map(source.description, _weight_map(storage, source.description), index, lambda a, b: a == b)
    return index


FORMAT_SAFETENSORS = Format("safetensors", detect, open_index, remote=True)
