"""S3 and S3-compatible objects (`s3://bucket/key`), through obstore (`pip install
'torch-lazyload[remote]'`, or `pip install obstore`).

Client choice, measured against moto's S3 server (`benchmarks/bench_clients.py`: 300 ranged
4 KiB GETs of an 8 MiB object, one thread): obstore 1.7-1.8 s, boto3 2.9-3.3 s, s3fs 4.5-4.9 s;
eight 1 MiB GETs 50-64, 65-90, 146-178 ms (two runs). Much of it is the server's own time,
so the gap in the clients is larger than this: obstore signs and parses in Rust, without
botocore's per-request Python. (The s3fs that pip pairs with this boto3 is 0.4.2, which
wraps boto3; a newer, aiobotocore-based one was not measured.)

Credentials and endpoint come from the standard AWS environment, as obstore (object_store)
reads it: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_REGION or
AWS_DEFAULT_REGION, AWS_ENDPOINT_URL(_S3) for S3-compatible stores (http:// endpoints are
allowed when named so), web identity and instance metadata. obstore's own retries are off:
`Store.get` retries, so that every retry is counted.
"""
from __future__ import annotations

import os
import re
from datetime import timedelta

from ..errors import RemoteError, RequestRefusedError
from ..redact import printable, redact
from .store import TRANSIENT_STATUS, Body, Into, ObjectIdentity, RemoteOptions, Response, Store, Transient, refused

_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
_REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")
_STATUS = re.compile(r"non-2xx status code: ([0-9]{3})")  # in obstore's message for a store's error status
STREAM_CHUNK = 256 << 10  # a GET's body comes from obstore in pieces of about this size
_CODE = re.compile(r"<Code>([A-Za-z0-9.]{1,64})</Code>")  # S3's error code, in the error body obstore quotes
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}")


