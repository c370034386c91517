"""The model class text-generation-webui (TGW) drives, backed by any Kestrel LoadedModel.

TGW's non-transformers loaders (ExLlamav2 before 2026, ExLlamav3, llama.cpp) hand TGW one
object that is both `shared.model` and `shared.tokenizer`, and TGW calls on it:

    from_pretrained(model_name) -> (model, tokenizer)   reads TGW's shared.args
    generate_with_streaming(prompt, state)   yields the cumulative reply; stops when
                                             shared.stop_everything or state['stop_event']
    generate(prompt, state) -> str
    encode(text, add_bos=True) -> LongTensor [1, n];  decode(ids, skip_special_tokens=True)
    get_logits(token_ids [1, n]) -> float32 CPU [1, 1, vocab] (the last position)
    unload();  device;  last_prompt_token_count
    model(input_ids=[1, n], labels=[1, n]).loss, .config.max_position_embeddings
                                             (TGW's perplexity evaluation, as for HF models)

Only `from_pretrained` imports TGW; the rest takes TGW's state dict and works without it.
The installer (loader/tgw/installer.py) teaches TGW this class's name.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import loader as kestrel_loaders
from engine.generator import TokenLogprob
from engine.sampling import Sampler
from loader.base import LoadedModel, LoaderError
from loader.tgw.state import (
    ignored_text,
    load_options,
    logprob_processor,
    prompt_budget,
    sampling_settings,
)

log = logging.getLogger(__name__)


@dataclass
class TGWConfig:
    """The part of an HF config TGW reads from a model (evaluate.py)."""

    max_position_embeddings: int


@dataclass
class CausalLMOutput:
    """What TGW's perplexity evaluation takes from `model(input_ids=..., labels=...)`."""

    logits: torch.Tensor  # [1, n, vocab], float32, CPU
    loss: torch.Tensor | None = None  # mean cross-entropy over labels != -100 (shifted)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


