"""A LoRA comparison grid: prompts × variants (the base model, adapters, mixes with scales)
generated together as one continuous batch with the same sampling settings and seed.

    grid = LoraGrid.new(model, ["Write a haiku."], parse_variants(["base", "pirate",
                        "pirate=0.5 + formal=0.5"]), {"temperature": 0, "max_new_tokens": 64})
    for _ in run_grid(model, grid):       # the grid fills in as the batch streams
        ...
    grid_perplexity(model, grid, text, window=512, windows=8)   # same windows for all
    grid.to_json(), grid.to_markdown(); LoraGrid.from_json(data)

Every cell is one job of one `LoadedModel.stream_many` call: its settings are the grid's
with the variant's `loras` ({} for the base: no adapter, whatever set_loras chose) and the
grid's seed (a random one drawn once when the settings say -1), so a cell is what that
variant gives alone with the same settings. The adapters must be loaded on the model
(`load_lora`); which ones a variant names is checked at submit, by the loader.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_settings import SamplingSettings
from loader.base import LoadedModel
from loader.perplexity import NllSum, bos_id, text_windows, window_nll

FORMAT = "kestrel-lora-grid"
VERSION = 1
BASE = "base"
_SCALE = re.compile(r"^(?P<name>[^=]+?)\s*(?:=\s*(?P<scale>\S+))?$")


class GridError(ValueError):
    """A variant spec, a grid file or a grid request that cannot be used; says which."""


@dataclass(frozen=True)
class Variant:
    """One column: a label and the LoRA selection its jobs run with ({}: the base model)."""

    label: str
    loras: dict[str, float]


def parse_variant(spec: str) -> Variant:
    """ "base" (no adapter), "NAME" (scale 1), "NAME=0.5", or a mix "A=0.5 + B=0.8"."""
    text = spec.strip() if isinstance(spec, str) else ""
    if not text:
        raise GridError("an empty variant: write base, NAME, NAME=SCALE or A=0.5 + B=0.5")
    if text.lower() == BASE:
        return Variant(BASE, {})
    loras: dict[str, float] = {}
    for part in text.split("+"):
        match = _SCALE.match(part.strip())
        if not match or not match["name"].strip():
            raise GridError(f"variant {spec!r}: {part.strip()!r} is not NAME or NAME=SCALE")
        name = match["name"].strip()
        try:
            scale = float(match["scale"]) if match["scale"] is not None else 1.0
        except ValueError:
            raise GridError(f"variant {spec!r}: the scale of {name} is not a number") from None
        if not math.isfinite(scale) or abs(scale) > 1e6:
            raise GridError(f"variant {spec!r}: the scale of {name} must be a finite number")
        if name in loras:
            raise GridError(f"variant {spec!r} names {name} twice")
        loras[name] = scale
    return Variant(variant_label(loras), loras)


def variant_label(loras: Mapping[str, float]) -> str:
    """The canonical spelling of a selection: "base", "A", "A=0.5 + B=0.5"."""
    if not loras:
        return BASE
    return " + ".join(n if s == 1.0 else f"{n}={s:g}" for n, s in loras.items())


def parse_variants(specs: Iterable[str]) -> list[Variant]:
    """Variants from specs (blank ones skipped); two specs of one selection are an error."""
    variants = [parse_variant(s) for s in specs if isinstance(s, str) and s.strip()]
    if not variants:
        raise GridError("no variants: give at least one (base, an adapter name, a mix)")
    labels = [v.label for v in variants]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise GridError(f"variant {twice[0]!r} is given twice")
    return variants


def adapter_names(variants: Iterable[Variant]) -> list[str]:
    """Every adapter the variants name, in order of first use."""
    return list(dict.fromkeys(name for v in variants for name in v.loras))


@dataclass
class Cell:
    """One prompt × variant: its text so far and its numbers."""

    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0  # from its first token to its last (its share of the batch)
    finish_reason: str | None = None

    @property
    def tokens_per_second(self) -> float:
        # The first token comes with the prompt, so the rate counts the ones after it.
        return (self.tokens - 1) / self.seconds if self.seconds > 0 and self.tokens > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "seconds": round(self.seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "finish_reason": self.finish_reason,
        }


@dataclass
class LoraGrid:
    model: str
    prompts: list[str]
    variants: list[Variant]
    settings: dict[str, Any]  # the sampling settings that differ from the defaults
    seed: int
    chat_template: bool = False
    cells: list[list[Cell]] = field(default_factory=list)  # [prompt][variant]
    seconds: float = 0.0  # wall time of the whole batch
    perplexity: dict[str, Any] | None = None  # {"file", "window", "windows", "values"}
    created: str = ""
    name: str = ""

    @classmethod
    def new(
        cls,
        model: LoadedModel,
        prompts: list[str],
        variants: list[Variant],
        settings: SamplingSettings | Mapping[str, Any] | None = None,
        *,
        chat_template: bool = False,
    ) -> LoraGrid:
        """An empty grid; a seed of -1 in `settings` becomes one random seed for all."""
        prompts = [p for p in prompts if isinstance(p, str) and p.strip()]
        if not prompts:
            raise GridError("no prompts: give at least one")
        if not variants:
            raise GridError("no variants: give at least one")
        parsed = SamplingSettings.from_any(settings)
        seed = parsed.seed if parsed.seed != -1 else secrets.randbelow(2**31)
        return cls(
            model=str(getattr(model, "path", "")),
            prompts=prompts,
            variants=list(variants),
            settings=_changed_settings(dataclasses.replace(parsed, seed=seed, loras=None)),
            seed=seed,
            chat_template=chat_template,
            cells=[[Cell() for _ in variants] for _ in prompts],
            created=time.strftime("%Y-%m-%d %H:%M:%S"),
        )

    # -- numbers ------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return sum(c.tokens for row in self.cells for c in row)

    @property
    def tokens_per_second(self) -> float:
        """Aggregate rate of the batch: every cell's tokens over the batch's wall time."""
        return self.total_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for row in self.cells for c in row)

    def column(self, label: str) -> int:
        for i, v in enumerate(self.variants):
            if v.label == label:
                return i
        raise GridError(f"no variant {label!r} in the grid")

    # -- files --------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "created": self.created,
            "model": self.model,
            "chat_template": self.chat_template,
            "prompts": list(self.prompts),
            "variants": [{"label": v.label, "loras": dict(v.loras)} for v in self.variants],
            "seed": self.seed,
            "settings": dict(self.settings),
            "cells": [[c.to_json() for c in row] for row in self.cells],
            "batch": {
                "seconds": round(self.seconds, 6),
                "tokens": self.total_tokens,
                "tokens_per_second": round(self.tokens_per_second, 3),
            },
            "perplexity": self.perplexity,
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "the grid") -> LoraGrid:
        """A grid from `to_json`'s dict; GridError names the key that is wrong."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise GridError(f"{source} is not a Kestrel LoRA grid (format {FORMAT!r})")
        prompts = _list(data, "prompts", source)
        variants_raw = _list(data, "variants", source)
        cells_raw = _list(data, "cells", source)
        variants = []
        for i, v in enumerate(variants_raw):
            if not isinstance(v, dict) or not isinstance(v.get("loras"), dict):
                raise GridError(f"{source}: variants[{i}] needs a 'loras' mapping")
            loras = {str(n): float(s) for n, s in v["loras"].items()}
            variants.append(Variant(str(v.get("label") or variant_label(loras)), loras))
        if not all(isinstance(p, str) for p in prompts):
            raise GridError(f"{source}: every prompt must be text")
        if len(cells_raw) != len(prompts) or any(
            not isinstance(row, list) or len(row) != len(variants) for row in cells_raw
        ):
            raise GridError(
                f"{source}: 'cells' must hold {len(prompts)} rows of {len(variants)} cells"
            )
        cells = [[_cell(c, source) for c in row] for row in cells_raw]
        batch = _dict(data.get("batch")) or {}
        settings = _dict(data.get("settings")) or {}
        perplexity = _dict(data.get("perplexity"))
        return cls(
            model=str(data.get("model", "")),
            prompts=list(prompts),
            variants=variants,
            settings=settings,
            seed=int(data.get("seed", -1)),
            chat_template=bool(data.get("chat_template", False)),
            cells=cells,
            seconds=float(batch.get("seconds", 0.0)),
            perplexity=perplexity,
            created=str(data.get("created", "")),
            name=str(data.get("name", "")),
        )

    def to_markdown(self) -> str:
        """The grid as Markdown: the settings, then per prompt a table of the variants."""
        ppl = (self.perplexity or {}).get("values") or {}
        lines = [f"# LoRA grid{': ' + self.name if self.name else ''}", ""]
        lines.append(f"- model: `{self.model}`")
        lines.append(f"- created: {self.created}")
        lines.append(f"- seed: {self.seed}; chat template: {'yes' if self.chat_template else 'no'}")
        settings = ", ".join(f"{k}={v!r}" for k, v in self.settings.items() if k != "seed")
        lines.append(f"- settings: {settings or 'defaults'}")
        lines.append(
            f"- batch: {len(self.prompts)} prompt(s) × {len(self.variants)} variant(s), "
            f"{self.total_tokens} tokens in {self.seconds:.2f} s "
            f"({self.tokens_per_second:.1f} tok/s together)"
        )
        if self.perplexity:
            p = self.perplexity
            lines.append(
                f"- perplexity: {p.get('file')}, {p.get('windows')} window(s) "
                f"of {p.get('window')} tokens"
            )
        for i, prompt in enumerate(self.prompts):
            lines += ["", f"## Prompt {i + 1}", "", *[f"> {x}" for x in prompt.splitlines()], ""]
            lines.append("| variant | tokens | tok/s | perplexity | text |")
            lines.append("|---|---|---|---|---|")
            for variant, cell in zip(self.variants, self.cells[i], strict=True):
                value = ppl.get(variant.label)
                lines.append(
                    f"| {_md(variant.label)} | {cell.tokens} | {cell.tokens_per_second:.1f} | "
                    f"{'' if value is None else f'{value:.4f}'} | {_md(cell.text)} |"
                )
        return "\n".join(lines) + "\n"


