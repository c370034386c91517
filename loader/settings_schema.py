"""Which load-time controls a loader takes, for a UI to render (TGW's loaders_and_params).

    schema = loader.settings_schema("kestrel")
    for control in schema.controls: ...      # name, kind, label, default, range or choices
    options = schema.check({"max_seq_len": 4096, "cache_type": "fp16"})

A control's `name` is the keyword `loader.load(path, loader=name, **options)` takes. A
third-party loader (entry point group `kestrel.loaders`) publishes its schema as a
module-level `SETTINGS_SCHEMA`; one that publishes none gets an empty schema, and a UI
then offers no load options for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.cache import CACHE_TYPES
from engine.engine import EngineOptions
from loader.base import LoaderError

Kind = Literal["int", "float", "bool", "choice", "text", "float_list"]


@dataclass(frozen=True)
class Control:
    name: str  # the load() keyword
    kind: Kind
    label: str
    default: Any = None  # None: the loader decides (e.g. the model's own context length)
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    choices: tuple[str, ...] = ()

    def check(self, value: Any) -> Any:
        """`value` if it fits this control (None always does); else a LoaderError."""
        if value is None:
            return None
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "choice": value in self.choices,
            "text": isinstance(value, str),
            "float_list": isinstance(value, (list, tuple))
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value),
        }[self.kind]
        if ok and self.kind in ("int", "float"):
            ok = (self.minimum is None or value >= self.minimum) and (
                self.maximum is None or value <= self.maximum
            )
        if not ok:
            raise LoaderError(f"{self.name}={value!r}: expected {self.expected()}")
        return value

    def expected(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind in ("int", "float") and (self.minimum is not None or self.maximum is not None):
            low = "-inf" if self.minimum is None else self.minimum
            high = "inf" if self.maximum is None else self.maximum
            return f"{self.kind} in [{low}, {high}]"
        return {"float_list": "a list of numbers", "bool": "true or false"}.get(
            self.kind, self.kind
        )


@dataclass(frozen=True)
class SettingsSchema:
    loader: str
    controls: tuple[Control, ...] = field(default_factory=tuple)

    def names(self) -> list[str]:
        return [c.name for c in self.controls]

    def defaults(self) -> dict[str, Any]:
        return {c.name: c.default for c in self.controls}

    def check(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options, each checked against its control; unknown names are errors."""
        by_name = {c.name: c for c in self.controls}
        unknown = sorted(set(options) - set(by_name))
        if unknown:
            raise LoaderError(
                f"unknown option(s) for the {self.loader} loader: {', '.join(unknown)} "
                f"(known: {', '.join(by_name) or 'none'})"
            )
        return {name: by_name[name].check(value) for name, value in options.items()}


_DEVICE = Control(
    "device", "text", "device", None, "cpu, cuda or cuda:N; empty picks the first GPU, else cpu"
)
_DTYPE = Control(
    "dtype",
    "choice",
    "dtype",
    None,
    "weights and activations; empty picks per device",
    choices=("float16", "bfloat16", "float32"),
)
_CONTEXT = Control(
    "max_seq_len",
    "int",
    "context length",
    None,
    "empty: the loader's default (Kestrel: 8192 at most)",
    minimum=256,
    maximum=1048576,
    step=256,
)

_ENGINE = EngineOptions()
KESTREL = SettingsSchema(
    "kestrel",
    (
        _DEVICE,
        _DTYPE,
        _CONTEXT,
        Control(
            "cache_type",
            "choice",
            "cache type",
            _ENGINE.cache_type,
            "KV cache storage",
            choices=tuple(CACHE_TYPES),
        ),
        Control("gpu_split", "float_list", "GPU split", None, "GB of weights per GPU"),
        Control("autosplit", "bool", "autosplit", False, "fill the GPUs in order"),
        Control("tensor_parallel", "bool", "tensor parallel", False, "shard every layer"),
        Control(
            "cache_tokens",
            "int",
            "cache tokens",
            _ENGINE.cache_tokens,
            "cache size over all jobs; empty: one full context",
            minimum=256,
        ),
        Control(
            "max_batch",
            "int",
            "max batch",
            _ENGINE.max_batch,
            "jobs decoded together",
            minimum=1,
            maximum=256,
        ),
        Control(
            "prefill_chunk",
            "int",
            "prefill chunk",
            _ENGINE.prefill_chunk,
            "tokens per scheduler step",
            minimum=64,
            maximum=65536,
            step=64,
        ),
        Control(
            "rope_alpha",
            "float",
            "RoPE alpha",
            _ENGINE.rope_alpha,
            "NTK scaling of the positions for a longer context",
            minimum=1.0,
            maximum=32.0,
        ),
        Control(
            "rope_scale",
            "float",
            "RoPE scale",
            _ENGINE.rope_scale,
            "linear: positions divided by it (compress_pos_emb), for models trained that way",
            minimum=1.0,
            maximum=32.0,
        ),
        Control("cuda_graphs", "bool", "CUDA graphs", _ENGINE.cuda_graphs, "replay decode steps"),
        Control(
            "lookahead",
            "bool",
            "lookahead",
            _ENGINE.lookahead,
            "launch the next decode step before reading the last one's tokens",
        ),
        Control(
            "prefix_caching",
            "bool",
            "prefix caching",
            _ENGINE.prefix_caching,
            "reuse the cache of a repeated prompt start",
        ),
        Control(
            "speculative",
            "choice",
            "speculative decoding",
            _ENGINE.speculative,
            "ngram: prompt lookup; draft: a draft model; empty: off",
            choices=("ngram", "draft"),
        ),
        Control(
            "draft_model",
            "text",
            "draft model",
            _ENGINE.draft_model,
            "a smaller model with the same tokenizer (implies speculative=draft)",
        ),
        Control(
            "num_draft_tokens",
            "int",
            "draft tokens",
            _ENGINE.num_draft_tokens,
            "tokens drafted per step",
            minimum=1,
            maximum=16,
        ),
    ),
)
TRANSFORMERS = SettingsSchema("transformers", (_DEVICE, _DTYPE, _CONTEXT))
BUILTIN: dict[str, SettingsSchema] = {s.loader: s for s in (KESTREL, TRANSFORMERS)}


def schema_for(name: str, plugin: Any) -> SettingsSchema:
    """A loader's schema: its SETTINGS_SCHEMA, a built-in one, or an empty one."""
    published = getattr(plugin, "SETTINGS_SCHEMA", None)
    if published is not None:
        if not isinstance(published, SettingsSchema):
            raise LoaderError(
                f"loader '{name}': SETTINGS_SCHEMA must be a loader.settings_schema."
                f"SettingsSchema, got {type(published).__name__}"
            )
        return published
    return BUILTIN.get(name, SettingsSchema(name))
