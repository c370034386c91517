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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.generate import GenerationBackend, generate
from engine.generator import TokenLogprob
from engine.sampling_settings import SamplingSettings
from loader.embeddings import check_pooling, default_pooling, pool


class LoaderError(ValueError):
    """A loader cannot load this model with these options; the message says why."""


class UnsupportedFeatureError(LoaderError):
    """The chosen loader does not offer a feature (yet)."""


@dataclass
class Chunk:
    """One piece of a streamed completion."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error" on the last chunk
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    generate_seconds: float = 0.0
    seed: int | None = None
    job_id: int = 0  # which prompt of a stream_many() call (its index) or job this is
    logprobs: list[TokenLogprob] | None = None  # settings["logprobs"] = k asks for them
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    queue_seconds: float = 0.0
    draft_tokens: int = 0  # speculative decoding: drafts proposed / accepted so far
    accepted_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0


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
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] as float32 on the CPU."""

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
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.backend.tokenizer.encode(text, add_bos=add_bos)

    def decode(self, ids: list[int]) -> str:
        return self.backend.tokenizer.decode(ids)

    def encode_for_embedding(self, text: str) -> list[int]:
        """Token ids of `text` as `embed` should see them (engine/tokenizer.py)."""
        return self.backend.tokenizer.encode_for_embedding(text)

    def stream(
        self, prompt: str | list[int], settings: SamplingSettings | Mapping[str, Any] | None = None
    ) -> Iterator[Chunk]:
        settings = SamplingSettings.from_any(settings)
        ids = self._prompt_ids(prompt, settings)
        for event in generate(self.backend, ids, settings):
            yield Chunk(**event.__dict__)

    def stream_many(
        self,
        prompts: list[str | list[int]],
        settings: SamplingSettings | Mapping[str, Any] | None = None,
    ) -> Iterator[Chunk]:
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
                    yield Chunk(**{**event.__dict__, "job_id": index})
            return
        jobs = []
        try:
            for prompt_ids, s in zip(ids, parsed, strict=True):
                jobs.append(scheduler.submit(prompt_ids, s))
        except BaseException:
            for job in jobs:
                scheduler.cancel(job)
            raise
        index = {job.id: i for i, job in enumerate(jobs)}
        for event in scheduler.stream_many(jobs):
            yield Chunk(**{**event.__dict__, "job_id": index[event.job_id]})

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
