"""The adapters loaded into one engine: slots, per-request selections, hot load and unload.

Contract:
- `load(path, name)` reads and checks the adapter outside any lock (LoraError on bad
  input, the model untouched), then installs it under the engine lock between two steps:
  it takes the next slot, and every linear it targets gets its stacks rebuilt.
- A selection is `{name: scale}`; `resolve` checks it (known names, finite scales, at most
  one active replacement per module) and drops zeros. `default` (set by `set_default`) is
  the selection of requests that bring none and of `Engine.logits`.
- Jobs `acquire` their selection at submit and `release` it when they end. `unload(name)`
  of an adapter no job holds frees it at once (True); otherwise it is marked unloading
  (new requests naming it are refused) and freed when its last job ends (False).
- `version` changes whenever slots or stacks change: the CUDA-graph decode steps that
  captured the stacks' addresses are then captured again.
- `scales(selections)` turns a step's selections into one scale per (sequence, slot), None
  when no row uses an adapter (the no-LoRA path); `batch(scales, ...)` into the
  `LoraBatch` that the runner puts in the step's ForwardBatch.
- `salt(selection)` names a selection for the prefix cache: pages computed under one
  selection are never reused under another (or under a reloaded adapter of the same name).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.linears import linear_features
from engine.lora.adapter import LoraAdapter, LoraError, Target, read_adapter
from engine.lora.batch import LoraBatch, LoraSegments
from engine.lora.layers import LoraEmbedding, LoraLinear
from engine.quantized_linear import QuantizedLinear

if TYPE_CHECKING:  # engine.architectures' modules import engine.lora.batch
    from engine.architectures.base import CausalLM

_HEAD, _EMBED = "lm_head", "model.embed_tokens"
_uid = itertools.count(1)


def _module_device(module: nn.Module) -> torch.device:
    if isinstance(module, LoraLinear | LoraEmbedding):
        module = module.base
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    if isinstance(module, QuantizedLinear):  # it keeps its tensors in a dataclass
        return module.qweight.scales.device
    raise LoraError(f"cannot tell the device of {type(module).__name__}")


def lora_targets(model: CausalLM) -> dict[str, Target]:
    """Adapter module names this model can apply a LoRA to: attention and dense-MLP
    projections (also by their unfused names where the model fuses them) and lm_head.
    Linears inside MoE experts see routed rows, not a request's rows, and are left out."""
    from engine.modules import Attention, FusedGatedMLP, GatedMLP

    targets: dict[str, Target] = {}

    def add(
        name: str, linear: str, module: nn.Module, offset: int = 0, out: int | None = None
    ) -> None:
        in_features, out_features = linear_features(module)
        targets[name] = Target(linear, in_features, out_features if out is None else out, offset)

    for name, module in model.named_modules():
        prefix = f"{name}."
        if isinstance(module, Attention):
            s = module.spec
            q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            if s.fused_qkv:
                fused = module.qkv_proj
                if "qkv_proj" not in module.load_sources:  # the checkpoint's own name
                    add(prefix + "qkv_proj", prefix + "qkv_proj", fused)
                slices = (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))
                for leaf, offset, size in slices:
                    add(prefix + leaf, prefix + "qkv_proj", fused, offset, size)
            else:
                for leaf in ("q_proj", "k_proj", "v_proj"):
                    add(prefix + leaf, prefix + leaf, getattr(module, leaf))
            add(prefix + "o_proj", prefix + "o_proj", module.o_proj)
        elif isinstance(module, FusedGatedMLP) or (
            isinstance(module, GatedMLP) and module.gate_up_proj is not None  # build plan
        ):
            gate_up = module.gate_up_proj
            assert gate_up is not None
            fused = gate_up
            half = linear_features(fused)[1] // 2
            if isinstance(module, FusedGatedMLP):  # the checkpoint's own name
                add(prefix + "gate_up_proj", prefix + "gate_up_proj", fused)
            add(prefix + "gate_proj", prefix + "gate_up_proj", fused, 0, half)
            add(prefix + "up_proj", prefix + "gate_up_proj", fused, half, half)
            add(prefix + "down_proj", prefix + "down_proj", module.down_proj)
        elif isinstance(module, GatedMLP):
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                add(prefix + leaf, prefix + leaf, getattr(module, leaf))
    add(_HEAD, _HEAD, model.lm_head)
    return targets