class KestrelTGWModel:
    def __init__(
        self,
        model: LoadedModel,
        *,
        stop_requested: Callable[[], bool] = lambda: False,
        warn: Callable[[str], None] = log.warning,
    ) -> None:
        self.model: LoadedModel | None = model
        # TGW's global Stop button (shared.stop_everything) and TGW's logger (the one its
        # console shows; Kestrel's own logger is silent there); injected so that this
        # class needs no TGW import.
        self.stop_requested = stop_requested
        self.warn = warn
        self.loras: list[str] = []
        self._last_prompt_token_count = 0

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: Path,
        args: Any,
        *,
        stop_requested: Callable[[], bool] = lambda: False,
        warn: Callable[[str], None] = log.warning,
    ) -> KestrelTGWModel:
        """Load `path` with the kestrel engine, options taken from TGW-style `args`."""
        model = kestrel_loaders.load(path, "kestrel", **load_options(args))
        return cls(model, stop_requested=stop_requested, warn=warn)

    @classmethod
    def from_pretrained(cls, model_name: str) -> tuple[KestrelTGWModel, KestrelTGWModel]:
        """TGW's entry point: the model under TGW's model dir, TGW's Model-tab flags."""
        from modules import shared  # TGW's globals; only ever called inside TGW
        from modules.logging_colors import logger
        from modules.utils import resolve_model_path

        path = Path(resolve_model_path(model_name))
        model = cls.load(
            path,
            shared.args,
            stop_requested=lambda: bool(shared.stop_everything),
            warn=logger.warning,
        )
        return model, model

    @property
    def loaded(self) -> LoadedModel:
        if self.model is None:
            raise LoaderError("the Kestrel model was unloaded")
        return self.model

    @property
    def device(self) -> torch.device:
        return self.loaded.logits_device

    @property
    def max_seq_len(self) -> int:
        return self.loaded.context_length

    @property
    def last_prompt_token_count(self) -> int:
        return self._last_prompt_token_count

    @property
    def config(self) -> TGWConfig:
        return TGWConfig(max_position_embeddings=self.max_seq_len)

    def __call__(self, input_ids: Any, labels: Any = None, **_: Any) -> CausalLMOutput:
        """HF-style forward of one sequence; with `labels`, the loss as transformers computes
        it: the logits at position i predict label i + 1, and -100 labels are ignored."""
        logits = self.loaded.logits(_id_list(input_ids)).float().cpu()
        loss = None
        if labels is not None:
            targets = torch.tensor(_id_list(labels), dtype=torch.long)
            loss = torch.nn.functional.cross_entropy(logits[:-1], targets[1:], ignore_index=-100)
        return CausalLMOutput(logits.unsqueeze(0), loss)

    # -- tokens --------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = True, **_: Any) -> torch.Tensor:
        ids = self.loaded.encode(str(text), add_bos=add_bos)
        return torch.tensor([ids], dtype=torch.long)

    def decode(self, ids: Any, skip_special_tokens: bool = True, **_: Any) -> str:
        return self.loaded.decode(_id_list(ids), skip_special=skip_special_tokens)

    def get_logits(self, token_ids: Any, **_: Any) -> torch.Tensor:
        logits = self.loaded.logits(_id_list(token_ids))
        return logits[-1:].unsqueeze(0).float().cpu()

    def apply_samplers(
        self, logits: torch.Tensor, token_ids: Any, state: Mapping[str, Any]
    ) -> torch.Tensor:
        """Next-token logits [vocab] after the samplers `state` sets up, for the context
        `token_ids`: their softmax is what a draw would use (TGW's "Use samplers")."""
        ids = _id_list(token_ids)
        tokenizer = self.loaded.tokenizer
        sampler = Sampler(
            sampling_settings(state, len(ids)),
            device=logits.device,
            eos_token_ids=tokenizer.eos_token_ids,
            encode=lambda text: tokenizer.encode(text, add_bos=False),
        )
        context = torch.tensor(ids, dtype=torch.long, device=logits.device)
        return sampler.process(logits.reshape(-1).float(), context)

    # -- generation ----------------------------------------------------------------------
    def prompt_ids(self, prompt: str, state: Mapping[str, Any]) -> list[int]:
        ids = self.loaded.encode(str(prompt), add_bos=bool(state.get("add_bos_token", True)))
        budget = prompt_budget(state)
        return ids[-budget:] if budget is not None else ids

    def generate_with_streaming(self, prompt: str, state: Mapping[str, Any]) -> Iterator[str]:
        ids = self.prompt_ids(prompt, state)
        self._last_prompt_token_count = len(ids)
        settings = sampling_settings(state, len(ids))
        ignored = settings.unsupported()
        if ignored:
            self.warn(f"Kestrel ignores these settings: {ignored_text(ignored)}")
        # TGW's API asks for logprobs by putting a LogprobProcessor (a transformers logits
        # processor) into the state and reading the top alternatives it recorded per token;
        # Kestrel computes them in its sampler and records them there the same way.
        logprob_proc = logprob_processor(state)
        stop_event = state.get("stop_event")
        reply = ""
        chunks = self.loaded.stream(ids, settings)
        try:  # closing `chunks` (here, or when TGW drops this generator) cancels the job
            for chunk in chunks:
                if self.stop_requested() or (stop_event is not None and stop_event.is_set()):
                    break
                if logprob_proc is not None and chunk.logprobs:
                    self._record_logprobs(logprob_proc, chunk.logprobs)
                if chunk.text:
                    reply += chunk.text
                    yield reply
        finally:
            chunks.close()

    def _record_logprobs(self, proc: Any, logprobs: Sequence[TokenLogprob]) -> None:
        """Each token's top alternatives as TGW's LogprobProcessor records them: a dict
        {token text: logprob}, best first, as `token_alternatives` (the latest token) and
        appended to `token_alternatives_history`."""
        for entry in logprobs:
            alternatives = {
                self.decode([token_id], skip_special_tokens=False): float(value)
                for token_id, value in entry.top
            }
            proc.token_alternatives = alternatives
            proc.token_alternatives_history.append(alternatives)

    def generate(self, prompt: str, state: Mapping[str, Any]) -> str:
        replies = self.generate_with_streaming(prompt, state)
        return next(iter(deque(replies, maxlen=1)), "")  # the last cumulative reply

    # -- LoRA ----------------------------------------------------------------------------
    def set_tgw_loras(self, paths: Mapping[str, Path]) -> None:
        """Make exactly these adapters (name -> directory) active at scale 1, as TGW's
        LoRA menu means: load the new ones, unload the ones no longer listed."""
        model = self.loaded
        wanted = list(paths)
        if wanted == self.loras:
            return
        for name in wanted:
            if name not in self.loras:
                model.load_lora(paths[name], name=name)
                self.loras.append(name)
        for name in [n for n in self.loras if n not in paths]:
            model.unload_lora(name)
            self.loras.remove(name)
        model.set_loras({name: 1.0 for name in wanted})
        self.loras = wanted

    # -- teardown ------------------------------------------------------------------------
    def unload(self) -> None:
        if self.model is not None:
            self.model.unload()
            self.model = None
            self.loras = []


def _id_list(ids: Any) -> list[int]:
    """Token ids from what TGW passes: a list, an int, or a tensor of shape [n] or [1, n]."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() > 1:
            if ids.shape[0] != 1:
                raise ValueError(
                    f"expected one sequence of token ids, got shape {tuple(ids.shape)}"
                )
            ids = ids[0]
        return [int(i) for i in ids.reshape(-1).tolist()]
    if isinstance(ids, int):
        return [ids]
    if isinstance(ids, Sequence) or hasattr(ids, "__iter__"):
        return [int(i) for i in ids]
    raise ValueError(f"expected token ids, got {type(ids).__name__}")
