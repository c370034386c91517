"""Drives text-generation-webui's (TGW) web UI, with the Kestrel loader installed, in
headless Chromium: the Model tab's loader and cache-type menus, loading a model with the
Kestrel loader, a streamed chat reply and the Stop button.

Used by tests/tgw/test_tgw.py against a TGW server it started; every step waits on the page's
state (menus, visibility, text), never on time. Returns what it saw as a dict.
"""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Locator, Page, expect, sync_playwright

LAST_REPLY = (
    "() => { const b = [...document.querySelectorAll('#chat .message-body')];"
    " return b.length ? b[b.length - 1].innerText : '' }"
)


def _options(dropdown: Locator) -> Locator:
    """The option list of this Gradio dropdown (rendered inside its own div.wrap)."""
    wrap = dropdown.locator("xpath=ancestor::div[contains(concat(' ', @class, ' '), ' wrap ')][1]")
    return wrap.locator("ul[role=listbox] li")


def _menu_options(page: Page, dropdown: Locator) -> list[str]:
    """The options a Gradio dropdown offers (opened, read, closed again)."""
    dropdown.click()
    options = _options(dropdown)
    options.first.wait_for()
    texts = [text.replace("✓", "").strip() for text in options.all_inner_texts()]
    page.keyboard.press("Escape")
    dropdown.evaluate("e => e.blur()")  # a focused dropdown does not open on the next click
    options.first.wait_for(state="detached")
    return texts


def _pick(page: Page, dropdown: Locator, option: str) -> None:
    dropdown.click()
    _options(dropdown).filter(has_text=option).first.click()
    _options(dropdown).first.wait_for(state="detached")


def _pick_loader(page: Page, tab: Locator, loader: str) -> None:
    """Choose `loader` and wait for TGW to apply its controls: gpu-layers belongs to
    llama.cpp and not to Kestrel, and arrives in the same update as the cache types."""
    _pick(page, tab.get_by_label("Model loader"), loader)
    gpu_layers = tab.get_by_label("gpu-layers").first
    gpu_layers.wait_for(state="visible" if loader == "llama.cpp" else "hidden")


def run(url: str, model: str, screenshots: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_selector("#chat-input textarea", timeout=120_000)

            page.get_by_role("tab", name="Model").click()
            tab = page.locator("#model-tab")
            loader, cache = tab.get_by_label("Model loader"), tab.get_by_label("cache-type")
            seen["loaders"] = _menu_options(page, loader)
            _pick_loader(page, tab, "llama.cpp")
            seen["llamacpp_cache_types"] = _menu_options(page, cache)
            _pick_loader(page, tab, "Kestrel")
            seen["kestrel_cache_types"] = _menu_options(page, cache)
            info = tab.get_by_text("Kestrel: fp16")  # the cache-type help, Kestrel's now
            info.wait_for()
            seen["kestrel_cache_info"] = info.inner_text()
            page.screenshot(path=f"{screenshots}/model-tab-kestrel.png", full_page=True)

            _pick_loader(page, tab, "llama.cpp")
            # Selecting an EXL2-named folder makes TGW pick the Kestrel loader by itself.
            _pick(page, tab.get_by_label("Model", exact=True), model)
            expect(loader).to_have_value("Kestrel")
            tab.get_by_label("gpu-layers").first.wait_for(state="hidden")
            seen["loader_picked_for_model"] = loader.input_value()
            tab.get_by_role("button", name="Load", exact=True).click()
            page.wait_for_function(
                "() => /Successfully loaded|Failed to load/.test(document.body.innerText)",
                timeout=300_000,
            )
            seen["load_message"] = next(
                line
                for line in page.inner_text("body").splitlines()
                if "loaded" in line.lower() or "failed to load" in line.lower()
            )

            page.get_by_role("tab", name="Chat").first.click()
            page.fill("#chat-input textarea", "Tell me a long story about a kestrel.")
            page.click("#Generate")
            lengths = []
            for _ in range(3):  # the reply grows while it streams
                before = len(page.evaluate(LAST_REPLY))
                page.wait_for_function(f"() => ({LAST_REPLY})().length > {before}")
                lengths.append(len(page.evaluate(LAST_REPLY)))
            seen["reply_lengths_while_streaming"] = lengths
            seen["stop_shown_while_streaming"] = page.is_visible("#stop")
            page.click("#stop")
            page.wait_for_selector("#stop", state="hidden", timeout=60_000)
            page.wait_for_selector("#Generate", state="visible")
            seen["reply_after_stop"] = page.evaluate(LAST_REPLY)
            page.screenshot(path=f"{screenshots}/chat-stopped.png", full_page=True)
        finally:
            browser.close()
    return seen
