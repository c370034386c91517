"""Issue 24 in a real browser: what a user writes in the Chat and Notebook tabs is never lost
(Continue, saved chats, a message sent while a reply streams, New chat during a reply), and
the settings the page shows are the ones in effect and survive a reload.

`python ui.py --model tiny-llama` serves a tiny random model; headless Chromium drives it.
Each test opens its own page; all wait on the page's state, never on sleeps.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from helpers.browser import (
    SLOW,
    STOPPABLE_LAYERS,
    bot_messages,
    chat_name,
    choose,
    desktop_context,
    open_page,
    require_browser,
    running_ui,
    set_value,
    status_tokens,
    tab,
    user_messages,
)
from helpers.browser import send as click_send
from helpers.model_factory import make_tiny_llama
from serving.storage import locked

sync_api = require_browser()
expect = sync_api.expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=SLOW)
LONG = 3000  # tokens: a reply that is still streaming when the test acts on it


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-state")
    make_tiny_llama(
        root / "models" / "tiny-llama",
        max_position_embeddings=4096,
        num_hidden_layers=STOPPABLE_LAYERS,
    )
    return {"root": root, "models": root / "models", "user": root / "user_data"}


@pytest.fixture(scope="module")
def server(dirs):
    args = [
        "--models-dir", str(dirs["models"]), "--user-data-dir", str(dirs["user"]),
        "--model", "tiny-llama",
    ]  # fmt: skip
    with running_ui(args, dirs["root"] / "server.log") as url:
        yield url


@pytest.fixture
def context(browser):
    with desktop_context(browser) as context:
        yield context


def saved_chat(dirs, name: str) -> dict:
    return json.loads((dirs["user"] / "chats" / f"{name}.json").read_text())


def settle(page, max_new_tokens: int, *, ban_eos: bool, preset: str | None = None) -> None:
    tab(page, "Parameters")
    if preset:
        choose(page, "preset", preset)
        expect(page.locator("#params-status")).to_contain_text(f"Preset {preset} loaded")
    # The tab's first frames may still write the page load's remembered value over what was
    # typed (Gradio writes a hidden tab's held props late on a busy machine; seen in CI as a
    # 3-token reply where 3000 were asked for, the previous test's value): type it again
    # until it stays for two frames.
    tokens = page.locator("#param-max_new_tokens input[type=number]").first
    for _ in range(5):
        set_value(page, "param-max_new_tokens", max_new_tokens)
        next_frames(page)
        next_frames(page)
        if tokens.input_value() == str(max_new_tokens):
            break
    expect(tokens).to_have_value(str(max_new_tokens))
    box = page.locator("#param-ban_eos_token input")
    if box.is_checked() != ban_eos:
        box.click()
    expect(page.locator("#preset-in-effect")).to_be_visible()
    tab(page, "Chat")


def send(page, text: str) -> None:
    """Send `text` and wait until it is on the page: until then Send is still visible and the
    status still shows the previous reply's end, so a following `wait_done` would return at
    once (seen in CI: a second page's message then raced the first page's save)."""
    before = user_messages(page).count()
    click_send(page, text)
    expect(user_messages(page)).to_have_count(before + 1)


def new_chat(page) -> None:
    page.click("#chat-clear")
    expect(bot_messages(page)).to_have_count(0)
    expect(user_messages(page)).to_have_count(0)


def wait_streaming(page) -> None:
    """Until the last reply is on the page and growing (Stop shown meanwhile)."""
    expect(page.locator("#chat-stop")).to_be_visible()
    expect(page.locator("#chat-status")).to_contain_text("tok/s")
    first = len(bot_messages(page).last.inner_text())
    page.wait_for_function(
        "n => { const m = document.querySelectorAll('#chatbot .bot.message');"
        " return m.length && m[m.length - 1].innerText.length > n; }",
        arg=first,
    )


def wait_done(page) -> str:
    """The status line once the reply ended (Send is back)."""
    expect(page.locator("#chat-send")).to_be_visible()
    expect(page.locator("#chat-status")).to_contain_text(re.compile(r"length|stop"))
    return page.inner_text("#chat-status")


# -- 1. Continue ----------------------------------------------------------------------------
def test_continue_appends_to_the_reply_and_saves_it(context, server, dirs):
    page = open_page(context, server)
    settle(page, 25, ban_eos=True, preset="Deterministic")
    new_chat(page)
    send(page, "Describe the ocean.")
    assert status_tokens(wait_done(page)) == 25
    reply = bot_messages(page).last.inner_text()
    page.click("#chat-continue")
    expect(bot_messages(page).last).not_to_have_text(reply)
    assert status_tokens(wait_done(page)) == 25
    expect(bot_messages(page)).to_have_count(1)
    longer = bot_messages(page).last.inner_text()
    assert longer.startswith(reply.rstrip()[:40]) and len(longer) > len(reply), (reply, longer)
    saved = saved_chat(dirs, chat_name(page))["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"]
    assert saved[0]["content"] == "Describe the ocean."
    assert saved[1]["content"] != "Describe the ocean." and len(saved[1]["content"]) > len(
        reply.strip()
    )


# -- 2. saved chats -------------------------------------------------------------------------
def test_reload_reopens_the_latest_chat_and_new_chats_get_their_own_file(
    context, server, dirs, browser
):
    page = open_page(context, server)
    settle(page, 5, ban_eos=True)
    new_chat(page)
    send(page, "first chat here")
    wait_done(page)
    first = chat_name(page)
    page.reload()
    page.wait_for_selector("#chat-input textarea:not([disabled])")
    # The reload opens the chat it left, and the next message goes on in it.
    expect(user_messages(page).first).to_have_text("first chat here")
    assert chat_name(page) == first
    send(page, "and a second message")
    wait_done(page)
    assert [m["content"] for m in saved_chat(dirs, first)["messages"] if m["role"] == "user"] == [
        "first chat here",
        "and a second message",
    ]
    # Two pages pressing New chat at once get two names, and two files.
    other = open_page(browser.new_context(), server)
    for p in (page, other):
        p.click("#chat-clear")
    for p in (page, other):
        expect(user_messages(p)).to_have_count(0)
    assert len({chat_name(page), chat_name(other), first}) == 3
    send(page, "from page one")
    send(other, "from page two")
    wait_done(page)
    wait_done(other)
    assert saved_chat(dirs, chat_name(page))["messages"][0]["content"] == "from page one"
    assert saved_chat(dirs, chat_name(other))["messages"][0]["content"] == "from page two"
    assert len(saved_chat(dirs, first)["messages"]) == 4  # untouched
    # Past chats are listed by their first message.
    page.click("#chat-past input")
    labels = page.locator("[role=option]").all_inner_texts()
    assert any(label.startswith("first chat here") for label in labels), labels
    page.keyboard.press("Escape")
    other.context.close()


def test_two_pages_on_one_chat_never_overwrite_each_other(context, server, dirs, browser):
    page = open_page(context, server)
    settle(page, 5, ban_eos=True)
    new_chat(page)
    send(page, "shared start")
    wait_done(page)
    shared = chat_name(page)
    other = open_page(browser.new_context(), server)  # opens the latest chat: this one
    assert chat_name(other) == shared
    send(page, "page one goes on")
    wait_done(page)
    send(other, "page two goes on")
    wait_done(other)
    expect(other.locator("#chat-status")).to_contain_text("saved as")
    forked = chat_name(other)
    assert forked != shared
    users = [m["content"] for m in saved_chat(dirs, shared)["messages"] if m["role"] == "user"]
    assert users == ["shared start", "page one goes on"]
    users = [m["content"] for m in saved_chat(dirs, forked)["messages"] if m["role"] == "user"]
    assert users == ["shared start", "page two goes on"]
    other.context.close()


# -- 3. a message sent while a reply streams -----------------------------------------------
def test_send_becomes_stop_and_a_message_typed_meanwhile_is_kept(context, server):
    page = open_page(context, server)
    settle(page, LONG, ban_eos=True)
    new_chat(page)
    expect(page.locator("#chat-stop")).to_be_hidden()
    send(page, "Tell me a long story")
    wait_streaming(page)
    expect(page.locator("#chat-send")).to_be_hidden()
    page.fill("#chat-input textarea", "my next question")
    page.press("#chat-input textarea", "Enter")
    expect(page.get_by_text("press Stop first")).to_be_visible()
    expect(page.locator("#chat-input textarea")).to_have_value("my next question")
    page.click("#chat-stop")
    status = wait_done(page)
    assert "stopped" in status and 0 < status_tokens(status) < LONG
    page.click("#chat-send")  # the kept message goes now
    expect(user_messages(page)).to_have_count(2)
    expect(user_messages(page).last).to_have_text("my next question")
    page.click("#chat-stop")
    wait_done(page)


# -- 4. New chat / the trash icon during a reply -------------------------------------------
@pytest.mark.parametrize("how", ["new-chat", "trash"])
def test_clearing_during_a_reply_detaches_it(context, server, dirs, how):
    page = open_page(context, server)
    settle(page, LONG, ban_eos=True)
    new_chat(page)
    send(page, f"old conversation {how}")
    wait_streaming(page)
    old = chat_name(page)
    if how == "new-chat":
        page.click("#chat-clear")
    else:
        page.locator("#chatbot button[aria-label='Clear']").click()
    # New chat takes effect (a new name) before the conversation is checked.
    name_box = page.locator("#chat-name textarea, #chat-name input").first
    expect(name_box).not_to_have_value(old)
    expect(user_messages(page)).to_have_count(0)
    expect(page.locator("#chat-send")).to_be_visible()
    new = chat_name(page)
    assert new != old
    settle(page, 5, ban_eos=True)
    send(page, "new conversation")
    wait_done(page)
    # The old reply never came back, and the new chat holds only its own turns.
    expect(user_messages(page)).to_have_count(1)
    expect(user_messages(page)).to_have_text("new conversation")
    assert [m["content"] for m in saved_chat(dirs, new)["messages"]][0] == "new conversation"
    assert len(saved_chat(dirs, new)["messages"]) == 2
    # The old one was stopped and saved under its own name, with what was written.
    kept = saved_chat(dirs, old)["messages"]
    assert kept[0]["content"] == f"old conversation {how}" and kept[1]["role"] == "assistant"


# What the page's events did, as the page itself received them, and one way to reorder them.
# Each message of the event stream is noted once the page's own reader has had it and its
# handlers have run (a task queued when the chunk is handed over). While `on`, the stream's
# streamed updates are held back; `kestrelTestRelease()` hands them over, after whatever the
# page has applied meanwhile: the page's own order when it applies one event's update after
# another's (each event's updates are applied in a loop of that event's own, awaiting each).
# Answers to the page's unqueued calls are counted once the page has read them.
EVENT_LOG = """
(() => {
  const seen = { joins: 0, streamed: new Set(), ended: new Set(), calls: 0, answered: 0 };
  const held = { on: false, parts: [], released: 0, stream: null };
  const encoder = new TextEncoder();
  window.kestrelTestEvents = seen;
  window.kestrelTestHold = held;
  // Every event the page asked for has ended, except streamed ones still running.
  window.kestrelTestOnlyStreamsRunning = () => {
    const running = [...seen.streamed].filter((id) => !seen.ended.has(id)).length;
    return seen.joins === seen.ended.size + running;
  };
  window.kestrelTestStreamsEnded = () =>
    seen.streamed.size > 0 && [...seen.streamed].every((id) => seen.ended.has(id));
  function parse(part) {
    for (const line of part.split("\\n")) {
      if (!line.startsWith("data:")) continue;
      try { return JSON.parse(line.slice(5)); } catch (e) { return null; }
    }
    return null;
  }
  function note(message) {
    if (message === null) return;
    if (message.msg === "process_generating") seen.streamed.add(message.event_id);
    if (message.msg === "process_completed") seen.ended.add(message.event_id);
  }
  function handOver(controller, out) {
    controller.enqueue(encoder.encode(out.map(([part]) => part + "\\n\\n").join("")));
    setTimeout(() => out.forEach(([, message]) => note(message)), 0);
  }
  // The parts to hand over now, in order, for one complete part of the stream.
  function route(controller, part) {
    const message = parse(part);
    if (held.on && message && message.msg === "process_generating") {
      held.parts.push([part, message]);
      held.stream = controller;
      return [];
    }
    return [[part, message]];
  }
  window.kestrelTestRelease = () => {
    held.on = false;
    if (held.parts.length) handOver(held.stream, held.parts);
    held.released += held.parts.length;
    held.parts = [];
  };
  const fetchFirst = window.fetch.bind(window);
  window.fetch = async (input, init) => {
    const url = typeof input === "string" ? input : input.url;
    if (url.includes("/queue/join")) seen.joins += 1;
    const unqueued = url.includes("/run/");
    if (unqueued) seen.calls += 1;
    const response = await fetchFirst(input, init);
    if (unqueued) {
      for (const read of ["json", "text"]) {
        const first = response[read].bind(response);
        response[read] = async () => {
          const value = await first();
          setTimeout(() => { seen.answered += 1; }, 0);
          return value;
        };
      }
      return response;
    }
    if (!url.includes("/queue/data") || response.body === null) return response;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let text = "";
    const body = new ReadableStream({
      async pull(controller) {  // only when the page reads: it takes the parts at once
        for (;;) {
          const { value, done } = await reader.read();
          if (done) { controller.close(); return; }
          text += decoder.decode(value, { stream: true });
          const parts = text.split("\\n\\n");
          text = parts.pop();
          const out = parts.flatMap((part) => route(controller, part));
          if (!out.length) continue;
          handOver(controller, out);
          return;
        }
      },
      cancel(reason) { return reader.cancel(reason); },
    }, { highWaterMark: 0 });
    const { status, statusText, headers } = response;
    return new Response(body, { status, statusText, headers });
  };
})();
"""


def next_frames(page) -> None:
    """Until the page has drawn twice more (what its handlers changed is on the page)."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


