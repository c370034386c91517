"""Constrained decoding: JSON schema, JSON object, regex, GBNF and Lark grammars per job.

Contract:
- A job asks for a constraint through its settings (`SamplingSettings.extra`, one key at
  most): `json_schema` (a dict or its JSON text), `json_object` (True: any JSON object),
  `regex`, `lark`, or TGW's `grammar_string` (GBNF as llama.cpp and TGW write it; Lark is
  taken too). `constraint_spec(settings)` reads it; `compile_constraint(spec, tokenizer,
  vocab)` builds the job's `JobConstraint`, raising `ConstraintError` (a KestrelError and
  ValueError whose `param` names the key) for a grammar or schema that is wrong, with the
  engine's message saying where. `check_constraint(spec)` does the same check without a
  tokenizer (front ends call it before they submit).
- Token masks come from llguidance (tools/grammar_engines.py compares it with xgrammar).
  The scheduler calls three hooks (engine/constraints/hooks.py) and nothing else:
  `mask_logits` before its samplers (the masks of a step are computed on the host, after the
  forward was launched, so that they overlap the GPU's work, and applied on the device by
  the runner's `apply_token_bitmask`, kernels/token_bitmask.py), `trim_drafts` when it
  drafts (a draft the grammar refuses is cut with everything after it), and
  `sync_constraint` after a job's tokens changed (accepted tokens are consumed; rejected
  drafts and banned-string rewinds roll back).
- A job whose grammar leaves no token to continue with (a schema the tokenizer cannot
  satisfy) ends with finish_reason "constraint_error"; a finished grammar allows only the
  stop tokens (EOS unless ban_eos_token), and with none open it ends the job as "stop".
"""

from engine.constraints.compiler import check_constraint, compile_constraint
from engine.constraints.hooks import ApplyMask, mask_logits, sync_constraint, trim_drafts
from engine.constraints.spec import (
    CONSTRAINT_KEYS,
    ConstraintError,
    ConstraintSpec,
    constraint_spec,
)
from engine.constraints.state import CONSTRAINT_ERROR, JobConstraint

__all__ = [
    "ApplyMask",
    "CONSTRAINT_ERROR",
    "CONSTRAINT_KEYS",
    "ConstraintError",
    "ConstraintSpec",
    "JobConstraint",
    "check_constraint",
    "compile_constraint",
    "constraint_spec",
    "mask_logits",
    "sync_constraint",
    "trim_drafts",
]
