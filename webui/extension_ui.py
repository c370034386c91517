"""Active extensions' own UI (their `ui()` functions) inside the Gradio page."""

from __future__ import annotations

import gradio as gr

from serving import extensions


def create_extension_ui() -> list[str]:
    """Call each active extension's `ui()`; returns the names drawn. Must run inside a
    gradio Blocks: as in TGW, extensions whose params say `is_tab` get a Tab of their own
    (titled params["display_name"]), the others share one Column (elem_id "extensions")."""
    with_ui = [e for e in extensions.active() if e.has("ui")]
    blocks = [e for e in with_ui if not e.params.get("is_tab", False)]
    tabs = [e for e in with_ui if e.params.get("is_tab", False)]
    if blocks:
        with gr.Column(elem_id="extensions"):
            for extension in blocks:
                extension.module.ui()
    for extension in tabs:
        title = extension.params.get("display_name", extension.name)
        with gr.Tab(title, elem_classes="extension-tab"):
            extension.module.ui()
    return [e.name for e in blocks + tabs]
