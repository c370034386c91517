"""The web UI's browser tests share one Chromium per test module (tests/helpers/browser.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from helpers.browser import chromium


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b
