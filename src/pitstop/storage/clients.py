"""Byte-level clients of an object store: the narrow interface :class:`ObjectStorage` is
written on, and its two implementations.

A client knows keys (``step-0000000100/manifest.json``, relative to the root URL's prefix)
and nothing of checkpoints: put an object whole (optionally only if absent), read it whole
or a byte range of it, list a prefix, delete keys, copy one. Errors are the client's own
exceptions turned into :class:`ObjectMissing` (the key does not exist), :class:`ObjectExists`
(a conditional put found one) or ``OSError`` (anything else: the server, the network).

* :class:`ObstoreClient` (default for ``s3://``, ``gs://``, ``az://``, ``memory://``): the
  Rust ``object_store`` crate through ``obstore``; requests run outside the GIL, and a put
  ``if absent`` is a real conditional request (S3 ``If-None-Match: *``).
* :class:`FsspecClient` (any other URL fsspec knows, or ``client="fsspec"``): ``fsspec``
  file systems (``s3fs``, ``gcsfs``, ...). Its conditional put is a check, then a write.

Measured on one loopback S3 server (moto), ``benchmarks/object_store.py``, same bytes, part
size and concurrency: obstore's ranged GETs ran 3.5-4.6x s3fs's throughput, its PUTs 1.2x
(the server was the limit), at 0.26-0.45x s3fs's client CPU per GB; see
docs/object-storage.md.
"""

from __future__ import annotations

import datetime
import errno
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pitstop.errors import MissingExtraError, UnsupportedSetupError

__all__ = [
    "FsspecClient",
    "ObjectClient",
    "ObjectExists",
    "ObjectInfo",
    "ObjectMissing",
    "ObstoreClient",
    "make_client",
    "split_url",
]

OBSTORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure")
# (memory:// goes to fsspec: its memory file system is one per process, obstore's one per client)
EXTRA = "pitstop[s3]"


class ObjectMissing(FileNotFoundError):
    """The key does not exist."""


class ObjectExists(FileExistsError):
    """A put ``if_absent`` found the key there."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float


class ObjectClient(Protocol):
    url: str

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None: ...

    def get(self, key: str, limit: int) -> bytes:
        """The whole object; OSError(EFBIG) if it is larger than ``limit``."""
        ...

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Bytes ``[offset, offset + len(out))`` of ``key`` into ``out``; how many there were."""
        ...

    def head(self, key: str) -> ObjectInfo: ...

    def scan(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursively)."""
        ...

    def list_dirs(self) -> tuple[list[str], list[str]]:
        """The top level: (names of "directories", names of objects)."""
        ...

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (missing ones are no error)."""
        ...

    def copy(self, src: str, dst: str) -> None: ...


