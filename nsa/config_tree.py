"""Configs as a tree of frozen dataclasses (``RunConfig`` -> ``ModelConfig`` -> ``AttentionConfig``
-> ``NSAParams``), and the three things done to a tree by field name: change fields, read one
back from nested dicts, and list the differences between two.

A field is named by its path (``model.attention.nsa.window``) or by any part of it that ends in
the field's name and finds one field only: ``window``, ``attention.window`` and ``nsa.window``
name the same one. A section given a plain value sets its ``kind`` (``attention=dense`` means
``attention.kind=dense``).
"""

from __future__ import annotations

import dataclasses
import typing
from functools import cache


@cache
def _field_types(cls: type) -> dict[str, object]:
    """Field name -> resolved annotation of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def is_section(annotation) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


@cache
def field_paths(cls: type) -> dict[tuple[str, ...], object]:
    """Every field of the tree under ``cls``, sections included: path -> annotation."""
    paths: dict[tuple[str, ...], object] = {}
    for name, annotation in _field_types(cls).items():
        paths[(name,)] = annotation
        if is_section(annotation):
            paths.update({(name, *sub): t for sub, t in field_paths(annotation).items()})
    return paths


def _is_subsequence(parts: tuple[str, ...], path: tuple[str, ...]) -> bool:
    it = iter(path)
    return all(part in it for part in parts)


def resolve_key(cls: type, key: str, value=None) -> tuple[tuple[str, ...], object]:
    """(path, annotation) of the field of ``cls``'s tree that ``key`` names (see the module
    docstring); a section with a ``value`` that is not one resolves to its ``kind``.
    ``ValueError`` naming ``key`` when it names no field or several."""
    parts = tuple(key.split("."))
    if not all(parts):
        raise ValueError(f"unknown config key {key!r}")
    paths = field_paths(cls)
    found = [p for p in paths if p[-1] == parts[-1] and _is_subsequence(parts[:-1], p[:-1])]
    if not found:
        raise ValueError(f"unknown config key {key!r}")
    if len(found) > 1:
        names = ", ".join(".".join(p) for p in found)
        raise ValueError(f"config key {key!r} is ambiguous: write one of {names}")
    (path,) = found
    annotation = paths[path]
    if is_section(annotation) and not isinstance(value, annotation):
        if "kind" not in _field_types(annotation):
            raise ValueError(f"config key {key!r} is a section: set one of its fields, e.g. "
                             f"{key}.{dataclasses.fields(annotation)[0].name}=...")
        path = (*path, "kind")
        annotation = paths[path]
    return path, annotation


def replace_fields(config, **changes):
    """``dataclasses.replace`` for a tree: ``changes`` by field name or path (``window=256``,
    ``**{"attention.window": 256}``), applied together, each section rebuilt (and so validated)
    once, innermost first."""
    by_path = {resolve_key(type(config), key, value)[0]: value for key, value in changes.items()}
    return _replace(config, by_path)


def _replace(config, changes: dict[tuple[str, ...], object]):
    own = {path[0]: value for path, value in changes.items() if len(path) == 1}
    inner: dict[str, dict] = {}
    for path, value in changes.items():
        if len(path) > 1:
            inner.setdefault(path[0], {})[path[1:]] = value
    for name, sub in inner.items():
        own[name] = _replace(own.get(name, getattr(config, name)), sub)
    return dataclasses.replace(config, **own)


def from_dict(cls: type, data: dict):
    """The tree ``cls`` from nested dicts (what ``dataclasses.asdict`` made); unknown or
    missing names raise ``TypeError`` naming them, bad values the config's ``ValueError``."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} must be read from a dict, got {type(data).__name__}")
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    return cls(**{name: from_dict(types[name], value) if is_section(types[name]) else value
                  for name, value in data.items()})


def differences(old, new, prefix: str = "") -> list[str]:
    """'path: old -> new' for every field where two trees of one class differ."""
    changed = []
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b:
            continue
        if dataclasses.is_dataclass(a) and type(a) is type(b):
            changed += differences(a, b, f"{prefix}{f.name}.")
        else:
            changed.append(f"{prefix}{f.name}: {a!r} -> {b!r}")
    return changed
