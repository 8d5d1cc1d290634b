"""Sources: where a checkpoint's bytes come from, behind one small protocol.

A checkpoint *format* turns what a path names into an Index (`CheckpointIndex`: every
stored tensor as (file, key, dtype, shape, byte range), and logical tensors over pieces),
from metadata alone. It reads that metadata through a *storage*, so the same format module
serves local files and URLs (`s3://`, `http(s)://`, `hf://`). The readers then read the
byte ranges the plan names; they know a file only by its `TensorEntry.file` and the
identity the storage recorded for it.

Adding a format is one module and one call (as `torch.distributed.checkpoint` takes a new
`StorageReader`):

    from lazyload.formats import CheckpointSource, Format, register

    def detect(storage, target):        # a path or URL, or a list of paths (a glob, expanded)
        if isinstance(target, str) and storage.is_dir(target) and storage.exists(storage.join(target, "my.json")):
            return CheckpointSource("mine", files=[...], description=storage.join(target, "my.json"))
        return None                     # not this format: the next one is asked

    def open_index(source, storage, options):   # -> CheckpointIndex
        doc = storage.read_json(source.description, "my format's json")
        headers = storage.headers(source.files)  # safetensors headers, concurrently for a URL
        return CheckpointIndex.of(source.files, entries, layouts, ...)

    register(Format("mine", detect, open_index, remote=True), before="safetensors")

Extension points, and what each promises:

- `Format.detect(storage, target) -> CheckpointSource | None`: whether `target` is this
  format, from names and small metadata reads only. Formats are asked in registration
  order (`formats()`), the first answer wins; `register(..., before=name)` places a new
  one. The built-ins, in order: `sharded` (lazyload_sharded.json), `deepspeed` (DeepSpeed's
  json), the training checkpoints `megatron_dist` (Megatron-Core `torch_dist`),
  `dcp_safetensors` (DCP's per-rank safetensors) and `dcp` (torch DCP directories),
  `megatron` (mp_rank_XX/ directories), `torch` (.bin/.pt state dicts), `safetensors`
  (files, a directory, an index json: the catch-all, last). A local glob is
  expanded to its list of files before any format is asked.
  A detect that recognises its format but finds it broken raises a `CheckpointError`.
- `Format.open_index(source, storage, options) -> CheckpointIndex`: the Index, without
  reading a tensor byte. `options` is an `OpenOptions` (`trust_pickle`). Each file's
  identity (`FileIdentity` locally, `ObjectIdentity` for a URL) goes into the index, so that
  the readers refuse a file that changed after indexing.
- `Format.iterations`: a save directory of this format holds `iter_NNNNNNN/` folders; with
  `iteration=` (`resolve_in`) `detect` is asked for that folder, and a checkpoint of a
  format without iterations is an ArgumentError.
- `Format.remote`: whether the format reads through a URL's storage. A URL is offered
  only to those (each probe costs a request); one that needs local files (torch's
  unpickler maps them) is not asked, so a URL of its files reaches the safetensors
  catch-all, which refuses them as not safetensors.
- `Storage` (below): `LocalStorage` (`formats/local.py`) for paths, `RemoteCheckpoint`
  (`remote/source.py`) for URLs, where a path is the object's URL (any object under the
  root of the store the URL named; the remote reader reads files by their URLs). A storage
  for other places (chunks of training checkpoints, another rank's memory) implements the
  same methods, and a reader for its `TensorEntry.file`s.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from ..errors import ArgumentError, CheckpointError
from ..headers import MAX_HEADER, TensorEntry
from ..index import CheckpointIndex
from .ranges import FileRanges


class Storage(Protocol):
    """Where metadata comes from. Paths are strings in the storage's own spelling (file
    paths; for a URL's store, URLs); `TensorEntry.file` is such a path."""

    remote: bool  # a URL's store: formats with `remote=False` are not asked

    def join(self, folder: str, name: str) -> str:
        """`name` (a plain or relative name) inside `folder`."""

    def dirname(self, path: str) -> str:
        """The folder holding `path`."""

    def is_dir(self, path: str) -> bool:
        """Whether `path` names a folder (for a URL: a prefix, not an object name)."""

    def exists(self, path: str) -> bool:
        """Whether something is at `path` (an object; locally a directory or FIFO too, which
        `read` then refuses, naming it)."""

    def list(self, folder: str) -> list[str] | None:
        """Names directly inside `folder`, sorted; None where the storage cannot list (HTTP)."""

    def read(self, path: str, what: str, limit: int = MAX_HEADER) -> bytes:
        """A small file whole (a json); `what` names it in errors; longer than `limit` is refused."""

    def read_json(self, path: str, what: str) -> Any:
        """`read`, parsed strictly (duplicate keys, NaN refused)."""

    def headers(self, files: Sequence[str]) -> list[tuple[list[TensorEntry], int, Any]]:
        """Per safetensors file, (entries, bytes of its header, identity)."""

    def ranges(self, windows: Mapping[str, Sequence[tuple[int, int]]]) -> dict[str, FileRanges]:
        """Per file, its small byte ranges (zip headers of a training checkpoint's chunks):
        `windows` are fetched ahead where a request costs (a URL: touching windows by one
        GET, concurrently), and `FileRanges.read` serves any range, with the file's identity."""