def run_grid(
    model: LoadedModel,
    grid: LoraGrid,
    *,
    stop: threading.Event | None = None,
    prompt_ids: list[list[int]] | None = None,
) -> Iterator[LoraGrid]:
    """Fill `grid` by generating every cell in one `stream_many` batch; yields the grid after
    every chunk. `stop` set: the unfinished jobs are cancelled ("cancelled" cells).
    `prompt_ids`: the token ids of the prompts, where not their text (a benchmark's)."""
    settings = SamplingSettings.from_any({**grid.settings, "seed": grid.seed})
    if prompt_ids is None:
        prompt_ids = [_prompt_ids(model, p, settings, grid.chat_template) for p in grid.prompts]
    elif len(prompt_ids) != len(grid.prompts):
        raise GridError(f"{len(prompt_ids)} prompt id lists for {len(grid.prompts)} prompts")
    jobs: list[str | list[int]] = []
    places: list[tuple[int, int]] = []
    for i, ids in enumerate(prompt_ids):
        for j in range(len(grid.variants)):
            jobs.append(ids)
            places.append((i, j))
    # One settings per job (stream_many takes a list; its annotation names the single form).
    each: Any = [
        dataclasses.replace(settings, loras=dict(grid.variants[j].loras)) for _, j in places
    ]
    grid.cells = [[Cell() for _ in grid.variants] for _ in grid.prompts]
    started = time.perf_counter()
    stream = model.stream_many(jobs, each)
    try:
        for chunk in stream:
            i, j = places[chunk.job_id]
            cell = grid.cells[i][j]
            cell.text += chunk.text
            cell.tokens = chunk.generated_tokens
            cell.prompt_tokens = chunk.prompt_tokens or cell.prompt_tokens
            cell.seconds = chunk.generate_seconds
            if chunk.finish_reason is not None:
                cell.finish_reason = chunk.finish_reason
            grid.seconds = time.perf_counter() - started
            yield grid
            if stop is not None and stop.is_set():
                break
    finally:
        stream.close()  # cancels the jobs still running (engine: their pages are freed)
        grid.seconds = time.perf_counter() - started
        for row in grid.cells:
            for cell in row:
                if cell.finish_reason is None:
                    cell.finish_reason = "cancelled"