@pytest.mark.parametrize("how", ["new-chat", "trash", "open"])
def test_a_detached_reply_applied_late_never_stays_in_the_chat_shown(context, server, dirs, how):
    """A reply cut off by New chat (or the trash icon, or Open) may still have an update of
    its old conversation on its way, and the page may apply it after the new chat (each
    event's updates are applied in a loop of its own): seen in CI at idle and at load 8 as
    the old conversation in the new chat, on screen until the page was reloaded. Here the
    page is made to apply it late on every run (`hold`), and the reply's save waits on the
    chats folder's lock, held as another Kestrel process saving a chat would hold it: once
    the old reply has ended, the page shows the chat it moved to, and goes on with it."""
    context.add_init_script(EVENT_LOG)
    page = open_page(context, server)
    expected: list[str] = []
    if how == "open":
        settle(page, 3, ban_eos=True)
        new_chat(page)
        send(page, "a past chat to open")
        wait_done(page)
        expected = ["a past chat to open"]
    settle(page, LONG, ban_eos=True)
    new_chat(page)
    send(page, f"old conversation, left by {how}")
    wait_streaming(page)
    old = chat_name(page)
    name_box = page.locator("#chat-name textarea, #chat-name input").first
    with locked(dirs["user"] / "chats" / "held.json"):
        if how == "open":
            choose(page, "chat-past", "a past chat to open")
        # The reply's next update is held back, and applied once the new chat is shown.
        page.evaluate("kestrelTestHold.on = true")
        page.wait_for_function("kestrelTestHold.parts.length > 0")
        if how == "new-chat":
            page.click("#chat-clear")
        elif how == "trash":
            page.locator("#chatbot button[aria-label='Clear']").click()
        else:
            page.click("#chat-open")
        expect(name_box).not_to_have_value(old)
        expect(page.locator("#chat-send")).to_be_visible()
        if how == "open":
            expect(user_messages(page).first).to_have_text("a past chat to open")
        else:
            expect(user_messages(page)).to_have_count(0)
        page.evaluate("kestrelTestRelease()")
        # The old conversation was painted over the chat shown: what this test is about.
        expect(user_messages(page).first).to_have_text(f"old conversation, left by {how}")
        # Everything the page asked for has ended but the old reply, whose save waits.
        page.wait_for_function("kestrelTestOnlyStreamsRunning()")
        assert not (dirs["user"] / "chats" / f"{old}.json").exists()
        calls = page.evaluate("kestrelTestEvents.calls")
    # The old reply saves its chat now, and its event ends; what the page asks for once it
    # has applied all of the reply's updates has its answer.
    page.wait_for_function(
        "n => kestrelTestStreamsEnded() && kestrelTestEvents.calls > n"
        " && kestrelTestEvents.answered === kestrelTestEvents.calls",
        arg=calls,
    )
    expect(user_messages(page)).to_have_count(len(expected))
    assert user_messages(page).all_inner_texts() == expected
    assert bot_messages(page).count() == len(expected)
    kept = saved_chat(dirs, old)["messages"]
    assert kept[0]["content"] == f"old conversation, left by {how}"
    assert kept[1]["role"] == "assistant"
    # The chat shown goes on with its own turns only.
    shown = chat_name(page)
    settle(page, 3, ban_eos=True)
    send(page, "new conversation")
    wait_done(page)
    expect(user_messages(page)).to_have_count(len(expected) + 1)
    users = [m["content"] for m in saved_chat(dirs, shown)["messages"] if m["role"] == "user"]
    assert users == [*expected, "new conversation"]


