"""The Chat tab: a conversation rendered with the model's chat template, streamed, with
regenerate / continue / stop / new chat, a system prompt, tokens/s under the reply, and the
chat saved after every reply (webui.sessions) and reloadable from "Past chats".

The conversation lives in a per-browser-session `gr.State` as plain {role, content}
messages (the Chatbot only displays it), so two users chatting at once never see each
other's turns, and their generations are batched together by the engine's scheduler.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from webui import generation
from webui.context import AppContext
from webui.generation import Message, Progress
from webui.parameters_tab import ParametersTab
from webui.sessions import new_chat_name
from webui.storage import StorageError


@dataclass
class ChatTab:
    chatbot: gr.Chatbot
    history: gr.State
    chat_name: gr.Textbox
    text: gr.Textbox
    send: gr.Button
    stop: gr.Button
    regenerate: gr.Button
    cont: gr.Button
    clear: gr.Button
    status: gr.Markdown
    system_prompt: gr.Textbox
    template: gr.Code
    past: gr.Dropdown
    load_past: gr.Button
    delete_past: gr.Button


def build(ctx: AppContext, remembered: dict[str, Any]) -> ChatTab:
    with gr.Row():
        with gr.Column(scale=4):
            chatbot = gr.Chatbot(
                label="Chat",
                elem_id="chatbot",
                height=480,
                buttons=["copy"],
                feedback_options=None,
            )
            with gr.Row():
                text = gr.Textbox(
                    placeholder="Send a message (Enter sends, Shift+Enter for a new line)",
                    show_label=False,
                    lines=1,
                    max_lines=12,
                    scale=6,
                    elem_id="chat-input",
                )
                send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
            with gr.Row():
                stop = gr.Button("Stop", variant="stop", elem_id="chat-stop")
                regenerate = gr.Button("Regenerate", elem_id="chat-regenerate")
                cont = gr.Button("Continue", elem_id="chat-continue")
                clear = gr.Button("New chat", elem_id="chat-clear")
            status = gr.Markdown(elem_id="chat-status")
        with gr.Column(scale=1, min_width=260):
            chat_name = gr.Textbox(
                new_chat_name(),
                label="Chat name",
                elem_id="chat-name",
                info="saved after every reply",
            )
            past = gr.Dropdown(
                ctx.user_data.chat_names(),
                label="Past chats",
                elem_id="chat-past",
                allow_custom_value=False,
            )
            with gr.Row():
                load_past = gr.Button("Open", elem_id="chat-open")
                delete_past = gr.Button("Delete", variant="stop", elem_id="chat-delete")
            system_prompt = gr.Textbox(
                remembered.get("system_prompt", ""),
                label="System prompt",
                lines=4,
                elem_id="system-prompt",
            )
            with gr.Accordion("Chat template (from the model)", open=False):
                template = gr.Code(
                    label="chat template",
                    language="jinja2",
                    interactive=False,
                    elem_id="chat-template",
                )
    history = gr.State([])
    return ChatTab(
        chatbot,
        history,
        chat_name,
        text,
        send,
        stop,
        regenerate,
        cont,
        clear,
        status,
        system_prompt,
        template,
        past,
        load_past,
        delete_past,
    )


def model_template(ctx: AppContext) -> str:
    """The current model's chat template source, for display."""
    if not ctx.manager.is_loaded():
        return "(no model loaded)"
    backend = ctx.manager.current().backend
    template = getattr(getattr(backend, "tokenizer", None), "chat_template", None)
    if template is None:
        return "(this model has no chat template)"
    if isinstance(template, dict):
        return "\n\n".join(f"{{# {name} #}}\n{src}" for name, src in template.items())
    return str(template)


def _status_html(progress: Progress) -> str:
    if progress.error:
        return (
            f"<div class='kestrel-error' id='chat-error'>Error: {html.escape(progress.error)}</div>"
        )
    return progress.status


