"""The Chat tab: a conversation rendered with the model's chat template, streamed, with
regenerate / continue / stop / new chat, a system prompt, tokens/s under the reply, and the
chat saved after every reply (serving.sessions) and reloadable from "Past chats".

The conversation lives in a per-browser-session `gr.State` as plain {role, content}
messages (the Chatbot only displays it), so two users chatting at once never see each
other's turns, and their generations are batched together by the engine's scheduler.

One reply at a time per page (webui.context.Job): while it is written, Send becomes Stop and
a message sent with Enter stays in the box with a note. New chat (or the chat's trash icon)
stops the running reply and cuts it off from the page; it is still saved to its own chat.
A page opens on the latest saved chat (as TGW does) and saves with the revision it saw of
that chat (`SavedAt`: a rename onto another saved chat's name is a chat it never saw), so
two pages on one chat never overwrite each other (serving.sessions).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from serving.sessions import new_chat_name
from serving.storage import StorageError
from webui import generation
from webui.context import AppContext, Job
from webui.generation import Message, Progress
from webui.parameters_tab import ParametersTab


@dataclass
class ChatTab:
    chatbot: gr.Chatbot
    history: gr.State
    chat_name: gr.Textbox
    revision: gr.State  # SavedAt of the chat this page shows (None: not saved yet)
    job: gr.State  # id of this page's running reply (webui.context)
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
                show_label=False,  # the tab says it; the badge covered the first message
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
                    # Until the page has its remembered settings (webui.app's page load),
                    # a message would be sent with the values the app was built with.
                    interactive=False,
                )
                send = gr.Button(
                    "Send", variant="primary", scale=1, min_width=72, elem_id="chat-send"
                )
                stop = gr.Button(
                    "Stop",
                    variant="stop",
                    scale=1,
                    min_width=72,
                    visible=False,
                    elem_id="chat-stop",
                )
            with gr.Row(elem_id="chat-actions"):
                regenerate = gr.Button(
                    "Regenerate", size="sm", min_width=60, elem_id="chat-regenerate"
                )
                cont = gr.Button("Continue", size="sm", min_width=60, elem_id="chat-continue")
                clear = gr.Button("New chat", size="sm", min_width=60, elem_id="chat-clear")
            status = gr.Markdown(elem_id="chat-status")
        with gr.Column(scale=1, min_width=260):
            chat_name = gr.Textbox(
                new_chat_name(),
                label="Chat name",
                elem_id="chat-name",
                info="saved after every reply",
                # Editable once the page load has put the latest chat's name in
                # (app.on_page_load): a name typed before was replaced by it.
                interactive=False,
            )
            past = gr.Dropdown(
                ctx.user_data.chat_choices(),
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
                # Editable once the page load has restored it (app.on_page_load), as the
                # notebook: what is typed before would be overwritten.
                interactive=False,
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
        gr.State(None),
        gr.State(None),
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
    template = ctx.manager.current().chat_template
    if template is None:
        return "(this model has no chat template)"
    if isinstance(template, dict):
        return "\n\n".join(f"{{# {name} #}}\n{src}" for name, src in template.items())
    return str(template)


# (name, revision) of the saved chat a page shows, as the page last saw it.
SavedAt = tuple[str, int]


def seen_revision(saved_at: SavedAt | None, name: str) -> int | None:
    """The revision to save chat `name` with: the one the page saw of that very chat, or
    None (no such file should be there yet) for a chat never saved, or renamed since: the
    page never saw the chat of that name, so a file there is someone else's to keep."""
    if saved_at is None or saved_at[0] != name.strip():  # saved under the name stripped
        return None
    return saved_at[1]


def _status_html(progress: Progress) -> str:
    if progress.error:
        return (
            f"<div class='kestrel-error' id='chat-error'>Error: {html.escape(progress.error)}</div>"
        )
    return progress.status