def rename(page, name: str):
    """Type `name` as the chat's name; returns its box once the server has the rename (the
    page shows nothing when: wait for the answer to the request the typing sent)."""
    box = page.locator("#chat-name textarea, #chat-name input").first
    with page.expect_response(
        lambda r: "/run/" in r.url and name in (r.request.post_data or "")
    ) as answer:
        box.fill(name)
    assert answer.value.ok, answer.value.status
    return box


# -- 12. a rename while a reply is written -------------------------------------------------
def test_a_rename_typed_while_a_reply_streams_is_kept_and_the_reply_saved_under_it(
    context, server, dirs
):
    page = open_page(context, server)
    settle(page, LONG, ban_eos=True)
    new_chat(page)
    old = chat_name(page)
    send(page, "a reply to rename")
    wait_streaming(page)
    name_box = rename(page, "renamed while streaming")
    # More of the reply reaches the page after the rename, and the rename stays.
    wait_streaming(page)
    expect(name_box).to_have_value("renamed while streaming")
    page.click("#chat-stop")
    wait_done(page)
    # The reply's end (its save) does not put the old name back, and the reply is saved in
    # the chat the page shows.
    expect(name_box).to_have_value("renamed while streaming")
    saved = saved_chat(dirs, "renamed while streaming")["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"]
    assert saved[1]["content"].strip()
    assert not (dirs["user"] / "chats" / f"{old}.json").exists()
    # The next reply goes on in the renamed chat.
    settle(page, 3, ban_eos=True)
    send(page, "and more")
    wait_done(page)
    expect(name_box).to_have_value("renamed while streaming")
    users = [m["content"] for m in saved_chat(dirs, "renamed while streaming")["messages"]]
    assert users[0::2] == ["a reply to rename", "and more"]


