"""Every failure lazyload raises is a LazyLoadError; each message names the file, key or
parameter concerned and says what to do about it. A message never shows a credential:
it is redacted when the error is made (`redact.redact`)."""
from __future__ import annotations

import reprlib

from .redact import redact


class _Shown(reprlib.Repr):
    """reprlib's short repr, whose integers past 128 bits are shown by their size: Python
    refuses str() of one over 4,300 digits (a ValueError in place of the message)."""

    def repr_int(self, x, level):
        if x.bit_length() <= 128:
            return super().repr_int(x, level)
        return f"<{'negative ' if x < 0 else ''}integer of {x.bit_length()} bits>"


_shown = _Shown()
_shown.maxlist, _shown.maxtuple, _shown.maxdict, _shown.maxstring, _shown.maxlong = 8, 8, 4, 200, 40


def shown(value) -> str:
    """A value from a checkpoint file, as a message shows it: short whatever it is (a
    100000-dim shape, a 1 MB string, a 5000-digit integer, lists nested thousands deep)."""
    return _shown.repr(value)


class LazyLoadError(Exception):
    """Base class of every lazyload error."""

    def __init__(self, *args):
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class ArgumentError(LazyLoadError):
    """An argument of `LazyCheckpoint` or `load_into` has the wrong type or value (a path
    passed as the model, an invalid `key_map` regex, an unknown `missing=` choice)."""


class OutputError(ArgumentError):
    """A writer's output directory cannot be used: it is the source checkpoint's directory
    (or inside it, or holds it), or it already holds files and `overwrite` was not given."""


class CheckpointError(LazyLoadError):
    """The checkpoint files themselves are unusable: unreadable header, duplicate key,
    index json naming a key its file lacks, unknown dtype, data outside the file."""


class CorruptValuesError(CheckpointError):
    """A checkpoint tensor whose values cannot be used (an NVFP4 global scale that is zero,
    NaN or infinite, an MXFP4 scale of 255): found only once its bytes are read, it stops
    the load as a failed read does, and says the same of the model (`loaded`, `not_loaded`,
    `partly_written`: see ReadError)."""

    def __init__(self, message: str, loaded: list[str] = (), not_loaded: list[str] = (),
                 partly_written: list[str] = ()):
        super().__init__(message)
        self.loaded, self.not_loaded, self.partly_written = list(loaded), list(not_loaded), list(partly_written)


class MappingError(LazyLoadError):
    """Model parameters and checkpoint tensors do not correspond."""


class MissingKeysError(MappingError):
    """Model parameters or persistent buffers that no checkpoint tensor provides."""

    def __init__(self, message: str, keys: list[str]):
        super().__init__(message)
        self.keys = keys


class UnexpectedKeysError(MappingError):
    """Checkpoint tensors that no model parameter uses."""

    def __init__(self, message: str, keys: list[str]):
        super().__init__(message)
        self.keys = keys


class ShapeMismatchError(MappingError):
    """A checkpoint tensor (or the expression built from it) has another shape than the
    parameter it should fill."""

    def __init__(self, message: str, mismatches: list[tuple[str, tuple, tuple]]):
        super().__init__(message)
        self.mismatches = mismatches


class DtypeError(MappingError):
    """A cast that cannot be done (e.g. floating point into an integer parameter)."""


class PlanError(LazyLoadError):
    """The rank/world split cannot be made: bad rank or world, sizes not divisible."""


class ReadError(LazyLoadError):
    """Reading bytes from a checkpoint file failed (short read, I/O error, permission
    denied, a file removed, truncated or replaced since it was indexed).

    Raised from a load, it says what the model holds: `loaded`, the targets fully
    written (and assigned); `not_loaded`, the others, which keep their previous values
    (a real model) or stay on meta; among them `partly_written`, targets of a real model
    filled in place whose bytes were being written when the read failed: their values
    are a mix of old and new (load them again). A load that quantizes or makes the model
    parallel puts its modules back as they were: nothing is `loaded`."""

    def __init__(self, message: str, loaded: list[str] = (), not_loaded: list[str] = (),
                 partly_written: list[str] = ()):
        super().__init__(message)
        self.loaded, self.not_loaded, self.partly_written = list(loaded), list(not_loaded), list(partly_written)


class RankFailedError(LazyLoadError):
    """Another rank of this torch.distributed load failed (or did not report within
    `rank_timeout`); this rank stopped before making its model runnable. `ranks`: the
    failed ranks -> their errors."""

    def __init__(self, message: str, ranks: dict[int, str] | None = None):
        super().__init__(message)
        self.ranks = dict(ranks or {})


class MetaBufferError(LazyLoadError):
    """A buffer left on the meta device that neither the checkpoint nor its module can fill."""


class DeviceError(ArgumentError):
    """The device to load onto does not exist here: CUDA asked for where there is none, a
    device index beyond the visible devices, or a LOCAL_RANK with no device of its own."""


class RemoteError(CheckpointError):
    """A remote checkpoint (s3://, https://, hf://) cannot be read: the store kept failing
    after its retries, or answered something lazyload cannot use. The message names the URL,
    never the credentials. During a load every such failure is a ReadError."""


class ObjectNotFoundError(RemoteError):
    """No object at a URL (or no checkpoint under a prefix)."""


class AccessDeniedError(RemoteError):
    """The store refused the request (401/403): the credentials of its standard
    configuration are missing, wrong, or do not grant read access."""


class ObjectChangedError(RemoteError):
    """An object changed (another ETag, version or size) since its header was indexed."""


class RequestRefusedError(RemoteError):
    """The store answered a status that retrying cannot change (a 4xx other than those
    above, or a redirect the client does not follow: a malformed request, a wrong region or
    endpoint, a conflict); the request fails at once, unretried."""


class ExchangeError(LazyLoadError):
    """Replicas exchanging what they read (a cooperative load over a device mesh): the
    exchange failed on this rank (the other ranks get a RankFailedError naming it)."""


class SyncError(RankFailedError):
    """A weight sync (`lazyload.WeightSync`) that did not complete on every rank: this rank's
    error, or another rank's that failed or stopped. `report`: this rank's `SyncReport`, whose
    `written` names the target tensors that hold the new version, `untouched` those that hold
    the last one (its `version` not advanced); calling the sync again completes it."""

    def __init__(self, message: str, ranks: dict[int, str] | None = None, report: object = None):
        super().__init__(message, ranks)
        self.report = report