def split_url(url: str) -> tuple[str, str]:
    """``(scheme, rest)`` of ``s3://bucket/run``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise UnsupportedSetupError(f"{url}: not a URL (scheme://...)", path=url, phase="plan")
    return scheme.lower(), rest


def make_client(url: str, options: Mapping[str, Any] | None, client: str | None) -> ObjectClient:
    """The client for ``url``: obstore for the schemes it covers (``client=`` ``"obstore"`` or
    ``"fsspec"`` to choose), fsspec for the rest. A missing library is named with its extra."""
    scheme, _ = split_url(url)
    which = client or ("obstore" if scheme in OBSTORE_SCHEMES else "fsspec")
    if which == "obstore":
        return ObstoreClient(url, dict(options or {}))
    if which == "fsspec":
        return FsspecClient(url, dict(options or {}))
    raise ValueError(f"client= is 'obstore' or 'fsspec', got {client!r}")


def _missing_extra(url: str, module: str) -> MissingExtraError:
    extra = EXTRA if module == "obstore" else "pitstop[fsspec]"
    return MissingExtraError(
        f"{url}: object storage needs the optional package {module!r}: pip install '{extra}'",
        path=url, phase="plan",
    )  # fmt: skip


def _secs(t: Any) -> float:
    if isinstance(t, datetime.datetime):
        return t.timestamp()
    if isinstance(t, (int, float)):
        return float(t)
    return 0.0


# ---------------------------------------------------------------------------------- obstore
class ObstoreClient:
    """``obstore`` (Rust ``object_store``). ``options``: the store's config keys
    (``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ...; the rest come
    from the environment as the client reads it: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
    ...), HTTP settings (``allow_http``, ``timeout``, ...: moved to the client options), plus
    ``client_options`` and ``retry_config`` passed as they are."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        try:
            import obstore
            from obstore.store import from_url
        except ImportError:
            raise _missing_extra(url, "obstore") from None
        self.url = url.rstrip("/")
        self._obs = obstore
        from obstore import exceptions

        self._missing = (exceptions.NotFoundError, FileNotFoundError)
        self._exists = (
            exceptions.AlreadyExistsError, exceptions.PreconditionError, FileExistsError,
        )  # fmt: skip
        retry = options.pop("retry_config", None) or {
            "max_retries": 3,
            "retry_timeout": datetime.timedelta(seconds=30),
            "backoff": {
                "init_backoff": datetime.timedelta(milliseconds=100),
                "max_backoff": datetime.timedelta(seconds=2),
                "base": 2,
            },
        }
        client_options = dict(options.pop("client_options", None) or {})
        for key in _CLIENT_KEYS & set(options):  # HTTP settings given with the store's config
            client_options[key] = options.pop(key)
        scheme, rest = split_url(self.url)
        if scheme in ("s3", "s3a") and "endpoint" not in options and _endpoint():
            options["endpoint"] = _endpoint()
        endpoint = str(options.get("endpoint", ""))
        if endpoint.startswith("http://"):
            client_options.setdefault("allow_http", True)
        if (
            scheme in ("s3", "s3a")
            and "region" not in options
            and not os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION"))
        ):
            options["region"] = "us-east-1"  # the client refuses none; S3 answers any
        provider = None
        if scheme in ("s3", "s3a") and not _has_keys(options):
            provider = _config_file_credentials()
        kwargs_provider = {"credential_provider": provider} if provider is not None else {}
        target = self.url if rest else self.url + "/"
        try:
            settings: dict[str, Any] = {
                "client_options": client_options, "retry_config": retry, **kwargs_provider,
                **options,
            }  # fmt: skip
            self._store = from_url(target, **settings)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # its own errors for a bad config; a Rust panic for some
            raise UnsupportedSetupError(
                f"{url}: cannot set up the object store client: {_short(e)}", path=url,
                phase="plan",
            ) from None  # fmt: skip

    def _err(self, e: BaseException, key: str) -> OSError:
        if isinstance(e, self._missing):
            return ObjectMissing(errno.ENOENT, f"{key}: no such object")
        if isinstance(e, self._exists):
            return ObjectExists(errno.EEXIST, f"{key}: exists")
        text = _short(e)
        if "invalid path" in text.lower():  # a key with an empty or "."/".." segment
            return OSError(
                errno.EINVAL,
                f"{key}: {text}: an object under {self.url} has a key this client cannot "
                "list (an empty '//' or a '.'/'..' segment); delete that object with another "
                "tool (aws s3 rm ...)",
            )
        status = _STATUS.search(str(e))
        code = {"403": errno.EACCES, "400": errno.EINVAL, "404": errno.ENOENT}.get(
            status.group(1) if status else "", errno.EREMOTEIO
        )  # (a 404 here is a bucket, not a key: a missing key is ObjectMissing above)
        return OSError(code, f"{key}: {text}" if key and key != "/" else text)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        try:
            self._obs.put(
                self._store, key, data, mode="create" if if_absent else "overwrite",
                use_multipart=False,
            )  # fmt: skip
        except Exception as e:
            raise self._err(e, key) from None

    def get(self, key: str, limit: int) -> bytes:
        try:
            result = self._obs.get(self._store, key)
        except Exception as e:
            raise self._err(e, key) from None
        size = int(result.meta["size"])
        if size > limit:
            raise OSError(errno.EFBIG, f"{key}: {size} bytes, more than the limit {limit}")
        try:
            return bytes(result.bytes())
        except Exception as e:
            raise self._err(e, key) from None

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Streamed into ``out`` in chunks of about ``_STREAM_CHUNK``: the read adds that, not a
        second copy of the whole range, to the reader's own buffer."""
        if not len(out):
            return 0
        n = 0
        try:
            result = self._obs.get(self._store, key, options={"range": (offset, offset + len(out))})
            for chunk in result.stream(min_chunk_size=_STREAM_CHUNK):
                view = memoryview(chunk)
                take = min(len(view), len(out) - n)
                out[n : n + take] = view[:take]
                n += take
                if n >= len(out):
                    break
        except Exception as e:
            raise self._err(e, key) from None
        return n

    def head(self, key: str) -> ObjectInfo:
        try:
            meta = self._obs.head(self._store, key)
        except Exception as e:
            raise self._err(e, key) from None
        return ObjectInfo(key, int(meta["size"]), _secs(meta.get("last_modified")))

    def scan(self, prefix: str) -> list[ObjectInfo]:
        out = []
        try:
            for batch in self._obs.list(self._store, prefix):
                for meta in batch:
                    out.append(
                        ObjectInfo(meta["path"], int(meta["size"]), _secs(meta["last_modified"]))
                    )
        except Exception as e:
            raise self._err(e, prefix) from None
        return [o for o in out if o.key.startswith(prefix)]

    def list_dirs(self) -> tuple[list[str], list[str]]:
        try:
            got = self._obs.list_with_delimiter(self._store, None)
        except Exception as e:
            raise self._err(e, "/") from None
        dirs = [p.rstrip("/").rsplit("/", 1)[-1] for p in got["common_prefixes"]]
        return dirs, [o["path"].rsplit("/", 1)[-1] for o in got["objects"]]

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            for i in range(0, len(keys), 1000):
                self._obs.delete(self._store, keys[i : i + 1000])
        except Exception as e:
            if isinstance(e, self._missing):
                return
            raise self._err(e, keys[0]) from None

    def copy(self, src: str, dst: str) -> None:
        try:
            self._obs.copy(self._store, src, dst, overwrite=True)
        except Exception as e:
            raise self._err(e, src) from None


