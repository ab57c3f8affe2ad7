"""Command-line flags, config-file keys and benchmark knobs generated from config dataclasses.

A knob is declared once, as a field of a frozen config dataclass with its help text beside it
(`knob(default, "help")`), and validated once, in that dataclass's __post_init__. Everything
that names knobs - `backfill` flags, the server's config file, `bench coserve --modes` variants -
is generated from those fields here, so a new field appears everywhere at once (docs/server.md).

Config dataclasses nest (ServingConfig holds a CoServeConfig, which holds an SLO); an option's
flat name is the field's name, or its `option=` alias, and must be unique over the whole tree.
Fields without help text (internal ones, or nested dataclasses) get no option.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any

_SCALARS = (bool, int, float, str)


def knob(default: Any = MISSING, help: str = "", *, group: str = "", option: str | None = None,
         choices: tuple[str, ...] | None = None, default_factory: Any = MISSING) -> Any:
    """A dataclass field that is also an option (flag, config-file key, mode knob)."""
    meta = {"help": help, "group": group, "option": option, "choices": choices}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Option:
    name: str                    # flag --name-with-dashes, config-file key, mode knob
    path: tuple[str, ...]        # field names from the root config down to this field
    type: type                   # bool, int, float or str
    default: Any
    help: str
    group: str
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _scalar(hint: Any) -> type | None:
    """bool/int/float/str for `T` or `T | None`; None for anything else."""
    if hint in _SCALARS:
        return hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1 and inner[0] in _SCALARS:
            return inner[0]
    return None


def options_of(cls: type, group: str | None = None) -> tuple[Option, ...]:
    """Every option of cls's tree (nested config dataclasses included), in field order."""
    found: list[Option] = []
    _walk(cls, (), found)
    names = [o.name for o in found]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise TypeError(f"{cls.__name__}: option names declared twice: {', '.join(sorted(duplicates))}")
    return tuple(o for o in found if group is None or o.group == group)


def _walk(cls: type, path: tuple[str, ...], found: list[Option]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            _walk(hint, path + (f.name,), found)
            continue
        if not f.metadata.get("help"):
            continue
        kind = _scalar(hint)
        if kind is None:
            raise TypeError(f"{cls.__name__}.{f.name}: an option must be bool, int, float or str")
        default = f.default if f.default is not MISSING else f.default_factory()
        found.append(Option(f.metadata.get("option") or f.name, path + (f.name,), kind, default,
                            f.metadata["help"], f.metadata.get("group", ""), f.metadata.get("choices")))


def add_arguments(parser: argparse.ArgumentParser, opts: tuple[Option, ...],
                  defaults: dict[str, Any] | None = None, hidden: tuple[str, ...] = (),
                  shown_defaults: dict[str, Any] | None = None) -> None:
    """One flag per option. An absent flag leaves its option out of the parsed namespace, so the
    dataclass default applies (or `defaults`, the command's own, set on the parser); bools get --x / --no-x. Values are
    checked by the dataclass, not here, so a bad one gets the same typed error from a flag or a file.
    shown_defaults: defaults the caller applies itself (below a config file, say), shown in the help only."""
    defaults = defaults or {}
    for o in opts:
        default = defaults.get(o.name, (shown_defaults or {}).get(o.name, o.default))
        text = o.help + (f"; one of {', '.join(o.choices)}" if o.choices else "")
        text = f"{text} (default: {'unset' if default is None else default})".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": o.name, "default": argparse.SUPPRESS,
                                  "help": argparse.SUPPRESS if o.name in hidden else text}
        if o.type is bool:
            parser.add_argument(o.flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            parser.add_argument(o.flag, type=o.type, **kwargs)
    own = {o.name: defaults[o.name] for o in opts if o.name in defaults}
    if own:
        parser.set_defaults(**own)


def given(args: argparse.Namespace, opts: tuple[Option, ...]) -> dict[str, Any]:
    """{option name: value} of the flags given (and of the command's own defaults)."""
    return {o.name: getattr(args, o.name) for o in opts if hasattr(args, o.name)}


def build(cls: type, values: dict[str, Any], base: Any = None) -> Any:
    """cls (or a copy of base) with the named options set, each nested config rebuilt (and so
    validated again) where one of its options changed. Unknown names raise KeyError."""
    by_name = {o.name: o for o in options_of(cls)}
    tree: dict = {}
    for name, value in values.items():
        node = tree
        path = by_name[name].path
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _apply(cls, base, tree)


def _apply(cls: type, base: Any, tree: dict) -> Any:
    hints = typing.get_type_hints(cls)
    changes = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            inner = getattr(base, name) if base is not None else None
            changes[name] = _apply(hints[name], inner, value)
        else:
            changes[name] = value
    return cls(**changes) if base is None else dataclasses.replace(base, **changes)


def value_of(config: Any, option: Option) -> Any:
    for part in option.path:
        config = getattr(config, part)
    return config


def as_flags(config: Any, opts: tuple[Option, ...]) -> list[str]:
    """The flags that set opts to config's values (for a child process); unset values are left out."""
    out: list[str] = []
    for o in opts:
        value = value_of(config, o)
        if o.type is bool:
            out.append(o.flag if value else "--no-" + o.flag[2:])
        elif value is not None:
            out += [o.flag, str(value)]
    return out
