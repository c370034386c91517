"""The conversion's working directory, OUT.partial: what is finished, so a rerun resumes.

Layout (every file is written to a temporary name and renamed into place, so a kill at
any moment leaves either the old or the new version, never half of one):

    job.json                  settings + progress (measured layers, strategy, quantized
                              layers, head done)
    calibration.safetensors   the token rows ("rows", "measure_rows")
    states/STAGE_NNNNN.safetensors   hidden states of a stage (measure, quant) after NNNNN
                              finished layers: one file per count, written before the count
                              is recorded and the previous one removed after, so a kill
                              between the two still finds the states of the recorded count
    layers/layer_NNNNN.safetensors   a quantized layer's tensors (checkpoint names)
    head.safetensors          the quantized lm_head
    layers-sX/, head-sX.safetensors, states/quant-sX_NNNNN.safetensors
                              the same for the quantizing pass at Hessian shrinkage X,
                              when the shrinkage is chosen among passes (shrink_choice.py)
    input/                    a GGUF input imported to FP16 (when the input is GGUF)
    final/                    the output being assembled; renamed to OUT when complete

`Job.open(path, settings, resume)` starts a job or picks up one whose settings match; a
mismatch raises `JobMismatchError` naming the differing keys (rerun with the same flags,
or -nr to start over).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

JOB_FORMAT = 2  # 2: hidden states per finished-layer count (a job of 1 starts over)


class JobMismatchError(ValueError):
    """OUT.partial holds a job made with other settings."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace(tmp: Path, path: Path) -> None:
    # safetensors creates its file owner-only; give it the usual permissions of new files.
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    _replace(tmp, path)


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    _replace(tmp, path)


@dataclass
class Job:
    path: Path
    settings: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)
    resumed: bool = False

    @classmethod
    def open(cls, path: Path, settings: dict[str, Any], *, resume: bool) -> Job:
        job_file = path / "job.json"
        if path.exists() and not resume:
            shutil.rmtree(path)
        if job_file.is_file():
            try:
                saved = json.loads(job_file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                saved = None
            if saved and saved.get("format") == JOB_FORMAT:
                differing = sorted(
                    k
                    for k in set(settings) | set(saved.get("settings", {}))
                    if settings.get(k) != saved["settings"].get(k)
                )
                if differing:
                    raise JobMismatchError(
                        f"{path} holds an unfinished conversion made with other settings "
                        f"({', '.join(differing)}); rerun with the same flags to resume it, "
                        "or pass -nr to start over"
                    )
                return cls(path, settings, saved.get("state", {}), resumed=True)
        if path.exists():  # no readable job.json: leftovers of a job that never started
            shutil.rmtree(path)
        path.mkdir(parents=True)
        job = cls(path, settings)
        job.save()
        return job

    @staticmethod
    def saved_settings(path: Path) -> dict[str, Any] | None:
        """The settings of the job in `path`, or None where there is no readable one."""
        try:
            saved = json.loads((path / "job.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(saved, dict) or saved.get("format") != JOB_FORMAT:
            return None
        settings = saved.get("settings")
        return settings if isinstance(settings, dict) else None

    def save(self) -> None:
        payload = {"format": JOB_FORMAT, "settings": self.settings, "state": self.state}
        atomic_write_text(self.path / "job.json", json.dumps(payload, indent=1))

    def update(self, **changes: Any) -> None:
        self.state.update(changes)
        self.save()

    def get(self, key: str, default: Any = None) -> Any:
        return self.state.get(key, default)

    # -- tensors -----------------------------------------------------------------------
    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> Path:
        path = self.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_save_tensors(path, tensors)
        return path

    def load_tensors(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / name))

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    @staticmethod
    def layer_file(i: int, tag: str = "") -> str:
        """Layer i's quantized tensors; `tag` names one of several quantizing passes."""
        return f"layers{tag}/layer_{i:05d}.safetensors"

    @staticmethod
    def states_file(stage: str, layers: int) -> str:
        return f"states/{stage}_{layers:05d}.safetensors"

    def load_states(self, stage: str, layers: int) -> torch.Tensor:
        """The hidden states of `stage` after `layers` finished layers."""
        return self.load_tensors(self.states_file(stage, layers))["states"]

    def load_state_extras(self, stage: str, layers: int) -> dict[str, torch.Tensor]:
        """What `advance_states` saved beside the states (its `extra`)."""
        tensors = self.load_tensors(self.states_file(stage, layers))
        tensors.pop("states")
        return tensors

    def advance_states(
        self,
        stage: str,
        layers: int,
        states: torch.Tensor,
        *,
        extra: dict[str, torch.Tensor] | None = None,
        **progress: Any,
    ) -> None:
        """Save the states after `layers` finished layers, then record `progress`, then
        drop the states of the count before: at every moment the recorded count's states
        are on disk (a kill after the save but before the record resumes from the older
        count, whose states are still there)."""
        self.save_tensors(self.states_file(stage, layers), {"states": states, **(extra or {})})
        self.update(**progress)
        (self.path / self.states_file(stage, layers - 1)).unlink(missing_ok=True)
