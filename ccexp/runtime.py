"""Process-wide settings of a run: offline flags, one line per library message, and the run's phase times."""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable


def run_command(main: Callable[[], object]) -> None:
    """Run a command's ``main`` (``python -m ccexp``, ``ccexp.plan``, ``ccexp.report``, ...) and exit as it says
    (``sys.exit`` of what it returns: None is status 0), without the interpreter's last full garbage collection:
    with torch, Lightning and MLflow loaded that collection alone took 3-4 s after a tiny run's ``done:`` line
    (``py-spy dump --native``: ``gc_collect_main`` during finalisation). ``gc.freeze`` moves every object to the
    permanent generation, which no collection visits; ``atexit`` handlers, open files and threads end as before."""
    import gc

    try:
        code = main()
    finally:
        gc.freeze()
    sys.exit(code)


def _thread_disk_full_in_one_line(args) -> None:
    """``threading.excepthook`` for a run: a library's writer thread (TensorBoard's event writer) that stops on a
    full disk is one warning line, not a traceback (the run's own error line names the disk when the library raises
    it again in the run); any other exception in a thread is printed as Python prints it."""
    from ccexp.errors import disk_full_line

    if disk_full_line(args.exc_value) is None:
        threading.__excepthook__(args)
        return
    logging.getLogger("ccexp").warning("thread %s stopped: %s", getattr(args.thread, "name", "?"),
                                       str(args.exc_value).splitlines()[0] if str(args.exc_value) else args.exc_type)


def quiet_libraries(sweep: bool = False) -> None:
    """Offline flags, and one line per message through Hydra's handlers (no duplicate or tip lines); in a
    ``sweep`` run in this process, each warning once on the console ([`once_on_the_console`][ccexp.runtime.once_on_the_console]);
    and in a launch of several ranks, this rank's GPU as the current device ([`use_this_ranks_gpu`][ccexp.runtime.use_this_ranks_gpu])."""
    use_this_ranks_gpu()
    threading.excepthook = _thread_disk_full_in_one_line
    if sweep:
        once_on_the_console()
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # it logs each CPU variant it tries
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "Tip:" not in r.getMessage())
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")  # Lightning's own use of a torch deprecation
    # on any machine with Slurm installed (a login node, a workstation): ccexp's Slurm launcher starts the
    # ranks with srun, and a run outside Slurm is not a mistake
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    # torch's FSDP1 about its own internals (ShardedTensor state dicts, a process group with gloo beside it), at every
    # checkpoint on every rank; and its NO_SHARD notice of a one-rank run, which ccexp's log line already states
    for message in (r"Please use DTensor instead and we are deprecating ShardedTensor",
                    r"`_get_pg_default_device` will be deprecated", r"Multiple backends are registered with this",
                    r"FSDP is switching to use `NO_SHARD`", r"When using ``NO_SHARD`` for ``ShardingStrategy``",
                    # reading a sharded checkpoint on one process (ccexp.training.export): what no_dist=True says
                    r"torch.distributed is disabled, unavailable or uninitialized",
                    # a continued run has its own folder: Lightning's note that the old one's best score is not reused
                    r"The dirpath has changed from"):
        warnings.filterwarnings("ignore", message=message)
    quiet_other_ranks()
    if not sys.stderr.isatty():  # redirected to a file: libraries' tqdm bars would be one \r-joined line
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' weight loading, lm-eval's requests, datasets
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass


def _not_ccexp_info(record: logging.LogRecord) -> bool:
    return record.name != "ccexp" or record.levelno >= logging.WARNING


def quiet_other_ranks() -> None:
    """On a rank other than 0 of a launch, ccexp's own lines below a warning stay off the console: they are in the
    rank's own ``ccexp-rank<r>.log``, and rank 0's console tells the run once, not once per rank (the libraries'
    lines, Lightning's "GLOBAL_RANK: 1" among them, still show)."""
    from ccexp.embedding.shards import launch_rank

    if launch_rank()[0] == 0:
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                and _not_ccexp_info not in handler.filters:
            handler.addFilter(_not_ccexp_info)


def use_this_ranks_gpu() -> None:
    """In a launch of several ranks with CUDA visible, make this rank's GPU the current device
    (``torch.cuda.set_device``) before any stage: whatever allocates on "cuda" lands there."""
    from ccexp.embedding.shards import launch_rank, local_rank

    torch = sys.modules.get("torch")
    if launch_rank()[1] > 1 and torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())


class OnceOnTheConsole(logging.Filter):
    """Pass a warning to the console once per process: the jobs of a local sweep share one process, and the
    same line (the same corpus, the same setting) from each job says nothing new. Each job's log file still
    holds every line (the filter sits on the console handlers only)."""

    def __init__(self) -> None:
        super().__init__("")
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


_ONCE: dict[int, OnceOnTheConsole] = {}  # id(a console's stream) -> its filter: what that console has shown


