"""Dataclass configs from YAML values and command-line options: one typed path, errors naming the key."""

from __future__ import annotations

import argparse
import dataclasses
import difflib

from ..errors import ConfigError


def _as_float(value):
    """`value` as a float when it is a number or a string that reads as one ("2e-3": YAML 1.1 leaves it a string)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def did_you_mean(key: str, known, prefix: str = "") -> str:
    """" (did you mean train.steps?)" for a mistyped `key` ("stepz"): `prefix` ("train.") and the nearest of the
    `known` keys, or "" where none is near (difflib's ratio of at least 0.6)."""
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def apply_overrides(config, overrides: dict, name: str | None = None):
    """Return a copy of dataclass `config` with `overrides` applied; unknown keys and wrong types name the key.

    Values must have the type of the current value (an int is accepted for a float, a list for a tuple).
    `name` is how errors call the dataclass (default: its class name).
    """
    name = name or type(config).__name__
    if not isinstance(overrides, dict):
        raise ConfigError(f"{name}: expected a mapping, got {overrides!r}")
    fields = {f.name: f for f in dataclasses.fields(config) if f.init}
    values = {key: getattr(config, key) for key in fields}
    for key, value in overrides.items():
        if key not in fields:
            hint = did_you_mean(key, fields, f"{name}.")
            raise ConfigError(f"unknown key {name}.{key}{hint}; known: {sorted(fields)}")
        values[key] = typed_value(f"{name}.{key}", values[key], value)
    return type(config)(**values)


def typed_value(where: str, current, value):
    """`value` as the type of `current` (an int is accepted for a float, a list for a tuple); a ConfigError naming
    `where`, the value and the type expected otherwise."""
    if isinstance(current, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(current, bool)
    elif isinstance(current, float):
        value = _as_float(value)
        ok = isinstance(value, float)
    elif isinstance(current, tuple):
        ok = isinstance(value, (list, tuple))
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, type(current))
    if not ok:
        raise ConfigError(f"{where}: expected {type(current).__name__}, got {value!r}")
    return value


def option(default, help: str, *, choices: tuple | None = None, flag: str | None = None):
    """A dataclass field that is also a command-line option: its help text, allowed values and, where the option's
    name is not the field's (`--format` for `fmt`), that name without the dashes."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


def add_arguments(parser, cls) -> None:
    """One `--field-name` option per field of dataclass `cls` (declared with `option`), typed and defaulted by it."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        name = meta["flag"] or f.name
        typed = ({"action": argparse.BooleanOptionalAction} if isinstance(f.default, bool) else
                 {"type": type(f.default), "choices": meta["choices"], "metavar": None if meta["choices"] else
                  name.upper()})
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=f.name, default=f.default, help=f"{meta['help']} (default {f.default!r})",
                            **typed)


def from_arguments(cls, args):
    """The dataclass `cls` from the options `add_arguments` declared."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
