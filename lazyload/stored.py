"""A checkpoint as stored: its files, the Index from their headers, and the config.json
beside them (its quantization settings; for a URL fetched from the store while indexing).
No tensor byte is read here. `LazyCheckpoint` adds the load on top; the planner, the CLI
preview and the writer take a `StoredCheckpoint`."""
from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .errors import ArgumentError
from .formats import CheckpointSource, open_index, resolve
from .hub import local_path
from .index import CheckpointIndex, TensorEntry
from .quant.formats import Quantization as PreQuantized, detect, quantization_config_of, read_quantization_config
from .remote import RemoteCheckpoint, RemoteOptions, is_remote


class StoredCheckpoint:
    """See `LazyCheckpoint` for the arguments."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *, trust_pickle: bool = False,
                 remote: RemoteOptions | None = None, iteration: int | None = None):
        check_paths(paths)
        self._paths = paths
        self.trust_pickle = trust_pickle
        self._index: CheckpointIndex | None = None
        self._quantization: PreQuantized | None = None
        self._config: dict | None = None
        self.remote = RemoteCheckpoint(paths, remote, iteration) if is_remote(paths) else None
        self.source: CheckpointSource = self.remote.source if self.remote else resolve(local_path(paths), iteration)
        self.files = self.source.files

    @classmethod
    def of_index(cls, index: CheckpointIndex, quantization_config: dict | None = None) -> "StoredCheckpoint":
        """An index made elsewhere (the writer's view of names as tensors), as a checkpoint."""
        stored = cls.__new__(cls)
        stored._paths, stored.trust_pickle, stored.remote = list(index.files), False, None
        stored._index, stored._quantization, stored._config = index, None, quantization_config or {}
        stored.source, stored.files = None, list(index.files)
        return stored

    @property
    def paths(self) -> Any:
        """The paths (or URL) as given."""
        return self._paths

    @property
    def index(self) -> CheckpointIndex:
        if self._index is None:
            self._index = (self.remote.index(self.trust_pickle) if self.remote
                           else open_index(self.source, self.trust_pickle))
        return self._index

    @property
    def quantization(self) -> PreQuantized:
        """The checkpoint's pre-quantized weights and their scales (from the tensors and the
        `quantization_config` of the config.json beside its files); loads dequantize them."""
        if self._quantization is None:
            self._quantization = self.detect()
        return self._quantization

    def detect(self, held=lambda key: False) -> PreQuantized:
        """Pre-quantized weights; `held`: keys the model holds as they are (not dequantized)."""
        return detect(self.index, self.quantization_config(), held)

    def quantization_config(self) -> dict | None:
        """The `quantization_config` of the config.json beside the files (from the store, for a URL)."""
        if self._config is not None:
            return self._config or None
        if self.remote is None:
            return read_quantization_config(self.files)
        self.index  # indexing fetches config.json, beside the headers
        return None if self.remote.config_json is None else quantization_config_of(*self.remote.config_json)

    def config_json(self) -> tuple[str, bytes] | None:
        """(where, bytes) of the config.json beside the files, or None: a local file's
        path, or for a URL the copy fetched from the store while indexing."""
        if self.remote is not None:
            self.index
            return self.remote.config_json
        paths = self._paths if isinstance(self._paths, (list, tuple)) else [self._paths]
        path = os.fspath(local_path(paths[0])) if paths else ""
        directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        file = os.path.join(directory, "config.json")
        if not os.path.isfile(file):
            return None
        with open(file, "rb") as f:
            return file, f.read()

    def keys(self) -> list[str]:
        return list(self.index)

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def entry(self, key: str) -> TensorEntry:
        return self.index[key]

    @property
    def total_bytes(self) -> int:
        return self.index.total_bytes

    @property
    def header_bytes_read(self) -> int:
        return self.index.header_bytes_read

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.files)} files, {len(self.index)} tensors, {self.total_bytes} bytes)"


def transformers_config(stored: StoredCheckpoint, config: Any = None, option: str = "config=") -> Any:
    """A transformers config: `config` itself, or read from a config.json file or a directory
    holding one, or else the one beside the checkpoint's files (for a URL, its store's).
    `option`: how the caller's users pass a config (named in the errors)."""
    import tempfile

    from transformers import AutoConfig

    if config is not None and not isinstance(config, (str, os.PathLike)):
        return config
    if config is not None:
        source = os.fspath(local_path(config))
        file = os.path.join(source, "config.json") if os.path.isdir(source) else source
        if not os.path.isfile(file):
            raise ArgumentError(f"{file}: no such file ({option} {config} has no config.json); pass {option} with "
                                "the model's config.json or the directory holding it.")
        found = (file, open(file, "rb").read())
    else:
        found = stored.config_json()
        if found is None:
            raise ArgumentError(f"{stored.paths}: no config.json beside the checkpoint to build the model from; "
                                f"pass {option} with the model's config.json or the directory holding it.")
    with tempfile.TemporaryDirectory(prefix="lazyload-config-") as copy:  # transformers reads configs from disk
        with open(os.path.join(copy, "config.json"), "wb") as f:
            f.write(found[1])
        try:
            return AutoConfig.from_pretrained(copy)
        except Exception as exc:  # whatever transformers meets: a RecursionError, its field validation, TypeError
            raise ArgumentError(f"{found[0]}: not a config transformers can read ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}).") from exc


def meta_model(config: Any) -> nn.Module:
    """The model a transformers config describes, built on meta (a causal LM where it is one)."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            return AutoModel.from_config(config)


def check_paths(paths: Any) -> None:
    """Something other than paths (the model, with the arguments swapped) is refused with what goes where."""
    items = paths if isinstance(paths, (list, tuple)) else [paths]
    wrong = next((p for p in items if not isinstance(p, (str, os.PathLike))), None)
    if wrong is not None or not items:
        got = f"a {type(wrong).__name__}" if items else "an empty list"
        model = " (a model: it goes to load_into)" if isinstance(wrong, nn.Module) else ""
        raise ArgumentError(f"LazyCheckpoint takes the checkpoint: a directory, file, list of files, glob, repo id "
                            f"or URL; got {got}{model}. Use LazyCheckpoint(path).load_into(model, rank, world).")