class LoraManager:
    def __init__(self, model: CausalLM, lock: threading.RLock) -> None:
        self.model = model
        self.lock = lock
        self.adapters: dict[str, LoraAdapter] = {}  # slot order
        self.uids: dict[str, int] = {}
        self.default: dict[str, float] = {}
        self.version = 0
        # Called after every change of the stacks (the engine drops its LoRA decode graphs).
        self.listeners: list[Callable[[], None]] = []
        self._in_use: Counter[str] = Counter()
        self._unloading: set[str] = set()
        self._dtype = model.embed_dtype
        self._targets = lora_targets(model)
        head_in, head_out = linear_features(model.lm_head)
        self._replaceable: dict[str, tuple[int, ...]] = {
            _HEAD: (head_out, head_in),
            _EMBED: tuple(model.embed_weight.shape),
        }

    # -- loading -------------------------------------------------------------------------
    def load(self, path: str | Path, name: str | None = None) -> str:
        path = Path(path).expanduser()
        name = name or path.name
        if not name:
            raise LoraError(f"cannot derive an adapter name from {path}: pass name=")
        with self.lock:
            if name in self.adapters:
                raise LoraError(f"an adapter named '{name}' is already loaded; unload it first")
        adapter = read_adapter(path, name, self._targets, self._replaceable)
        with self.lock:
            if name in self.adapters:
                raise LoraError(f"an adapter named '{name}' is already loaded; unload it first")
            device = _module_device(self.model.lm_head)
            adapter.replacements = {
                module: t.to(device=device, dtype=self._dtype)
                for module, t in adapter.replacements.items()
            }
            for module in adapter.base_copies:
                if torch.equal(adapter.replacements[module], self._base_weight(module)):
                    del adapter.replacements[module]  # the model's own weight: nothing to do
            self.adapters[name] = adapter
            self.uids[name] = next(_uid)
            try:
                self._rebuild()
            except BaseException:
                del self.adapters[name], self.uids[name]
                self._rebuild()
                raise
        return name

    def _base_weight(self, module: str) -> torch.Tensor:
        """The dense weight of lm_head / embed_tokens as the model holds it (an empty
        tensor for a quantized head, which then never equals a saved copy)."""
        layer = self.model.get_submodule(module)
        if isinstance(layer, LoraLinear | LoraEmbedding):
            layer = layer.base
        weight = getattr(layer, "weight", None)
        return weight if isinstance(weight, torch.Tensor) else torch.empty(0)

    def unload(self, name: str) -> bool:
        """Free the adapter now (True) or once the jobs using it end (False)."""
        with self.lock:
            self._check_known(name)
            self.default.pop(name, None)
            if self._in_use[name]:
                self._unloading.add(name)
                return False
            self._remove(name)
            return True

    def set_default(self, selection: Mapping[str, float] | None) -> None:
        with self.lock:
            self.default = self.resolve(selection or {})

    def _check_known(self, name: str) -> None:
        if name not in self.adapters:
            known = ", ".join(self.adapters) or "none"
            raise LoraError(f"no LoRA adapter named '{name}' is loaded (loaded: {known})")

    def _remove(self, name: str) -> None:
        del self.adapters[name]
        del self.uids[name]
        self._unloading.discard(name)
        self._in_use.pop(name, None)
        self._rebuild()

    # -- selections ----------------------------------------------------------------------
    def resolve(self, selection: Mapping[str, float] | None) -> dict[str, float]:
        """A checked copy of `selection` without zero scales; None gives the default."""
        if selection is None:
            return dict(self.default)
        with self.lock:
            out: dict[str, float] = {}
            for name, scale in selection.items():
                self._check_known(name)
                if name in self._unloading:
                    raise LoraError(f"LoRA adapter '{name}' is being unloaded")
                if isinstance(scale, bool) or not isinstance(scale, int | float):
                    raise LoraError(f"the scale of LoRA '{name}' must be a number, got {scale!r}")
                if not math.isfinite(scale):
                    raise LoraError(f"the scale of LoRA '{name}' must be finite, got {scale}")
                if scale:
                    out[name] = float(scale)
            for module in (_HEAD, _EMBED):
                users = [n for n in out if module in self.adapters[n].replacements]
                if len(users) > 1:
                    raise LoraError(
                        f"adapters {', '.join(users)} all replace {module} (modules_to_save); "
                        "only one of them can be active in a request"
                    )
            return out

    def acquire(self, selection: Mapping[str, float]) -> None:
        with self.lock:
            self._in_use.update(selection.keys())

    def release(self, selection: Mapping[str, float]) -> None:
        with self.lock:
            for name in selection:
                self._in_use[name] -= 1
                if self._in_use[name] <= 0:
                    del self._in_use[name]
                    if name in self._unloading:
                        self._remove(name)

    def salt(self, selection: Mapping[str, float]) -> str:
        return ";".join(f"{self.uids[n]}={s!r}" for n, s in sorted(selection.items()))

    # -- one forward ---------------------------------------------------------------------
    def scales(self, selections: list[dict[str, float]]) -> torch.Tensor | None:
        """[len(selections), slots] float32 (CPU): each selection's scale per slot; None
        when no selection uses an adapter (the step then runs without LoRA)."""
        if not any(selections):
            return None
        slots = {name: i for i, name in enumerate(self.adapters)}
        scales = torch.zeros((len(selections), len(slots)), dtype=torch.float32)
        for g, selection in enumerate(selections):
            for name, scale in selection.items():
                scales[g, slots[name]] = scale
        return scales

    def batch(
        self, scales: torch.Tensor, lengths: list[int], logits_lengths: list[int]
    ) -> LoraBatch:
        """The batch the LoRA modules read: sequence g has `lengths[g]` rows in the decoder
        and `logits_lengths[g]` rows at lm_head, all at `scales[g]`."""
        device = _module_device(self.model.lm_head)
        body = self._segments(lengths, scales, device)
        head = body if logits_lengths == lengths else self._segments(logits_lengths, scales, device)
        return LoraBatch(body=body, head=head)

    @staticmethod
    def _segments(lengths: list[int], scales: torch.Tensor, device: torch.device) -> LoraSegments:
        starts = list(itertools.accumulate(lengths, initial=0))
        return LoraSegments(
            starts=torch.tensor(starts, dtype=torch.int32).to(device),
            scales=scales.to(device),
            max_len=max(lengths, default=0),
            host_starts=starts,
            host_scales=scales,
        )

    def graphable(self, selections: list[dict[str, float]]) -> bool:
        """Whether a decode step with these selections may replay a CUDA graph: not when a
        replacement (modules_to_save) is active, which runs on host-side row lists."""
        return not any(self.adapters[n].replacements for s in selections for n in s)

    def static_batch(self, batch_size: int, device: torch.device) -> LoraBatch:
        """Device buffers of a decode step of `batch_size` rows (one segment per row), for
        graph capture. The caller must own the result as long as the graph may replay: the
        kernels keep the addresses of `starts` and `scales`, and each step fills `scales`.
        `host_scales` stay 0: the host-side branches (replacements) are taken at capture as
        for a step where no row uses one, which `graphable` makes true of every replay."""
        scales = torch.zeros((batch_size, len(self.adapters)), dtype=torch.float32)
        seg = LoraSegments(
            starts=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
            scales=scales.to(device),
            max_len=1,
            host_starts=list(range(batch_size + 1)),
            host_scales=scales,
        )
        return LoraBatch(body=seg, head=seg)

    # -- module stacks -------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Wrap the targeted modules, (re)build every stack, unwrap what nothing targets."""
        self.version += 1
        names = list(self.adapters)
        linears = {linear for a in self.adapters.values() for linear in a.parts}
        if any(_HEAD in a.replacements for a in self.adapters.values()):
            linears.add(_HEAD)
        wrapped = {n for n, m in self.model.named_modules() if isinstance(m, LoraLinear)}
        for linear in sorted(linears | wrapped):
            module = self._wrap(linear) if linear in linears else None
            if module is None:
                self._unwrap(linear)
                continue
            self._fill(module, linear, names)
        embed = self.model.model.embed_tokens
        users = [(i, a) for i, a in enumerate(self.adapters.values()) if _EMBED in a.replacements]
        if users and not isinstance(embed, LoraEmbedding):
            embed = self.model.model.embed_tokens = LoraEmbedding(embed)
        if isinstance(embed, LoraEmbedding):
            embed.replacements = {i: a.replacements[_EMBED] for i, a in users}
            if embed.empty:
                self.model.model.embed_tokens = embed.base
        for listener in self.listeners:
            listener()

    def _wrap(self, linear: str) -> LoraLinear:
        parent_name, _, leaf = linear.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        module = getattr(parent, leaf)
        if not isinstance(module, LoraLinear):
            module = LoraLinear(module, head=linear == _HEAD)
            setattr(parent, leaf, module)
        return module

    def _unwrap(self, linear: str) -> None:
        parent_name, _, leaf = linear.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        module = getattr(parent, leaf)
        if isinstance(module, LoraLinear):
            setattr(parent, leaf, module.base)

    def _fill(self, module: LoraLinear, linear: str, names: list[str]) -> None:
        device = _module_device(module.base)
        adapters = [self.adapters[n] for n in names]
        users = [(s, a) for s, a in enumerate(adapters) if linear in a.parts]
        slot_map = torch.full((len(names),), -1, dtype=torch.int32)
        module.lora_a = module.lora_b = None
        if users:
            rank = max(sum(p.a.shape[0] for p in a.parts[linear]) for _, a in users)
            a_stack = torch.zeros((len(users), rank, module.in_features), dtype=self._dtype)
            b_stack = torch.zeros((len(users), module.out_features, rank), dtype=self._dtype)
            for local, (slot, adapter) in enumerate(users):
                slot_map[slot] = local
                r0 = 0
                for part in adapter.parts[linear]:
                    r = part.a.shape[0]
                    a_stack[local, r0 : r0 + r] = part.a
                    rows = slice(part.offset, part.offset + part.b.shape[0])
                    b_stack[local, rows, r0 : r0 + r] = part.b
                    r0 += r
            module.lora_a, module.lora_b = a_stack.to(device), b_stack.to(device)
        module.slot_map = slot_map.to(device)
        module.replacements = {
            s: self.adapters[n].replacements[linear]
            for s, n in enumerate(names)
            if linear in self.adapters[n].replacements
        }

    # -- reporting -----------------------------------------------------------------------
    def info(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {
                name: {
                    "path": str(a.path),
                    "rank": a.rank,
                    "alpha": a.alpha,
                    "use_rslora": a.use_rslora,
                    "base_model": a.base_model,
                    "linears": len(a.parts),
                    "modules_to_save": sorted(a.replacements),
                    "scale": self.default.get(name, 0.0),
                    "in_use": self._in_use.get(name, 0),
                    "unloading": name in self._unloading,
                    "mib": round(a.nbytes / 2**20, 3),
                }
                for name, a in self.adapters.items()
            }
