"""Corpora in object stores: a ``data.path`` URL (``s3://``, ``gs://``, ``hf://``, ``az://``, ``https://``, ...) is
opened with fsspec, credentials from the usual environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_PROFILE`` and ``AWS_ENDPOINT_URL`` for an S3-compatible server; ``GOOGLE_APPLICATION_CREDENTIALS``;
``HF_TOKEN``). A URL names one object, or a prefix whose ``.jsonl(.gz)`` / ``.parquet`` objects are read as one
corpus in sorted order. Nothing is downloaded whole: the readers stream each object ([`RemoteSource.open`][ccexp.data.remote.RemoteSource.open]:
the filesystem's read-ahead, s3fs's 50 MiB blocks, cut into lines from 1 MiB reads), and a store that fails
mid-read is one line saying how far the read got ([`ObjectStream`][ccexp.data.remote.ObjectStream]).

The corpus stage keys a remote source by what the store says about each object it reads (ETag, version id or
generation, size: [`RemoteSource.identity`][ccexp.data.remote.RemoteSource.identity]), not by its bytes, so a changed object is re-read and an
unchanged one costs one metadata request.
"""
from __future__ import annotations

import hashlib
import io
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccexp.errors import CcexpError

log = logging.getLogger("ccexp")

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
SUFFIXES = {"jsonl": (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson", ".ndjson.gz"), "parquet": (".parquet",)}
# what a store says about an object that changes when its bytes do (S3 / S3-compatible, GCS, Azure, the Hub)
IDENTITY_KEYS = ("ETag", "etag", "VersionId", "version_id", "generation", "blob_id", "lfs", "md5Hash", "crc32c",
                 "content_md5", "checksum")
# where each store's credentials come from, for the one line of a refused or unreachable request
CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; AWS_ENDPOINT_URL for an "
                     "S3-compatible server",
               "gs": "GOOGLE_APPLICATION_CREDENTIALS", "gcs": "GOOGLE_APPLICATION_CREDENTIALS", "hf": "HF_TOKEN",
               "az": "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME and a key or token",
               "abfs": "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME and a key or token"}
# bytes of one read from an object's file: lines are cut from reads of this size out of the filesystem's read-ahead
# (s3fs: 50 MiB blocks), never from a whole block per line (fsspec's readline reads a block and seeks back, which
# copies up to a block per line: quadratic in the object's size below one block)
READ_BUFFER = 1 << 20


def _credentials(url: str) -> str:
    where = CREDENTIALS.get(_URL.match(url).group(1).lower())
    return (f"check the credentials and endpoint in the environment ({where})" if where else
            "check the URL and the store's credentials in the environment")


def is_url(path: Any) -> bool:
    """True for a ``scheme://`` string other than ``file://`` (those are local paths)."""
    if not isinstance(path, str):
        return False
    m = _URL.match(path)
    return bool(m) and m.group(1).lower() != "file"


def local_or_url(path: str | Path) -> str | Path:
    """A URL unchanged; a local path (``file://`` stripped, ``~`` expanded) as a [`Path`][pathlib.Path]."""
    if is_url(path):
        return str(path)
    path = str(path)
    return Path(path[len("file://"):] if path.lower().startswith("file://") else path).expanduser()


def format_of(name: str) -> str | None:
    """``jsonl`` or ``parquet`` from an object's name; None when the name does not tell."""
    name = name.lower()
    return next((fmt for fmt, ends in SUFFIXES.items() if name.endswith(ends)), None)


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:160]


def store_error(url: str, e: BaseException, key: str = "data.path") -> CcexpError:
    """The one line for an object store that refused or could not be reached (``key``: the setting that names
    ``url``)."""
    if isinstance(e, PermissionError):
        return CcexpError(f"{key}={url!r}: access denied ({_first_line(e)}); {_credentials(url)}")
    return CcexpError(f"{key}={url!r}: cannot be read from the object store ({type(e).__name__}: "
                      f"{_first_line(e)}); {_credentials(url)}")


