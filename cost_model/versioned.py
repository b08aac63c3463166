"""Loading versioned JSON documents (plans, profiles): JSON only (never pickle or eval), the
``version`` checked before anything else is read, then pydantic validation; every problem is one
line that says what to do."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class DuplicateKeyError(ValueError):
    """A JSON object that names one key twice (``json`` alone would keep the last silently)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r} appears twice in one object")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads``: a duplicate key raises DuplicateKeyError."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def parse_versioned(
    text: str,
    model: type[M],
    version: int,
    *,
    error: type[Exception],
    kind: str,
    regenerate: str,
    field_fix: str,
) -> M:
    """Validate ``text`` as a ``model`` document of ``version``. Raises ``error`` with one line:
    ``kind`` names the document (``"plan"``, ``"profile.json: profile"``), ``regenerate`` is the
    fix for an unreadable one, ``field_fix`` the fix for an invalid field."""
    try:
        raw = json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKeyError as e:
        raise error(f"{kind} JSON names {e.key!r} twice in one object: {regenerate}") from None
    except json.JSONDecodeError as e:
        raise error(
            f"{kind} is not valid JSON ({e.msg} at line {e.lineno}): {regenerate}"
        ) from None
    except RecursionError:
        raise error(f"{kind} JSON is nested too deeply to be a {kind}: {regenerate}") from None
    if not isinstance(raw, dict) or "version" not in raw:
        got = (
            "has no 'version' key"
            if isinstance(raw, dict)
            else f"is a {type(raw).__name__}, not an object with a 'version' key"
        )
        raise error(f"{kind} JSON {got} (not a {kind.split()[-1]}): {regenerate}")
    if type(raw["version"]) is not int or raw["version"] != version:
        raise error(
            f"{kind} version {raw['version']!r} is not supported (this autopar reads version "
            f"{version}): {regenerate}"
        )
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        where = f"{kind} field {loc!r} is invalid" if loc else f"{kind} is invalid"
        raise error(f"{where}: {msg}; {field_fix}") from None