def test_a_rename_then_new_chat_saves_the_old_reply_under_the_new_name(context, server, dirs):
    page = open_page(context, server)
    settle(page, LONG, ban_eos=True)
    new_chat(page)
    old = chat_name(page)
    send(page, "renamed then left")
    wait_streaming(page)
    name_box = rename(page, "left behind")
    expect(name_box).to_have_value("left behind")
    page.click("#chat-clear")
    expect(name_box).not_to_have_value("left behind")
    expect(user_messages(page)).to_have_count(0)
    # The detached reply ends and saves to the chat as the user last named it.
    path = dirs["user"] / "chats" / "left behind.json"
    deadline = time.monotonic() + SLOW / 1000
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # the file is written by the server: nothing in the page says when
    kept = saved_chat(dirs, "left behind")["messages"]
    assert kept[0]["content"] == "renamed then left" and kept[1]["role"] == "assistant"
    assert not (dirs["user"] / "chats" / f"{old}.json").exists()


def test_a_rename_to_another_saved_chat_never_overwrites_it(context, server, dirs):
    page = open_page(context, server)
    settle(page, 5, ban_eos=True)
    new_chat(page)
    send(page, "the other chat")
    wait_done(page)
    other = chat_name(page)
    new_chat(page)
    send(page, "this chat")
    wait_done(page)  # both chats are at revision 1 now
    this = chat_name(page)
    rename(page, other)
    send(page, "saved under the other's name?")
    wait_done(page)
    # The other chat keeps its own conversation; this one goes to a new name, and says so.
    users = [m["content"] for m in saved_chat(dirs, other)["messages"] if m["role"] == "user"]
    assert users == ["the other chat"]
    expect(page.locator("#chat-status")).to_contain_text("saved as")
    name_box = page.locator("#chat-name textarea, #chat-name input").first
    expect(name_box).not_to_have_value(other)
    forked = chat_name(page)
    assert forked not in (other, this)
    users = [m["content"] for m in saved_chat(dirs, forked)["messages"] if m["role"] == "user"]
    assert users == ["this chat", "saved under the other's name?"]


