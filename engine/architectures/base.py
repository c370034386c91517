"""The decoder-only causal LM skeleton that architecture files fill in.

An architecture file subclasses `CausalLM`, builds `self.model.layers` from the shared
modules in engine/modules.py (its quirks stay in that file) and names itself in
`architectures`. Parameters are created on the meta device and replaced at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cache import ForwardBatch, PagedKVCache
from engine.config import ModelConfig
from engine.modules import Linear, RMSNorm, Rotary
from engine.rope import rope_tables


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    # HF architecture names this class serves (config.json "architectures").
    architectures: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, self.build_layers(config))
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self._rotary: dict[torch.device, Rotary] = {}
        self.layer_devices: list[torch.device] = []

    def build_layers(self, config: ModelConfig) -> list[nn.Module]:
        raise NotImplementedError

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Scaled-embedding architectures (Gemma) override this."""
        return self.model.embed_tokens(token_ids)

    def setup_rotary(self, max_seq_len: int, *, rope_alpha: float = 1.0) -> None:
        cos, sin = rope_tables(self.config, max_seq_len, rope_alpha=rope_alpha)
        self._rotary = {d: Rotary(cos.to(d), sin.to(d)) for d in dict.fromkeys(self.layer_devices)}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in float32, on the last layer's device."""
        first = self.model.embed_tokens.weight.device
        h = self.embed(batch.on(first).token_ids)
        for layer, device in zip(self.model.layers, self.layer_devices, strict=True):
            h = layer(h.to(device), batch.on(device), cache, self._rotary[device])
        device = self.lm_head_device
        h = h.to(device)[batch.on(device).logits_indices]
        return self.lm_head(self.model.norm(h)).float()

    @property
    def lm_head_device(self) -> torch.device:
        return self.model.norm.weight.device
