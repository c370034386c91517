"""The decoder-only causal LM skeleton that architecture files fill in.

An architecture file subclasses `CausalLM`, builds `self.model.layers` from the shared
modules in engine/modules.py (its quirks stay in that file) and names itself in
`architectures`. Parameters are created on the meta device and replaced at load time.

Hooks an architecture may override or set:

- `build_layers(config)`: the decoder layers (required);
- `embed(token_ids)`: scaled embeddings (Gemma);
- `layer_rope(i)`: the RoPE settings of layer i (Gemma 3's local layers use another base);
  layers with equal settings on one device share one cos/sin table;
- `unit_offset_norm`: the final norm multiplies by (1 + w) (Gemma);
- `final_logit_softcap`: logits become cap * tanh(logits / cap) (Gemma 2).

A layer with `forward_residual(x, residual, batch, cache, rotary, next_norm=, next_qkv=)
-> (x, residual)` (see engine.modules.DecoderLayer; the next layer's input norm and qkv
projection on this device, or None) runs that way while `fuse_kernels` is on: the hidden
state stays split in two until the next norm adds them in its own kernel. The result is that
of the layers' plain `forward`, bit for bit where the kernels' roundings are torch's.

`tensor_names` gives the checkpoint's tensor names to architectures whose module layout
depends on how the checkpoint was saved (MoE experts stored per expert or fused).

`plan` (engine/build_plan.py) says what to build: architectures make their attention and
gated MLPs through `self.attention(spec, i)` and `self.gated_mlp(i, ...)`, which build
q/k/v and gate/up as one linear where the plan fuses them; kernel fusion is set in every
`FusesKernels` module as the plan says, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from engine.build_plan import BuildPlan
from engine.cache import ForwardBatch, PagedKVCache
from engine.config import ConfigError, ModelConfig, RopeParameters
from engine.lora.batch import LoraBatch
from engine.modules import (
    Attention,
    AttentionSpec,
    Embedding,
    FusesKernels,
    GatedMLP,
    Linear,
    RMSNorm,
    Rotary,
)
from engine.norm_fold import FoldedHidden
from engine.rope import rope_tables

LAYER_TYPES = ("full_attention", "sliding_attention")


class DecoderStack(nn.Module):
    def __init__(
        self, config: ModelConfig, layers: list[nn.Module], *, unit_offset_norm: bool = False
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = Embedding(config.vocab_size, config.hidden_size)
        self.layers: nn.ModuleList = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=unit_offset_norm)


class CausalLM(FusesKernels):
    """Fused kernels: residual adds inside the next norm (layers' forward_residual)."""

    # HF architecture names this class serves (config.json "architectures").
    architectures: tuple[str, ...] = ()
    unit_offset_norm: bool = False
    # Whether the residual stream leaves float16's range (65,504) on ordinary text: such a
    # model runs in bfloat16 on a GPU unless asked otherwise (engine.loading.resolve_dtype).
    overflows_float16: bool = False

    def __init__(
        self,
        config: ModelConfig,
        *,
        tensor_names: Collection[str] | None = None,
        plan: BuildPlan | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.plan = plan or BuildPlan()
        self._tensor_names = tensor_names
        self.final_logit_softcap: float | None = None
        self.model = DecoderStack(
            config, self.build_layers(config), unit_offset_norm=self.unit_offset_norm
        )
        self.lm_head: nn.Module = Linear(config.hidden_size, config.vocab_size)
        self._layer_rotary: list[Rotary] = []
        self.layer_devices: list[torch.device] = []
        for module in self.modules():
            if isinstance(module, FusesKernels):
                module.fuse_kernels = self.plan.fuse_kernels

    def attention(self, spec: AttentionSpec, layer_idx: int) -> Attention:
        """Layer `layer_idx`'s attention (`self_attn`), with q/k/v as one linear where the
        plan fuses them."""
        prefix = f"model.layers.{layer_idx}.self_attn."
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        fuse = not spec.fused_qkv and self.plan.fuse(
            [
                (prefix + "q_proj", q_size),
                (prefix + "k_proj", kv_size),
                (prefix + "v_proj", kv_size),
            ]
        )
        return Attention(spec, layer_idx, fuse_qkv=fuse)

    def gated_mlp(
        self, layer_idx: int, hidden: int, intermediate: int, act: str, bias: bool = False
    ) -> GatedMLP:
        """Layer `layer_idx`'s gated MLP (`mlp`), with gate/up as one linear where the plan
        fuses them."""
        prefix = f"model.layers.{layer_idx}.mlp."
        fuse = self.plan.fuse(
            [(prefix + "gate_proj", intermediate), (prefix + "up_proj", intermediate)]
        )
        return GatedMLP(hidden, intermediate, act, bias, fuse_gate_up=fuse)

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        raise NotImplementedError

    @property
    def tensor_names(self) -> Collection[str]:
        """The checkpoint's tensor names: as given, else read from config.model_dir's headers."""
        if self._tensor_names is None:
            from engine.weights import WeightStore

            model_dir = self.config.model_dir
            self._tensor_names = set(WeightStore(model_dir).names()) if model_dir else set()
        return self._tensor_names

    def embed(self, token_ids: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """Scaled-embedding architectures (Gemma) override this."""
        embedded: torch.Tensor = self.model.embed_tokens(token_ids, lora)
        return embedded

    def layer_rope(self, layer_idx: int) -> RopeParameters:
        """RoPE settings of one layer; the config's for every layer unless overridden."""
        return self.config.rope

    def setup_rotary(
        self, max_seq_len: int, *, rope_alpha: float = 1.0, rope_scale: float = 1.0
    ) -> None:
        distinct: list[RopeParameters] = []
        tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        on_device: dict[tuple[int, torch.device], Rotary] = {}
        self._layer_rotary = []
        for i, device in enumerate(self.layer_devices):
            rope = self.layer_rope(i)
            if rope not in distinct:
                distinct.append(rope)
                tables.append(
                    rope_tables(
                        self.config,
                        max_seq_len,
                        rope_alpha=rope_alpha,
                        rope_scale=rope_scale,
                        rope=rope,
                    )
                )
            key = (distinct.index(rope), device)
            if key not in on_device:
                cos, sin = tables[key[0]]
                on_device[key] = Rotary(cos.to(device), sin.to(device))
            self._layer_rotary.append(on_device[key])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in float32, on the head's device."""
        h = self.forward_embed(batch)
        return self.forward_span(h, batch, cache, 0, len(self.model.layers), head=True)

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """The final norm's output [T, hidden] for every new token of the batch, on the
        head's device: what the head would read (embeddings pool it)."""
        h = self.forward_embed(batch)
        h = self.forward_span(h, batch, cache, 0, len(self.model.layers), head=False)
        normed: torch.Tensor = self.model.norm(h.to(self.lm_head_device))
        return normed

    # The forward in parts, so that the decode graphs of a layer-split model
    # (engine/cuda_graph.py) can capture each device's share as its own graph and still
    # run exactly this code.
    def forward_embed(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's tokens, on the embeddings' device."""
        return self.embed(batch.on(self.embed_device).token_ids, batch.lora)

    def forward_span(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        start: int,
        stop: int,
        *,
        head: bool,
    ) -> torch.Tensor:
        """Decoder layers [start, stop) on h [T, hidden] (h follows each layer's device),
        then with `head` the final norm and lm_head: the logits, float32 [N, vocab], else
        the hidden states. Inside a span the hidden state is carried as x + residual, so
        that each residual add runs in the next norm's kernel; a span that ends without
        the head adds them once to hand one tensor to the next device."""
        x: torch.Tensor | FoldedHidden = h
        residual: torch.Tensor | None = None
        for i in range(start, stop):
            layer, device, rotary = (
                self.model.layers[i],
                self.layer_devices[i],
                self._layer_rotary[i],
            )
            # A layer's output with the next norm folded into the next GEMV (issue 28,
            # engine/norm_fold.py) goes on as such only to a layer on its device.
            if isinstance(x, FoldedHidden) and x.h.device != device:
                x = x.h
            x = x if isinstance(x, FoldedHidden) else x.to(device)
            residual = residual.to(device) if residual is not None else None
            # A layer that can carry the residual apart (DecoderLayer.forward_residual).
            forward_residual = getattr(layer, "forward_residual", None)
            if self.fuse_kernels and forward_residual is not None:
                # The next layer's input norm, for a layer that folds it into its GEMVs.
                # Its qkv projection: the row order the norm's input is stored in.
                next_norm = next_qkv = None
                if i + 1 < stop and self.layer_devices[i + 1] == device:
                    following = self.model.layers[i + 1]
                    next_norm = getattr(following, "input_layernorm", None)
                    next_qkv = getattr(getattr(following, "self_attn", None), "qkv_proj", None)
                x, residual = forward_residual(
                    x, residual, batch.on(device), cache, rotary, next_norm=next_norm,
                    next_qkv=next_qkv,
                )  # fmt: skip
                continue
            if isinstance(x, FoldedHidden):
                x = x.h
            if residual is not None:
                x, residual = residual + x, None
            x = layer(x, batch.on(device), cache, rotary)
        if isinstance(x, FoldedHidden):  # the final norm runs as a kernel of its own
            x = x.h
        if not head:
            return x if residual is None else residual + x
        return self._head(x, residual, batch)

    def _head(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> torch.Tensor:
        """Final norm (fused with the last residual add) and lm_head on the logits rows."""
        device = self.lm_head_device
        rows = batch.on(device).logits_indices
        x = x.to(device)
        norm = self.model.norm
        if residual is None:
            normed = norm(x[rows])
        elif rows.shape[0] == x.shape[0]:
            # Decode: every row is wanted. Norm first, then one gather instead of two.
            normed = norm.forward_add(x, residual.to(device))[0][rows]
        else:
            normed = norm.forward_add(x[rows], residual.to(device)[rows])[0]
        logits: torch.Tensor = self.lm_head(normed, batch.lora)
        if self.final_logit_softcap is not None:
            # In the activation dtype, as transformers caps them.
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @property
    def embed_weight(self) -> torch.Tensor:
        """The embedding table (a LoraEmbedding passes its base's through)."""
        weight = self.model.embed_tokens.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    @property
    def embed_device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def embed_dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def lm_head_device(self) -> torch.device:
        return self.model.norm.weight.device


def extra_int(config: ModelConfig, *keys: str, default: int | None = None) -> int:
    """A positive integer the config holds under the first of `keys` it has (spellings
    differ between the Hub and transformers 5), else `default`."""
    for key in keys:
        value = config.extra.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{config.source}: '{key}' must be a positive integer, got {value!r}")
        return value
    if default is None:
        raise ConfigError(f"{config.source}: required key '{keys[0]}' is missing")
    return default


def layer_types(config: ModelConfig, default: Callable[[int], str]) -> list[str]:
    """Each layer's attention type ("full_attention" / "sliding_attention").

    transformers 5 writes `layer_types` into config.json; older configs leave it out and
    the architecture's rule (`default(layer_idx)`) applies, as transformers' config does."""
    types = config.extra.get("layer_types")
    if types is None:
        return [default(i) for i in range(config.num_hidden_layers)]
    if (
        not isinstance(types, list)
        or len(types) != config.num_hidden_layers
        or any(t not in LAYER_TYPES for t in types)
    ):
        raise ConfigError(
            f"{config.source}: 'layer_types' must list one of {', '.join(LAYER_TYPES)} per "
            f"layer ({config.num_hidden_layers}), got {types!r}"
        )
    return list(types)


def layer_windows(config: ModelConfig, types: list[str]) -> list[int | None]:
    """The sliding window of each layer: config.sliding_window on sliding layers."""
    window = config.sliding_window
    if any(t == "sliding_attention" for t in types) and not (
        isinstance(window, int) and window > 0
    ):
        raise ConfigError(
            f"{config.source}: sliding-attention layers need a positive 'sliding_window', "
            f"got {window!r}"
        )
    return [window if t == "sliding_attention" else None for t in types]
