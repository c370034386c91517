"""Reading a PEFT LoRA adapter directory and placing its tensors on a model's linears.

A PEFT adapter is `adapter_config.json` + `adapter_model.safetensors` (or the older pickled
`adapter_model.bin`, read only through `torch.load(weights_only=True)`, which refuses
anything but tensors). Tensor names look like
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); `modules_to_save` (`lm_head`, `embed_tokens`) are whole replacement weights
(`base_model.model.lm_head.weight`), and so is the base weight peft saves beside a LoRA on
lm_head or embed_tokens (`...lm_head.base_layer.weight`); the manager drops such a copy
when it equals the model's own weight.

Contract of `read_adapter(path, targets)`:
- the scaling of each module is peft's: lora_alpha / r, or lora_alpha / sqrt(r) with
  use_rslora, with `rank_pattern` / `alpha_pattern` overrides matched as peft matches them;
  it is folded into B, so the engine only multiplies by the request's scale;
- a lora_A/lora_B pair for a module the model holds fused (q/k/v of Phi-3's `qkv_proj`,
  gate/up of `gate_up_proj`) becomes a part of that linear at the slice's row offset;
- everything that does not fit raises `LoraError` naming the file and tensor or key: a
  missing file, a pickle that is not plain tensors, a non-LoRA or DoRA adapter, a module
  the model has not (another architecture), a shape that differs (another model size),
  a lora_A without its lora_B, a rank that contradicts the config.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.errors import KestrelError
from engine.lora.patterns import UnsafePatternError, check_pattern

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
_PREFIXES = ("base_model.model.",)
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.default)?\.weight$")
_SAVED_KEY = re.compile(
    r"^(?P<module>.+?)(?P<base>\.base_layer)?(?:\.modules_to_save\.default)?\.weight$"
)


class LoraError(KestrelError, ValueError):
    """An adapter cannot be loaded onto this model; the message says which file and key."""


@dataclass(frozen=True)
class Target:
    """Where a module name of an adapter lands: rows offset:offset+out of linear `linear`."""

    linear: str
    in_features: int
    out_features: int
    offset: int = 0


@dataclass
class LoraPart:
    """One lora_A/lora_B pair placed on a linear: delta = (x @ a^T) @ b^T at rows offset:."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out_part, r], scaling folded in
    offset: int


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    base_model: str | None
    parts: dict[str, list[LoraPart]] = field(default_factory=dict)  # linear -> parts
    replacements: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> weight
    # Replacements stored as `<module>.base_layer.weight`: peft saves the base embedding or
    # head of an adapter that targets them (save_embedding_layers), resized or not.
    base_copies: set[str] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        tensors = [t for ps in self.parts.values() for p in ps for t in (p.a, p.b)]
        tensors += list(self.replacements.values())
        return sum(t.numel() * t.element_size() for t in tensors)


