"""Corpora in object stores: a ``data.path`` URL (``s3://``, ``gs://``, ``hf://``, ``az://``, ``https://``, ...) is
opened with fsspec, credentials from the usual environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_PROFILE`` and ``AWS_ENDPOINT_URL`` for an S3-compatible server; ``GOOGLE_APPLICATION_CREDENTIALS``;
``HF_TOKEN``). A URL names one object, or a prefix whose ``.jsonl(.gz)`` / ``.parquet`` objects are read as one
corpus in sorted order. Nothing is downloaded whole: the readers stream each object.

The corpus stage keys a remote source by what the store says about each object it reads (ETag, version id or
generation, size: :meth:`RemoteSource.identity`), not by its bytes, so a changed object is re-read and an
unchanged one costs one metadata request.
"""
from __future__ import annotations

import hashlib
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
    """A URL unchanged; a local path (``file://`` stripped, ``~`` expanded) as a :class:`Path`."""
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


def store_error(url: str, e: BaseException) -> CcexpError:
    """The one line for an object store that refused or could not be reached."""
    if isinstance(e, PermissionError):
        return CcexpError(f"data.path={url!r}: access denied ({_first_line(e)}); {_credentials(url)}")
    return CcexpError(f"data.path={url!r}: cannot be read from the object store ({type(e).__name__}: "
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


@dataclass(frozen=True)
class RemoteSource:
    """A corpus in an object store: its URL, its fsspec filesystem and the objects read (paths on ``fs``,
    sorted)."""

    url: str
    fs: Any
    objects: tuple[str, ...]

    def __str__(self) -> str:
        return self.url

    def name(self, obj: str) -> str:
        """An object's URL (for messages)."""
        return self.fs.unstrip_protocol(obj)

    def open(self, obj: str):
        """The object as a binary file that reads ranges on demand (a bounded read-ahead), not a download."""
        return self.fs.open(obj, "rb")

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
                raise CcexpError(f"data.path={self.url!r}: {self.name(obj)} no longer exists") from None
            except Exception as e:  # the stores raise their own types for refused or unreachable requests
                raise store_error(self.url, e) from None
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
