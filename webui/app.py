"""The Gradio app: the tabs put together, extension UIs, and what each page load restores.

`build_app(ctx)` returns the Blocks; `launch_kwargs(ctx)` the theme/CSS/JS for launch()
(Gradio 6 takes them there, not in Blocks()).
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from webui import (
    chat_tab,
    extensions,
    lora_panel,
    model_tab,
    notebook_tab,
    parameters_tab,
    sampler_controls,
)
from webui.context import AppContext
from webui.presets import BUILTIN

CSS = """
.kestrel-error { color: #b91c1c; background: #fef2f2; border: 1px solid #fecaca;
                 border-radius: 6px; padding: 8px 12px; white-space: pre-wrap; }
#chat-status, #notebook-status { font-size: 0.9em; opacity: 0.85; min-height: 1.5em; }
"""


# The preset of a first start: TGW's long-time default, which keeps small models on topic
# (plain temperature-1 sampling makes a 135M model ramble).
FIRST_RUN_PRESET = "simple-1"


def _remembered_parameters(ctx: AppContext, remembered: dict[str, Any]) -> dict[str, Any]:
    values = {**sampler_controls.defaults(), **BUILTIN[FIRST_RUN_PRESET]}
    saved = remembered.get("parameters")
    if isinstance(saved, dict):
        candidate = {**values, **{k: v for k, v in saved.items() if k in values}}
        try:
            sampler_controls.validate(candidate)
            values = candidate
        except ValueError:  # settings.yaml edited by hand into nonsense: start from defaults
            pass
    return values


def _remembered_preset(ctx: AppContext, remembered: dict[str, Any]) -> str:
    name = remembered.get("preset")
    if name in ctx.presets.names():
        return str(name)
    return "Default" if remembered.get("parameters") else FIRST_RUN_PRESET


def build_app(ctx: AppContext) -> gr.Blocks:
    remembered = ctx.user_data.load_settings()
    initial = _remembered_parameters(ctx, remembered)
    preset = (
        remembered.get("preset") if remembered.get("preset") in ctx.presets.names() else "Default"
    )
    with gr.Blocks(title="Kestrel", analytics_enabled=False) as demo:
        with gr.Tabs(elem_id="tabs"):
            with gr.Tab("Chat", id="chat", elem_id="tab-chat"):
                chat = chat_tab.build(ctx, remembered)
            with gr.Tab("Notebook", id="notebook", elem_id="tab-notebook"):
                notebook = notebook_tab.build(ctx, remembered)
            with gr.Tab("Parameters", id="parameters", elem_id="tab-parameters"):
                params = parameters_tab.build(ctx, initial, preset)
            with gr.Tab("Model", id="model", elem_id="tab-model"):
                model = model_tab.build(ctx, remembered)
                loras = lora_panel.build(ctx)
            if any(e.has("ui") for e in extensions.active()):
                with gr.Tab("Extensions", id="extensions", elem_id="tab-extensions"):
                    extensions.create_extension_ui()
        parameters_tab.wire(ctx, params)
        chat_tab.wire(ctx, chat, params)
        notebook_tab.wire(ctx, notebook, params)
        loaded, unloaded = model_tab.wire(ctx, model)
        lora_panel.wire(ctx, loras)

        def on_page_load() -> list[Any]:
            # A page opened later sees the latest remembered settings and the model loaded
            # since the app was built, not the values of the moment it was built.
            saved = ctx.user_data.load_settings()
            values = _remembered_parameters(ctx, saved)
            chosen = (
                saved.get("preset") if saved.get("preset") in ctx.presets.names() else "Default"
            )
            return [
                *(values[n] for n in sampler_controls.CONTROL_NAMES),
                gr.update(choices=ctx.presets.names(), value=chosen),
                saved.get("system_prompt", ""),
                gr.update(choices=model_tab.model_choices(ctx.manager), value=ctx.manager.name),
                model_tab.describe_loaded(ctx.manager),
                chat_tab.model_template(ctx),
                gr.update(choices=ctx.user_data.chat_names()),
            ]

        demo.load(
            on_page_load,
            None,
            [
                *params.components,
                params.preset,
                chat.system_prompt,
                model.model,
                model.status,
                chat.template,
                chat.past,
            ],
        )
        # The template shown follows the model: refresh it after every load/unload.
        for event in (loaded, unloaded):
            event.then(lambda: chat_tab.model_template(ctx), None, [chat.template])
    return demo


def launch_kwargs(ctx: AppContext) -> dict[str, Any]:
    css = CSS + extensions.custom_css()
    js = extensions.custom_js()
    kwargs: dict[str, Any] = {"css": css, "theme": gr.themes.Soft()}
    if js:
        kwargs["js"] = js
    return kwargs