def open_fs(url: str):
    """``(filesystem, path)`` of ``url`` through fsspec.

    Raises:
        CcexpError: fsspec, or the package of the URL's filesystem (s3fs, gcsfs, ...), is not installed, or the
            scheme is unknown.
    """
    scheme = _URL.match(url).group(1).lower()
    try:
        import fsspec
    except ImportError:
        raise CcexpError(f"data.path={url!r} is a URL, which needs the fsspec package; pip install fsspec") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        from fsspec.registry import known_implementations

        spec = known_implementations.get(scheme, {})
        package = spec.get("class", scheme).split(".")[0].replace("_", "-")
        raise CcexpError(f"data.path={url!r} needs the {package} package to read {scheme}:// URLs; "
                         f"pip install {package}") from None
    except ValueError as e:  # "Protocol not known"
        raise CcexpError(f"data.path={url!r}: {scheme}:// is not a filesystem fsspec knows ({_first_line(e)}); use "
                         "s3://, gs://, hf://, az://, https:// or a local path") from None
    except OSError as e:  # a filesystem that connects when it is made (ftp://, sftp://): host unknown, refused
        raise CcexpError(f"data.path={url!r}: cannot reach the {scheme}:// server ({_first_line(e)}); check the host, "
                         "the port and the network") from None


