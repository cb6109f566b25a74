"""``python -m ccexp --help``: what ccexp answers, how to call it, its config groups and every setting with
its value and the description its schema ([`ccexp.config`][ccexp.config]) gives it. ``--help`` after overrides shows
the settings of that composition (``python -m ccexp sampler=clusterclip --help`` lists the clip threshold).
Everything here reads the shipped config files and the schemas' source; nothing imports torch."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from ccexp import config as schemas
from ccexp.conf import CONFIG_DIR

_COLUMN, _WIDTH = 45, 118  # where descriptions start; the line width
_PRAGMA = re.compile(r"^(type:\s*ignore(\[[^\]]*\])?|noqa(:\s*\S+)?)\s*(#\s*)?")


@functools.lru_cache(maxsize=None)
def field_notes(schema: type) -> dict[str, str]:
    """Each field of the dataclass ``schema`` (and of its bases) mapped to its description: the comment
    on the field's line, else the comment lines directly above it; pragmas (``type: ignore``, ``noqa``)
    are dropped. A field without a comment is absent."""
    notes: dict[str, str] = {}
    for cls in reversed([c for c in schema.__mro__ if dataclasses.is_dataclass(c)]):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        above: list[str] = []
        pending: str | None = None  # the field of the current line, waiting for its trailing comment
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                text = _PRAGMA.sub("", tok.string.lstrip("#").strip()).strip()
                if pending is not None:
                    if text:
                        notes[pending] = text
                    pending = None
                elif text:
                    above.append(text)
            elif tok.type == tokenize.NAME and tok.start[1] == 4 and pending is None and tok.string.isidentifier():
                line = tok.line.strip()
                if re.match(rf"{tok.string}\s*:", line):
                    pending = tok.string
                    if above:
                        notes[tok.string] = " ".join(above)
                    above = []
            elif tok.type == tokenize.NEWLINE:
                pending = None
            elif tok.type == tokenize.NL and tok.line.strip() == "":
                above = []
    return notes


def _value(node: DictConfig, key: str) -> str:
    child = node._get_node(key)
    if child._is_interpolation():
        raw = str(child._value())
        if raw.startswith("${ccexp."):  # a resolver's derivation: its value here, not its formula
            try:
                return f"{node[key]} (derived)"
            except Exception:  # noqa: BLE001 (it may need a setting given at run time)
                return raw
        return raw
    value = OmegaConf.to_container(child) if isinstance(child, (DictConfig, ListConfig)) else child._value()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def _settings(node: DictConfig, schema: type | None, prefix: str, lines: list[str]) -> None:
    notes = field_notes(schema) if schema is not None else {}
    for key in node.keys():
        if str(key).startswith("_"):
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
            sub = schemas.child_schema(schema, str(key), child) if schema else None
            _settings(child, sub, f"{prefix}{key}.", lines)
            continue
        setting = f"  {prefix}{key}={_value(node, str(key))}"
        note = notes.get(str(key))
        if not note:
            lines.append(setting)
            continue
        wrapped = textwrap.wrap(note, width=_WIDTH - _COLUMN)
        lines.append(f"{setting:<{_COLUMN - 1}} {wrapped[0]}" if len(setting) < _COLUMN - 1 else
                     f"{setting}\n{'':<{_COLUMN}}{wrapped[0]}")
        lines += [f"{'':<{_COLUMN}}{more}" for more in wrapped[1:]]


def plain(doc: str) -> str:
    """A docstring as a terminal shows it: a cross-reference ``[`name`][ccexp.x.name]`` (mkdocstrings' syntax,
    a link on the docs site) as ``name``, and RST's double backticks as single ones."""
    return re.sub(r"\[`([^`]+)`\]\[[\w.]+\]", r"\1", doc).replace("``", "`")


def groups() -> dict[str, list[str]]:
    """Each config group (a folder of ``ccexp/conf``) and its options (the YAML files in it)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(Path(CONFIG_DIR).iterdir())
            if d.is_dir() and d.name != "hydra" and any(d.glob("*.yaml"))}


def help_text(overrides: list[str], swept: bool = False, header: str | None = None,
              sections: tuple[str, ...] | None = None, footer: str | None = None) -> str:
    """The ``--help`` page for the configuration ``overrides`` compose: ``header`` (default: ccexp's own),
    the config groups, then every setting with its value and description, or only those under the top-level
    keys ``sections`` (``python -m ccexp.plan --help`` shows plan, data, clusterer, sampler and train), then
    ``footer``.

    Raises:
        hydra.errors.HydraException, omegaconf.errors.OmegaConfBaseException: for a bad override.
    """
    shipped = OmegaConf.load(Path(CONFIG_DIR) / "config.yaml").hydra.help
    cfg = schemas.compose(overrides)
    from ccexp.preflight import _check_keys_and_bounds

    _check_keys_and_bounds(cfg, schemas.RootConfig, "")  # an added key the run would refuse is refused here too
    lines = [header or shipped.header, "", "== Config groups (group=option) =="]
    lines += [f"  {group}: {', '.join(options)}" for group, options in groups().items()]
    lines += ["", "== Settings (key=value; " + ("with " + " ".join(overrides) if overrides else "the defaults")
              + (", a sweep list's first value" if swept else "") + "), and what each does =="]
    if sections is None:
        _settings(cfg, schemas.RootConfig, "", lines)
    else:
        for key in sections:
            node = OmegaConf.masked_copy(cfg, [key])
            _settings(node, schemas.RootConfig, "", lines)
    lines += ["", footer or shipped.footer]
    return "\n".join(lines)