# -- 11. a phone ----------------------------------------------------------------------------
def test_chat_is_usable_at_phone_width(browser, server):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = open_page(context, server)
    box = page.locator("#chat-input").bounding_box()
    send_button = page.locator("#chat-send").bounding_box()
    # The message box and Send share one line; Send is a thumb-sized button, not a bar.
    assert abs(send_button["y"] - box["y"]) < box["height"], (box, send_button)
    assert send_button["width"] < 150, send_button
    actions = [page.locator(f"#chat-{n}").bounding_box() for n in ("regenerate", "continue")]
    actions.append(page.locator("#chat-clear").bounding_box())
    assert len({round(a["y"]) for a in actions}) == 1, actions  # one row
    assert all(a["width"] < 150 for a in actions), actions
    # The whole chat fits on the screen: input and actions above the fold.
    assert max(a["y"] + a["height"] for a in actions) <= 844
    # No label badge drawn over the conversation.
    assert page.locator("#chatbot label, #chatbot [data-testid='block-label']").count() == 0
    # The rarely used parameter groups start folded (the page was ~4,900 px tall).
    tab(page, "Parameters")
    expect(page.locator("#param-temperature")).to_be_visible()
    height = page.evaluate("document.documentElement.scrollHeight")
    assert height < 3500, height
    context.close()
