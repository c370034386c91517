"""Time and size bounds for rendering chat templates, which are untrusted code from the Hub.

Jinja's sandbox stops templates from reaching Python internals but not from running
forever: two nested `range(100000)` loops are 10^10 iterations, and `'x' * 10**9 * 100`
asks for 100 GB. `bounded_render` runs a compiled template with:

- a deadline (RENDER_SECONDS): a trace function, active only in this thread and only in the
  template's own compiled code, checks it on every line (every loop iteration executes
  one), so even a loop with no output and no calls ends with `TemplateLimitError`;
- an output cap (MAX_OUTPUT_CHARS), checked as the template yields output;
- `BoundedSandbox`, whose `*`, `**` and `%` refuse results past the cap before computing
  them (a string repeated, a huge power, a `%999999999d` format).

A real template renders in milliseconds; these limits only ever stop hostile ones.
"""

from __future__ import annotations

import re
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from _typeshed import TraceFunction  # what sys.settrace takes (typeshed only)

RENDER_SECONDS = 5.0
MAX_OUTPUT_CHARS = 64 * 2**20  # far above a full context of text plus the template's own
MAX_POWER_BITS = 4096
# A printf width or precision of 7 digits or more (a million characters of padding).
_HUGE_FORMAT = re.compile(r"%[-+ #0]*(?:\*|\d{7,})|%[-+ #0]*\d*\.\d{7,}")
TEMPLATE_FILENAME = "<template>"  # jinja's name for code compiled from a string

# The events sys.settrace's functions receive (typeshed's names).
TraceEvent = Literal["call", "line", "return", "exception", "opcode"]


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """A chat template ran past its time or size limit."""


def _too_big(what: str) -> TemplateLimitError:
    return TemplateLimitError(
        f"the chat template asked for {what}, past the limit of {MAX_OUTPUT_CHARS} characters"
    )


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "%"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(count, int):
                    if len(seq) * count > MAX_OUTPUT_CHARS:
                        raise _too_big(f"a sequence of {len(seq)} x {count}")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise TemplateLimitError(f"the chat template computes {left} ** {right}")
        elif operator == "%" and isinstance(left, str) and _HUGE_FORMAT.search(left):
            raise _too_big("a format with a huge width or precision")
        return super().call_binop(context, operator, left, right)


def bounded_render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """`template.render(**variables)` within RENDER_SECONDS and MAX_OUTPUT_CHARS."""
    deadline = time.monotonic() + RENDER_SECONDS
    previous = sys.gettrace()

    def check() -> None:
        if time.monotonic() > deadline:
            raise TemplateLimitError(
                f"the chat template ran for more than {RENDER_SECONDS:g} s and was stopped"
            )

    def line_tracer(frame: FrameType, event: TraceEvent, arg: Any) -> TraceFunction:
        if event == "line":
            check()
        return line_tracer

    def tracer(frame: FrameType, event: TraceEvent, arg: Any) -> TraceFunction | None:
        if frame.f_code.co_filename == TEMPLATE_FILENAME:
            return line_tracer
        # Another tracer (a debugger, coverage) keeps seeing the rest of the code.
        return previous(frame, event, arg) if previous is not None else None

    parts: list[str] = []
    size = 0
    sys.settrace(tracer)
    try:
        for part in template.generate(**variables):
            size += len(part)
            if size > MAX_OUTPUT_CHARS:
                raise _too_big(f"more than {size} characters of output")
            parts.append(part)
            check()
    finally:
        sys.settrace(previous)
    return "".join(parts)
