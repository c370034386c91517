"""The model as the quantizer sees it: one decoder layer in memory at a time.

`LayerwiseModel(model_dir, device, dtype)` builds the engine's own architecture on the
meta device (so calibration runs exactly the forward Kestrel runs) and materializes the
weights of one layer at a time from the checkpoint. `CalibrationRunner` pushes hidden
states [rows, length, hidden] through one layer in chunks of rows, with a KV cache sized
for one chunk and shared by all layers (layers run one after another).

`linear_groups(layer)` lists a layer's linears as the quantizer treats them: the attention
and the MLP (the two measured modules), each an ordered list of `LinearGroup`s of linears
that read the same input (q/k/v, gate/up), so one Hessian serves a group.
`mid_stream_path(layer)` names the norm whose input is the stream between the two.

`supported_for_conversion(config)` refuses what the quantizer cannot handle yet (any
architecture the engine lacks, and MoE models) with the list of supported ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.architectures import ARCHITECTURES, architecture_class
from engine.cache import ForwardBatch, PagedKVCache, Sequence
from engine.config import ModelConfig
from engine.loading import check_layer_count
from engine.modules import Linear, RMSNorm, Rotary
from engine.weights import WeightStore

# MoE layers route tokens to experts; their calibration needs per-expert Hessians.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


class UnsupportedModelError(ValueError):
    """The model cannot be converted (yet); the message lists what can."""


def convertible_architectures() -> list[str]:
    return sorted(a for a in ARCHITECTURES if a not in MOE_ARCHITECTURES)


def supported_for_conversion(config: ModelConfig) -> None:
    arch = config.architecture
    if arch not in ARCHITECTURES or arch in MOE_ARCHITECTURES:
        why = "MoE models are not supported by the quantizer yet" if arch in ARCHITECTURES else ""
        raise UnsupportedModelError(
            f"{config.source}: architecture '{arch}' cannot be converted"
            + (f" ({why})" if why else "")
            + f"; supported: {', '.join(convertible_architectures())}"
        )


@dataclass
class LinearGroup:
    """Linears of one layer that read the same input (one Hessian)."""

    names: list[str]  # names relative to the layer, e.g. "self_attn.q_proj"


@dataclass
class ModuleSpec:
    kind: str  # "attn" | "mlp"
    path: str  # the module's name in the layer ("self_attn", "mlp")
    groups: list[LinearGroup] = field(default_factory=list)

    @property
    def linears(self) -> list[str]:
        return [n for g in self.groups for n in g.names]

    @property
    def output_linear(self) -> str:
        """The last linear, whose output is the module's output (o_proj, down_proj)."""
        return self.groups[-1].names[-1]


_GROUPS = {
    "attn": [["q_proj", "k_proj", "v_proj"], ["qkv_proj"], ["o_proj"]],
    "mlp": [["gate_proj", "up_proj"], ["gate_up_proj"], ["down_proj"]],
}


def module_specs(layer: nn.Module) -> list[ModuleSpec]:
    mlp_name = getattr(layer, "mlp_name", "mlp")
    specs = []
    for kind, path in (("attn", "self_attn"), ("mlp", mlp_name)):
        module = layer.get_submodule(path)
        spec = ModuleSpec(kind, path)
        for names in _GROUPS[kind]:
            present = [n for n in names if isinstance(getattr(module, n, None), Linear)]
            if present:
                spec.groups.append(LinearGroup([f"{path}.{n}" for n in present]))
        specs.append(spec)
    return specs


def mid_stream_path(layer: nn.Module) -> str:
    """The norm whose input is the residual stream right after the attention (h plus the
    attention's output, Gemma's post-attention norm applied): the MLP's pre-norm."""
    for name in ("pre_feedforward_layernorm", "post_attention_layernorm"):
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    raise UnsupportedModelError(f"{type(layer).__name__}: no norm in front of the MLP")


