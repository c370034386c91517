"""What passes between the scheduler and the model runner in one engine step.

    plan = scheduler.schedule()          # bookkeeping: jobs, pages, what each row feeds
    output = runner.execute(plan)        # the model: graphs, LoRA batch, draft model, forward
    events = scheduler.update(plan, output)   # sampling, stops, detokenizing, events

`StepPlan` names sequences (page tables the scheduler has reserved room in), the tokens
each feeds and which rows' logits are wanted; `StepOutput` carries what the forward
produced. Both are plain data: this module imports no model code, so the scheduler can
depend on it (and on `Runner`, the protocol the runner satisfies) without depending on
the model (tests/project/test_layering.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from engine.pages import Sequence


@dataclass(eq=False)
class DraftRequest:
    """A row that the runner's draft model drafts for, before the target's forward."""

    sequence: Sequence  # the job's place in the draft model's cache
    context: list[int]  # the job's tokens so far (prompt + generated)
    k: int  # at most this many drafts


@dataclass(eq=False)
class StepPlan:
    """One forward over several sequences.

    Each row feeds `new_tokens[b]` into `sequences[b]` under the LoRA selection
    `loras[b]`; logits come for each row's last token, its last `logits_counts[b]` tokens
    (speculative verification, logits jobs), or every token with `all_logits`.
    `hidden_states`: the final norm's output of every token instead of logits (embeddings).
    `device_tokens`: one input token per row already on the device (drawn by the last
    step's sampler and not read back: the lookahead); `new_tokens` then holds placeholders.
    `drafts[b]`: the runner's draft model proposes up to k tokens that row `b` feeds after
    its own (the output's `drafts` says which), with their logits too.
    `rows`: the scheduler's own record of each row; the runner never reads it."""

    sequences: list[Sequence]
    new_tokens: list[list[int]]
    loras: list[dict[str, float]]
    logits_counts: list[int] | None = None
    all_logits: bool = False
    hidden_states: bool = False
    device_tokens: Tensor | None = None
    drafts: list[DraftRequest | None] | None = None
    rows: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sequences)


@dataclass(eq=False)
class StepOutput:
    """`values`: logits [rows wanted, vocab] (float32, in plan order, on the logits'
    device), or hidden states [tokens, hidden] for a `hidden_states` plan. `drafts`: per
    row, the tokens the draft model proposed and the forward fed after the row's own
    (their logits follow the row's last token's), None when the plan asked for none."""

    values: Tensor
    drafts: list[list[int]] | None = None


class Runner(Protocol):
    """What the scheduler needs of the model side (engine/runner.py's ModelRunner)."""

    def execute(self, plan: StepPlan) -> StepOutput: ...

    def apply_token_bitmask(self, logits: Tensor, bitmask: Tensor, rows: Tensor) -> Tensor:
        """Grammar masks (engine/constraints) applied to `logits` rows `rows`, in place:
        a token whose bit is 0 gets -inf."""
        ...

    def greedy_tokens(self, logits: Tensor) -> Tensor:
        """Each row's argmax (int64 [N]) of logits [N, vocab], exactly as torch's argmax
        gives it (first index on ties, NaN above all): every argmax of a draw, plain greedy
        rows' and the batched draw's (engine/samplers/batched.py)."""
        ...