def once_on_the_console() -> None:
    """Give each console handler of the root logger the [`OnceOnTheConsole`][ccexp.runtime.OnceOnTheConsole] of its stream (Hydra makes new
    handlers for each job of a sweep, on the same stdout: the filter, and what it has shown, is the stream's)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                and not any(isinstance(f, OnceOnTheConsole) for f in handler.filters):
            handler.addFilter(_ONCE.setdefault(id(handler.stream), OnceOnTheConsole()))


def memory_bytes(reset: bool = False) -> tuple[str, int, int]:
    """``(what, now, peak)``: bytes this process holds on its device now and at most since the last ``reset``: the
    CUDA caching allocator's allocated bytes on this process's GPU once torch has initialised CUDA (what
    ``python -m ccexp.plan model`` plans per GPU), else the resident set (``VmRSS``, ``VmHWM`` of /proc/self/status:
    every allocation of the process, Python's and the libraries' included). ``reset`` starts a new peak
    (``torch.cuda.reset_peak_memory_stats``; writing 5 to /proc/self/clear_refs). ``(what, 0, 0)`` where neither can
    be read."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return "cuda_allocated", int(now), int(peak)
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        now, peak = (int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        return "rss", now, peak
    except (OSError, KeyError, ValueError):
        return "none", 0, 0


class Phases:
    """Wall-clock seconds of a run's phases, in order: ``start`` (from ``since``, a ``time.perf_counter()``
    value, or else from the process's start: Python, imports, Hydra's composition and the pre-flight), then
    each [`mark`][ccexp.runtime.Phases.mark]'s phase since the previous mark; and each phase's memory at its start and
    its peak ([`memory_bytes`][ccexp.runtime.memory_bytes]), which ``benches/bench_fsdp_memory.py`` and the GPU check
    hold against ``python -m ccexp.plan model``'s plan."""

    def __init__(self, since: float | None = None) -> None:
        import psutil

        self._last = time.perf_counter()
        start = self._last - since if since is not None else time.time() - psutil.Process().create_time()
        self.seconds: dict[str, float] = {"start": max(0.0, start)}
        self.memory_kind, self._memory_at, _ = memory_bytes(reset=True)
        self.memory: dict[str, dict[str, int]] = {}  # phase -> {"start": bytes, "peak": bytes}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
        kind, held, peak = memory_bytes(reset=True)
        if kind != self.memory_kind:  # CUDA came up during the phase: its allocator counts from then
            self.memory_kind, self._memory_at = kind, 0
        before = self.memory.get(phase, {"start": self._memory_at, "peak": 0})
        self.memory[phase] = {"start": before["start"], "peak": max(before["peak"], peak)}
        self._memory_at = held

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def line(self) -> str:
        """``time: 112 s = start 14 s (12%) · embed 50 s (45%) · ...``, every phase of at least 0.5 s."""
        total = self.total
        parts = [f"{name} {secs:.0f} s ({100 * secs / total:.0f}%)" for name, secs in self.seconds.items()
                 if secs >= 0.5]
        return f"time: {total:.0f} s = " + " · ".join(parts)

    def metrics(self) -> dict[str, float]:
        """``time/phase_<phase>_seconds`` for each phase (``+`` as ``_``) and ``time/total_seconds``, the
        ``reports`` phase marked first."""
        self.mark("reports")
        return {**{f"time/phase_{name.replace('+', '_')}_seconds": secs for name, secs in self.seconds.items()},
                "time/total_seconds": self.total}

    def done(self, name: str, train_seconds: float, tokens: int, run_dir: Path) -> None:
        """Close the ``reports`` phase and log the run's last two lines: [`line`][ccexp.runtime.Phases.line], then ``done:`` with the
        run's name, time, training throughput, folder and balance report."""
        self.mark("reports")
        log = logging.getLogger("ccexp")
        log.info(self.line())
        balance = run_dir / "balance" / "balance.md"
        trained = f"train {train_seconds:.0f} s, {tokens / train_seconds:.0f} tokens/s" if tokens > 0 else \
            "no step left to train in this launch"
        log.info("done: %s in %.0f s (%s); outputs in %s%s", name, self.total, trained, run_dir,
                 f"; balance report: {balance}" if balance.is_file() else "")

    def write(self, path: Path, stages: dict[str, str]) -> Path:
        """``{"total_seconds": ..., "seconds": {phase: s}, "stages": {stage: fingerprint}, "memory_kind": ...,
        "memory_bytes": {phase: {"start": bytes, "peak": bytes}}}`` as JSON (what benches/bench_first_run.py and
        benches/bench_fsdp_memory.py read; the fingerprints name the stages' folders in the cache)."""
        path.write_text(json.dumps({"total_seconds": self.total, "seconds": self.seconds, "stages": stages,
                                    "memory_kind": self.memory_kind, "memory_bytes": self.memory}, indent=1) + "\n")
        return path
