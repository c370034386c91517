"""The errors front ends see, re-exported from the engine.

The web UI, the API and extensions import these from here (or from `loader`), never from
engine/: one error root, `KestrelError`, whose `param` names the field at fault, and the
specific kinds a front end answers differently (a prompt too long, a full queue, ...).
`LoaderError` (loader/base.py) covers what the loader layer itself refuses.
"""

from __future__ import annotations

from engine.cache import CacheFullError
from engine.chat_template import ChatTemplateError
from engine.config import ConfigError
from engine.constraints import ConstraintError
from engine.engine import ContextLengthError, EmptyPromptError
from engine.errors import KestrelError
from engine.lora import LoraError
from engine.samplers.parse import SamplingSettingsError
from engine.scheduler import GenerationMemoryError, QueueFullError, SchedulerError
from engine.weights import WeightError

__all__ = [
    "CacheFullError",
    "ChatTemplateError",
    "ConfigError",
    "ConstraintError",
    "ContextLengthError",
    "EmptyPromptError",
    "GenerationMemoryError",
    "KestrelError",
    "LoraError",
    "QueueFullError",
    "SamplingSettingsError",
    "SchedulerError",
    "WeightError",
]
