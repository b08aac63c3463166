"""Every test plans with its own, empty plan cache (the ``plan`` command reads and writes one by
default): nothing leaks into the user's cache directory or from one test into another."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_plan_cache(tmp_path_factory, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("plan-cache")))
