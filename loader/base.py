"""The public model interface that the UI, the API, extensions and TGW use.

`LoadedModel` is what `loader.load(...)` returns, whatever loader made it. Loaders
implement the abstract methods; sampling, stop handling and streaming are shared
(engine/generator.py), so every loader streams the same way.

`stream()` runs one job; on a backend with a scheduler (the kestrel loader) it is batched
with every other job in flight, so concurrent `stream()` calls from several threads share
the GPU. `stream_many()` submits several prompts at once and interleaves their chunks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.generate import GenerationBackend, generate
from engine.generator import GenerationEvent
from engine.sampling_settings import SamplingSettings
from engine.tokenizer import Tokenizer
from loader.embeddings import check_pooling, default_pooling, pool


class LoaderError(ValueError):
    """A loader cannot load this model with these options; the message says why."""


class UnsupportedFeatureError(LoaderError):
    """The chosen loader does not offer a feature (yet)."""


# The one event type from the engine to every client: a piece of a streamed completion (a text
# delta, its token ids, logprobs, the finish reason on the last; token counts and timings).
# The engine makes it, the loader passes it on as it is, and so does serving/'s request flow.
Chunk = GenerationEvent


class LoadedModel(ABC):
    loader_name: str = ""

    def __init__(self, path: Path) -> None:
        self.path = path

    # -- what each loader provides ------------------------------------------------------
    @property
    @abstractmethod
    def backend(self) -> GenerationBackend:
        """The generation backend (tokenizer, sessions) that stream() drives."""

    @abstractmethod
    def logits(self, ids: list[int], *, loras: Mapping[str, float] | None = None) -> torch.Tensor:
        """Logits [len(ids), vocab] as float32 on the CPU, under the LoRA selection `loras`
        ({name: scale}; {} none; None the model's own, set_loras)."""

    def token_nll(
        self, ids: list[int], *, loras: Mapping[str, float] | None = None
    ) -> tuple[float, int]:
        """(Σ NLL, count): the negative log-likelihood of every token of `ids` after the
        first, each given the tokens before it, under the LoRA selection `loras` (as in
        logits()). This default scores logits(); a loader may keep them on its device."""
        # A third-party loader's logits() may predate the `loras` keyword: pass it only when set.
        logits = (self.logits(ids) if loras is None else self.logits(ids, loras=loras)).float()
        targets = torch.tensor(ids[1:], dtype=torch.long)
        nll = F.cross_entropy(logits[:-1], targets, reduction="sum")
        return float(nll), len(targets)

    def hidden_states(self, ids: list[int]) -> torch.Tensor:
        """The final norm's output [len(ids), width] as float32 on the CPU."""
        raise UnsupportedFeatureError(
            f"loader '{self.loader_name}' does not give hidden states (embeddings) yet"
        )

    def hidden_states_many(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """`hidden_states` of each input (a loader may batch them)."""
        return [self.hidden_states(ids) for ids in inputs]

    @abstractmethod
    def info(self) -> dict[str, Any]: ...

    @abstractmethod
    def unload(self) -> None: ...

    # -- shared behaviour ---------------------------------------------------------------
    # Front ends read the model's tokenizer and limits here, never through `backend` (an
    # engine-side object whose shape is the engine's business).
    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (token bytes for logprobs, special tokens, its template)."""
        return self.backend.tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size): the tokenizer's ids, added tokens included."""
        return int(self.backend.tokenizer.vocab_size)

    @property
    def context_length(self) -> int:
        """Tokens one sequence may hold: prompt plus generated."""
        return int(self.backend.max_seq_len)

    @property
    def max_token_bytes(self) -> int:
        """The longest token's UTF-8 bytes (the first call walks the vocabulary once)."""
        return int(self.backend.tokenizer.max_token_bytes)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The model's chat template source (named ones as a dict), or None: it has none."""
        return self.backend.tokenizer.chat_template

    @property
    def logits_device(self) -> torch.device:
        """Where the model's logits come out (its last layer's device)."""
        return torch.device(self.backend.logits_device)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.backend.tokenizer.encode(text, add_bos=add_bos)

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        return self.backend.tokenizer.decode(ids, skip_special=skip_special)

    def encode_for_embedding(self, text: str) -> list[int]:
        """Token ids of `text` as `embed` should see them (engine/tokenizer.py)."""
        return self.backend.tokenizer.encode_for_embedding(text)

    def stream(
        self, prompt: str | list[int], settings: SamplingSettings | Mapping[str, Any] | None = None
    ) -> Generator[Chunk, None, None]:
        """The completion of `prompt` as events, the last with a finish_reason. Closing the
        generator early cancels the job (its cache pages are freed at once)."""
        settings = SamplingSettings.from_any(settings)
        ids = self._prompt_ids(prompt, settings)
        yield from generate(self.backend, ids, settings)

    def stream_many(
        self,
        prompts: list[str | list[int]],
        settings: SamplingSettings | Mapping[str, Any] | None = None,
    ) -> Generator[Chunk, None, None]:
        """Generate for several prompts at once; chunks interleave, and `chunk.job_id` is the
        index of the prompt it belongs to. `settings` is one for all, or a list (one each).
        Without a scheduler (the transformers loader) the prompts run one after another."""
        each = settings if isinstance(settings, list) else [settings] * len(prompts)
        if len(each) != len(prompts):
            raise ValueError(f"{len(each)} settings for {len(prompts)} prompts")
        parsed = [SamplingSettings.from_any(s) for s in each]
        ids = [self._prompt_ids(p, s) for p, s in zip(prompts, parsed, strict=True)]
        scheduler = getattr(self.backend, "scheduler", None)
        if scheduler is None:
            for index, (prompt_ids, s) in enumerate(zip(ids, parsed, strict=True)):
                for event in generate(self.backend, prompt_ids, s):
                    yield replace(event, job_id=index)
            return
        jobs = []
        try:
            for prompt_ids, s in zip(ids, parsed, strict=True):
                jobs.append(scheduler.submit(prompt_ids, s))
        except BaseException:
            for job in jobs:
                scheduler.cancel(job)
            raise
        order = {job.id: i for i, job in enumerate(jobs)}
        for event in scheduler.stream_many(jobs):
            yield replace(event, job_id=order[event.job_id])

    def _prompt_ids(self, prompt: str | list[int], settings: SamplingSettings) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return self.encode(prompt, add_bos=settings.add_bos_token)

    def embed(
        self, ids: list[int], pooling: str | None = None, dimensions: int | None = None
    ) -> torch.Tensor:
        """An L2-normalised embedding [width] (or its first `dimensions`) of `ids`: the
        final hidden states pooled by `pooling` (loader/embeddings.py; default: the
        model's sentence-transformers pooling config, else "mean")."""
        return self.embed_many([ids], pooling, dimensions)[0]

    def embed_many(
        self, inputs: list[list[int]], pooling: str | None = None, dimensions: int | None = None
    ) -> list[torch.Tensor]:
        """`embed` of each input; short inputs may share forwards."""
        pooling = check_pooling(pooling or default_pooling(self.path))  # before the forwards
        states = self.hidden_states_many([list(ids) for ids in inputs])
        return [pool(h, pooling, dimensions) for h in states]

    def generate(
        self, prompt: str | list[int], settings: SamplingSettings | Mapping[str, Any] | None = None
    ) -> str:
        return "".join(chunk.text for chunk in self.stream(prompt, settings))

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return self.backend.tokenizer.apply_chat_template(messages, **kwargs)

    def load_lora(self, path: str | Path, name: str | None = None) -> str:
        raise UnsupportedFeatureError(
            f"loader '{self.loader_name}' does not load LoRA adapters yet"
        )

    def set_loras(self, scales: Mapping[str, float]) -> None:
        raise UnsupportedFeatureError(
            f"loader '{self.loader_name}' does not load LoRA adapters yet"
        )

    def unload_lora(self, name: str) -> bool:
        raise UnsupportedFeatureError(
            f"loader '{self.loader_name}' does not load LoRA adapters yet"
        )

    def loras(self) -> dict[str, dict[str, Any]]:
        """Loaded adapters by name (path, rank, default scale, jobs using it, ...)."""
        return {}