def open_latest(ctx: AppContext) -> tuple[list[Message], str, SavedAt | None, str]:
    """What a page opens on: the latest saved chat (messages, name, SavedAt, system
    prompt), or an empty chat with a new name when there is none or it does not read."""
    name = ctx.user_data.latest_chat()
    if name is not None:
        try:
            messages, system_prompt = ctx.user_data.load_chat(name)
            revision = ctx.user_data.chat_revision(name)
            return messages, name, _saved_at(name, revision), system_prompt
        except StorageError:  # listed in Past chats, where opening it shows the error
            pass
    return [], new_chat_name(), None, ""


def _busy(tab: ChatTab) -> list[Any]:
    """Send hidden and Stop shown (in that order), while a reply is written."""
    return [gr.update(visible=False), gr.update(visible=True)]


def wire(ctx: AppContext, tab: ChatTab, params: ParametersTab) -> None:
    def messages_for(history: list[Message], system_prompt: str) -> list[Message]:
        system = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
        return system + list(history)

    def session(request: gr.Request) -> str:
        return f"{request.session_hash or ''}/chat"  # the Notebook's job is its own

    def run(
        make: Callable[..., Iterator[Progress]],
        job: Job,
        prompt: list[Message],
        keep: list[Message],
        system_prompt: str,
        name: str,
        revision: SavedAt | None,
        raw: tuple[Any, ...],
    ) -> Iterator[tuple[Any, ...]]:
        """Stream `make(prompt)` as the assistant message after `keep`, then save the chat.
        Yields (chatbot, history, status, past, name, revision); `to_page` passes them on
        while the page is this job's.

        The chat is saved under the name the page shows at the end (a rename typed
        meanwhile reaches the job through `rename_chat`), and the name box is written only
        when the save had to pick another name: an update with the name the reply began
        with would land after whatever the user typed since, and undo it."""
        job.name_chat(name)
        values = params.values(raw)
        ctx.user_data.update_settings(parameters=values, system_prompt=system_prompt)
        final, status = keep, ""
        for progress in make(messages_for(prompt, system_prompt), values, job.stop):
            reply = [{"role": "assistant", "content": progress.text}] if progress.text else []
            final, status = keep + reply, _status_html(progress)
            yield final, final, status, *_unchanged(3)
        if not final:
            return
        name = job.chat_name or name
        try:
            seen = seen_revision(revision, name)
            saved = ctx.user_data.save_chat(name, final, system_prompt, seen)
        except StorageError as e:
            err = (
                "<div class='kestrel-error' id='chat-error'>Reply not saved: "
                f"{html.escape(str(e))}</div>"
            )
            yield final, final, err, *_unchanged(3)
            return
        if job.detached.is_set():  # the page shows another chat: its Past chats can wait
            return
        past = gr.update(choices=ctx.user_data.chat_choices(), value=saved.name)
        if saved.forked:
            why = (
                f"A saved chat is named **{html.escape(name)}** already"
                if seen is None
                else f"Another page saved **{html.escape(name)}** meanwhile"
            )
            status += f"<br>{why}, so this conversation was saved as **{saved.name}**."
        shown = saved.name if saved.forked else gr.update()
        yield final, final, status, past, shown, (saved.name, saved.revision)

    def to_page(job: Job, updates: Iterator[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
        """The page updates of `job` while the page is still its own (New chat and Open
        detach it: it goes on and saves its chat, and sends the page nothing more), then
        one that changes nothing; the job ends with the stream.

        Why that last one: Gradio ends a streamed event with one more message, which repeats
        the last values the handler yielded, and sends it once the handler has returned. A
        detached reply returns only after it has stopped and saved its chat, so on a busy
        machine that repeat came after the new chat was shown and painted the old
        conversation into it (the history kept the new chat's, so the next message lost
        the chat's turns from the page). Ending on an update that changes nothing makes the
        repeat harmless whenever it lands, for every run: one that ends just as New chat is
        pressed too."""
        try:
            for update in updates:
                if job.may_update_page():
                    yield update
            yield _nothing()
        finally:
            ctx.end_job(job)

    chat_outputs = [tab.chatbot, tab.history, tab.status, tab.past, tab.chat_name, tab.revision]
    inputs = [
        tab.job,
        tab.history,
        tab.system_prompt,
        tab.chat_name,
        tab.revision,
        *params.components,
    ]

    def start(request: gr.Request) -> Job:
        job = ctx.start_job(session(request))
        if job is None:  # the buttons are hidden meanwhile: only Enter or a shortcut get here
            raise gr.Error(
                "A reply is still being written: press Stop first. Your message stays in the box.",
                duration=8,
            )
        return job

    def add_user(request: gr.Request, text: str, history: list[Message]) -> tuple[Any, ...]:
        if not text.strip():
            raise gr.Error("Type a message first.", duration=4)
        job = start(request)
        updated = [*history, {"role": "user", "content": text}]
        return "", updated, updated, job.id, *_busy(tab)

    def begin(request: gr.Request) -> tuple[Any, ...]:
        return start(request).id, *_busy(tab)

    def job_of(request: gr.Request, job_id: int | None) -> Job | None:
        return ctx.job(session(request), job_id)

    def reply(request: gr.Request, job_id, history, system_prompt, name, revision, *raw):
        job = job_of(request, job_id)
        if job is None:  # detached before it began
            yield _nothing()
            return
        if not history or history[-1]["role"] != "user":
            yield from to_page(job, iter(()))
            return
        yield from to_page(
            job,
            run(generation.chat_reply, job, history, history, system_prompt, name, revision, raw),
        )

    def regenerate(request: gr.Request, job_id, history, system_prompt, name, revision, *raw):
        job = job_of(request, job_id)
        if job is None:
            yield _nothing()
            return
        keep = history[:-1] if history and history[-1]["role"] == "assistant" else history
        if not keep or keep[-1]["role"] != "user":
            msg = "Nothing to regenerate."
            yield from to_page(job, iter([(history, history, msg, *_unchanged(3))]))
            return
        yield from to_page(
            job, run(generation.chat_reply, job, keep, keep, system_prompt, name, revision, raw)
        )

    def cont(request: gr.Request, job_id, history, system_prompt, name, revision, *raw):
        job = job_of(request, job_id)
        if job is None:
            yield _nothing()
            return
        if not history or history[-1]["role"] != "assistant":
            msg = "Nothing to continue: send a message first."
            yield from to_page(job, iter([(history, history, msg, *_unchanged(3))]))
            return
        # The prompt holds the reply so far; its text grows in place (TGW's Continue).
        keep = history[:-1]
        yield from to_page(
            job,
            run(generation.continue_reply, job, history, keep, system_prompt, name, revision, raw),
        )

    def rename(request: gr.Request, name: str) -> None:
        ctx.rename_chat(session(request), name)

    def settle(request: gr.Request, history: list[Message]) -> tuple[Any, Any, Any]:
        """Once a reply's event has ended on the page: the chat shown is the page's own
        again, and Send is back, unless this page started another reply meanwhile (its
        stream paints the chat, and it settles the page when it ends).

        Why the chat is painted again: the page applies each event's updates in a loop of
        that event's own, awaiting each, so a reply cut off by New chat, the trash icon or
        Open can have an update of its old conversation applied after the new chat was
        shown (seen once in a hundred runs at idle, more often under load). This runs when
        that loop has applied all of the reply's updates, and `history` is the chat the page
        shows now (a detached reply no longer writes it: `to_page`)."""
        if ctx.is_running(session(request)):
            return gr.update(), gr.update(visible=False), gr.update(visible=True)
        return history, gr.update(visible=True), gr.update(visible=False)

    def stop(request: gr.Request) -> None:
        ctx.stop(session(request))

    def clear(request: gr.Request) -> tuple[Any, ...]:
        ctx.detach(session(request))
        return [], [], "", new_chat_name(), None, gr.update(visible=True), gr.update(visible=False)

    def open_chat(request: gr.Request, name: str | None) -> tuple[Any, ...]:
        if not name:
            return *_unchanged(2), "Choose a past chat first.", *_unchanged(5)
        try:
            messages, system_prompt = ctx.user_data.load_chat(name)
            revision = ctx.user_data.chat_revision(name)
        except StorageError as e:
            err = f"<div class='kestrel-error' id='chat-error'>{html.escape(str(e))}</div>"
            return *_unchanged(2), err, *_unchanged(5)
        ctx.detach(session(request))  # a reply still streaming belongs to the other chat
        saved_at = _saved_at(name, revision)
        opened = f"Opened **{name}**."
        # Send is back at once, as after New chat: the detached reply is no longer this page's.
        idle = (gr.update(visible=True), gr.update(visible=False))
        return messages, messages, opened, name, saved_at, system_prompt, *idle

    def delete_chat(name: str | None) -> tuple[Any, str]:
        if not name:  # nothing chosen, or the confirmation was declined
            return gr.update(), "Nothing deleted."
        try:
            ctx.user_data.delete_chat(name)
        except StorageError as e:
            return gr.update(), f"**Error:** {html.escape(str(e))}"
        return gr.update(choices=ctx.user_data.chat_choices(), value=None), f"Deleted **{name}**."

    # Generation handlers may run side by side (one per browser session); the scheduler
    # batches them. Page updates are throttled in webui.generation.
    gen = dict(concurrency_limit=None, show_progress="hidden")
    buttons = [tab.send, tab.stop]
    fast = dict(queue=False, show_progress="hidden")
    settled = dict(fn=settle, inputs=[tab.history], outputs=[tab.chatbot, *buttons], **fast)
    for trigger in (tab.text.submit, tab.send.click):
        trigger(
            add_user,
            [tab.text, tab.history],
            [tab.text, tab.history, tab.chatbot, tab.job, *buttons],
            show_progress="hidden",  # queued: its refusal is a toast the user sees
        ).success(reply, inputs, chat_outputs, **gen).then(**settled)
    for button, handler in ((tab.regenerate, regenerate), (tab.cont, cont)):
        button.click(begin, None, [tab.job, *buttons], show_progress="hidden").success(
            handler, inputs, chat_outputs, **gen
        ).then(**settled)
    tab.stop.click(stop, None, None, queue=False)
    # Every change of the name reaches a running reply, in order and the last one always
    # ("always_last": one request at a time per page, then the latest value). `change`, not
    # `input`: Gradio's textbox sends `input` on key presses only, so a name pasted with
    # the mouse would not reach it. The page's own changes (New chat, Open) come after
    # they detached the reply, so they never rename it.
    tab.chat_name.change(rename, [tab.chat_name], None, queue=False, trigger_mode="always_last")
    cleared = [tab.chatbot, tab.history, tab.status, tab.chat_name, tab.revision, *buttons]
    # No update of the reply it detached can follow (`to_page`): the empty chat stays.
    tab.clear.click(clear, None, cleared)
    # The Chatbot's trash icon presses New chat (webui.app's page script).
    tab.load_past.click(
        open_chat,
        [tab.past],
        [tab.chatbot, tab.history, tab.status, tab.chat_name, tab.revision, tab.system_prompt]
        + buttons,
    )
    tab.delete_past.click(
        delete_chat,
        [tab.past],
        [tab.past, tab.status],
        js="(name) => (name && confirm(`Delete the saved chat ${name}?`)) ? name : null",
    )


def _saved_at(name: str, revision: int | None) -> SavedAt | None:
    return None if revision is None else (name, revision)


def _unchanged(n: int) -> list[Any]:
    return [gr.update() for _ in range(n)]


def _nothing() -> tuple[Any, ...]:
    """A chat reply's update that changes nothing (of chatbot, history, status, past, name,
    revision)."""
    return tuple(_unchanged(6))
