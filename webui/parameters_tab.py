"""The Parameters tab: every generation setting (webui.sampler_controls) and presets.

Choosing a preset loads it into the controls at once (as TGW does); "Save preset" writes the
controls' values that differ from the defaults to `<user data>/presets/<name>.yaml`. The
current values are remembered in settings.yaml whenever a preset is chosen or saved and
whenever a generation starts, and restored when the page is opened again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from webui import sampler_controls
from webui.context import AppContext
from webui.sampler_controls import CONTROLS, GROUP_TITLES, Control
from webui.storage import StorageError


@dataclass
class ParametersTab:
    components: list[gr.components.Component]  # in sampler_controls.CONTROL_NAMES order
    preset: gr.Dropdown
    preset_name: gr.Textbox
    save: gr.Button
    delete: gr.Button
    status: gr.Markdown

    def values(self, raw: tuple[Any, ...] | list[Any]) -> dict[str, Any]:
        return dict(zip(sampler_controls.CONTROL_NAMES, raw, strict=True))


def _component(control: Control, value: Any) -> gr.components.Component:
    common: dict[str, Any] = dict(
        label=control.name, info=control.info or None, elem_id=f"param-{control.name}"
    )
    if control.kind == "slider":
        return gr.Slider(control.minimum, control.maximum, value=value, step=control.step, **common)
    if control.kind == "number":
        return gr.Number(value=value, precision=0, minimum=control.minimum, **common)
    if control.kind == "checkbox":
        return gr.Checkbox(value=bool(value), **common)
    lines = 4 if control.name == "sampler_priority" else 1
    return gr.Textbox(value=value, lines=lines, max_lines=24, **common)


def build(ctx: AppContext, initial: dict[str, Any], preset: str) -> ParametersTab:
    by_name: dict[str, gr.components.Component] = {}
    with gr.Row():
        preset_dd = gr.Dropdown(
            ctx.presets.names(), value=preset, label="Preset", elem_id="preset", scale=2
        )
        preset_name = gr.Textbox(label="Save as", placeholder="my-preset", elem_id="preset-name")
        save = gr.Button("Save preset", elem_id="preset-save")
        delete = gr.Button("Delete preset", elem_id="preset-delete", variant="stop")
    status = gr.Markdown(elem_id="params-status")
    groups: dict[str, list[Control]] = {}
    for control in CONTROLS:
        groups.setdefault(control.group, []).append(control)
    columns = (("length", "curve"), ("truncation", "mirostat"), ("repetition", "other"))
    assert sorted(sum(columns, ())) == sorted(GROUP_TITLES)
    with gr.Row():
        for column in columns:
            with gr.Column():
                for group in column:
                    with gr.Group():
                        gr.Markdown(f"**{GROUP_TITLES[group]}**")
                        for control in groups[group]:
                            by_name[control.name] = _component(
                                control, initial.get(control.name, control.default)
                            )
    components = [by_name[n] for n in sampler_controls.CONTROL_NAMES]
    return ParametersTab(components, preset_dd, preset_name, save, delete, status)


def wire(ctx: AppContext, tab: ParametersTab) -> None:
    def choose(name: str, *raw: Any) -> list[Any]:
        try:
            preset = ctx.presets.load(name)
        except (StorageError, ValueError) as e:
            return [gr.update() for _ in tab.components] + [f"**Error:** {e}"]
        values = {**tab.values(raw), **preset}
        ctx.user_data.update_settings(preset=name, parameters=values)
        updates = [
            preset[n] if n in preset else gr.update() for n in sampler_controls.CONTROL_NAMES
        ]
        return updates + [f"Preset **{name}** loaded."]

    def save(name: str, *raw: Any) -> tuple[Any, str]:
        values = tab.values(raw)
        try:
            path = ctx.presets.save(name, values)
        except (StorageError, ValueError) as e:
            return gr.update(), f"**Error:** {e}"
        clean = path.stem
        ctx.user_data.update_settings(preset=clean, parameters=values)
        return gr.update(
            choices=ctx.presets.names(), value=clean
        ), f"Saved preset **{clean}** to `{path}`."

    def delete(name: str) -> tuple[Any, str]:
        try:
            ctx.presets.delete(name)
        except StorageError as e:
            return gr.update(), f"**Error:** {e}"
        return gr.update(
            choices=ctx.presets.names(), value="Default"
        ), f"Deleted preset **{name}**."

    # `input`, not `change`: only the user's choice loads a preset, not a programmatic update
    # (which would reset the controls after a save).
    tab.preset.input(choose, [tab.preset, *tab.components], [*tab.components, tab.status])
    tab.save.click(save, [tab.preset_name, *tab.components], [tab.preset, tab.status])
    tab.delete.click(delete, [tab.preset], [tab.preset, tab.status]).then(
        choose, [tab.preset, *tab.components], [*tab.components, tab.status]
    )
