"""A warm start for the tests' ``python -m <module>`` commands: one process per pytest worker imports what every
ccexp command imports (torch, Lightning, MLflow, Hydra, sentence-transformers: about 8 s of a tiny run's 20 s), then
forks a child for each command. The child is a real process of its own (its own pid, exit status, signals, stdout,
stderr, working directory and environment) that runs the module as ``python -m`` does (``runpy``, ``__main__``,
the working directory first on ``sys.path``) and ends through the interpreter's normal exit (threads joined,
``atexit`` run), so a test sees what a user's fresh process gives. Only the imports are shared, as
``multiprocessing``'s forkserver shares its preloaded modules.

A warm process serves the commands whose environment is the one it was started with in every variable that
imports can read (all but the prefixes in ``RUNTIME_VARIABLES``, and those the imports set themselves); a worker
keeps at most three (with and without ``PYTHONWARNINGS=ignore``, and one other), and runs any other command in a
fresh process, as it does every command when a warm process cannot start. ``CCEXP_TESTS_FRESH=1`` runs every command fresh (to
compare); ``CCEXP_TESTS_WARM_LOG=<file>`` appends where each command ran and its seconds.

Run as a script, this file is the warm process: it reads one JSON request per line on stdin and answers
``{"pid": n}`` when the child starts and ``{"status": waitpid's status}`` when it ends."""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# modules every ccexp command imports sooner or later; imported once, before any fork
PRELOAD = ("torch", "lightning", "mlflow", "mlflow.store.db.utils", "mlflow.store.tracking.sqlalchemy_store",
           "hydra", "omegaconf", "sentence_transformers", "transformers", "faiss", "ccexp.pipeline")
# variables read when they are needed, not when a module is imported: a command may set these and still run warm
RUNTIME_VARIABLES = ("MLFLOW_", "CCEXP_", "AWS_", "TMPDIR", "SLURM_", "NO_MKDOCS", "PYTEST_")


def _serve() -> None:
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    before = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    imported = {k: v for k, v in os.environ.items() if before.get(k) != v}  # what importing torch sets (KMP_...)
    gc.freeze()  # a child's collections then never walk (and so copy, page by page) what the imports made
    answers.write(json.dumps({"ready": True, "threads": len(os.listdir("/proc/self/task")), "env": imported}) + "\n")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            _child(request)  # ends the process: its exit status is the command's
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": status}) + "\n")


def _child(request: dict) -> None:
    import atexit
    import runpy

    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if request["stderr"] is None else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR is read again
    sys.argv = [request["module"], *request["args"]]
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:  # what the interpreter does with it
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (an uncaught exception: its traceback, status 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    # the interpreter's exit without its teardown of every module the preload imported (the seconds of it are not
    # the command's): non-daemon threads joined, atexit handlers run, output flushed, as Py_FinalizeEx begins
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code & 0xFF)


def _imports_see(env: dict[str, str], imported: set[str]) -> frozenset:
    """The part of ``env`` a process's imports can read: all but the run-time variables and those the preloaded
    imports set themselves."""
    return frozenset((k, v) for k, v in env.items() if not k.startswith(RUNTIME_VARIABLES) and k not in imported)


