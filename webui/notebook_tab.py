"""The Notebook tab: raw completion. The model continues the text in the box, in place,
with no chat template; Stop ends it and keeps what was written.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import gradio as gr

from webui import generation
from webui.context import AppContext
from webui.parameters_tab import ParametersTab


@dataclass
class NotebookTab:
    text: gr.Textbox
    generate: gr.Button
    stop: gr.Button
    status: gr.Markdown


def build(ctx: AppContext, remembered: dict[str, Any]) -> NotebookTab:
    text = gr.Textbox(
        remembered.get("notebook", "Once upon a time,"),
        lines=20,
        max_lines=40,
        label="Text",
        elem_id="notebook-text",
        info="the model continues this text (no chat template)",
    )
    with gr.Row():
        generate = gr.Button("Generate", variant="primary", elem_id="notebook-generate")
        stop = gr.Button("Stop", variant="stop", elem_id="notebook-stop")
    status = gr.Markdown(elem_id="notebook-status")
    return NotebookTab(text, generate, stop, status)


def wire(ctx: AppContext, tab: NotebookTab, params: ParametersTab) -> None:
    def run(request: gr.Request, prompt: str, *raw: Any):
        values = params.values(raw)
        ctx.user_data.update_settings(parameters=values, notebook=prompt)
        stop = ctx.new_stop(request.session_hash or "")
        for progress in generation.complete(prompt, values, stop):
            if progress.error:
                err = html.escape(progress.error)
                yield prompt + progress.text, f"<div class='kestrel-error'>Error: {err}</div>"
            else:
                yield prompt + progress.text, progress.status

    def stop(request: gr.Request) -> None:
        ctx.stop(request.session_hash or "")

    tab.generate.click(
        run,
        [tab.text, *params.components],
        [tab.text, tab.status],
        concurrency_limit=None,
        show_progress="hidden",
    )
    tab.stop.click(stop, None, None, queue=False)