def grid_perplexity(
    model: LoadedModel,
    grid: LoraGrid,
    text: str,
    *,
    source: str,
    window: int = 512,
    windows: int | None = 8,
    start_fraction: float = 0.0,
    add_bos: bool = True,
    stop: threading.Event | None = None,
) -> Iterator[tuple[int, int]]:
    """Each variant's perplexity on the same windows of `text` (loader/perplexity.py), into
    `grid.perplexity`; yields (windows scored, windows in all) as it goes."""
    chunks = text_windows(
        model, text, window=window, windows=windows, start_fraction=start_fraction
    )
    bos = bos_id(model, add_bos)
    sums = {v.label: NllSum() for v in grid.variants}
    total = len(chunks) * len(grid.variants)
    done = 0
    for chunk in chunks:
        for variant in grid.variants:
            if stop is not None and stop.is_set():
                return
            sums[variant.label].add(window_nll(model, chunk, bos=bos, loras=variant.loras))
            done += 1
            yield done, total
    grid.perplexity = {
        "file": source,
        "window": window,
        "windows": len(chunks),
        "start_fraction": start_fraction,
        "add_bos": add_bos,
        "values": {label: round(s.perplexity, 6) for label, s in sums.items()},
    }


def _prompt_ids(
    model: LoadedModel, prompt: str, settings: SamplingSettings, chat_template: bool
) -> list[int]:
    if chat_template:
        text = model.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        return model.encode(text, add_bos=False)  # the template writes its own BOS, if any
    return model.encode(prompt, add_bos=settings.add_bos_token)


