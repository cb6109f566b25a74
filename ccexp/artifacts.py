"""Content-addressed stage store: ``<cache>/<stage>/<fingerprint>/`` with atomic publish.

A stage's fingerprint hashes its own config, the fingerprints of its inputs and a stage version
(the Marin executor's rule: an output path is its step's config plus inputs). A stage writes into
a temporary sibling folder and renames it into place only when complete, after writing a
``DONE`` marker, so an interrupted stage never looks finished and is simply recomputed. Runs that
need the same stage at once serialise on a per-fingerprint file lock ([`StageStore.lock`][ccexp.artifacts.StageStore.lock]): one
computes, the others wait and reuse its output.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("ccexp")

DONE = "DONE"


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or not at all: written to a temporary sibling, then renamed into place
    (a kill or a full disk mid-write leaves the previous file, never a truncated one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def replace_folder(new: Path, final: Path) -> None:
    """Put folder ``new`` at ``final`` (a folder, a file, or nothing): the old one is renamed aside first and removed
    after, so ``final`` is always either the old whole content or the new whole one (absent only for the instant
    between two renames)."""
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:12]}") if final.exists() else None
    if old is not None:
        os.replace(final, old)
    os.replace(new, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)


@contextmanager
def folder_written_whole(final: Path) -> Iterator[Path]:
    """Write a folder at ``final`` whole or not at all: the body writes into the yielded temporary sibling
    (``.<name>.tmp-<id>``), which replaces ``final`` ([`replace_folder`][ccexp.artifacts.replace_folder]) when the body
    ends, and is removed if it raises."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_folder(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def folder_problem(path: Path) -> str | None:
    """Why folder ``path`` cannot be made or written, or None when it can: its nearest existing ancestor is not a
    folder or not writable, or making it fails (a name too long, a read-only file system; tried for real, and what
    was made removed again)."""
    path = Path(path).expanduser().absolute()
    probe = path
    try:
        while not probe.exists():
            if probe.parent == probe:
                return "no part of it exists"
            probe = probe.parent
    except OSError as e:  # a name longer than the file system takes: asking for it already fails
        return f"{e.strerror or type(e).__name__}"
    if not probe.is_dir():
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    if probe == path:
        return None
    try:
        path.mkdir(parents=True)
    except OSError as e:
        return f"{e.strerror or type(e).__name__}"
    made = path
    while made != probe:  # what the try made, deepest first
        made.rmdir()
        made = made.parent
    return None


def fingerprint(stage: str, version: int, config: Any, inputs: dict[str, str] | None = None) -> str:
    """Return a 16-hex-digit SHA-256 fingerprint of ``(stage, version, config, inputs)``.

    ``config`` must be JSON-serialisable (plain dicts/lists/scalars); keys are sorted so the
    fingerprint does not depend on dict order.
    """
    payload = json.dumps({"stage": stage, "version": version, "config": config, "inputs": inputs or {}},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    """SHA-256 (hex, 16 digits) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()[:16]


def path_digest(path: Path) -> str:
    """[`file_digest`][ccexp.artifacts.file_digest] of a file; of a folder (a ``datasets`` folder), SHA-256 (16 hex digits) over its
    files' relative paths and digests, in sorted order."""
    path = Path(path)
    if not path.is_dir():
        return file_digest(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path).as_posix()}:{file_digest(f)}\n".encode())
    return h.hexdigest()[:16]


class StageStore:
    """Stage outputs under ``root/<stage>/<fingerprint>/``; see the module docstring."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, stage: str, fp: str) -> Path:
        return self.root / stage / fp

    def is_done(self, stage: str, fp: str) -> bool:
        return (self.path(stage, fp) / DONE).is_file()

    def wait(self, stage: str, fp: str, poll_s: float = 1.0, until=None) -> None:
        """Block until ``<stage>/<fp>`` is published (by rank 0 or another run) — or, with ``until`` (a
        path), until that file exists first."""
        while not self.is_done(stage, fp) and not (until is not None and Path(until).is_file()):
            time.sleep(poll_s)

    def lock(self, stage: str, fp: str):
        """A file lock (``<root>/.locks/<stage>-<fp>.lock``) held while a run computes that stage output."""
        from filelock import FileLock

        (self.root / ".locks").mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / ".locks" / f"{stage}-{fp}.lock"))

    @contextmanager
    def publish(self, stage: str, fp: str, meta: dict[str, Any] | None = None) -> Iterator[Path]:
        """Yield a temporary folder to write into; on success, mark it done and rename it.

        On any exception the temporary folder is removed and nothing is published.
        """
        final = self.path(stage, fp)
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(final.parent)
        tmp = final.parent / f".tmp-{fp}-{os.getpid()}-{uuid.uuid4().hex[:8]}~{_host()}"
        tmp.mkdir()
        try:
            yield tmp
            info = {"stage": stage, "fingerprint": fp, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    **(meta or {})}
            (tmp / "meta.json").write_text(json.dumps(info, indent=2, default=str))
            (tmp / DONE).write_text("ok\n")
            if final.exists():  # an incomplete leftover (no DONE), or a concurrent writer won
                if (final / DONE).is_file():
                    shutil.rmtree(tmp)
                    return
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


STALE_S = 7 * 24 * 3600  # another node's temporary folder untouched this long is abandoned


def _host() -> str:
    import socket

    return socket.gethostname().replace("~", "_").replace("/", "_")


def _remove_orphans(stage_dir: Path) -> None:
    """Delete temporary folders left by writers that were killed: on this node, those whose process no
    longer exists; another node's (a shared file system) only when untouched for [`STALE_S`][ccexp.artifacts.STALE_S]
    seconds, since its process cannot be checked from here."""
    for tmp in stage_dir.glob(".tmp-*"):
        name, _, host = tmp.name.partition("~")
        parts = name.split("-")
        pid = int(parts[2]) if len(parts) >= 4 and parts[2].isdigit() else None
        if host and host != _host():
            try:
                stale = time.time() - tmp.stat().st_mtime > STALE_S
            except FileNotFoundError:
                continue
            if stale:
                shutil.rmtree(tmp, ignore_errors=True)
        elif pid is None or not pid_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """True when process ``pid`` exists on this machine (another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