_STREAM_CHUNK = 1024 * 1024

_CLIENT_KEYS = frozenset(
    {"allow_http", "allow_invalid_certificates", "connect_timeout", "timeout", "user_agent",
     "proxy_url", "pool_idle_timeout", "pool_max_idle_per_host", "http1_only", "http2_only"}
)  # fmt: skip


def _has_keys(options: Mapping[str, Any]) -> bool:
    """Whether credentials are given or in the environment (the client reads those itself)."""
    return any(k in options for k in ("access_key_id", "aws_access_key_id", "token")) or bool(
        os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE")
    )


def _config_file_credentials() -> Any:
    """Credentials from the AWS config files (``~/.aws/credentials``, profiles, SSO, instance
    roles) through boto3 when it is installed and finds some; else None (the client then
    tries the instance metadata itself)."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    try:
        session = boto3.Session()
        if session.get_credentials() is None:
            return None
        return Boto3CredentialProvider(session)
    except Exception:
        return None


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


_S3_ERROR = re.compile(r"<Code>([^<]{1,100})</Code>(?:.*?<Message>([^<]{0,300})</Message>)?", re.S)
_SECRET_ELEMENT = re.compile(
    r"<(Token(?:-\d+)?|SecurityToken|AWSAccessKeyId|StringToSign(?:Bytes)?|SignatureProvided|"
    r"CanonicalRequest(?:Bytes)?)>.*?</\1>",
    re.S,
)
_SECRET_PARAM = re.compile(
    r"(X-Amz-Security-Token|X-Amz-Credential|X-Amz-Signature|Signature|sig|token)=[^&\s\"'<]+",
    re.I,
)
_STATUS = re.compile(r"status code: (\d{3})")


def scrub(text: str) -> str:
    """``text`` without what may hold a secret: the token, key id and signature elements an
    S3 error body echoes, and signature and token parameters of a URL."""
    text = _SECRET_ELEMENT.sub(lambda m: f"<{m.group(1)}>(removed)</{m.group(1)}>", text)
    return _SECRET_PARAM.sub(lambda m: f"{m.group(1)}=(removed)", text)


def _short(e: BaseException) -> str:
    """What a client's error says, in a line: the S3 error code and message when the server
    sent them (``NoSuchBucket: The specified bucket does not exist``), else the first line
    (obstore's errors carry pages of debug output); secrets removed (:func:`scrub`)."""
    text = scrub(str(e))
    found = _S3_ERROR.search(text)
    status = _STATUS.search(text)
    if found is not None:
        said = f"{found.group(1)}: {found.group(2)}" if found.group(2) else found.group(1)
        return f"{said} (HTTP {status.group(1)})" if status else said
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else type(e).__name__


# ---------------------------------------------------------------------------------- fsspec
class FsspecClient:
    """An ``fsspec`` file system; ``options`` are its ``storage_options``."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        try:
            import fsspec
        except ImportError:
            raise _missing_extra(url, "fsspec") from None
        self.url = url.rstrip("/")
        scheme, _ = split_url(self.url)
        try:
            self._fs, self._root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError as e:
            raise UnsupportedSetupError(
                f"{url}: fsspec has no installed file system for {scheme}:// ({_short(e)})",
                path=url, phase="plan",
            ) from None  # fmt: skip
        except Exception as e:
            raise UnsupportedSetupError(
                f"{url}: cannot set up the fsspec file system: {_short(e)}", path=url,
                phase="plan",
            ) from None  # fmt: skip
        self._root = self._root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}" if key else self._root

    def _key(self, path: str) -> str:
        path = path.rstrip("/")
        root = self._root.lstrip("/")
        path = path.lstrip("/")
        return path[len(root) :].lstrip("/") if path.startswith(root) else path

    def _err(self, e: BaseException, key: str) -> OSError:
        if isinstance(e, FileNotFoundError):
            return ObjectMissing(errno.ENOENT, f"{key}: no such object")
        if isinstance(e, FileExistsError):
            return ObjectExists(errno.EEXIST, f"{key}: exists")
        if isinstance(e, OSError) and e.errno is not None:
            return e
        return OSError(errno.EREMOTEIO, f"{key}: {_short(e)}")

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        try:
            if if_absent and self._fs.exists(self._path(key)):
                raise ObjectExists(errno.EEXIST, f"{key}: exists")
            self._fs.pipe_file(self._path(key), bytes(data))
        except ObjectExists:
            raise
        except Exception as e:
            raise self._err(e, key) from None

    def get(self, key: str, limit: int) -> bytes:
        info = self.head(key)
        if info.size > limit:
            raise OSError(errno.EFBIG, f"{key}: {info.size} bytes, more than the limit {limit}")
        try:
            return bytes(self._fs.cat_file(self._path(key)))
        except Exception as e:
            raise self._err(e, key) from None

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        if not len(out):
            return 0
        try:
            got = self._fs.cat_file(self._path(key), start=offset, end=offset + len(out))
        except Exception as e:
            raise self._err(e, key) from None
        n = min(len(got), len(out))
        out[:n] = memoryview(got)[:n]
        return n

    def head(self, key: str) -> ObjectInfo:
        try:
            info = self._fs.info(self._path(key))
        except Exception as e:
            raise self._err(e, key) from None
        if info.get("type") == "directory":
            raise ObjectMissing(errno.ENOENT, f"{key}: no such object")
        return ObjectInfo(key, int(info.get("size") or 0), _mtime(info))

    def scan(self, prefix: str) -> list[ObjectInfo]:
        base = prefix.rstrip("/")
        try:
            self._fs.invalidate_cache()
            found = self._fs.find(self._path(base), detail=True) if base else {}
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._err(e, prefix) from None
        out = [ObjectInfo(self._key(p), int(i.get("size") or 0), _mtime(i))
               for p, i in found.items()]  # fmt: skip
        return [o for o in out if o.key.startswith(prefix)]

    def list_dirs(self) -> tuple[list[str], list[str]]:
        try:
            self._fs.invalidate_cache()
            found = self._fs.ls(self._root, detail=True)
        except FileNotFoundError:
            return [], []
        except Exception as e:
            raise self._err(e, "/") from None
        dirs = [self._key(i["name"]) for i in found if i.get("type") == "directory"]
        files = [self._key(i["name"]) for i in found if i.get("type") != "directory"]
        return dirs, files

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            self._fs.rm([self._path(k) for k in keys])
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._err(e, keys[0]) from None

    def copy(self, src: str, dst: str) -> None:
        try:
            self._fs.copy(self._path(src), self._path(dst))
        except Exception as e:
            raise self._err(e, src) from None


def _mtime(info: Mapping[str, Any]) -> float:
    for k in ("mtime", "LastModified", "last_modified", "created"):
        if k in info:
            return _secs(info[k])
    return 0.0
