"""The Model tab's "Download from Hugging Face" panel: an id (owner/name, or
owner/name:branch) is fetched into the models directory (loader/hub.py: through the Hugging
Face cache, resumable) with the download's progress in the page, then listed and selected.
Offline, a missing id or a repository Kestrel cannot load gives one message in the page."""

from __future__ import annotations

import html
from typing import Any

import gradio as gr

from loader.hub import ModelSourceError, parse_hub_id, resolve_model
from loader.manager import ModelManager


def download(manager: ModelManager, text: str) -> tuple[str, str | None]:
    """(status message, name of the model in the models directory or None on failure)."""
    text = (text or "").strip()
    if parse_hub_id(text) is None:
        return f"**Error:** {html.escape(repr(text))} is not a Hugging Face id (owner/name)", None
    try:
        path = resolve_model(text, manager.models_dir)
    except ModelSourceError as e:
        return f"**Error:** {html.escape(str(e))}", None
    return f"Downloaded {html.escape(text)} into `{html.escape(str(path))}`.", path.name


def build(manager: ModelManager, model_dropdown: gr.Dropdown, choices: Any) -> None:
    """Adds the panel where it is called (inside the Model tab) and wires it; `choices`
    gives the dropdown's choices for the current models directory."""
    with gr.Accordion("Download from Hugging Face", open=False):
        with gr.Row():
            hub_id = gr.Textbox(
                label="Hugging Face id",
                placeholder="HuggingFaceTB/SmolLM2-360M-Instruct  or  owner/Model-exl2:4.0bpw",
                elem_id="hub-id",
                scale=4,
            )
            fetch = gr.Button("Download", elem_id="hub-download", scale=1)
        status = gr.Markdown(elem_id="hub-status")

    # huggingface_hub draws tqdm bars; Gradio shows them in the page.
    def on_fetch(text: str, progress=gr.Progress(track_tqdm=True)) -> tuple[str, Any]:  # noqa: B008
        message, name = download(manager, text)
        if name is None:
            return message, gr.update()
        return message, gr.update(choices=choices(manager), value=name)

    fetch.click(on_fetch, [hub_id], [status, model_dropdown], concurrency_id="model")
