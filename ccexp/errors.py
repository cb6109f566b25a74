"""The exception types a user sees: :class:`CcexpError` for problems a user can fix (bad input, bad
config, missing files) and :class:`Interrupted` for a run stopped by a signal.

The command-line entry point prints a :class:`CcexpError` as a single line, ``ccexp: error: ...``,
and exits with status 2; any other exception is a bug and keeps its traceback.
"""


class CcexpError(Exception):
    """A user-facing error: the message names what is wrong and how to fix it, in one line."""


class Interrupted(BaseException):
    """The run was stopped by a signal (SIGTERM from Slurm or Kubernetes, SIGINT from Ctrl-C).

    A ``BaseException``, so no ``except Exception`` swallows it; the CLI prints its message as one
    line and exits with ``128 + signal number`` (143 for SIGTERM, 130 for SIGINT).
    """

    def __init__(self, signum: int, message: str = ""):
        import signal

        self.signum = int(signum)
        self.name = signal.Signals(self.signum).name
        super().__init__(message or f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Refused(BaseException):
    """A :class:`CcexpError` raised where a framework would swallow an ``Exception`` (Hydra catches
    what its callbacks raise): the CLI prints it as one line and exits with status 2."""
