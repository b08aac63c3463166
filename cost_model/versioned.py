"""Loading versioned JSON documents (plans, profiles): JSON only (never pickle or eval), the
``version`` checked before anything else is read, then pydantic validation; every problem is one
line that says what to do."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


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
        raw = json.loads(text)
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
        raise error(f"{kind} field {loc!r} is invalid: {msg}; {field_fix}") from None