@dataclass(frozen=True)
class CheckpointSource:
    """What a path names: the format (a registered `Format.name`), its files, and the
    description file (index json, layout json, DeepSpeed json, Megatron directory) when
    there is one."""

    kind: str
    files: list[str]
    description: str | None = None


@dataclass(frozen=True)
class OpenOptions:
    """What the caller allows a format while indexing (grows by fields, with defaults)."""

    trust_pickle: bool = False  # let pickled files run the code they name (see torch_files)


@dataclass(frozen=True)
class Format:
    """A registered checkpoint format: its name (`CheckpointSource.kind`) and its hooks."""

    name: str
    detect: Callable[[Storage, Any], CheckpointSource | None]
    open_index: Callable[[CheckpointSource, Storage, OpenOptions], CheckpointIndex]
    remote: bool = False  # reads through a URL's storage too
    iterations: bool = False  # a save directory holds iterations (`iter_NNNNNNN/`): `resolve_in(iteration=)`


ITERATION = "iter_{:07d}"  # Megatron's name of an iteration's directory
_ITERATION = re.compile(r"^iter_(\d{7})/?$")


_FORMATS: list[Format] = []


def register(fmt: Format, before: str | None = None) -> Format:
    """Add `fmt` to the formats asked by `resolve`: ahead of the one named `before`, else
    last; a format of the same name is replaced in its place."""
    names = [f.name for f in _FORMATS]
    if fmt.name in names:
        _FORMATS[names.index(fmt.name)] = fmt
        return fmt
    if before is not None and before not in names:
        raise ArgumentError(f"register({fmt.name!r}, before={before!r}): no format {before!r}; registered: {names}.")
    _FORMATS.insert(names.index(before) if before is not None else len(_FORMATS), fmt)
    return fmt


def unregister(name: str) -> None:
    """Remove a registered format (a test's toy one)."""
    _FORMATS[:] = [f for f in _FORMATS if f.name != name]


def formats() -> list[Format]:
    """The registered formats, in the order `resolve` asks them."""
    return list(_FORMATS)


def format_named(name: str) -> Format:
    for fmt in _FORMATS:
        if fmt.name == name:
            return fmt
    raise CheckpointError(f"checkpoint format {name!r} is not registered (registered: "
                          f"{', '.join(f.name for f in _FORMATS)}).")


def resolve_in(storage: Storage, target: Any, iteration: int | None = None) -> CheckpointSource:
    """What `target` names in `storage`: the first registered format's answer (for a URL's
    storage, of the formats that read through one: a probe of another costs a request).
    `iteration`: the `iter_NNNNNNN/` of the save directory `target`, by a format with iterations."""
    asked = [f for f in _FORMATS if f.remote or not storage.remote]
    if iteration is not None:
        return _iteration(storage, target, iteration, asked)
    for fmt in asked:
        source = fmt.detect(storage, target)
        if source is not None:
            return source
    raise CheckpointError(f"{_shown(target)}: no checkpoint format lazyload knows (asked "
                          f"{', '.join(f.name for f in asked)}); pass a directory, files or a description json.")


def _iteration(storage: Storage, target: Any, n: int, asked: list[Format]) -> CheckpointSource:
    """Iteration `n` of the save directory `target`; a missing one is a CheckpointError listing
    those present; `target` of a format without iterations is an ArgumentError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ArgumentError(f"iteration={n!r}: an iteration is a number >= 0 (the NNNNNNN of iter_NNNNNNN/).")
    with_iterations = [f for f in asked if f.iterations]
    folder = storage.join(target, ITERATION.format(n)) if isinstance(target, str) else None
    if folder is not None and storage.is_dir(target):
        for fmt in with_iterations:
            source = fmt.detect(storage, folder)
            if source is not None:
                return source
    try:
        kind = resolve_in(storage, target).kind
    except CheckpointError:
        kind = None
    if kind is not None and kind not in [f.name for f in with_iterations]:
        raise ArgumentError(f"iteration={n}: {_shown(target)} is a {kind} checkpoint, which has no iterations; "
                            "iteration= picks iter_NNNNNNN/ of a save directory (formats with iterations: "
                            f"{', '.join(f.name for f in with_iterations)}). Leave it out.")
    raise CheckpointError(f"{_shown(target)}: no iteration {n} ({folder} holds no checkpoint); "
                          f"{_present(storage, target)}.")


def _present(storage: Storage, target: Any) -> str:
    """The iterations a save directory holds, as far as the storage can list them."""
    listed = storage.list(target) if isinstance(target, str) and storage.is_dir(target) else []
    if listed is None:
        return "the store cannot list the iterations present (HTTP); name one that latest_checkpointed_iteration.txt "\
               "or the training log gives"
    found = sorted(int(m.group(1)) for m in map(_ITERATION.match, listed) if m)
    return f"the iterations present: {', '.join(map(str, found))}" if found else (
        "it holds no iter_NNNNNNN/ directory; iteration= names one of the save directory that holds them")


def open_in(source: CheckpointSource, storage: Storage, options: OpenOptions = OpenOptions()) -> CheckpointIndex:
    """The Index of a resolved checkpoint, by its format's `open_index`."""
    return format_named(source.kind).open_index(source, storage, options)


def _shown(target: Any) -> str:
    return target if isinstance(target, str) else f"{len(target)} files ({target[0] if target else ''}, ...)"
