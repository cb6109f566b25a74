"""The one exception type for problems a user can fix (bad input, bad config, missing files).

The command-line entry point prints a :class:`CcexpError` as a single line, ``ccexp: error: ...``,
and exits with status 2; any other exception is a bug and keeps its traceback.
"""


class CcexpError(Exception):
    """A user-facing error: the message names what is wrong and how to fix it, in one line."""
