"""The exception types a user sees: [`CcexpError`][ccexp.errors.CcexpError] for problems a user can fix (bad input, bad
config, missing files) and [`Interrupted`][ccexp.errors.Interrupted] for a run stopped by a signal.

The command-line entry point prints a [`CcexpError`][ccexp.errors.CcexpError] as a single line, ``ccexp: error: ...``,
and exits with status 2; any other exception is a bug and keeps its traceback.
"""


class CcexpError(Exception):
    """A user-facing error: the message names what is wrong and how to fix it, in one line."""


class Interrupted(BaseException):
    """The run was stopped by a signal (SIGTERM from Slurm or Kubernetes, SIGINT from Ctrl-C).

    A ``BaseException``, so no ``except Exception`` swallows it; the CLI prints its message as one
    line and exits with ``128 + signal number`` (143 for SIGTERM, 130 for SIGINT). ``pass_on`` is the
    handler that listened for the signal before ccexp did (submitit's, which requeues a Slurm job on
    SIGUSR2): the entry point calls it once the run is closed.
    """

    def __init__(self, signum: int, message: str = "", pass_on=None, step: int | None = None):
        import signal

        self.signum = int(signum)
        self.step = step  # the optimizer steps done when it stopped (None: not known)
        self.name = signal.Signals(self.signum).name
        self.pass_on = pass_on
        super().__init__(message or f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StoppedEarly(BaseException):
    """Training ended before its budget because a callback stopped it (``callbacks=timer``, early stopping,
    any callback that sets ``trainer.should_stop``): the run is *incomplete* — its metrics are those of the
    step reached, its MLflow run is KILLED (never FINISHED), a sweep does not keep it as done, and its
    resume continues to the end. The CLI prints the message as one line and exits with status 75
    (``EX_TEMPFAIL``: not done, run again to continue)."""

    exit_code = 75

    def __init__(self, step: int, steps: int, checkpoint: str, by: str):
        self.step, self.steps = int(step), int(steps)
        super().__init__(f"stopped by {by} after step {step} of {steps}, before the run's budget: the run is not "
                         f"complete (its metrics are of step {step}); run the same command again to continue it (or "
                         f"train.resume_from={checkpoint})")


def raise_interrupted(signum, frame) -> None:
    """A signal handler: raise [`Interrupted`][ccexp.errors.Interrupted] for ``signum``, with SIGINT and SIGTERM ignored from then
    on, so no further signal cuts short the closing of the run (MLflow KILLED, status files)."""
    import signal

    for other in (signal.SIGINT, signal.SIGTERM):
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)


class Refused(BaseException):
    """A [`CcexpError`][ccexp.errors.CcexpError] raised where a framework would swallow an ``Exception`` (Hydra catches
    what its callbacks raise): the CLI prints it as one line and exits with status 2."""


def one_line(exc: BaseException) -> str:
    """Condense Hydra/OmegaConf error text into one line: drop the search-path dump and the
    full_key/object_type details, list available options comma-separated, and append the
    underlying cause (e.g. the type error behind "Error merging override")."""
    parts: list[str] = []
    options: list[str] = []
    for ln in (x.strip() for x in str(exc).splitlines()):
        if ln.startswith("Config search path"):
            break
        if not ln or ln.startswith(("Set the environment variable HYDRA_FULL_ERROR", "full_key:", "object_type=",
                                    "reference_type=", "Traceback")):
            continue
        if ln.startswith("Available options"):
            parts.append(ln)
        elif parts and parts[-1].startswith("Available options") and " " not in ln:
            options.append(ln)
        else:
            parts.append(ln)
    text = " ".join(p + (" " + ", ".join(options) if p.startswith("Available options") else "") for p in parts)
    text = text.replace("CcexpError raised while resolving interpolation: ", "")  # ours, from a resolver
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        text += " (" + one_line(cause) + ")"
    return text


def not_utf8_line(name: str, exc: UnicodeDecodeError, kind: str = "UTF-8 text") -> str:
    """The one line for a file that is not UTF-8 text: ``<name> is not UTF-8 text (byte 0xe9 at offset 29);
    save it as <kind>`` (``name`` names the setting and the file)."""
    byte = exc.object[exc.start:exc.start + 1]
    shown = f"byte 0x{byte[0]:02x}" if byte else "a byte"
    return f"{name} is not UTF-8 text ({shown} at offset {exc.start}); save it as {kind}"


def disk_full_line(exc: BaseException, folder=None, settings: dict | None = None) -> str | None:
    """The one line for an error caused by a full disk (or a quota), or None for any other: an ``OSError``
    ENOSPC/EDQUOT anywhere in the exception's chain, SQLite's "database or disk is full", or a failed
    write when the disk holding ``folder`` has (almost) no space left (torch reports a failed checkpoint
    write as a RuntimeError).

    ``settings`` (setting -> folder: ``paths.outputs``, ``paths.cache``, a logger's ``save_dir``; default
    ``{"paths.outputs": folder}``) names the disk: the file the error names, else the first of them whose disk has
    (almost) no space left (a library's writer thread, e.g. TensorBoard's, reports ENOSPC without a file name), and
    the line tells to set the setting whose folder holds it."""
    import errno

    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    settings = {k: v for k, v in (settings or ({"paths.outputs": folder} if folder is not None else {})).items() if v}
    where, full = None, False
    for e in chain:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):  # a copy's target is filename2
            full, where = True, e.filename2 or e.filename or where
        elif "database or disk is full" in str(e) or "No space left on device" in str(e):
            full = True
    if not full and any(w in str(e).lower() for e in chain for w in ("write", "written")):  # numpy: "N requested
        full = any(_free_bytes(p) < (1 << 20) for p in [*settings.values(), *([folder] if folder else [])])  # and M written"
    if not full:
        return None
    if where is None:  # the file is not named: the disk that is full, of those the run writes to
        where = next((path for path in settings.values() if _free_bytes(path) < (1 << 20)), folder)
    place = _existing(where or ".")
    place = place if place.is_dir() else place.parent
    setting = next((name for name, path in sorted(settings.items(), key=lambda kv: -len(str(_existing(kv[1]))))
                    if place == _existing(path) or _existing(path) in place.parents), "paths.outputs")
    return (f"no space left on the disk holding {place}: free some space there, or set {setting} to a folder "
            "on a larger disk; stages, checkpoints and the MLflow store are written whole or not at all, so nothing "
            "half-written was kept and the same command can run again")


def _existing(path):
    """``path`` (expanded, absolute) or its nearest folder above that exists."""
    from pathlib import Path

    path = Path(str(path)).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _free_bytes(path) -> int:
    """Free bytes on the disk holding ``path`` (or its nearest existing folder); a large number when unknown."""
    import shutil

    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return 1 << 62