class _Warm:
    """One warm process, for the commands whose import-time environment is the one it was started with."""

    def __init__(self, env: dict[str, str]) -> None:
        self.buffer = b""
        self.busy = False  # claimed by a command that has not ended yet (``_Pool.warm_for`` sets it)
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, cwd=Path(__file__).parent)
        ready = self._answer(600)
        self.imported: dict[str, str] = ready["env"] if ready else {}  # what its imports set (KMP_..., as fresh ones)
        if not ready:
            self.stop()

    def _answer(self, timeout: float) -> dict | None:
        """The warm process's next answer line, None at its end or after ``timeout`` seconds. Read from the pipe's
        descriptor with a buffer of its own: two answers can arrive in one read (a child that ends at once), and a
        buffered reader would hold the second where ``select`` cannot see it."""
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def start(self, module: str, args: list[str], cwd: Path, env: dict[str, str], stdout: str,
              stderr: str | None) -> int | None:
        """The pid of the command started in a child (its output written to the files ``stdout`` and ``stderr``,
        None: into ``stdout``), or None where this process is gone. Its end is the next answer
        ([`ended`][warm._Warm.ended]); the process serves one command at a time."""
        request = {"module": module, "args": list(args), "cwd": str(cwd), "env": {**env, **self.imported},
                   "stdout": stdout, "stderr": stderr}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started = self._answer(60)
        if started is None:
            self.stop()
            self.busy = False
            return None
        return started["pid"]

    def ended(self, pid: int, timeout: float) -> int | None:
        """The exit code of the child ``pid`` (as ``Popen.returncode``: minus the signal that killed it), None while
        it runs after ``timeout`` seconds."""
        ended = self._answer(timeout)
        if ended is None:
            if self.proc is not None and self.proc.poll() is not None:  # the warm process itself is gone
                self.stop()
                self.busy = False
                raise RuntimeError(f"the warm process that ran pid {pid} ended")
            return None
        self.busy = False
        return os.waitstatus_to_exitcode(ended["status"])

    def run(self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
            merge: bool) -> tuple[int, str, str] | None:
        """``(returncode, stdout, stderr)`` of the command run in a child, or None where this process is gone."""
        with tempfile.TemporaryDirectory(prefix="ccexp-warm-") as tmp:
            pid = self.start(module, args, cwd, env, f"{tmp}/out", None if merge else f"{tmp}/err")
            if pid is None:
                return None
            code = self.ended(pid, timeout)
            if code is None:
                os.kill(pid, signal.SIGKILL)
                self.ended(pid, 60)
                raise subprocess.TimeoutExpired([module, *args], timeout)
            read = lambda p: Path(p).read_text(errors="replace") if Path(p).exists() else ""  # noqa: E731
            return code, read(f"{tmp}/out"), "" if merge else read(f"{tmp}/err")


class _Pool:
    """This pytest worker's warm processes, one per import-time environment (at most ``MAX_WARM``; a command of
    another environment runs fresh), each started on first use; one command at a time."""

    MAX_WARM = 3

    def __init__(self) -> None:
        self.warm: dict[frozenset, _Warm | None] = {}  # None: it could not start
        self.imported: set[str] = set()
        self.lock = threading.Lock()
        self.fresh = os.environ.get("CCEXP_TESTS_FRESH") == "1"
        self.why = ""  # why the last command ran fresh: the variables its environment differs in from a warm one

    def warm_for(self, env: dict[str, str]) -> _Warm | None:
        """The warm process for ``env``'s import-time environment, started on first use; None where the command
        runs fresh (``CCEXP_TESTS_FRESH``, a third environment, one that could not start, or one busy with a
        command still running in the background). ``self.why`` says why, for the log."""
        with self.lock:
            key = _imports_see(env, self.imported)
            if self.fresh or (key not in self.warm and len(self.warm) >= self.MAX_WARM):
                self.why = "" if self.fresh else "differs in " + ",".join(sorted(
                    {k for k, _ in key.symmetric_difference(min(self.warm, key=lambda w: len(w ^ key)))}))
                return None
            if key not in self.warm:
                started = _Warm(env)
                self.warm[key] = started if started.proc is not None else None
                if not set(started.imported) <= self.imported:  # learnt: key the pool without them
                    self.imported |= set(started.imported)
                    self.warm = {_imports_see(dict(k), self.imported): w for k, w in self.warm.items()}
                    key = _imports_see(env, self.imported)
            warm = self.warm[key]
            if warm is not None and warm.proc is None:
                self.warm[key] = warm = None  # gone: the commands of its environment run fresh from now on
            self.why = "busy with a command in the background" if warm is not None and warm.busy else ""
            if warm is None or warm.busy:
                return None
            warm.busy = True  # claimed under the lock: one command at a time; ``ended`` frees it
            return warm

    def run(self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
            merge: bool) -> tuple[int, str, str] | None:
        warm = self.warm_for(env)
        return warm.run(module, args, cwd, env, timeout, merge) if warm is not None else None


WARM = _Pool()


