"""The Notebook tab: raw completion. The model continues the text in the box, in place,
with no chat template; Stop ends it and keeps what was written.

The text is remembered as it is typed (settings.yaml) and restored when the page is opened
again. While the model writes, the box is read-only and Generate becomes Stop, so nothing
typed meanwhile is overwritten by the stream.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import gradio as gr

from webui import generation
from webui.context import AppContext
from webui.parameters_tab import ParametersTab

DEFAULT_TEXT = "Once upon a time,"


def remembered_text(remembered: dict[str, Any]) -> str:
    text = remembered.get("notebook")
    return text if isinstance(text, str) else DEFAULT_TEXT


@dataclass
class NotebookTab:
    text: gr.Textbox
    generate: gr.Button
    stop: gr.Button
    status: gr.Markdown
    saved: gr.Markdown  # "Text saved (N characters)." once a typed change is remembered
    # How many runs this page has seen end (kept in the page, so each event carries the
    # count as it was when the event fired): a stream's own updates fire `.change` events
    # that can reach the server after the run ended and saved its final text; they carry
    # an older count and are not saved over it.
    runs_seen: gr.Number


def build(ctx: AppContext, remembered: dict[str, Any]) -> NotebookTab:
    text = gr.Textbox(
        remembered_text(remembered),
        lines=20,
        max_lines=40,
        label="Text",
        elem_id="notebook-text",
        info="the model continues this text (no chat template)",
        # The page puts the remembered text in and keeps the box read-only until then
        # (webui.notebook_restore): typing before that would be lost.
    )
    with gr.Row():
        generate = gr.Button("Generate", variant="primary", elem_id="notebook-generate")
        stop = gr.Button("Stop", variant="stop", visible=False, elem_id="notebook-stop")
    status = gr.Markdown(elem_id="notebook-status")
    saved = gr.Markdown(elem_id="notebook-saved")
    runs_seen = gr.Number(0, visible=False, precision=0, elem_id="notebook-runs-seen")
    return NotebookTab(text, generate, stop, status, saved, runs_seen)


def wire(ctx: AppContext, tab: NotebookTab, params: ParametersTab) -> None:
    def session(request: gr.Request) -> str:
        return f"{request.session_hash or ''}/notebook"

    def run(request: gr.Request, prompt: str, *raw: Any):
        job = ctx.start_job(session(request))
        if job is None:
            raise gr.Error("The model is still writing: press Stop first.", duration=6)
        busy = [gr.update(visible=False), gr.update(visible=True), gr.update()]
        try:
            values = params.values(raw)
            ctx.user_data.update_settings(parameters=values, notebook=prompt)
            text = prompt
            yield gr.update(interactive=False), "", *busy
            for progress in generation.complete(prompt, values, job.stop):
                text = prompt + progress.text
                if progress.error:
                    err = html.escape(progress.error)
                    yield text, f"<div class='kestrel-error'>Error: {err}</div>", *busy
                else:
                    yield text, progress.status, *busy
            ctx.user_data.update_settings(notebook=text)
        finally:
            ctx.end_job(job)
        yield (
            gr.update(interactive=True),
            gr.update(),
            gr.update(visible=True),
            gr.update(visible=False),
            ctx.ended_jobs(session(request)),
        )

    def stop(request: gr.Request) -> None:
        ctx.stop(session(request))

    def remember(request: gr.Request, text: str, runs_seen: float | None) -> Any:
        # The stream's own updates are not the user's: the run saves its final text itself.
        if ctx.is_running(session(request)):
            return gr.update()
        if int(runs_seen or 0) < ctx.ended_jobs(session(request)):
            return gr.update()  # fired by a run's update before that run ended: stale
        ctx.user_data.update_settings(notebook=text)
        # Which text was saved, not only that one was: a page load's own restore saves too,
        # and a reader (or a test) can tell that the latest typing is what is kept.
        return f"Text saved ({len(text)} characters)."

    tab.generate.click(
        run,
        [tab.text, *params.components],
        [tab.text, tab.status, tab.generate, tab.stop, tab.runs_seen],
        concurrency_limit=None,
        show_progress="hidden",
    )
    tab.stop.click(stop, None, None, queue=False)
    # Saved as typed (the last of a burst of keystrokes wins), so a reload loses nothing.
    tab.text.change(
        remember,
        [tab.text, tab.runs_seen],
        [tab.saved],
        trigger_mode="always_last",
        show_progress="hidden",
    )