def wire(ctx: AppContext, tab: ChatTab, params: ParametersTab) -> None:
    def messages_for(history: list[Message], system_prompt: str) -> list[Message]:
        system = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
        return system + list(history)

    def run(
        make: Callable[..., Iterator[Progress]],
        history: list[Message],
        base: list[Message],
        system_prompt: str,
        name: str,
        raw: tuple[Any, ...],
        request: gr.Request,
    ) -> Iterator[tuple[Any, ...]]:
        """Stream `make(...)` into a new last assistant message after `base`."""
        values = params.values(raw)
        ctx.user_data.update_settings(parameters=values, system_prompt=system_prompt)
        stop = ctx.new_stop(request.session_hash or "")
        final = history
        for progress in make(messages_for(base, system_prompt), values, stop):
            reply = [{"role": "assistant", "content": progress.text}] if progress.text else []
            final = base + reply
            yield final, final, _status_html(progress), gr.update()
        past = gr.update()
        if final:
            try:
                ctx.user_data.save_chat(name, final, system_prompt)
                past = gr.update(choices=ctx.user_data.chat_names(), value=name)
            except StorageError as e:
                yield final, final, f"**Error:** reply not saved: {html.escape(str(e))}", past
                return
        yield final, final, gr.update(), past

    outputs = [tab.chatbot, tab.history, tab.status, tab.past]
    inputs = [tab.history, tab.system_prompt, tab.chat_name, *params.components]

    def add_user(text: str, history: list[Message]) -> tuple[str, list[Message], list[Message]]:
        if not text.strip():
            return text, history, history
        updated = [*history, {"role": "user", "content": text}]
        return "", updated, updated

    def reply(request: gr.Request, history, system_prompt, name, *raw):
        if not history or history[-1]["role"] != "user":
            yield history, history, gr.update(), gr.update()
            return
        yield from run(generation.chat_reply, history, history, system_prompt, name, raw, request)

    def regenerate(request: gr.Request, history, system_prompt, name, *raw):
        base = history[:-1] if history and history[-1]["role"] == "assistant" else history
        if not base or base[-1]["role"] != "user":
            yield history, history, "Nothing to regenerate.", gr.update()
            return
        yield from run(generation.chat_reply, history, base, system_prompt, name, raw, request)

    def cont(request: gr.Request, history, system_prompt, name, *raw):
        if not history or history[-1]["role"] != "assistant":
            yield history, history, "Nothing to continue: send a message first.", gr.update()
            return

        def more(messages, values, stop):
            return generation.continue_reply(messages, values, stop)

        yield from run(more, history, history[:-1], system_prompt, name, raw, request)

    def stop(request: gr.Request) -> None:
        ctx.stop(request.session_hash or "")

    def clear() -> tuple[Any, ...]:
        return [], [], "", new_chat_name()

    def open_chat(name: str | None) -> tuple[Any, ...]:
        if not name:
            return gr.update(), gr.update(), "Choose a past chat first.", gr.update(), gr.update()
        try:
            messages, system_prompt = ctx.user_data.load_chat(name)
        except StorageError as e:
            return (
                gr.update(),
                gr.update(),
                f"**Error:** {html.escape(str(e))}",
                gr.update(),
                gr.update(),
            )
        return messages, messages, f"Opened **{name}**.", name, system_prompt

    def delete_chat(name: str | None) -> tuple[Any, str]:
        if not name:
            return gr.update(), "Choose a past chat first."
        try:
            ctx.user_data.delete_chat(name)
        except StorageError as e:
            return gr.update(), f"**Error:** {html.escape(str(e))}"
        return gr.update(choices=ctx.user_data.chat_names(), value=None), f"Deleted **{name}**."

    # Generation handlers may run side by side (one per browser session); the scheduler
    # batches them. Page updates are throttled in webui.generation.
    gen = dict(concurrency_limit=None, show_progress="hidden")
    for trigger in (tab.text.submit, tab.send.click):
        trigger(add_user, [tab.text, tab.history], [tab.text, tab.history, tab.chatbot]).then(
            reply, inputs, outputs, **gen
        )
    tab.regenerate.click(regenerate, inputs, outputs, **gen)
    tab.cont.click(cont, inputs, outputs, **gen)
    tab.stop.click(stop, None, None, queue=False)
    tab.clear.click(clear, None, [tab.chatbot, tab.history, tab.status, tab.chat_name])
    tab.load_past.click(
        open_chat,
        [tab.past],
        [tab.chatbot, tab.history, tab.status, tab.chat_name, tab.system_prompt],
    )
    tab.delete_past.click(delete_chat, [tab.past], [tab.past, tab.status])
