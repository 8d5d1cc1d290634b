"""Checkpoints in object storage and over HTTP (`s3://`, `https://`, `hf://`): the index
from range requests, the bytes of read items as ranged GETs (see `readers/remote.py`).

`store.py`: options, object identity, retries and counts; `http.py` and `s3.py`: one
request to each kind of store; `proxy.py`: the proxy an HTTP(S) request goes through;
`source.py`: the storage of a URL, through which the
registered formats (`formats/protocol.py`) find what it names and build its Index;
`cache.py`: the optional local cache of fetched ranges. The clients (obstore for S3) are
optional extras, imported only when such a URL is opened.
"""
from .source import RemoteCheckpoint, is_remote
from .store import RemoteOptions

__all__ = ["RemoteCheckpoint", "RemoteOptions", "is_remote"]
