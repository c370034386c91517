"""The Gradio app: the tabs put together, extension UIs, and what each page load restores.

`build_app(ctx)` returns the Blocks; `launch_kwargs(ctx)` the theme/CSS/JS for launch()
(Gradio 6 takes them there, not in Blocks()).
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from serving import extensions
from webui import (
    chat_tab,
    extension_ui,
    lora_lab,
    lora_panel,
    model_tab,
    notebook_restore,
    notebook_tab,
    parameters_tab,
    sampler_controls,
    startup,
)
from webui.context import AppContext
from webui.presets import BUILTIN

CSS = """
.kestrel-error { color: #b91c1c; background: #fef2f2; border: 1px solid #fecaca;
                 border-radius: 6px; padding: 8px 12px; white-space: pre-wrap; }
#chat-status, #notebook-status { font-size: 0.9em; opacity: 0.85; min-height: 1.5em; }
#startup-status { background: #eff6ff; border: 1px solid #bfdbfe; border-radius: 6px;
                  padding: 6px 12px; }
/* Phones: the message box and Send/Stop share one line, the actions another, and the
   chat keeps most of the screen (one-handed use at 390 px). */
@media (max-width: 640px) {
  .gradio-container { padding: 4px !important; }
  #chatbot { height: 58vh !important; }
  #chat-actions { flex-wrap: nowrap !important; gap: 6px; }
  #chat-actions button { min-width: 0 !important; flex: 1 1 0; }
}
"""

# TGW's chat shortcuts: Ctrl+Enter regenerates, Alt+Enter continues. Caught before the
# message box sees the key, which would otherwise send the text on any Enter. And the
# chat's trash icon, caught before Gradio sees the click.
SHORTCUTS_JS = """
<script>
window.addEventListener("keydown", (event) => {
  if (event.key !== "Enter" || event.shiftKey || !(event.ctrlKey || event.altKey)) return;
  const chat = document.getElementById("tab-chat");
  if (!chat || chat.offsetParent === null) return;  // only on the Chat tab
  const button = document.getElementById(event.ctrlKey ? "chat-regenerate" : "chat-continue");
  if (!button) return;
  event.preventDefault();
  event.stopPropagation();
  button.click();
}, true);
// The chat's trash icon would empty the conversation in the browser only, while a reply
// still streaming puts it back: it does what New chat does instead (which stops the reply
// and starts a new saved chat).
window.addEventListener("click", (event) => {
  const trash = event.target.closest && event.target.closest('#chatbot button[aria-label="Clear"]');
  const clear = document.getElementById("chat-clear");
  if (!trash || !clear) return;
  event.preventDefault();
  event.stopPropagation();
  clear.click();
}, true);
</script>
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


def _remembered_preset(ctx: AppContext, remembered: dict[str, Any]) -> str | None:
    """The preset to show as chosen: the remembered one; on a first start the first-run
    preset (whose values the controls hold); None when custom values were remembered
    without a preset (the line under the presets then says "custom")."""
    name = remembered.get("preset")
    if name in ctx.presets.names():
        return str(name)
    return None if remembered.get("parameters") else FIRST_RUN_PRESET


def build_app(ctx: AppContext) -> gr.Blocks:
    remembered = ctx.user_data.load_settings()
    initial = _remembered_parameters(ctx, remembered)
    preset = _remembered_preset(ctx, remembered)
    with gr.Blocks(title="Kestrel", analytics_enabled=False) as demo:
        preparing = startup.preparation_status()
        banner = gr.Markdown(preparing or "", visible=bool(preparing), elem_id="startup-status")
        # Polls only while the default model is prepared (served at once meanwhile).
        ticker = gr.Timer(2.0, active=bool(preparing))
        remembered_notebook = notebook_restore.holder()
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
            lab = lora_lab.build(ctx)  # a tab of its own
            if any(e.has("ui") for e in extensions.active()):
                with gr.Tab("Extensions", id="extensions", elem_id="tab-extensions"):
                    extension_ui.create_extension_ui()
        parameters_tab.wire(ctx, params)
        chat_tab.wire(ctx, chat, params)
        notebook_tab.wire(ctx, notebook, params)
        loaded, unloaded = model_tab.wire(ctx, model)
        lora_panel.wire(ctx, loras)
        lora_lab.wire(ctx, lab, params)

        def on_page_load() -> list[Any]:
            # A page opened later sees the latest remembered settings, the latest chat and
            # the model loaded since the app was built, not the values of the moment it
            # was built; only then can a message be typed (chat_tab.build).
            saved = ctx.user_data.load_settings()
            values = _remembered_parameters(ctx, saved)
            chosen = _remembered_preset(ctx, saved)
            messages, name, revision, chat_system = chat_tab.open_latest(ctx)
            preparing_now = startup.preparation_status()  # not the build time's banner
            return [
                *(values[n] for n in sampler_controls.CONTROL_NAMES),
                gr.update(choices=ctx.presets.names(), value=chosen),
                parameters_tab.describe_preset(ctx.presets, chosen, values),
                gr.update(
                    value=chat_system if messages else saved.get("system_prompt", ""),
                    interactive=True,
                ),
                gr.update(choices=model_tab.model_choices(ctx.manager), value=ctx.manager.name),
                model_tab.describe_loaded(ctx.manager),
                chat_tab.model_template(ctx),
                gr.update(choices=ctx.user_data.chat_choices(), value=None),
                messages,
                messages,
                gr.update(value=name, interactive=True),
                revision,
                gr.update(interactive=True),
                notebook_tab.remembered_text(saved),
                gr.update(value=preparing_now or "", visible=bool(preparing_now)),
            ]

        page_load = demo.load(
            on_page_load,
            None,
            [
                *params.components,
                params.preset,
                params.in_effect,
                chat.system_prompt,
                model.model,
                model.status,
                chat.template,
                chat.past,
                chat.chatbot,
                chat.history,
                chat.chat_name,
                chat.revision,
                chat.text,
                remembered_notebook,
                banner,
            ],
            show_progress="hidden",
        )
        notebook_restore.wire(page_load, remembered_notebook)

        def on_page_unload(request: gr.Request) -> None:
            # The per-session counts of ended jobs would otherwise grow with every page ever
            # opened (a long-running UI serves thousands of sessions).
            ctx.forget_session(request.session_hash or "")

        demo.unload(on_page_unload)

        def on_tick() -> list[Any]:
            line = startup.preparation_status()
            if line is not None:
                return [gr.update(value=line, visible=True), *(gr.update() for _ in range(4))]
            # Ready: show the model as a load from the Model tab would.
            return [
                gr.update(value="", visible=False),
                gr.Timer(active=False),
                gr.update(choices=model_tab.model_choices(ctx.manager), value=ctx.manager.name),
                model_tab.describe_loaded(ctx.manager),
                chat_tab.model_template(ctx),
            ]

        ticker.tick(
            on_tick,
            None,
            [banner, ticker, model.model, model.status, chat.template],
            show_progress="hidden",
        )
        # The template shown follows the model: refresh it after every load/unload.
        for event in (loaded, unloaded):
            event.then(lambda: chat_tab.model_template(ctx), None, [chat.template])
    return demo


def launch_kwargs(ctx: AppContext) -> dict[str, Any]:
    css = CSS + extensions.custom_css()
    js = extensions.custom_js()
    head = SHORTCUTS_JS + notebook_restore.HEAD_JS
    kwargs: dict[str, Any] = {"css": css, "theme": gr.themes.Soft(), "head": head}
    if js:
        kwargs["js"] = js
    return kwargs