class LayerwiseModel:
    def __init__(self, model_dir: str | Path, *, device: torch.device, dtype: torch.dtype):
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(model_dir)
        supported_for_conversion(self.config)
        self.store = WeightStore(model_dir)
        check_layer_count(self.config, self.store)
        self.device, self.dtype = device, dtype
        cls = architecture_class(self.config.architecture, source=self.config.source)
        with torch.device("meta"):
            self.model = cls(self.config, tensor_names=set(self.store.names()))
        self.model.layer_devices = [device] * self.config.num_hidden_layers
        self.num_layers = self.config.num_hidden_layers

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def _materialize(self, module: nn.Module, prefix: str) -> None:
        for name, param in list(module.named_parameters(recurse=True)):
            tensor = self.store.get(
                prefix + name, dtype=self.dtype, device=self.device, shape=tuple(param.shape)
            )
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))

    def load_layer(self, i: int) -> nn.Module:
        layer = self.layers[i]
        self._materialize(layer, f"model.layers.{i}.")
        return layer

    def unload_layer(self, i: int) -> None:
        self.layers[i].to("meta")

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embedded rows [R, L, hidden] in the working dtype (embeddings loaded on demand)."""
        embed = self.model.model.embed_tokens
        self._materialize(embed, "model.embed_tokens.")
        out = self.model.embed(token_ids.to(self.device)).to(self.dtype)
        embed.to("meta")  # a large vocabulary's table need not stay on the device
        return out

    def head_weight(self) -> torch.Tensor:
        """lm_head.weight [vocab, hidden] (the embeddings when tied and absent)."""
        name = "lm_head.weight"
        if name not in self.store:
            name = "model.embed_tokens.weight"
        return self.store.get(name, dtype=torch.float32, device=self.device)

    def final_norm(self) -> RMSNorm:
        norm = self.model.model.norm
        if norm.weight.is_meta:
            self._materialize(norm, "model.norm.")
        return norm

    def setup_rotary(self, length: int) -> None:
        self.model.setup_rotary(length)

    def rotary(self, i: int) -> Rotary:
        # CausalLM keeps the per-layer tables private; its own forward is what uses them.
        return self.model._layer_rotary[i]


class CalibrationRunner:
    """Runs one decoder layer over calibration rows, `chunk_rows` rows per forward."""

    def __init__(
        self, lm: LayerwiseModel, *, length: int, chunk_rows: int, rotary_length: int | None = None
    ) -> None:
        """`rotary_length`: the positions the model's RoPE tables cover (default `length`);
        a runner of shorter rows beside another keeps the other's tables so."""
        self.lm = lm
        self.length = length
        self.chunk_rows = max(1, chunk_rows)
        cfg = lm.config
        page_size = 256
        pages_per_row = -(-length // page_size)
        # Layers run one at a time, so all of them can share one layer's cache tensors.
        self.cache = PagedKVCache(
            num_layers=1,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            num_pages=pages_per_row * self.chunk_rows,
            page_size=page_size,
            dtype=lm.dtype,
            layer_devices=[lm.device],
        )
        layers = cfg.num_hidden_layers
        for name in ("k", "v", "k_slots", "v_slots"):
            setattr(self.cache, name, getattr(self.cache, name) * layers)
        self._rows = 0
        self._seqs: list[Sequence] = []
        self._batch: ForwardBatch | None = None
        lm.setup_rotary(max(length, rotary_length or 0))

    def batch(self, rows: int) -> ForwardBatch:
        """The batch of `rows` sequences of `length` tokens (pages reused between chunks)."""
        if rows != self._rows or self._batch is None:
            for seq in self._seqs:
                seq.release(self.cache)
            self._seqs = [Sequence() for _ in range(rows)]
            tokens = [[0] * self.length for _ in range(rows)]
            batch = ForwardBatch.build(self.cache, self._seqs, tokens)
            # Every chunk takes the paged attention kernel whatever its row count (a chunk of
            # one row would be a fresh prompt, kernels.attention.prompt_attention): the same numbers
            # for every chunking, so a resumed conversion writes the same bytes.
            batch.fresh = False
            self._batch = batch.on(self.lm.device)
            self._rows = rows
        return self._batch

    def chunks(self, total_rows: int) -> Iterator[slice]:
        for start in range(0, total_rows, self.chunk_rows):
            yield slice(start, min(total_rows, start + self.chunk_rows))

    @torch.inference_mode()
    def map_rows(
        self,
        inputs: torch.Tensor,
        fn: Callable[[torch.Tensor, ForwardBatch], torch.Tensor],
    ) -> torch.Tensor:
        """fn over chunks of rows: inputs [R, L, d] -> [R, L, d] (on the inputs' device);
        fn takes the chunk's flat rows [r·L, d] on the working device and its batch."""
        out = torch.empty_like(inputs)
        self.each_chunk(inputs, fn, out)
        return out

    @torch.inference_mode()
    def each_chunk(
        self,
        inputs: torch.Tensor,
        fn: Callable[[torch.Tensor, ForwardBatch], torch.Tensor | None],
        out: torch.Tensor | None = None,
    ) -> None:
        """fn over chunks of rows as map_rows, its results written into `out` when given
        and dropped otherwise (a forward run for what its hooks see: no [R, L, d] buffer,
        and on a GPU no copy of each chunk's result to the host)."""
        count_all, length, d = inputs.shape
        for rows in self.chunks(count_all):
            x = inputs[rows].to(self.lm.device, self.lm.dtype)
            count = x.shape[0]
            y = fn(x.reshape(count * length, d), self.batch(count))
            if out is not None:
                assert y is not None
                out[rows] = y.reshape(count, length, -1).to(out.dtype)

    def run_layer(self, layer_idx: int, states: torch.Tensor) -> torch.Tensor:
        """Layer output [R, L, hidden] for states [R, L, hidden]."""
        layer = self.lm.layers[layer_idx]
        rotary = self.lm.rotary(layer_idx)
        return self.map_rows(states, lambda x, batch: layer(x, batch, self.cache, rotary))

    def run_module(self, layer_idx: int, path: str, inputs: torch.Tensor) -> torch.Tensor:
        """The output of the layer's module `path` (self_attn or the MLP) for its inputs."""
        layer = self.lm.layers[layer_idx]
        module = layer.get_submodule(path)
        if path == "self_attn":
            rotary = self.lm.rotary(layer_idx)
            return self.map_rows(inputs, lambda x, batch: module(x, batch, self.cache, rotary))
        return self.map_rows(inputs, lambda x, batch: module(x))
