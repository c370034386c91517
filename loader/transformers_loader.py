"""The `transformers` loader: Hugging Face AutoModelForCausalLM behind the same interface.

It is the reference Kestrel is tested against and a fallback for architectures Kestrel's
engine does not run. Tokenization and sampling are Kestrel's own (shared with the engine),
so both loaders stream identically for the same logits.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

import torch

from engine.engine import ContextLengthError
from engine.generate import GenerationBackend
from engine.loading import overflows_float16, resolve_device, resolve_dtype
from engine.sampling_settings import SamplingSettings
from engine.tokenizer import Tokenizer
from loader.base import Chunk, LoadedModel, LoaderError, UnsupportedFeatureError
from loader.peft_loras import PeftLoras
from loader.values import check_settings_constraint

NAME = "transformers"


def can_load(path: Path) -> bool:
    """A readable config.json object: transformers decides the rest (and explains it)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict)


def _overflows_float16(path: Path) -> bool:
    """Whether `path`'s config.json names an architecture Kestrel knows to leave float16's
    range (Gemma 2 and 3 do in transformers too)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    names = config.get("architectures") if isinstance(config, dict) else None
    return isinstance(names, list) and any(
        overflows_float16(name) for name in names if isinstance(name, str)
    )


def architecture_problem(path: Path) -> str | None:
    """Why AutoModelForCausalLM cannot build the model of `path`'s config.json, found from
    the config alone (no weight is read); None when transformers knows its model type."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # transformers' own error names the file
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        return f"{path / 'config.json'} has no 'model_type', which transformers needs"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        problem = (
            f"transformers {transformers.__version__} has no causal language model of type "
            f"{model_type!r}"
        )
        if isinstance(config, dict) and "auto_map" in config:
            # The checkpoint brings its own Python for it, which Kestrel never runs.
            problem += (
                "; the model ships its own code (auto_map in config.json), which Kestrel "
                "never runs (trust_remote_code=False)"
            )
        return problem
    return None


def load(
    path: Path,
    *,
    device: str | None = None,
    dtype: str | None = None,
    max_seq_len: int | None = None,
    cache_type: str = "fp16",
    gpu_split: list[float] | None = None,
    autosplit: bool = False,
    tensor_parallel: bool = False,
    **options: Any,
) -> TransformersModel:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise LoaderError("the transformers loader needs the 'transformers' package") from e
    if gpu_split or autosplit or tensor_parallel or cache_type != "fp16":
        raise LoaderError(
            "the transformers loader takes no gpu_split/autosplit/tensor_parallel/cache_type"
        )
    if options:
        raise LoaderError(f"unknown option(s) for the transformers loader: {sorted(options)}")
    problem = architecture_problem(path)
    if problem:  # before any file of the model is read
        raise LoaderError(f"the transformers loader cannot load {path}: {problem}")
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(
        dtype, resolved_device, overflows_float16=_overflows_float16(path)
    )
    tokenizer = Tokenizer.from_dir(path)
    try:
        # trust_remote_code=False: a checkpoint's own Python (auto_map) never runs, and
        # transformers never asks on the terminal whether it may.
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=resolved_dtype, use_safetensors=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError) as e:
        raise LoaderError(f"transformers could not load {path}: {e}") from e
    module: torch.nn.Module = model  # (transformers' own `to` wrapper confuses type checkers)
    module.to(resolved_device).eval()
    configured = getattr(model.config, "max_position_embeddings", None)
    context = max_seq_len or (int(configured) if configured else 2048)
    return TransformersModel(path, _Backend(model, tokenizer, context, resolved_device))


class _Session:
    def __init__(self, backend: _Backend) -> None:
        from transformers import DynamicCache

        self.backend = backend
        self.cache: DynamicCache | None = DynamicCache()
        self.length = 0

    @torch.inference_mode()
    def _run(self, ids: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], device=self.backend.device)
        out = self.backend.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True)
        self.length += len(ids)
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        return self._run(token_ids)

    def step(self, token_id: int) -> torch.Tensor:
        return self._run([token_id])

    def close(self) -> None:
        self.cache = None


