"""Config tables: every `[table]` of a serve config file decodes one way.

Each table is a frozen `msgspec.Struct` with `forbid_unknown_fields=True` whose `__post_init__` checks
values through `fail`. `decode_table(Struct, values, "table")` turns the raw TOML/JSON mapping into
it. Every refusal, a misspelt key, a wrong type or a bad value, is one `ValueError` in one form:

    config field `decode.max_running_requests`: expected `int`, got `str` ('eight')

It lives at the bottom of the package tree (it imports only msgspec) so that the cache's table, the
model's, the workers', the router's and the serve file's can all use it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NoReturn, TypeVar

import msgspec

T = TypeVar("T")

_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$")


def config_error(table: str, field: str, message: str) -> ValueError:
    """The one error of a bad config value: `config field `table.field`: message`."""
    return ValueError(f"config field `{'.'.join(p for p in (table, field) if p)}`: {message}")


def fail(table: str, field: str, message: str) -> NoReturn:
    """Raise `config_error(table, field, message)` (for `__post_init__` checks)."""
    raise config_error(table, field, message)


def decode_table(cls: type[T], values: Mapping[str, Any], table: str) -> T:
    """`values` (a config file's `[table]`; `table` "" for the file's top level) as a `cls`;
    `ValueError` (`config_error`) names the field and the bad value of an unknown key, a wrong type
    or a value `__post_init__` refuses."""
    try:
        return msgspec.convert(dict(values), type=cls)
    except msgspec.ValidationError as exc:
        raise _as_config_error(str(exc), values, table, cls) from None


def _as_config_error(text: str, values: Mapping[str, Any], table: str, cls: type) -> ValueError:
    if text.startswith("config field `"):  # a `fail` from __post_init__: already in the one form
        return ValueError(_AT.sub(r"\g<message>", text))
    match = _AT.match(text)
    assert match is not None  # the pattern matches any text
    message, path = match["message"], (match["path"] or "").lstrip(".")
    unknown = _UNKNOWN.match(message)
    if unknown:
        field = ".".join(p for p in (path.replace("[...]", ""), unknown["name"]) if p)
        known = getattr(cls, "__struct_fields__", ()) if not path else ()
        return config_error(table, field, "unknown field" + (f" (known: {', '.join(sorted(known))})" if known else ""))
    message = message[:1].lower() + message[1:]
    found, value = _lookup(values, path)
    return config_error(table, path.replace("[...]", ""), message + (f" ({value!r})" if found else ""))


def _lookup(values: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    """The value at a msgspec path such as `limits[...].max_running` (`[...]`: a table's one key)."""
    node: Any = values
    parts = [p for p in path.replace("[...]", ".*").split(".") if p]
    for part in parts:
        if not isinstance(node, Mapping):
            return False, None
        if part == "*":
            if len(node) != 1:
                return False, None
            node = next(iter(node.values()))
        elif part in node:
            node = node[part]
        else:
            return False, None
    return bool(parts), node
