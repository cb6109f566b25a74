"""Reading the files a user hands ccexp, one place per format, so every reader refuses the same faults the same way:
JSON (a corpus's lines, a weights or losses file) with a key given twice in one object refused (Python's ``json``
keeps the last value without a word: a hand-edited weights file that gives cluster 0 twice would train on the later
one), text that is not UTF-8 named with its byte; CSV with a column named twice refused (``csv.DictReader`` keeps the
last), a repeated row key refused by the reader that knows which column is the key (``ccexp.sampling.mixture``)."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from ccexp.errors import CcexpError, not_utf8_line


class RepeatedKey(ValueError):
    """A JSON object gives the same key twice: ``key`` is that key."""

    def __init__(self, key: str):
        super().__init__(f"the key {key!r} is given twice in one object")
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise RepeatedKey(key)
        out[key] = value
    return out


def loads(text: str) -> Any:
    """``json.loads`` that raises [`RepeatedKey`][ccexp.data.userfiles.RepeatedKey] (a ``ValueError``) for an object
    giving a key twice, at any depth."""
    return json.loads(text, object_pairs_hook=_unique)


def read_json(path: Path, name: str, kind: str = "UTF-8 JSON", noun: str = "key") -> Any:
    """The JSON value of the file ``path`` (``name``: the setting and file, as the lines say them; ``kind``: what to
    save it as; ``noun``: what an object's keys are, e.g. ``cluster``).

    Raises:
        CcexpError: one line for a file that cannot be read, is not UTF-8, is not JSON, or gives a key twice.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise CcexpError(not_utf8_line(name, e, kind)) from None
    except OSError as e:
        raise CcexpError(f"{name} cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        return loads(text)
    except RepeatedKey as e:
        raise CcexpError(f"{name} lists {noun} {e.key!r} twice; give each {noun} once") from None
    except ValueError as e:
        raise CcexpError(f"{name} is not readable JSON: {str(e).splitlines()[0]}") from None


def read_csv(path: Path, name: str) -> tuple[list[str], list[dict[str, str]]]:
    """(header, rows) of the CSV file ``path`` (``name``: the setting and file, as the lines say them).

    Raises:
        CcexpError: one line for a file that cannot be read, is not UTF-8 or not CSV text, or names a column twice.
    """
    try:  # decoded whole, so an error's offset is the file's; a byte-order mark (Excel's UTF-8 CSV) is no error
        reader = csv.DictReader(io.StringIO(Path(path).read_bytes().decode("utf-8-sig"), newline=""))
        header = list(reader.fieldnames or [])
        repeated = next((c for i, c in enumerate(header) if c in header[:i]), None)
        if repeated is not None:
            raise CcexpError(f"{name} names the column {repeated!r} twice; give each column once")
        return header, list(reader)
    except OSError as e:
        raise CcexpError(f"{name} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CcexpError(not_utf8_line(name, e, "UTF-8 CSV")) from None
    except csv.Error as e:  # a NUL byte: a binary file named .csv
        raise CcexpError(f"{name} is not a CSV text file ({e}); save it as UTF-8 CSV") from None
