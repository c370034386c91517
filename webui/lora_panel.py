"""The LoRA panel of the Model tab: adapters in the loras directory, loaded onto the current
model without reloading it (several at once), each with its own scale.

It drives `LoadedModel.load_lora(path, name)`, `set_loras({name: scale})` and
`unload_lora(name)`. A loader that cannot apply LoRAs raises UnsupportedFeatureError, whose
message is shown in the panel. The scales shown are this panel's record of what it set; it
starts empty whenever a different model is loaded.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import gradio as gr

from webui.context import AppContext


@dataclass
class LoraPanel:
    available: gr.Dropdown
    refresh: gr.Button
    load: gr.Button
    loaded: gr.Dropdown
    scale: gr.Slider
    unload: gr.Button
    status: gr.Markdown


def lora_choices(ctx: AppContext) -> list[tuple[str, str]]:
    out = []
    for entry in ctx.manager.list_loras():
        facts = [f"{entry.size_bytes / 1e6:.1f} MB"]
        if entry.rank is not None:
            facts.insert(0, f"rank {entry.rank}")
        out.append((f"{entry.name} ({', '.join(facts)})", entry.name))
    return out


def _describe(scales: dict[str, float]) -> str:
    if not scales:
        return "No LoRA applied."
    return "Applied: " + ", ".join(f"**{n}** × {s:g}" for n, s in scales.items())


def _error(message: str) -> str:
    return f"<div class='kestrel-error' id='lora-error'>Error: {html.escape(message)}</div>"


def build(ctx: AppContext) -> LoraPanel:
    with gr.Accordion(f"LoRA adapters (from {ctx.manager.loras_dir})", open=True):
        with gr.Row():
            available = gr.Dropdown(
                lora_choices(ctx),
                multiselect=True,
                label="Available LoRAs",
                elem_id="lora-available",
                scale=4,
            )
            refresh = gr.Button("Refresh list", elem_id="lora-refresh", scale=1)
            load = gr.Button("Apply LoRAs", variant="primary", elem_id="lora-load", scale=1)
        with gr.Row():
            loaded = gr.Dropdown([], label="Applied LoRA", elem_id="lora-loaded", scale=2)
            scale = gr.Slider(
                0, 2, value=1.0, step=0.05, label="scale", elem_id="lora-scale", scale=3
            )
            unload = gr.Button("Remove LoRA", elem_id="lora-unload", scale=1)
        status = gr.Markdown(_describe({}), elem_id="lora-status")
    return LoraPanel(available, refresh, load, loaded, scale, unload, status)


def wire(ctx: AppContext, panel: LoraPanel) -> None:
    record = ctx.loras

    def current() -> tuple[Any, dict[str, float]]:
        model = ctx.manager.current()
        return model, record.for_model(model)

    def loaded_update(scales: dict[str, float], value: str | None = None) -> Any:
        names = list(scales)
        pick = value if value in scales else (names[-1] if names else None)
        return gr.update(choices=names, value=pick)

    def apply(names: list[str] | None) -> tuple[Any, Any, str]:
        if not names:
            return gr.update(), gr.update(), _error("choose one or more LoRAs first")
        with record.lock:
            try:
                model, scales = current()
                held = set(model.loras())  # the LoRA lab may have loaded some already
                for name in names:
                    if name not in scales:
                        if name not in held:
                            model.load_lora(ctx.manager.resolve_lora(name), name)
                        scales[name] = 1.0
                model.set_loras(dict(scales))
            except Exception as e:
                msg = f"could not apply {', '.join(names)}: {e}"
                scales = record.scales
                return loaded_update(scales), gr.update(), _error(msg)
            return (
                loaded_update(scales, names[-1]),
                gr.update(value=scales[names[-1]]),
                _describe(scales),
            )

    def set_scale(name: str | None, value: float) -> str:
        if not name:
            return _describe(record.scales)
        with record.lock:
            try:
                model, scales = current()
                if name not in scales:
                    return _error(f"LoRA {name} is not applied to the current model")
                scales[name] = float(value)
                model.set_loras(dict(scales))
            except Exception as e:
                return _error(f"could not set the scale of {name}: {e}")
            return _describe(scales)

    def remove(name: str | None) -> tuple[Any, str]:
        if not name:
            return gr.update(), _error("choose an applied LoRA to remove")
        with record.lock:
            try:
                model, scales = current()
                remaining = {n: s for n, s in scales.items() if n != name}
                model.set_loras(remaining)  # new requests stop using it first
                freed = model.unload_lora(name)
                scales.pop(name, None)
            except Exception as e:
                return gr.update(), _error(f"could not remove {name}: {e}")
            note = "" if freed is not False else f" ({name} is freed when running replies end)"
            return loaded_update(scales), _describe(scales) + note

    def show_scale(name: str | None) -> Any:
        return gr.update(value=record.scales.get(name, 1.0)) if name else gr.update()

    panel.refresh.click(lambda: gr.update(choices=lora_choices(ctx)), None, [panel.available])
    panel.load.click(
        apply, [panel.available], [panel.loaded, panel.scale, panel.status], concurrency_id="model"
    )
    panel.scale.input(set_scale, [panel.loaded, panel.scale], [panel.status])
    panel.loaded.input(show_scale, [panel.loaded], [panel.scale])
    panel.unload.click(remove, [panel.loaded], [panel.loaded, panel.status], concurrency_id="model")
