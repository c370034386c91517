"""The Parameters tab: every generation setting (webui.sampler_controls) and presets.

Choosing a preset loads it into the controls at once (as TGW does); "Save preset" writes the
controls' values that differ from the defaults to `<user data>/presets/<name>.yaml`. The
current values are remembered in settings.yaml as soon as a control is changed (and when a
preset is chosen or saved, and when a generation starts), and restored when the page is
opened again. A line under the presets says which preset is in effect, or that the values
are custom and which ones differ from the chosen preset. Delete asks first, and leaves the
controls as they are.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

import gradio as gr

from serving.storage import StorageError
from webui import sampler_controls
from webui.context import AppContext
from webui.presets import Presets
from webui.sampler_controls import CONTROLS, GROUP_TITLES, Control

SHOWN_CHANGES = 4  # differing settings named in the preset line; more are counted
FOLDED_GROUPS = ("repetition", "mirostat", "other")


@dataclass
class ParametersTab:
    components: list[gr.components.Component]  # in sampler_controls.CONTROL_NAMES order
    preset: gr.Dropdown
    preset_name: gr.Textbox
    save: gr.Button
    delete: gr.Button
    status: gr.Markdown
    in_effect: gr.Markdown

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
    lines = {"sampler_priority": 4, "grammar_string": 6}.get(control.name, 1)
    return gr.Textbox(value=value, lines=lines, max_lines=24, **common)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)):
        return a == b
    return isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def changed_from(presets: Presets, name: str | None, values: dict[str, Any]) -> list[str] | None:
    """The sampler settings in `values` that differ from preset `name` (None when there is
    no such preset)."""
    if not name:
        return None
    try:
        preset = presets.load(name)
    except (StorageError, ValueError):
        return None
    return [n for n in sampler_controls.PRESET_NAMES if not _same(values.get(n), preset[n])]


def describe_preset(presets: Presets, name: str | None, values: dict[str, Any]) -> str:
    """Markdown for the line under the presets: the preset in effect, or "custom"."""
    changed = changed_from(presets, name, values)
    if changed == []:
        return f"Preset in effect: **{html.escape(str(name))}**."
    if changed is None:
        return "Custom settings (no preset chosen)."
    named = ", ".join(changed[:SHOWN_CHANGES])
    more = f" and {len(changed) - SHOWN_CHANGES} more" if len(changed) > SHOWN_CHANGES else ""
    return f"Custom settings: preset **{html.escape(str(name))}** with {named}{more} changed."


def build(ctx: AppContext, initial: dict[str, Any], preset: str | None) -> ParametersTab:
    by_name: dict[str, gr.components.Component] = {}
    with gr.Row():
        preset_dd = gr.Dropdown(
            ctx.presets.names(), value=preset, label="Preset", elem_id="preset", scale=2
        )
        preset_name = gr.Textbox(label="Save as", placeholder="my-preset", elem_id="preset-name")
        save = gr.Button("Save preset", elem_id="preset-save")
        delete = gr.Button("Delete preset", elem_id="preset-delete", variant="stop")
    in_effect = gr.Markdown(
        describe_preset(ctx.presets, preset, initial), elem_id="preset-in-effect"
    )
    status = gr.Markdown(elem_id="params-status")
    groups: dict[str, list[Control]] = {}
    for control in CONTROLS:
        groups.setdefault(control.group, []).append(control)
    columns = (("length", "curve"), ("truncation", "mirostat"), ("repetition", "other", "grammar"))
    assert sorted(sum(columns, ())) == sorted(GROUP_TITLES)
    with gr.Row():
        for column in columns:
            with gr.Column():
                for group in column:
                    # The rarely changed groups start folded: on a phone the columns stack,
                    # and unfolded they made the page ~4,900 px tall.
                    with gr.Accordion(
                        GROUP_TITLES[group],
                        open=group not in FOLDED_GROUPS,
                        elem_id=f"params-{group}",
                    ):
                        for control in groups[group]:
                            by_name[control.name] = _component(
                                control, initial.get(control.name, control.default)
                            )
    components = [by_name[n] for n in sampler_controls.CONTROL_NAMES]
    return ParametersTab(components, preset_dd, preset_name, save, delete, status, in_effect)


def wire(ctx: AppContext, tab: ParametersTab) -> None:
    def choose(name: str, *raw: Any) -> list[Any]:
        try:
            preset = ctx.presets.load(name)
        except (StorageError, ValueError) as e:
            return [gr.update() for _ in tab.components] + [_error(e), gr.update()]
        values = {**tab.values(raw), **preset}
        ctx.user_data.update_settings(preset=name, parameters=values)
        updates = [
            preset[n] if n in preset else gr.update() for n in sampler_controls.CONTROL_NAMES
        ]
        return updates + [
            f"Preset **{html.escape(name)}** loaded.",
            describe_preset(ctx.presets, name, values),
        ]

    def changed(name: str | None, *raw: Any) -> str:
        """A control was changed by the user: remember the values now, not at the next
        generation, and say whether they still are the preset's."""
        values = tab.values(raw)
        ctx.user_data.update_settings(parameters=values)
        return describe_preset(ctx.presets, name, values)

    def save(name: str, *raw: Any) -> tuple[Any, str, str]:
        values = tab.values(raw)
        try:
            path = ctx.presets.save(name, values)
        except (StorageError, ValueError) as e:
            return gr.update(), _error(e), gr.update()
        clean = path.stem
        ctx.user_data.update_settings(preset=clean, parameters=values)
        return (
            gr.update(choices=ctx.presets.names(), value=clean),
            f"Saved preset **{html.escape(clean)}** to `{path}`.",
            describe_preset(ctx.presets, clean, values),
        )

    def delete(name: str | None, *raw: Any) -> tuple[Any, str, Any]:
        if not name:  # none chosen, or the confirmation was declined
            return gr.update(), "Nothing deleted.", gr.update()
        try:
            ctx.presets.delete(name)
        except StorageError as e:
            return gr.update(), _error(e), gr.update()
        # The controls keep their values: they are now custom settings.
        ctx.user_data.update_settings(preset=None)
        return (
            gr.update(choices=ctx.presets.names(), value=None),
            f"Deleted preset **{html.escape(name)}**; the settings are unchanged.",
            describe_preset(ctx.presets, None, tab.values(raw)),
        )

    # `input`, not `change`: only the user's choice loads a preset, not a programmatic update
    # (which would reset the controls after a save).
    tab.preset.input(
        choose, [tab.preset, *tab.components], [*tab.components, tab.status, tab.in_effect]
    )
    for component in tab.components:
        component.input(
            changed,
            [tab.preset, *tab.components],
            [tab.in_effect],
            trigger_mode="always_last",
            show_progress="hidden",
        )
    tab.save.click(
        save, [tab.preset_name, *tab.components], [tab.preset, tab.status, tab.in_effect]
    )
    tab.delete.click(
        delete,
        [tab.preset, *tab.components],
        [tab.preset, tab.status, tab.in_effect],
        # Asked in the page; declining sends no name.
        js="(name, ...rest) => [(name && confirm(`Delete the preset ${name}?`)) ? name : null,"
        " ...rest]",
    )


def _error(e: Exception) -> str:
    return f"<div class='kestrel-error' id='params-error'>Error: {html.escape(str(e))}</div>"
