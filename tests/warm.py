"""A warm start for the tests' ``python -m <module>`` commands: one process per pytest worker imports what every
ccexp command imports (torch, Lightning, MLflow, Hydra, sentence-transformers: about 8 s of a tiny run's 20 s), then
forks a child for each command. The child is a real process of its own (its own pid, exit status, signals, stdout,
stderr, working directory and environment) that runs the module as ``python -m`` does (``runpy``, ``__main__``,
the working directory first on ``sys.path``) and ends through the interpreter's normal exit (threads joined,
``atexit`` run), so a test sees what a user's fresh process gives. Only the imports are shared, as
``multiprocessing``'s forkserver shares its preloaded modules.

A warm process serves the commands whose environment is the one it was started with in every variable that
imports can read (all but the prefixes in ``RUNTIME_VARIABLES``, and those the imports set themselves); a worker
keeps at most two (with and without ``PYTHONWARNINGS=ignore``), and runs any other command in a fresh process, as
it does every command when a warm process cannot start. ``CCEXP_TESTS_FRESH=1`` runs every command fresh (to
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

    def run(self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
            merge: bool) -> tuple[int, str, str] | None:
        """``(returncode, stdout, stderr)`` of the command run in a child, or None where this process is gone."""
        with tempfile.TemporaryDirectory(prefix="ccexp-warm-") as tmp:
            request = {"module": module, "args": list(args), "cwd": str(cwd), "env": {**env, **self.imported},
                       "stdout": f"{tmp}/out", "stderr": None if merge else f"{tmp}/err"}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            started = self._answer(60)
            if started is None:
                self.stop()
                return None
            ended = self._answer(timeout)
            if ended is None:
                os.kill(started["pid"], signal.SIGKILL)
                self._answer(60)
                raise subprocess.TimeoutExpired([module, *args], timeout)
            code = os.waitstatus_to_exitcode(ended["status"])
            read = lambda p: Path(p).read_text(errors="replace") if Path(p).exists() else ""  # noqa: E731
            return code, read(f"{tmp}/out"), "" if merge else read(f"{tmp}/err")


class _Pool:
    """This pytest worker's warm processes, one per import-time environment (at most ``MAX_WARM``; a command of
    another environment runs fresh), each started on first use; one command at a time."""

    MAX_WARM = 2

    def __init__(self) -> None:
        self.warm: dict[frozenset, _Warm | None] = {}  # None: it could not start
        self.imported: set[str] = set()
        self.lock = threading.Lock()
        self.fresh = os.environ.get("CCEXP_TESTS_FRESH") == "1"

    def run(self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
            merge: bool) -> tuple[int, str, str] | None:
        with self.lock:
            key = _imports_see(env, self.imported)
            if self.fresh or (key not in self.warm and len(self.warm) >= self.MAX_WARM):
                return None
            if key not in self.warm:
                started = _Warm(env)
                self.warm[key] = started if started.proc is not None else None
                if not set(started.imported) <= self.imported:  # learnt: key the pool without them
                    self.imported |= set(started.imported)
                    self.warm = {_imports_see(dict(k), self.imported): w for k, w in self.warm.items()}
                    key = _imports_see(env, self.imported)
            warm = self.warm[key]
            done = warm.run(module, args, cwd, env, timeout, merge) if warm is not None else None
            if warm is not None and warm.proc is None:
                self.warm[key] = None  # gone: the commands of its environment run fresh from now on
            return done


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
    if os.environ.get("CCEXP_TESTS_WARM_LOG"):  # where each command ran and how long it took
        with open(os.environ["CCEXP_TESTS_WARM_LOG"], "a") as log:
            log.write(f"{'fresh' if done is None else 'warm'} {time.monotonic() - started:.1f} "
                      f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]} {module}\n")
    return proc


if __name__ == "__main__":
    _serve()
