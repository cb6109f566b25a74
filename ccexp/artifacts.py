"""Content-addressed stage store: ``<cache>/<stage>/<fingerprint>/`` with atomic publish.

A stage's fingerprint hashes its own config, the fingerprints of its inputs and a stage version
(the Marin executor's rule: an output path is its step's config plus inputs). A stage writes into
a temporary sibling folder and renames it into place only when complete, after writing a
``DONE`` marker, so an interrupted stage never looks finished and is simply recomputed. Runs that
need the same stage at once serialise on a per-fingerprint file lock ([`StageStore.lock`][ccexp.artifacts.StageStore.lock]): one
computes, the others wait and reuse its output.
"""
from __future__ import annotations

import errno
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
        """A file lock (``<root>/.locks/<stage>-<fp>.lock``) held while a run computes that stage output
        ([`file_lock`][ccexp.artifacts.file_lock]: none, with a warning, on a file system without locks)."""
        (self.root / ".locks").mkdir(parents=True, exist_ok=True)
        return file_lock(self.root / ".locks" / f"{stage}-{fp}.lock", "two runs may compute the same stage at once")

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


# what flock answers on a file system without lock support: NFSv3 without lockd (ENOLCK), Lustre mounted without
# -o flock (ENOSYS), some FUSE and SMB mounts (EOPNOTSUPP)
NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)})
_WARNED_NO_LOCKS: set[str] = set()


def no_locks_warning(folder: Path, error: OSError, consequence: str) -> None:
    """Say once per folder that its file system gives no locks (``error``, whose errno is in
    [`NO_LOCKS`][ccexp.artifacts.NO_LOCKS]) and what that leaves unguarded."""
    key = str(folder)
    if key not in _WARNED_NO_LOCKS:
        _WARNED_NO_LOCKS.add(key)
        logging.getLogger("ccexp").warning(
            "locks: the file system of %s gives no file locks (%s: %s), so %s; put it on a file system with locks "
            "(a local disk, NFS with lockd, Lustre mounted with -o flock) to keep concurrent runs apart", folder,
            errno.errorcode.get(error.errno or 0, "?"), error.strerror or error, consequence)


@contextmanager
def file_lock(path: Path, consequence: str) -> Iterator[None]:
    """Hold a ``filelock.FileLock`` on ``path`` for the block. On a file system without locks (flock fails with an
    errno of [`NO_LOCKS`][ccexp.artifacts.NO_LOCKS]) the block runs without one, after one warning naming the folder
    and the ``consequence`` (a lock that cannot be taken there is no reason to lose the run)."""
    from filelock import FileLock

    lock = FileLock(str(path))
    try:
        lock.acquire()
    except OSError as e:
        if e.errno not in NO_LOCKS:
            raise
        no_locks_warning(Path(path).parent, e, consequence)
        yield
        return
    try:
        yield
    finally:
        lock.release()


STALE_S = 7 * 24 * 3600  # another node's temporary folder untouched this long is abandoned


def _host() -> str:
    import socket

    return socket.gethostname().replace("~", "_").replace("/", "_")


def _modified(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


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
        elif pid is None or not pid_alive(pid, started_by=_modified(tmp)):  # a pid reused since: not the writer
            shutil.rmtree(tmp, ignore_errors=True)


PID_START_SLACK_S = 2.0  # a process's start time is known to the clock tick, the boot time it counts from to ~1 s


def process_created(pid: int | None = None) -> float | None:
    """When process ``pid`` (this one by default) started, in seconds since the epoch (``psutil.Process.create_time``:
    the same value each time it is read on this machine), or None when it cannot be read."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def pid_alive(pid: int, started_by: float | None = None, created: float | None = None) -> bool:
    """True when process ``pid`` exists on this machine (another user's process counts) and is the process that
    recorded it: given ``created`` (its [`process_created`][ccexp.artifacts.process_created] when it recorded the
    pid), it started then; else, given ``started_by`` (seconds since the epoch when the recorder was running), no
    later than that (within [`PID_START_SLACK_S`][ccexp.artifacts.PID_START_SLACK_S]). After a SIGKILL, the OOM killer
    or a reboot a pid is soon another program's. A start time that cannot be read counts as alive. A pid that no
    process can have (0, negative: a process group to ``kill``, beyond the C int) is no process."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass
    if created is None and started_by is None:
        return True
    now = process_created(pid)
    if now is None:
        return True
    return abs(now - created) < 0.5 if created is not None else now <= started_by + PID_START_SLACK_S