class _Backend:
    def __init__(self, model: Any, tokenizer: Tokenizer, max_seq_len: int, device: torch.device):
        self.model = model
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.device = device

    @property
    def logits_device(self) -> torch.device:
        return self.device

    def check_length(self, prompt_tokens: int, new_tokens: int = 0) -> None:
        if prompt_tokens == 0:
            raise ContextLengthError("the prompt is empty: at least one token is needed")
        if prompt_tokens + new_tokens > self.max_seq_len:
            raise ContextLengthError(
                f"the prompt has {prompt_tokens} tokens; the context holds {self.max_seq_len}"
            )

    def open_session(self) -> _Session:
        return _Session(self)


class TransformersModel(LoadedModel):
    loader_name = NAME

    def __init__(self, path: Path, backend: _Backend) -> None:
        super().__init__(path)
        self._backend: _Backend | None = backend
        self._loras = PeftLoras()

    @property
    def backend(self) -> GenerationBackend:
        if self._backend is None:
            raise LoaderError(f"the model {self.path} was unloaded")
        return self._backend

    @torch.inference_mode()
    def _forward(self, ids: list[int], **kwargs: Any) -> Any:
        """The transformers model's output for the whole sequence `ids`."""
        backend = self._backend
        if backend is None:
            raise LoaderError(f"the model {self.path} was unloaded")
        backend.check_length(len(ids))
        input_ids = torch.tensor([list(ids)], device=backend.device)
        return backend.model(input_ids=input_ids, **kwargs)

    def logits(self, ids: list[int], *, loras: Mapping[str, float] | None = None) -> torch.Tensor:
        self._loras.check_request(loras)  # peft applies one selection to every forward
        logits: torch.Tensor = self._forward(ids).logits[0].float().cpu()
        return logits

    def hidden_states(self, ids: list[int]) -> torch.Tensor:
        # transformers' last hidden state is the final norm's output.
        out = self._forward(ids, output_hidden_states=True)
        states: torch.Tensor = out.hidden_states[-1][0].float().cpu()
        return states

    def info(self) -> dict[str, Any]:
        backend = self._backend
        if backend is None:
            raise LoaderError(f"the model {self.path} was unloaded")
        dtype = next(backend.model.parameters()).dtype
        return {
            "loader": NAME,
            "path": str(self.path),
            "arch": (backend.model.config.architectures or ["?"])[0],
            "bits": torch.finfo(dtype).bits,
            "dtype": str(dtype).removeprefix("torch."),
            "context": backend.max_seq_len,
            "devices": [str(backend.device)],
            "vram_gib": {},
            "loras": self._loras.info(),
        }

    # LoRA through peft: one selection for every request (loader/peft_loras.py).
    def load_lora(self, path: str | Path, name: str | None = None) -> str:
        backend = self._live()
        backend.model, name = self._loras.load(backend.model, path, name)
        return name

    def set_loras(self, scales: Mapping[str, float]) -> None:
        self._loras.set(self._live().model, scales)

    def unload_lora(self, name: str) -> bool:
        backend = self._live()
        backend.model = self._loras.unload(backend.model, name)
        return True

    def loras(self) -> dict[str, dict[str, Any]]:
        return self._loras.info()

    def stream(
        self, prompt: str | list[int], settings: SamplingSettings | Mapping[str, Any] | None = None
    ) -> Generator[Chunk, None, None]:
        settings = SamplingSettings.from_any(settings)
        self._loras.check_request(settings.loras)
        _refuse_constraint(settings)
        return super().stream(prompt, settings)

    def stream_many(
        self,
        prompts: list[str | list[int]],
        settings: SamplingSettings | Mapping[str, Any] | None = None,
    ) -> Generator[Chunk, None, None]:
        each = settings if isinstance(settings, list) else [settings]
        for s in each:
            checked = SamplingSettings.from_any(s)
            self._loras.check_request(checked.loras)
            _refuse_constraint(checked)
        return super().stream_many(prompts, settings)

    def _live(self) -> _Backend:
        if self._backend is None:
            raise LoaderError(f"the model {self.path} was unloaded")
        return self._backend

    def unload(self) -> None:
        self._backend = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _refuse_constraint(settings: SamplingSettings) -> None:
    """Structured output needs the kestrel loader's token masks: said, not ignored (output
    that merely looks constrained would be worse than an error)."""
    if check_settings_constraint(settings):
        raise UnsupportedFeatureError(
            "structured output (json_schema, json_object, regex, lark, grammar_string) needs "
            "the kestrel loader; the transformers loader cannot constrain its tokens"
        )
