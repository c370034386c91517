"""The value types front ends exchange with a loaded model, re-exported from the engine:
the sampling settings (TGW's names) and their integer parsing, a token's log-probability,
and the tokenizer type. The web UI and the API import them from here, never from engine/.
"""

from __future__ import annotations

from engine.generator import TokenLogprob
from engine.samplers.parse import as_int
from engine.sampling_settings import SamplingSettings
from engine.tokenizer import Tokenizer

__all__ = ["SamplingSettings", "TokenLogprob", "Tokenizer", "as_int"]
