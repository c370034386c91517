"""The draft model of speculative decoding: a second, smaller model with the same
vocabulary and its own KV cache, proposing greedy drafts for several jobs at once.

It belongs to the target's runner (engine/runner.py), which asks it for drafts inside
`execute`, right before the target's verification forward; the scheduler only keeps each
job's place in the draft cache (`Job.draft_sequence`: rewound with the job, released when
it ends) through the draft cache's `PagePool`. Drafts are the draft model's argmax tokens:
the acceptance rule (engine/speculative.py) treats them as point masses.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from engine.pages import CacheFullError, PagePool, Sequence
from engine.rewind import trim_sequence

# forward(sequences, new_tokens) -> the last new token's logits per sequence
DraftForward = Callable[[list[Sequence], list[list[int]]], Tensor]


class DraftModel:
    def __init__(
        self,
        forward: DraftForward,
        pages: PagePool,
        *,
        max_seq_len: int,
        prefill_chunk: int,
        vocab_size: int,
        target_vocab: int,
        name: str,
    ) -> None:
        if vocab_size != target_vocab:
            raise ValueError(
                f"the draft model {name} has a vocabulary of {vocab_size} tokens, the "
                f"target {target_vocab}: speculative decoding needs the same tokenizer"
            )
        self.forward = forward
        self.pages = pages
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk

    def propose(
        self, sequences: list[Sequence], contexts: list[list[int]], ks: list[int]
    ) -> list[list[int]]:
        """Drafts (greedy) for each job: `sequences[i]` is its place in the draft cache,
        `contexts[i]` its tokens so far, `ks[i]` how many to draft. A job whose draft
        cache cannot grow gets no drafts (and its draft sequence starts over later)."""
        pages = self.pages
        drafts: list[list[int]] = [[] for _ in contexts]
        live = []
        for i, (seq, ctx, k) in enumerate(zip(sequences, contexts, ks, strict=True)):
            if k <= 0:
                continue
            if seq.length >= len(ctx):  # never ahead of the context (kept by rewinds)
                trim_sequence(pages, seq, len(ctx) - 1)
            need = -(-(len(ctx) + k - 1) // pages.page_size) - len(seq.pages)
            if need > pages.free_pages or len(ctx) + k - 1 > self.max_seq_len:
                seq.release(pages)
                continue
            live.append(i)
        if not live:
            return drafts
        feed = [contexts[i][sequences[i].length :] for i in live]
        chunk = self.prefill_chunk
        try:
            # Catch up on what the job added since (prefill-sized pieces), then draft.
            while any(len(f) > 1 for f in feed):
                rows = [n for n, f in enumerate(feed) if len(f) > 1]
                pieces = [feed[n][: min(chunk, len(feed[n]) - 1)] for n in rows]
                self.forward([sequences[live[n]] for n in rows], pieces)
                for n, piece in zip(rows, pieces, strict=True):
                    feed[n] = feed[n][len(piece) :]
            last = [f[0] for f in feed]
            active = list(range(len(live)))
            for _ in range(max(ks[i] for i in live)):
                logits = self.forward(
                    [sequences[live[n]] for n in active], [[last[n]] for n in active]
                )
                tokens = logits.argmax(dim=-1).tolist()
                for n, token in zip(active, tokens, strict=True):
                    drafts[live[n]].append(token)
                    last[n] = token
                active = [n for n in active if len(drafts[live[n]]) < ks[live[n]]]
                if not active:
                    break
        except CacheFullError:
            for i in live:
                sequences[i].release(pages)
            return [[] for _ in contexts]
        return drafts
