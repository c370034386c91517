"""The engine object: a loaded model, its KV cache and its tokenizer.

`Engine.load(model_dir, options)` runs the load flow; `forward(...)` runs one batched
forward over sequences that hold pages of the cache. `engine.scheduler` (continuous
batching, engine/scheduler.py) drives it for generation; `engine.lock` serialises every
use of the cache (scheduler steps, `logits`) across threads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache import CACHE_TYPES, ForwardBatch, PagedKVCache, Sequence, cache_bytes_per_token
from engine.config import ModelConfig
from engine.cuda_graph import DecodeGraphs
from engine.loading import load_causal_lm, resolve_device, resolve_dtype
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer

DEFAULT_MAX_SEQ_LEN = 8192  # caps a 128k-context config so the cache fits a consumer GPU


class ContextLengthError(ValueError):
    """A prompt (plus the tokens asked for) does not fit the model's context."""


@dataclass
class EngineOptions:
    device: str | None = None
    dtype: str | None = None
    max_seq_len: int | None = None
    cache_type: str = "fp16"  # K/V storage: fp16 (the model's dtype), fp8, q8, q6, q4
    cache_tokens: int | None = None  # total cache size; default max_seq_len (one sequence)
    # Size the cache by memory instead: as many tokens as fit this many GiB of the cache
    # type (so a smaller type holds more tokens); cache_tokens wins when both are given.
    cache_gib: float | None = None
    page_size: int = 256
    rope_alpha: float = 1.0
    prefill_chunk: int = 2048
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (single-GPU engines)
    max_batch: int = 64  # concurrent jobs; more wait in the scheduler's queue
    prefix_caching: bool = True  # reuse the cached pages of a repeated prompt prefix


class Engine:
    def __init__(
        self,
        config: ModelConfig,
        model: torch.nn.Module,
        cache: PagedKVCache,
        tokenizer: Tokenizer,
        options: EngineOptions,
        model_dir: Path,
        load_seconds: float,
    ) -> None:
        self.config = config
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.options = options
        self.model_dir = model_dir
        self.max_seq_len = options.max_seq_len or DEFAULT_MAX_SEQ_LEN
        self.load_seconds = load_seconds
        self.graphs: DecodeGraphs | None = None
        self.lock = threading.RLock()
        # prefill_chunk is the step's token budget: decode tokens plus prefill chunks.
        self.scheduler = Scheduler(
            self,
            max_batch=options.max_batch,
            max_tokens_per_step=max(options.prefill_chunk, options.max_batch),
            prefix_caching=options.prefix_caching,
        )

    @classmethod
    def load(cls, model_dir: str | Path, options: EngineOptions | None = None) -> Engine:
        options = options or EngineOptions()
        started = time.perf_counter()
        model_dir = Path(model_dir)
        config = ModelConfig.from_dir(model_dir)
        if options.cache_type not in CACHE_TYPES:
            raise ValueError(
                f"unknown cache_type '{options.cache_type}' (available: {', '.join(CACHE_TYPES)})"
            )
        device = resolve_device(options.device)
        dtype = resolve_dtype(options.dtype, device)
        max_seq_len = options.max_seq_len or min(
            config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN
        )
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        tokenizer = Tokenizer.from_dir(model_dir)
        model = load_causal_lm(model_dir, device=device, dtype=dtype, config=config)
        model.setup_rotary(max_seq_len, rope_alpha=options.rope_alpha)
        cache_tokens = options.cache_tokens or max_seq_len
        if options.cache_gib is not None and options.cache_tokens is None:
            per_token = cache_bytes_per_token(
                options.cache_type,
                num_layers=config.num_hidden_layers,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                dtype=dtype,
            )
            cache_tokens = int(options.cache_gib * 2**30) // per_token
            if cache_tokens < options.page_size:
                raise ValueError(
                    f"cache_gib={options.cache_gib} holds {cache_tokens} tokens of "
                    f"{per_token} bytes ({options.cache_type}); one page needs {options.page_size}"
                )
        use_graphs = options.cuda_graphs and device.type == "cuda"
        cache = PagedKVCache(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            # one more page for the decode graphs' padding rows
            num_pages=-(-cache_tokens // options.page_size) + int(use_graphs),
            page_size=options.page_size,
            dtype=dtype,
            layer_devices=model.layer_devices,
            cache_type=options.cache_type,
        )
        options = EngineOptions(**{**options.__dict__, "max_seq_len": max_seq_len})
        engine = cls(
            config, model, cache, tokenizer, options, model_dir, time.perf_counter() - started
        )
        if use_graphs:
            engine.graphs = DecodeGraphs(model, cache, max_seq_len)
        return engine

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    @property
    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys(self.model.layer_devices))

    def check_length(self, prompt_tokens: int, new_tokens: int = 0) -> None:
        if prompt_tokens == 0:
            raise ContextLengthError("the prompt is empty: at least one token is needed")
        if prompt_tokens + new_tokens > self.max_seq_len:
            raise ContextLengthError(
                f"the prompt has {prompt_tokens} tokens"
                + (f" and {new_tokens} new tokens were asked for" if new_tokens else "")
                + f"; the context holds {self.max_seq_len} (max_seq_len)"
            )

    def forward(
        self, sequences: list[Sequence], new_tokens: list[list[int]], *, all_logits: bool = False
    ) -> torch.Tensor:
        if (
            self.graphs is not None
            and not all_logits
            and all(len(t) == 1 for t in new_tokens)
            and self.graphs.bucket(len(sequences)) is not None
        ):
            return self.graphs.decode(sequences, [t[0] for t in new_tokens])
        batch = ForwardBatch.build(self.cache, sequences, new_tokens, all_logits=all_logits)
        return self.model(batch, self.cache)

    def prefill(self, seq: Sequence, token_ids: list[int], *, all_logits: bool = False):
        """Feed a prompt in chunks; returns the last token's logits (or every token's)."""
        chunk = self.options.prefill_chunk
        outputs = []
        for start in range(0, len(token_ids), chunk):
            logits = self.forward([seq], [token_ids[start : start + chunk]], all_logits=all_logits)
            outputs.append(logits)
        return torch.cat(outputs) if all_logits else outputs[-1]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len, vocab] (float32, CPU) of a whole sequence, without keeping its cache."""
        self.check_length(len(token_ids))
        seq = Sequence()
        with self.lock:
            try:
                return self.prefill(seq, token_ids, all_logits=True).cpu()
            finally:
                seq.release(self.cache)

    @property
    def logits_device(self) -> torch.device:
        return self.model.lm_head_device

    def open_session(self) -> EngineSession:
        return EngineSession(self)

    def unload(self) -> None:
        self.scheduler.close()
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        self.model = None  # type: ignore[assignment]
        self.cache = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class EngineSession:
    """One sequence of the engine's cache, for the single-job loop (generate_single); it
    bypasses the scheduler's admission control and prefix cache."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sequence = Sequence()

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        with self.engine.lock:
            return self.engine.prefill(self.sequence, token_ids)[-1]

    def step(self, token_id: int) -> torch.Tensor:
        with self.engine.lock:
            return self.engine.forward([self.sequence], [[token_id]])[-1]

    def close(self) -> None:
        with self.engine.lock:
            if self.engine.cache is not None:
                self.sequence.release(self.engine.cache)