def read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoraError(f"LoRA adapter directory {path} does not exist")
    if not file.is_file():
        raise LoraError(f"{file} is missing: not a PEFT adapter directory")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{file}: cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{file}: expected a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"{file}: peft_type '{peft_type}' is not a LoRA adapter")
    if config.get("use_dora"):
        raise LoraError(f"{file}: use_dora is true; DoRA adapters are not supported")
    if config.get("bias", "none") not in ("none", None):
        raise LoraError(f"{file}: bias '{config['bias']}' is not supported (only 'none')")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise LoraError(f"{file}: 'r' must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise LoraError(f"{file}: 'lora_alpha' must be a positive number, got {alpha!r}")
    _check_patterns(config, file)
    return config


def _check_patterns(config: dict[str, Any], file: Path) -> None:
    # Before anything (this loader or peft) matches them: engine/lora/patterns.py.
    patterns: list[tuple[str, Any]] = []
    for key in ("rank_pattern", "alpha_pattern"):
        value = config.get(key) or {}
        if isinstance(value, dict):
            patterns += [(key, pattern) for pattern in value]
    if isinstance(config.get("target_modules"), str):
        patterns.append(("target_modules", config["target_modules"]))
    for key, pattern in patterns:
        try:
            check_pattern(pattern)
        except UnsafePatternError as e:
            raise LoraError(f"{file}: '{key}' holds a bad pattern: {e}") from None


def read_tensors(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The adapter's tensors (on the CPU) and the file they came from."""
    safetensors_file, pickle_file = path / SAFETENSORS_FILE, path / PICKLE_FILE
    if safetensors_file.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return safetensors_file, load_file(safetensors_file)
        except (SafetensorError, OSError) as e:
            raise LoraError(f"{safetensors_file}: cannot be read ({e})") from None
    if pickle_file.is_file():
        try:
            tensors = torch.load(pickle_file, map_location="cpu", weights_only=True)
        except Exception as e:  # any unpickling failure is the file's fault
            raise LoraError(
                f"{pickle_file}: refused; a pickled adapter is read only if it holds plain "
                f"tensors (torch.load weights_only=True): {type(e).__name__}: {e}"
            ) from None
        if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
        ):
            raise LoraError(f"{pickle_file}: expected a dict of tensor names to tensors")
        return pickle_file, tensors
    raise LoraError(f"{path} has neither {SAFETENSORS_FILE} nor {PICKLE_FILE}")


def _check_values(file: Path, key: str, tensor: torch.Tensor) -> None:
    # Refused rather than warned about, as for model weights (engine/weights.py): one NaN
    # in an adapter makes every answer that selects it garbage.
    if not tensor.is_floating_point():
        raise LoraError(
            f"{file}: tensor '{key}' has dtype {str(tensor.dtype).removeprefix('torch.')}, "
            "a LoRA weight must be floating point"
        )
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise LoraError(f"{file}: tensor '{key}' holds {bad} NaN or infinite values")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    # peft's get_pattern_key: the first pattern that matches the end of the module name.
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _pattern_number(
    config: dict[str, Any], key: str, module: str, default: float, file: Path
) -> Any:
    """`rank_pattern` / `alpha_pattern` value for `module`: a positive number (an int for
    ranks), else a LoraError naming the key."""
    patterns = config.get(key) or {}
    if not isinstance(patterns, dict):
        raise LoraError(f"{file}: '{key}' must be an object, got {patterns!r}")
    try:
        value = _pattern_value(patterns, module, default)
    except re.error as e:
        raise LoraError(f"{file}: '{key}' holds a bad pattern ({e})") from None
    want = int if key == "rank_pattern" else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, want)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise LoraError(f"{file}: '{key}' gives {module} {value!r}, not a positive number")
    return value


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def read_adapter(
    path: str | Path,
    name: str,
    targets: dict[str, Target],
    replaceable: dict[str, tuple[int, ...]],
) -> LoraAdapter:
    """Read and place an adapter. `targets`: adapter module name -> where it lands;
    `replaceable`: modules_to_save candidates (module name -> weight shape)."""
    path = Path(path)
    config = read_config(path)
    file, tensors = read_tensors(path)
    cfg_file = path / CONFIG_FILE
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    rslora = bool(config.get("use_rslora", False))
    adapter = LoraAdapter(
        name=name,
        path=path,
        rank=rank,
        alpha=alpha,
        use_rslora=rslora,
        base_model=config.get("base_model_name_or_path"),
    )
    pairs: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        _check_values(file, key, tensor)
        short = _strip(key)
        match = _LORA_KEY.match(short)
        if match:
            pairs.setdefault(match["module"], {})[match["which"]] = (key, tensor)
            continue
        if "lora_embedding" in short or "lora_magnitude" in short:
            raise LoraError(
                f"{file}: tensor '{key}': LoRA on embeddings and DoRA are not supported"
            )
        saved = _SAVED_KEY.match(short)
        module = saved["module"] if saved else None
        if module is None or module not in replaceable:
            known = ", ".join(sorted(replaceable)) or "none"
            raise LoraError(
                f"{file}: tensor '{key}' is neither a lora_A/lora_B weight nor a modules_to_save "
                f"weight this model has ({known})"
            )
        if tuple(tensor.shape) != replaceable[module]:
            raise LoraError(
                f"{file}: tensor '{key}' has shape {tuple(tensor.shape)}, the model's {module} "
                f"has {replaceable[module]}: the adapter was made for another model"
            )
        adapter.replacements[module] = tensor
        if saved is not None and saved["base"]:
            adapter.base_copies.add(module)
    if not pairs and not adapter.replacements:
        raise LoraError(f"{file}: holds no LoRA tensors")
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            have = next(iter(pair.values()))[0]
            raise LoraError(f"{file}: tensor '{have}' has no lora_{'B' if 'A' in pair else 'A'}")
        (a_key, a), (b_key, b) = pair["A"], pair["B"]
        target = targets.get(module)
        if target is None:
            raise LoraError(
                f"{file}: tensor '{a_key}': the model has no linear '{module}' a LoRA can apply "
                f"to (target_modules {config.get('target_modules')!r}); the adapter was made "
                "for another architecture or layer count"
            )
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(
                f"{file}: '{a_key}' {tuple(a.shape)} and '{b_key}' {tuple(b.shape)} are not a "
                "[r, in] / [out, r] pair"
            )
        if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
            raise LoraError(
                f"{file}: '{a_key}' {tuple(a.shape)} / '{b_key}' {tuple(b.shape)} do not fit "
                f"{module} (in {target.in_features}, out {target.out_features}): the adapter "
                "was made for another model size"
            )
        r = _pattern_number(config, "rank_pattern", module, rank, cfg_file)
        if a.shape[0] != r:
            raise LoraError(
                f"{file}: '{a_key}' has rank {a.shape[0]}, {cfg_file.name} says r={r} for {module}"
            )
        mod_alpha = _pattern_number(config, "alpha_pattern", module, alpha, cfg_file)
        scaling = mod_alpha / math.sqrt(r) if rslora else mod_alpha / r
        part = LoraPart(a=a.float(), b=b.float() * scaling, offset=target.offset)
        adapter.parts.setdefault(target.linear, []).append(part)
    return adapter
