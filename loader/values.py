"""The value types front ends exchange with a loaded model, re-exported from the engine:
the sampling settings (TGW's names) and their integer parsing, a token's log-probability,
and the tokenizer type, and the check of a request's schema or grammar. The web UI and the
API import them from here, never from engine/.
"""

from __future__ import annotations

from typing import Any

from engine.constraints import CONSTRAINT_ERROR, check_constraint, constraint_spec
from engine.generator import TokenLogprob
from engine.samplers.parse import as_int
from engine.sampling_settings import SamplingSettings
from engine.tokenizer import Tokenizer

__all__ = [
    "CONSTRAINT_ERROR",
    "SamplingSettings",
    "TokenLogprob",
    "Tokenizer",
    "as_int",
    "check_settings_constraint",
]


def check_settings_constraint(settings: SamplingSettings | dict[str, Any]) -> bool:
    """Whether `settings` constrain the output (json_schema, json_object, regex, lark,
    grammar_string); ConstraintError naming the key and where a schema or grammar is wrong."""
    spec = constraint_spec(SamplingSettings.from_any(settings))
    if spec is not None:
        check_constraint(spec)
    return spec is not None
