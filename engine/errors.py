"""The root of the errors a request or a file can cause, and what they name.

Every error the engine raises because of its input (a setting, a prompt, a file, an
adapter) derives from `KestrelError` as well as from the built-in type it always was
(ValueError, RuntimeError), so existing `except ValueError` code keeps working. `param`
names the setting or field at fault where there is one, so a front end reports it
without reading the message. The loader re-exports these (loader/errors.py): front ends
import them from there, never from the engine.
"""

from __future__ import annotations


class KestrelError(Exception):
    """An error caused by what Kestrel was given; `param` names the field, if any."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param
