"""The engine object: a loaded model, its KV cache, its tokenizer, and the two halves of
a step that it wires together.

`Engine.load(model_dir, options)` runs the load flow. `engine.runner` (engine/runner.py)
owns the model, the K/V storage, the CUDA graphs, LoRA batches and the draft model, and
runs a `StepPlan`; `engine.scheduler` (engine/scheduler.py) keeps the books (jobs, pages,
prefix cache, preemption) and drives the runner: every use of the model, generation,
`logits`, embeddings and the single-job session alike, is a kind of job of the scheduler
and runs in its steps, under its one lock (`engine.lock`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.architectures.base import CausalLM
from engine.cache import CACHE_TYPES, PagedKVCache, cache_bytes_per_token
from engine.cache_sizing import describe, memory_sized_tokens
from engine.config import ModelConfig
from engine.cuda_graph import DecodeGraphs
from engine.draft_model import DraftModel
from engine.limits import ContextLengthError, EmptyPromptError, check_length
from engine.loading import (
    LoadProgress,
    load_causal_lm,
    overflows_float16,
    resolve_device,
    resolve_dtype,
)
from engine.lora import LoraManager
from engine.moe import SparseMoE
from engine.placement import Placement, PlacementOptions, plan_for_model
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.session import EngineSession
from engine.speculative import SPECULATIVE_MODES
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DEFAULT_MAX_SEQ_LEN = 8192  # caps a 128k-context config so the cache fits a consumer GPU

__all__ = ["CACHE_TYPES", "ContextLengthError", "EmptyPromptError", "Engine", "EngineOptions"]


# Default of EngineOptions.lora_cuda_graphs: decode steps that apply LoRA adapters replay
# their own CUDA graphs. It was off after an H200 run (2026-11-22) where the LoRA graphs gave
# other greedy tokens than the eager path after a few steps: the graphs' segment-start
# buffer was owned by nothing after capture, so its memory went to the next small tensor
# and the replays read that as input (engine/cuda_graph.py now keeps it with the graph).
LORA_GRAPHS = True


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
    # Or: this fraction of the GPU memory free at load time (one GPU only; the API server's
    # default, engine/cache_sizing.py). cache_tokens and cache_gib win over it.
    cache_memory_fraction: float | None = None
    page_size: int = 256
    rope_alpha: float = 1.0
    # Linear RoPE scale (TGW's compress_pos_emb): positions divided by it, for models
    # fine-tuned to a longer context that way (SuperHOT-style). 1: off.
    rope_scale: float = 1.0
    prefill_chunk: int = 2048
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (one per GPU of a split)
    # Graphs for a layer split over several GPUs (one segment per GPU). On 2xH100 a 70B
    # split decodes as fast as one GPU with them (66.1 tok/s each); an eager split step is
    # bound by launching its kernels from Python (8B on 2xH200: 33 tok/s against 324).
    split_cuda_graphs: bool = True
    # ... also the decode steps that apply LoRA adapters (off: those run eagerly)
    lora_cuda_graphs: bool = LORA_GRAPHS
    max_batch: int = 64  # concurrent jobs; more wait in the scheduler's queue
    # Jobs that may wait beyond max_batch; more are refused (QueueFullError, the API's 429)
    # rather than queued without end. None: no limit.
    max_waiting: int | None = 256
    prefix_caching: bool = True  # reuse the cached pages of a repeated prompt prefix
    # The scheduler launches the next decode forward before reading the last step's tokens,
    # so its host work overlaps the GPU (engine/scheduler.py, "Lookahead"); same output.
    lookahead: bool = True
    fuse_projections: bool = True  # q/k/v and gate/up built as one linear each (build_plan.py)
    # Residual add + norm, SiLU * up, RoPE + KV write as one kernel each (same results), and
    # at quantized decode the norms folded into the GEMVs (reproducible, not the same bits).
    fuse_kernels: bool = True
    # Accepted for compatibility and ignored: decode is always bitwise reproducible on one
    # GPU (split-K partials are summed in a fixed order, kernels/quant_matmul/tiles.py), so
    # the same prompt, settings and seed give the same logits in every run (issue 31).
    deterministic: bool = True
    # Layer split (engine/placement/): GiB per GPU, or auto from free memory; CPU offload.
    gpu_split: list[float] | None = None
    autosplit: bool = False
    gpu_reserve_gb: float = 0.25
    cpu_offload: bool = False
    # Speculative decoding: "ngram" (prompt lookup) or "draft" (draft_model, a smaller model
    # with the same vocabulary); None: off. A draft_model alone implies "draft".
    speculative: str | None = None
    draft_model: str | None = None
    num_draft_tokens: int = 4
    speculative_max_batch: int = 16  # more decoding jobs than this: steps without drafts


# Makes the runner of an engine: (model, cache, loras, **runner options) -> ModelRunner.
RunnerFactory = Callable[..., ModelRunner]


class Engine:
    def __init__(
        self,
        config: ModelConfig,
        model: CausalLM,
        cache: PagedKVCache,
        tokenizer: Tokenizer,
        options: EngineOptions,
        model_dir: Path,
        load_seconds: float,
        *,
        runner_factory: RunnerFactory = ModelRunner,
    ) -> None:
        """`runner_factory`: the model runner's kind (tensor parallelism gives its own,
        which holds the other ranks: engine/tensor_parallel/launch.py)."""
        self.config = config
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.options = options
        self.model_dir = model_dir
        self.max_seq_len = options.max_seq_len or DEFAULT_MAX_SEQ_LEN
        self.load_seconds = load_seconds
        self.placement: Placement | None = None  # set by load
        self.draft_engine: Engine | None = None  # speculative="draft": the draft model
        self.lock = threading.RLock()
        # LoRA adapters (engine/lora): nothing is wrapped until one is loaded.
        self.loras = LoraManager(model, self.lock)
        self.runner = runner_factory(
            model,
            cache,
            self.loras,
            max_seq_len=self.max_seq_len,
            prefill_chunk=options.prefill_chunk,
            lora_graphs=options.lora_cuda_graphs,
        )
        # prefill_chunk is the step's token budget: decode tokens plus prefill chunks.
        self.scheduler = self.new_scheduler(
            max_batch=options.max_batch,
            max_tokens_per_step=max(options.prefill_chunk, options.max_batch),
            max_waiting=options.max_waiting,
            prefix_caching=options.prefix_caching,
            lookahead=options.lookahead,
        )

    def new_scheduler(
        self,
        *,
        max_batch: int,
        max_tokens_per_step: int,
        max_waiting: int | None = None,
        prefix_caching: bool = True,
        lookahead: bool = True,
    ) -> Scheduler:
        """A scheduler over this engine's runner, pages, tokenizer and LoRA selections."""
        return Scheduler(
            self.runner,
            self.cache,
            tokenizer=self.tokenizer,
            vocab_size=self.config.vocab_size,
            max_seq_len=self.max_seq_len,
            logits_device=self.runner.logits_device,
            loras=self.loras,
            lock=self.lock,
            max_batch=max_batch,
            max_tokens_per_step=max_tokens_per_step,
            max_waiting=max_waiting,
            prefix_caching=prefix_caching,
            lookahead=lookahead,
        )

    @property
    def tp_world_size(self) -> int:
        """Tensor-parallel ranks holding a shard each (1: not sharded)."""
        return self.runner.world_size

    @property
    def rank_devices(self) -> list[str]:
        return self.runner.rank_devices

    @property
    def rank_memory(self) -> list[dict[str, int]]:
        return self.runner.rank_memory

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.runner.graphs

    @property
    def lora_graphs(self) -> bool:
        """Whether LoRA decode steps replay graphs (tools/bench_lora.py flips it)."""
        return self.runner.lora_graphs

    @lora_graphs.setter
    def lora_graphs(self, value: bool) -> None:
        self.runner.lora_graphs = value

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        options: EngineOptions | None = None,
        *,
        progress: LoadProgress | None = None,
    ) -> Engine:
        """`progress(fraction, what)`, if given, hears how far the load is (the weights are
        most of it; the CUDA graphs' capture comes last)."""
        options = options or EngineOptions()
        started = time.perf_counter()
        model_dir = Path(model_dir)
        config = ModelConfig.from_dir(model_dir)
        if options.cache_type not in CACHE_TYPES:
            raise ValueError(
                f"unknown cache_type '{options.cache_type}' (available: {', '.join(CACHE_TYPES)})"
            )
        device = resolve_device(options.device)
        dtype = resolve_dtype(
            options.dtype, device, overflows_float16=overflows_float16(config.architecture)
        )
        max_seq_len = options.max_seq_len or min(
            config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN
        )
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        tokenizer = Tokenizer.from_dir(model_dir)
        cache_tokens = options.cache_tokens or max_seq_len
        # K and V bytes of one token in one layer, in the cache's storage type.
        layer_token_bytes = cache_bytes_per_token(
            options.cache_type,
            num_layers=1,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
        )
        if options.cache_gib is not None and options.cache_tokens is None:
            per_token = layer_token_bytes * config.num_hidden_layers
            cache_tokens = int(options.cache_gib * 2**30) // per_token
            if cache_tokens < options.page_size:
                raise ValueError(
                    f"cache_gib={options.cache_gib} holds {cache_tokens} tokens of "
                    f"{per_token} bytes ({options.cache_type}); one page needs {options.page_size}"
                )
        how = "cache_tokens" if options.cache_tokens else "one full context"
        if options.cache_gib is not None and options.cache_tokens is None:
            how = f"cache_gib={options.cache_gib:g}"
        elif (
            options.cache_memory_fraction is not None
            and options.cache_tokens is None
            and not (options.gpu_split or options.autosplit or options.cpu_offload)
        ):
            sized = memory_sized_tokens(
                fraction=options.cache_memory_fraction,
                device=device,
                model_dir=model_dir,
                token_bytes=layer_token_bytes * config.num_hidden_layers,
                max_seq_len=max_seq_len,
                max_batch=options.max_batch,
                prefill_chunk=options.prefill_chunk,
                vocab_size=config.vocab_size,
                page_size=options.page_size,
            )
            if sized is not None:
                cache_tokens = sized
                how = f"{options.cache_memory_fraction:g} of the free GPU memory"
            else:
                how = "one full context: sizing from free memory applies to GPUs only"
        held = -(-cache_tokens // options.page_size) * options.page_size  # whole pages
        log.info(describe(held, layer_token_bytes * config.num_hidden_layers, max_seq_len, how))
        placement = plan_for_model(
            str(model_dir),
            config,
            PlacementOptions(
                options.gpu_split, options.autosplit, options.gpu_reserve_gb, options.cpu_offload
            ),
            device=device,
            dtype=dtype,
            cache_tokens=cache_tokens,
            page_size=options.page_size,
            prefill_chunk=options.prefill_chunk,
            cache_token_bytes=layer_token_bytes,
        )
        if progress:
            progress(0.0, "reading the weights")
        model = load_causal_lm(
            model_dir,
            device=device,
            dtype=dtype,
            config=config,
            placement=placement,
            progress=(lambda f, what: progress(0.9 * f, what)) if progress else None,
            fuse_projections=options.fuse_projections,
            fuse_kernels=options.fuse_kernels,
        )
        model.setup_rotary(
            max_seq_len, rope_alpha=options.rope_alpha, rope_scale=options.rope_scale
        )
        # Decode graphs: one per bucket on a single GPU, one per device segment of a layer
        # split (engine/cuda_graph.py). A placement with CPU-offloaded parts stays eager:
        # its CPU layers, not launches, bound the step.
        # Mixture-of-experts layers choose their experts in a host loop (engine/moe.py), which
        # a graph cannot capture: those models decode eagerly.
        use_graphs = (
            options.cuda_graphs
            and all(d.type == "cuda" for d in placement.devices)
            and not any(isinstance(m, SparseMoE) for m in model.modules())
            and (len(set(placement.devices)) == 1 or options.split_cuda_graphs)
        )
        cache = PagedKVCache(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            num_pages=-(-cache_tokens // options.page_size),
            page_size=options.page_size,
            dtype=dtype,
            layer_devices=model.layer_devices,
            cache_type=options.cache_type,
        )
        options = EngineOptions(**{**options.__dict__, "max_seq_len": max_seq_len})
        engine = cls(
            config, model, cache, tokenizer, options, model_dir, time.perf_counter() - started
        )
        engine.placement = placement
        if use_graphs:
            if progress:
                progress(0.9, "capturing CUDA graphs")
            engine.enable_decode_graphs()
        engine.setup_speculation()
        if progress:
            progress(1.0, "loaded")
        return engine

    def enable_decode_graphs(
        self, *, capture: bool = True, split_at: Collection[int] = ()
    ) -> DecodeGraphs:
        """Run batched decode steps (and fresh prompts) through `DecodeGraphs`.
        `capture=False` runs their static buffers eagerly: the graph path on any device,
        for tests (Engine.load enables captured graphs when every part is on a GPU).
        `split_at`: layers that start a graph segment of their own even on the device of
        the layer before (tests run a one-device model as a layer split that way)."""
        return self.runner.enable_decode_graphs(capture=capture, split_at=split_at)

    def setup_speculation(self) -> None:
        """Turn on the speculative decoding the options ask for (loads the draft model)."""
        options = self.options
        mode = options.speculative or ("draft" if options.draft_model else None)
        if mode is None:
            return
        if mode not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}"
            )
        if mode == "draft":
            if not options.draft_model:
                raise ValueError('speculative="draft" needs draft_model=<model directory>')
            draft_options = EngineOptions(
                device=str(self.logits_device),
                dtype=options.dtype,
                max_seq_len=self.max_seq_len,
                cache_tokens=self.cache.capacity_tokens,
                page_size=self.cache.page_size,
                prefill_chunk=options.prefill_chunk,
                cuda_graphs=options.cuda_graphs,
                max_batch=options.max_batch,
                prefix_caching=False,
                fuse_projections=options.fuse_projections,
                fuse_kernels=options.fuse_kernels,
            )
            self.draft_engine = Engine.load(options.draft_model, draft_options)
            self.runner.draft = DraftModel(
                self.draft_engine.runner.forward,
                self.draft_engine.cache,
                max_seq_len=self.draft_engine.max_seq_len,
                prefill_chunk=draft_options.prefill_chunk,
                vocab_size=self.draft_engine.config.vocab_size,
                target_vocab=self.config.vocab_size,
                name=str(self.draft_engine.model_dir),
            )
        self.scheduler.set_speculation(
            mode,
            options.num_draft_tokens,
            self.draft_engine.cache if self.draft_engine is not None else None,
            options.speculative_max_batch,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_dtype

    @property
    def devices(self) -> list[torch.device]:
        if self.placement is not None:
            return self.placement.devices
        return list(dict.fromkeys(self.model.layer_devices))

    def check_length(self, prompt_tokens: int, new_tokens: int = 0) -> None:
        check_length(prompt_tokens, new_tokens, self.max_seq_len)

    def logits(
        self, token_ids: list[int], *, loras: Mapping[str, float] | None = None
    ) -> torch.Tensor:
        """Logits [len, vocab] (float32, CPU) of a whole sequence, without keeping its cache;
        under the LoRA selection `loras` (default: the model's, set_loras). A logits job of
        the scheduler: it runs batched with whatever else is running."""
        return self.scheduler.logits(token_ids, loras=loras)

    def token_nll(
        self, token_ids: list[int], *, loras: Mapping[str, float] | None = None
    ) -> tuple[float, int]:
        """(Σ NLL, count) of each token after the first given the tokens before it, the
        logits staying where they are computed (scheduler.token_nll)."""
        return self.scheduler.token_nll(token_ids, loras=loras)

    def hidden_states_many(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """Final hidden states [len, hidden] (float32, CPU) of whole sequences, after the
        final norm, without keeping their cache: hidden jobs of the scheduler, short ones
        sharing forwards."""
        return self.scheduler.hidden_states(inputs)

    @property
    def logits_device(self) -> torch.device:
        return self.runner.logits_device

    def open_session(self) -> EngineSession:
        """One sequence fed a piece at a time (the single-job loop, generate_single): a
        session job of the scheduler (engine/session.py)."""
        return self.scheduler.open_session()

    def unload(self) -> None:
        self.scheduler.close()
        with self.lock:  # tensor parallelism's stop message goes out between steps
            self.runner.release()
        if self.draft_engine is not None:
            self.draft_engine.unload()
            self.draft_engine = None
        self.model = None  # type: ignore[assignment]
        self.loras = None  # type: ignore[assignment]
        self.cache = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def abort(self) -> None:
        """Let go after a failed step without waiting on the model (tensor parallelism:
        stops the other ranks without a collective, which they may be stuck in)."""
        self.scheduler.close()
        self.runner.abort()
        # Released as in unload: the engine is not used again (typed as loaded while it is).
        self.model = None  # type: ignore[assignment]
        self.cache = None  # type: ignore[assignment]
