"""Typed JSON documents: dataclasses written to plain JSON values and read back, checked.

A report is a tree of dataclasses (``eval.schema``). ``to_json`` turns it into dicts, lists and
numbers for ``json.dumps``; ``from_json(cls, data)`` builds the dataclasses back from such data,
checking every value against its field's annotation, and names the place of the first value
that does not fit (``results.model.buckets[3].nats: expected a number, got 'x'``). A field whose
JSON name is not a Python name (``from``) says so with ``json_name``; a field that is left out
of the JSON when it is None says so with ``omit_none``. Reading refuses keys the class does not
know, so nothing read is dropped silently on the way back out.

Supported annotations: dataclasses, ``list[X]``, ``tuple[X, Y]`` (a JSON list of that length),
``dict[str, X]``, ``X | None``, int, float (an int is accepted), str, bool, and plain ``dict`` /
``Any`` (taken as they are).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def json_name(name: str, **kwargs) -> Any:
    """A field written under another JSON key (``start: int = json_name("from")``)."""
    return dataclasses.field(metadata={"json": name}, **kwargs)


def omit_none(default: Any = None) -> Any:
    """A field left out of the JSON while it is None (and None when the JSON has no such key)."""
    return dataclasses.field(default=default, metadata={"omit_none": True})


@dataclasses.dataclass(kw_only=True)
class Document:
    """A versioned JSON document: ``schema`` names its format (a subclass sets it as the field's
    default), ``created`` when and ``genome_lm`` by which version it was written."""

    schema: str
    created: str
    genome_lm: str

    def to_json(self) -> dict:
        return to_json(self)

    @classmethod
    def from_json(cls, data: Any):
        """The document in ``data`` (ValueError naming the first field that does not fit; a
        document of another schema is refused by name)."""
        expected = cls.__dataclass_fields__["schema"].default
        schema = data.get("schema") if isinstance(data, dict) else None
        if schema != expected:
            raise ValueError(f"schema {schema!r}, this genome-lm reads {expected}")
        return from_json(cls, data)


def to_json(value: Any) -> Any:
    """Dataclasses as dicts under their JSON names, tuples as lists; the rest as it is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if item is None and f.metadata.get("omit_none"):
                continue
            out[f.metadata.get("json", f.name)] = to_json(item)
        return out
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    return value


def from_json(cls: type[T], data: Any, where: str = "") -> T:
    """``cls`` built from JSON data, every value checked against its annotation (ValueError
    naming the place otherwise)."""
    return _read(cls, data, where)


def _read(kind: Any, data: Any, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) != 1:
            raise TypeError(f"{where}: only X | None unions are supported, not {kind}")
        return _read(others[0], data, where)
    if kind is Any or kind is dict or kind is object:
        return data
    if dataclasses.is_dataclass(kind):
        return _read_dataclass(kind, data, where)
    if origin is list:
        _expect(isinstance(data, list), "a list", data, where)
        return [_read(args[0], item, f"{where}[{i}]") for i, item in enumerate(data)]
    if origin is tuple:
        _expect(isinstance(data, list) and len(data) == len(args), f"a list of {len(args)}", data, where)
        return tuple(_read(a, item, f"{where}[{i}]") for i, (a, item) in enumerate(zip(args, data)))
    if origin is dict:
        _expect(isinstance(data, dict), "an object", data, where)
        return {key: _read(args[1], item, f"{where}.{key}") for key, item in data.items()}
    if kind is float:
        _expect(isinstance(data, (int, float)) and not isinstance(data, bool), "a number", data, where)
        return float(data)
    if kind is int:
        _expect(isinstance(data, int) and not isinstance(data, bool), "an integer", data, where)
        return data
    if kind is bool:
        _expect(isinstance(data, bool), "true or false", data, where)
        return data
    if kind is str:
        _expect(isinstance(data, str), "a string", data, where)
        return data
    raise TypeError(f"{where}: cannot read a field annotated {kind}")


def _read_dataclass(cls: type, data: Any, where: str) -> Any:
    _expect(isinstance(data, dict), "an object", data, where)
    hints = typing.get_type_hints(cls)
    values, known = {}, set()
    for f in dataclasses.fields(cls):
        key = f.metadata.get("json", f.name)
        known.add(key)
        place = f"{where}.{key}" if where else key
        if key in data:
            values[f.name] = _read(hints[f.name], data[key], place)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{place}: missing")
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where or 'the document'}: unknown key {unknown[0]!r} (this version of {cls.__name__} "
                         f"has {', '.join(sorted(known))})")
    return cls(**values)


def _expect(ok: bool, what: str, data: Any, where: str) -> None:
    if not ok:
        shown = repr(data)
        raise ValueError(f"{where}: expected {what}, got {shown if len(shown) <= 40 else shown[:37] + '...'}")