class S3Store(Store):
    credentials_hint = "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the instance's role"

    def __init__(self, bucket: str, options: RemoteOptions):
        super().__init__(options)
        try:
            import obstore
            from obstore.store import S3Store as ObjectStoreS3
        except ImportError:
            raise RemoteError(f"s3://{bucket}/: reading S3 needs obstore (pip install obstore).") from None
        if not _BUCKET.fullmatch(bucket):
            raise RemoteError(f"s3://{ascii(bucket)[1:-1]}/: not a valid bucket name (letters, digits, '.', '-', "
                              "'_'); check the URL.")
        self._obstore = obstore
        self.bucket = bucket
        self.hold_secrets(*(os.environ.get(name) for name in _SECRET_ENV))
        endpoint = next((os.environ[name] for name in _ENDPOINT_ENV if os.environ.get(name)), "")
        client = {"timeout": timedelta(seconds=options.timeout), "allow_http": endpoint.startswith("http://")}
        region = next((os.environ[name] for name in _REGION_ENV if os.environ.get(name)), None)
        config = {"region": region} if region else {}
        if endpoint:  # named to obstore too: the endpoint it asks is the one the cache names
            config["endpoint"] = endpoint
        self.endpoint = endpoint or f"https://s3.{region or 'us-east-1'}.amazonaws.com"
        try:
            self._store = ObjectStoreS3(bucket, client_options=client, retry_config={"max_retries": 0}, **config)
        except Exception as exc:  # obstore's configuration errors
            raise RemoteError(f"s3://{bucket}/: cannot configure the S3 client ({self._say(exc)}).") from None

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def attempt(self, key: str, start: int, end: int, identity: ObjectIdentity | None, into: Into | None = None
                ) -> Response:
        """One GET, its body streamed into `into()`'s views (or a buffer of the bytes asked,
        while indexing) and counted: an encoded body, or one that runs past the range, is
        refused as soon as it does (obstore checks the Content-Range, not the body)."""
        from obstore import exceptions as ex

        self.check_key(key)
        options = {"range": (start, end)}
        if identity is not None and identity.etag:
            options["if_match"] = identity.etag  # S3 answers 412 for another version of the object
        body = None
        try:
            result = self._obstore.get(self._store, key, options=options)
            self._check_encoding(key, result.attributes)
            meta = result.meta
            want = max(0, min(end, meta["size"]) - start)
            data = bytearray(want) if into is None else None  # at most the bytes asked, whatever the server says
            body = Body(into() if into is not None else [memoryview(data)], want)
            for chunk in result.stream(min_chunk_size=STREAM_CHUNK):
                body.write(chunk)
                if body.over:  # stop reading: the rest of the body is never pulled
                    raise self._overrun(key, want, body.served)
        except (ex.NotFoundError, FileNotFoundError):  # obstore raises the builtin one for a 404
            raise self.not_found(key) from None
        except (ex.PermissionDeniedError, ex.UnauthenticatedError, PermissionError) as exc:
            raise self.denied(key, type(exc).__name__) from None
        except ex.PreconditionError:
            raise self.changed(key, identity) from None
        except ex.BaseError as exc:
            raise self._failure(key, identity, exc, body.served if body else 0) from None
        except OSError as exc:
            raise Transient(self._say(exc), body.served if body else 0) from None
        except ValueError as exc:  # the client refused the request's arguments
            raise self._unusable(key, exc) from None
        if body.served < want:  # cut short (a smaller object: `check`)
            raise Transient(f"the body ended after {body.served} of {want} bytes", body.served)
        return Response(memoryview(b"" if data is None else data), meta["size"], meta.get("e_tag"),
                        meta.get("version"), landed=0 if into is None else body.landed)

    def _check_encoding(self, key: str, attributes) -> None:
        encoding = str(attributes.get("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            raise RemoteError(f"{self.url(key)}: the store sent the bytes {printable(encoding, 40)!r}-encoded "
                              "(Content-Encoding); byte ranges must be the stored bytes, unencoded. Store the object "
                              "without a Content-Encoding (lazyload reads safetensors as they are).")

    def _overrun(self, key: str, want: int, served: int) -> RemoteError:
        return refused(RemoteError(f"{self.url(key)}: the store sent more than the {want} bytes asked (at least "
                                   f"{served}); the store or a proxy on the way is broken (these would be the wrong "
                                   "bytes)."), served)

    def list(self, prefix: str) -> list[str]:
        from obstore import exceptions as ex

        self.check_key(prefix, prefix=True)
        try:
            listed = self._obstore.list_with_delimiter(self._store, prefix or None)
        except (ex.NotFoundError, FileNotFoundError):
            return []
        except (ex.PermissionDeniedError, ex.UnauthenticatedError, PermissionError) as exc:
            raise self.denied(prefix, type(exc).__name__) from None
        except Exception as exc:  # obstore's errors after its (disabled) retries
            raise RemoteError(f"{self.url(prefix)}: cannot list ({self._say(exc)}).") from None
        folders = [p.rstrip("/") + "/" for p in listed.get("common_prefixes", [])]  # a save dir's iter_NNNNNNN/
        return [meta["path"] for meta in listed["objects"]] + folders

    def check_key(self, key: str, prefix: bool = False) -> None:
        why = _key_problem(key.removesuffix("/") if prefix else key)
        if why:
            raise RemoteError(f"{ascii(self.url(key))[1:-1]}: not a valid S3 key ({why}); name the object "
                              "exactly as it is stored.")

    def _failure(self, key: str, identity: ObjectIdentity | None, exc: Exception, served: int = 0) -> Exception:
        """An obstore error other than the mapped ones, by the HTTP status it quotes: Transient
        for 408/429/5xx and for failures of the connection (a timeout, a reset, a body cut
        short: obstore's "HTTP error"), the error it is for any other status, and a RemoteError
        for an answer the client could not use (a malformed Content-Range, a non-partial answer)."""
        summary = str(exc).split("\n", 1)[0]  # the rest is obstore's debug dump
        match = _STATUS.search(summary)
        status = int(match.group(1)) if match else None
        if status == 416:  # a range past the end: the object shrank
            return self.changed(key, identity)
        if status in TRANSIENT_STATUS or (status is None and "HTTP error" in summary):
            return Transient(self._say(exc), served)
        if status is None:
            return self._unusable(key, exc)
        # The status and S3's error code only, not the body: it may echo a credential (an invalid session token).
        code = _CODE.search(str(exc))
        credentials = ("the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, and AWS_SESSION_TOKEN, since an "
                       "expired or malformed session token is answered 400), " if status == 400 else "")
        return RequestRefusedError(f"{self.url(key)}: the store answered HTTP {status}"
                                   f"{f' ({code.group(1)})' if code else ''}, which retrying cannot change; check "
                                   f"{credentials}the URL, the endpoint ({_ENDPOINT_ENV[1]}) and the region "
                                   f"({_REGION_ENV[0]}).")

    def _unusable(self, key: str, exc: Exception) -> RemoteError:
        return RemoteError(f"{self.url(key)}: the S3 client could not make the request or use the answer "
                           f"({self._say(exc)}); check the URL and that the endpoint ({_ENDPOINT_ENV[1]}) is an S3 "
                           "store (a proxy on the way may be changing its answers).")

    def _say(self, exc: BaseException) -> str:
        return redact(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", self.secrets)


def _key_problem(key: str) -> str | None:
    """What makes `key` one that S3 would not read as written (obstore refuses `.`, `..` and
    empty segments, or normalises them to another key), or None."""
    if any(segment in (".", "..") for segment in key.split("/")):
        return "a '.' or '..' segment"
    if key and not all(key.split("/")):
        return "an empty segment ('//', or a leading or trailing '/')"
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        return "a control character"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeError:  # a lone surrogate
        return "not UTF-8"
    return "over 1024 bytes" if size > 1024 else None
