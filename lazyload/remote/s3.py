"""S3 and S3-compatible objects (`s3://bucket/key`), through obstore (`pip install
'lazyload[remote]'`).

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
from datetime import timedelta

from ..errors import RemoteError
from .store import ObjectIdentity, RemoteOptions, Response, Store, Transient, redact

_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


class S3Store(Store):
    credentials_hint = "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the instance's role"

    def __init__(self, bucket: str, options: RemoteOptions):
        super().__init__(options)
        try:
            import obstore
            from obstore.store import S3Store as ObjectStoreS3
        except ImportError:
            raise RemoteError(f"s3://{bucket}/: reading S3 needs obstore (pip install 'lazyload[remote]').") from None
        self._obstore = obstore
        self.bucket = bucket
        self.secrets = tuple(os.environ[name] for name in _SECRET_ENV if os.environ.get(name))
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        client = {"timeout": timedelta(seconds=options.timeout), "allow_http": endpoint.startswith("http://")}
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        config = {"region": region} if region else {}
        try:
            self._store = ObjectStoreS3(bucket, client_options=client, retry_config={"max_retries": 0}, **config)
        except Exception as exc:  # obstore's configuration errors
            raise RemoteError(f"s3://{bucket}/: cannot configure the S3 client ({self._say(exc)}).") from None

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def attempt(self, key: str, start: int, end: int, identity: ObjectIdentity | None) -> Response:
        from obstore import exceptions as ex

        options = {"range": (start, end)}
        if identity is not None and identity.etag:
            options["if_match"] = identity.etag  # S3 answers 412 for another version of the object
        try:
            result = self._obstore.get(self._store, key, options=options)
            data = result.bytes()
        except (ex.NotFoundError, FileNotFoundError):  # obstore raises the builtin one for a 404
            raise self.not_found(key) from None
        except (ex.PermissionDeniedError, ex.UnauthenticatedError, PermissionError) as exc:
            raise self.denied(key, type(exc).__name__) from None
        except ex.PreconditionError:
            raise self.changed(key, identity) from None
        except ex.GenericError as exc:
            if "Range" in str(exc) and "416" in str(exc):  # a range past the end: the object shrank
                raise self.changed(key, identity) from None
            raise Transient(self._say(exc)) from None  # 5xx, timeouts, dropped connections
        except OSError as exc:
            raise Transient(self._say(exc)) from None
        meta = result.meta
        return Response(memoryview(data), meta["size"], meta.get("e_tag"), meta.get("version"))

    def list(self, prefix: str) -> list[str]:
        from obstore import exceptions as ex

        try:
            listed = self._obstore.list_with_delimiter(self._store, prefix or None)
        except (ex.NotFoundError, FileNotFoundError):
            return []
        except (ex.PermissionDeniedError, ex.UnauthenticatedError, PermissionError) as exc:
            raise self.denied(prefix, type(exc).__name__) from None
        except Exception as exc:  # obstore's errors after its (disabled) retries
            raise RemoteError(f"{self.url(prefix)}: cannot list ({self._say(exc)}).") from None
        return [meta["path"] for meta in listed["objects"]]

    def _say(self, exc: BaseException) -> str:
        return redact(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", self.secrets)