def _changed_settings(settings: SamplingSettings) -> dict[str, Any]:
    """The fields that differ from SamplingSettings() (plus the seed), as JSON values."""
    default = SamplingSettings()
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name == "seed" or value != getattr(default, f.name):
            is_dict = isinstance(value, dict)
            out[f.name] = {str(k): v for k, v in value.items()} if is_dict else value
    return out


def _dict(value: Any) -> dict[str, Any] | None:
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else None


def _list(data: dict[str, Any], key: str, source: str) -> list[Any]:
    value = data.get(key)
    if not isinstance(value, list):
        raise GridError(f"{source}: {key!r} must be a list")
    return value


def _cell(raw: Any, source: str) -> Cell:
    if not isinstance(raw, dict) or not isinstance(raw.get("text"), str):
        raise GridError(f"{source}: every cell needs a 'text'")
    try:
        return Cell(
            text=raw["text"],
            tokens=int(raw.get("tokens", 0)),
            prompt_tokens=int(raw.get("prompt_tokens", 0)),
            seconds=float(raw.get("seconds", 0.0)),
            finish_reason=raw.get("finish_reason"),
        )
    except (TypeError, ValueError) as e:
        raise GridError(f"{source}: a cell's numbers are not numbers ({e})") from None


def _md(text: str) -> str:
    """Text inside a Markdown table cell: pipes escaped, line breaks as <br>."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")
