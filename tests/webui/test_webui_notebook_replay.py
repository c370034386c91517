"""What is typed in the Notebook right after its tab first opens is kept and saved, even
when the browser draws its next frame only after the typing (issue 25).

When a tab first opens, Gradio 6 waits for an animation frame and then writes each new
component's props as it last knew them, the value included (`render_previously_invisible_
children`). Typed before that frame, the text was replaced by the box's earlier value, and
that value was saved: a fresh-clone CI run at load 8 typed 20 characters and saw "Text
saved (17 characters)", the length of the default text. Here the page's animation frames
are held from the tab's opening until the text is typed (a starved browser draws late) and
the saves are answered only after those frames have run (a busy server answers late), so
the order that CI run met by chance happens every time. Headless Chromium,
`python ui.py --model tiny-llama` on a fresh user-data folder."""

from __future__ import annotations

import pytest
import yaml

from helpers.browser import (
    SLOW,
    desktop_context,
    open_page,
    require_browser,
    running_ui,
    tab,
)
from helpers.model_factory import make_tiny_llama

sync_api = require_browser()
expect = sync_api.expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=SLOW)

# Typed by keyboard (the newline is an Enter key press), of different lengths so that
# "Text saved (N characters)" tells them apart.
FIRST = "Q: Is water wet?\nA: "
SECOND = "Q: Is fire hot?\nA: yes, "

# The page's animation frames, held while `window.kestrelTestHoldFrames` is on: callbacks
# asked for meanwhile run on the first frame after the test lets them go.
FRAME_GATE = """
(() => {
  const request = window.requestAnimationFrame.bind(window);
  let held = null;
  window.kestrelTestFrames = { held: 0, ran: 0 };
  window.kestrelTestHoldFrames = () => { held = []; };
  window.kestrelTestReleaseFrames = () => {
    const callbacks = held;
    held = null;
    for (const callback of callbacks) {
      request((t) => { try { callback(t); } finally { window.kestrelTestFrames.ran += 1; } });
    }
  };
  window.requestAnimationFrame = (callback) => {
    if (held === null) return request(callback);
    held.push(callback);
    window.kestrelTestFrames.held += 1;
    return 0;
  };
})();
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-notebook-replay")
    make_tiny_llama(root / "models" / "tiny-llama", max_position_embeddings=4096)
    return {"root": root, "user": root / "user_data"}


@pytest.fixture(scope="module")
def server(dirs):
    args = [
        "--models-dir", str(dirs["root"] / "models"), "--user-data-dir", str(dirs["user"]),
        "--model", "tiny-llama",
    ]  # fmt: skip
    with running_ui(args, dirs["root"] / "server.log") as url:
        yield url


def saved_notebook(dirs) -> str | None:
    return yaml.safe_load((dirs["user"] / "settings.yaml").read_text()).get("notebook")


def type_in_notebook(page, text: str):
    """Replace the Notebook's text by typing `text` key by key, as soon as it is editable."""
    box = page.locator("#notebook-text textarea")
    box.click()  # waits until the box is editable (the remembered text is in)
    page.keyboard.press("Control+A")
    page.keyboard.type(text)
    expect(box).to_have_value(text)
    return box


def wait_saved_or_replaced(page, text: str) -> None:
    """Until the server has saved `text`, or the box no longer holds it (then nothing more
    will save it): whichever comes first."""
    page.wait_for_function(
        """([text, saved]) => {
            const box = document.querySelector('#notebook-text textarea');
            const line = document.querySelector('#notebook-saved');
            return box.value !== text || (line !== null && line.innerText.includes(saved));
        }""",
        arg=[text, f"Text saved ({len(text)} characters)"],
    )


def is_save(request) -> bool:
    """A request that starts the Notebook's save: its inputs are the text and the count of
    ended runs (the only event of the page with exactly those)."""
    try:
        data = (request.post_data_json or {}).get("data")
    except ValueError:
        return False
    return isinstance(data, list) and len(data) == 2 and isinstance(data[0], str)


def test_text_typed_before_the_first_frame_after_the_tab_opens_is_kept(browser, server, dirs):
    with desktop_context(browser) as context:
        # A first visit leaves a remembered text other than the one the app was built with.
        page = open_page(context, server)
        tab(page, "Notebook")
        type_in_notebook(page, FIRST)
        expect(page.locator("#notebook-saved")).to_contain_text(f"Text saved ({len(FIRST)} ")
        assert saved_notebook(dirs) == FIRST
        page.close()

        context.add_init_script(FRAME_GATE)
        page = context.new_page()
        page.set_default_timeout(SLOW)
        held = []  # the saves not answered yet
        holding = {"on": True}

        def answer_late(route) -> None:
            if holding["on"] and is_save(route.request):
                held.append(route)
            else:
                route.continue_()

        page.route("**/queue/join*", answer_late)
        page.goto(server)
        page.wait_for_selector("#chat-input textarea:not([disabled])")  # the load has landed
        page.evaluate("window.kestrelTestHoldFrames()")
        tab(page, "Notebook")
        box = type_in_notebook(page, SECOND)
        assert page.evaluate("window.kestrelTestFrames.held") > 0  # the tab's frame is held
        page.evaluate("window.kestrelTestReleaseFrames()")
        page.wait_for_function(
            "() => window.kestrelTestFrames.ran === window.kestrelTestFrames.held"
        )
        holding["on"] = False
        for route in held:
            route.continue_()
        wait_saved_or_replaced(page, SECOND)
        assert box.input_value() == SECOND, "the typed text was replaced by the box's earlier value"
        assert saved_notebook(dirs) == SECOND

        # A new page shows what was typed last.
        other = open_page(context, server)
        tab(other, "Notebook")
        expect(other.locator("#notebook-text textarea")).to_have_value(SECOND)