class ObjectStream(io.RawIOBase):
    """One object of a [`RemoteSource`][ccexp.data.remote.RemoteSource] as a raw binary stream over its fsspec file (ranged reads through
    the filesystem's read-ahead), for `io.BufferedReader`. Whatever the store raises while it is read (the
    server gone, a connection reset, a timeout after the filesystem's retries) becomes the one line of
    [`RemoteSource.read_error`][ccexp.data.remote.RemoteSource.read_error], naming how many bytes had arrived.

    ``received`` counts the bytes the file delivered and ``reads`` the reads that delivered them."""

    def __init__(self, source: "RemoteSource", obj: str, f):
        self._src, self._obj, self._f = source, obj, f
        self.size: int | None = getattr(f, "size", None)
        self.received = self.reads = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self._f.seekable())

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        data = self._read(out.nbytes)
        out[:len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self._read(-1)

    def _read(self, n: int) -> bytes:
        try:
            data = self._f.read(n)
        except Exception as e:  # the stores raise their own types (botocore's, aiohttp's, OSError, ...)
            raise self._src.read_error(self._obj, e, self.received, self.size) from None
        self.received += len(data)
        self.reads += bool(data)
        return data

    def close(self) -> None:
        if not self.closed:
            try:
                self._f.close()
            finally:
                super().close()


@dataclass(frozen=True)
class RemoteSource:
    """A corpus in an object store: its URL, its fsspec filesystem and the objects read (paths on ``fs``,
    sorted). ``key`` is the setting that names the URL in messages (``data.path``, or ``data.sources[i].path``)."""

    url: str
    fs: Any
    objects: tuple[str, ...]
    key: str = "data.path"

    def __str__(self) -> str:
        return self.url

    def name(self, obj: str) -> str:
        """An object's URL (for messages)."""
        return self.fs.unstrip_protocol(obj)

    def open(self, obj: str) -> io.BufferedReader:
        """The object as a buffered binary file that reads ranges on demand, not a download: the filesystem's
        read-ahead (s3fs: blocks of 50 MiB; ``FSSPEC_S3_DEFAULT_BLOCK_SIZE`` sets another size) read in
        [`READ_BUFFER`][ccexp.data.remote.READ_BUFFER] pieces, so iterating its lines is linear in the object's size. A store that fails
        while it is read raises [`read_error`][ccexp.data.remote.RemoteSource.read_error]'s line.

        Raises:
            CcexpError: the object no longer exists, or the store refuses or cannot be reached.
        """
        try:
            f = self.fs.open(obj, "rb", cache_type="readahead")
        except FileNotFoundError:
            raise CcexpError(f"{self.key}={self.url!r}: {self.name(obj)} no longer exists") from None
        except Exception as e:  # the stores raise their own types for refused or unreachable requests
            raise store_error(self.url, e, self.key) from None
        return io.BufferedReader(ObjectStream(self, obj, f), READ_BUFFER)

    def read_error(self, obj: str, e: BaseException, received: int, size: int | None) -> CcexpError:
        """The one line for a store that failed while ``obj`` was read, ``received`` bytes (of ``size``) in; an
        object overwritten meanwhile (s3fs reads with ``If-Match: <ETag>`` and raises ``FileExpired``) is the
        corpus stage's "changed while it was read" line."""
        if type(e).__name__ == "FileExpired":
            return CcexpError(f"{self.key}={self.url!r} changed in the object store while it was read; run again")
        of = "" if self.name(obj) == self.url else f" of {self.name(obj)}"
        share = f" ({received / size:.1%} of {size:,})" if size else ""
        return CcexpError(f"{self.key}={self.url!r}: cannot be read from the object store ({type(e).__name__}: "
                          f"{_first_line(e)}) after {received:,} bytes{of}{share}; check the endpoint and network, "
                          "then run again")

    def identity(self) -> list[dict]:
        """For each object read, what the store says identifies its bytes — ETag and VersionId (S3), generation
        (GCS), blob id (the Hub), ... — and its size, asked afresh (fsspec's listing cache is dropped first).
        An object whose store says none of these is hashed (streamed), with a warning.

        Raises:
            CcexpError: an object is gone, or the store refuses.
        """
        self.fs.invalidate_cache()
        out = []
        for obj in self.objects:
            try:
                info = self.fs.info(obj)
            except FileNotFoundError:
                raise CcexpError(f"{self.key}={self.url!r}: {self.name(obj)} no longer exists") from None
            except Exception as e:  # the stores raise their own types for refused or unreachable requests
                raise store_error(self.url, e, self.key) from None
            ident = {k: info[k] for k in IDENTITY_KEYS if info.get(k) not in (None, "")}
            if not ident:
                log.warning("corpus: the store gives no ETag or version for %s; hashing its bytes to key the stage",
                            self.name(obj))
                h = hashlib.sha256()
                with self.open(obj) as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
                ident = {"sha256": h.hexdigest()}
            out.append({"name": self.name(obj), "size": info.get("size"), **ident})
        return out


def resolve(url: str, format: str = "auto") -> tuple[RemoteSource, str]:
    """The objects of ``url`` (one object, or a prefix's ``.jsonl(.gz)`` / ``.parquet`` objects) and their format,
    checked through the store without reading them.

    Raises:
        CcexpError: a missing object or prefix, a missing package, refused credentials, a prefix without corpus
            objects (or with both formats), a name that does not tell the format, or ``format=hf_disk``.
    """
    if format == "hf_disk":
        raise CcexpError(f"data.format=hf_disk reads a local datasets folder, not a URL ({url!r}); point data.path at "
                         ".jsonl, .jsonl.gz or .parquet objects (e.g. the Parquet files of a Hub dataset: "
                         "hf://datasets/<owner>/<name>/<file>.parquet)")
    fs, path = open_fs(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise CcexpError(f"data.path={url!r} does not exist; point data.path at a .jsonl, .jsonl.gz or .parquet "
                         "object, or a prefix holding them") from None
    except Exception as e:  # the stores raise their own types for refused or unreachable requests
        raise store_error(url, e) from None
    if info.get("type") != "directory":
        fmt = format_of(path) if format == "auto" else format
        if fmt is None:
            raise CcexpError(f"data.path={url!r}: cannot tell the format from the name; use a .jsonl, .jsonl.gz or "
                             ".parquet object, or set data.format=jsonl|parquet")
        return RemoteSource(url, fs, (path,)), fmt
    try:
        found = sorted(p for p in fs.find(path) if format_of(p))
    except Exception as e:
        raise store_error(url, e) from None
    formats = sorted({format_of(p) for p in found})
    if format != "auto":
        found = [p for p in found if format_of(p) == format]
    elif len(formats) > 1:
        raise CcexpError(f"data.path={url!r} holds both .jsonl and .parquet objects; set data.format=jsonl or "
                         "data.format=parquet to read one kind")
    if not found:
        raise CcexpError(f"data.path={url!r} is a prefix without {'.' + format if format != 'auto' else '.jsonl(.gz) or .parquet'} "
                         "objects; point data.path at one object, or a prefix holding them")
    return RemoteSource(url, fs, tuple(found)), format if format != "auto" else formats[0]