def python_m(module: str, *args: str, cwd: Path | str | None = None, env: dict[str, str] | None = None,
             timeout: float = 600, merge: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", module, *args], capture_output=True, text=True)`` (``merge``: stderr into
    stdout, as ``stderr=STDOUT``; ``env`` None: this process's), in a child of a warm process (module docstring)."""
    env = dict(os.environ if env is None else env)
    cwd = Path.cwd() if cwd is None else Path(cwd)
    started = time.monotonic()
    done = WARM.run(module, list(args), cwd, env, timeout, merge)
    cmd = [sys.executable, "-m", module, *args]
    if done is None:
        proc = subprocess.run(cmd, cwd=cwd, env=env, text=True, timeout=timeout, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT if merge else subprocess.PIPE)
    else:
        proc = subprocess.CompletedProcess(cmd, done[0], done[1], None if merge else done[2])
    _log(done is not None, started, module)
    return proc


def _log(warm: bool, started: float, module: str) -> None:
    """With ``CCEXP_TESTS_WARM_LOG``: where a command ran, its seconds, its test, and why it ran fresh."""
    if os.environ.get("CCEXP_TESTS_WARM_LOG"):
        with open(os.environ["CCEXP_TESTS_WARM_LOG"], "a") as log:
            log.write(f"{'warm' if warm else 'fresh'} {time.monotonic() - started:.1f} "
                      f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]} {module} {'' if warm else WARM.why}\n")


class Running:
    """A command started by [`python_popen`][warm.python_popen] in a child of a warm process: the part of
    ``subprocess.Popen`` the tests use (``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``kill``, ``communicate``). Its output goes to files, not pipes: ``stdout`` (a path the test reads while it
    runs, or a temporary file) and ``stderr`` (a file of its own, or ``stdout``'s with ``merge``)."""

    def __init__(self, warm: _Warm, module: str, args: list[str], cwd: Path, env: dict[str, str],
                 stdout: Path | None, merge: bool) -> None:
        self.warm = warm
        self._files(module, args, stdout, merge)
        self.pid = warm.start(module, args, cwd, env, str(self.stdout_path),
                              None if merge else str(self.stderr_path))

    def _files(self, module: str, args: list[str], stdout: Path | None, merge: bool) -> None:
        """What a started command has before it runs: its argv, start time, and output files, there (empty) to
        read from the start, as Popen's open files are."""
        self.args = [sys.executable, "-m", module, *args]
        self.module, self.returncode, self.started = module, None, time.monotonic()
        self.tmp = tempfile.TemporaryDirectory(prefix="ccexp-running-")
        self.stdout_path = Path(stdout) if stdout is not None else Path(self.tmp.name) / "out"
        self.stderr_path = None if merge else Path(self.tmp.name) / "err"
        for path in (self.stdout_path, self.stderr_path):
            if path is not None:
                path.write_text("")

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self.warm.ended(self.pid, 0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._ended(self.warm.ended(self.pid, 1e9 if timeout is None else timeout))
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _ended(self, code: int | None) -> None:
        if code is not None and self.returncode is None:
            self.returncode = code
            _log(True, self.started, self.module)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """``(stdout, stderr)`` once the command has ended (stderr None with ``merge``)."""
        self.wait(timeout)
        read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
        return read(self.stdout_path), None if self.stderr_path is None else read(self.stderr_path)


def python_popen(module: str, *args: str, cwd: Path | str | None = None, env: dict[str, str] | None = None,
                 stdout: Path | None = None, merge: bool = False) -> Running:
    """``subprocess.Popen([python, "-m", module, *args], text=True)`` for a command a test signals or watches
    while it runs, started in a child of a warm process where one is free ([`Running`][warm.Running]), else
    fresh. ``stdout``: a file the output is written to as it comes (the test may read it meanwhile), else a
    temporary one that ``communicate`` reads; ``merge``: stderr into it too. A fresh process writes the same
    files."""
    env = dict(os.environ if env is None else env)
    cwd = Path.cwd() if cwd is None else Path(cwd)
    warm = WARM.warm_for(env)
    if warm is not None:
        running = Running(warm, module, list(args), cwd, env, stdout, merge)
        if running.pid is not None:
            return running
    return _FreshRunning(module, list(args), cwd, env, stdout, merge)


class _FreshRunning(Running):
    """[`Running`][warm.Running] in a fresh process (``subprocess.Popen`` writing the same files)."""

    def __init__(self, module: str, args: list[str], cwd: Path, env: dict[str, str], stdout: Path | None,
                 merge: bool) -> None:
        self._files(module, args, stdout, merge)
        with self.stdout_path.open("w") as out, open(self.stderr_path or os.devnull, "w") as err:
            self.proc = subprocess.Popen(self.args, cwd=cwd, env=env, stdout=out,
                                         stderr=subprocess.STDOUT if merge else err)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        if self.returncode is None and self.proc.poll() is not None:
            self.returncode = self.proc.returncode
            _log(False, self.started, self.module)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.proc.wait(timeout)
            self.poll()
        return self.returncode


if __name__ == "__main__":
    _serve()
