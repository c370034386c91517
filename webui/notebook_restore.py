"""The Notebook's remembered text is put in its box by the page itself, before the box can
be typed in, and never after.

Why not as an update from the page load: Gradio keeps an update sent to a box that is not
on the page yet (the Notebook tab not opened) and applies it again once the box appears;
what the user types in between is replaced by the remembered text (seen in full-suite runs
on a busy machine). So the page load sends the text to a hidden holder, and the script
below copies it into the box when both exist, keeping the box read-only until then.
"""

from __future__ import annotations

import gradio as gr

HEAD_JS = """
<script>
(() => {
  let remembered = null;  // the text the page load sent, once it has come
  let restored = false;   // whether it has been put in the box (once per page)
  function restore() {
    const box = document.querySelector("#notebook-text textarea");
    if (restored || box === null) return;
    if (remembered === null) {
      box.readOnly = true;  // shown, but not typed in before the remembered text is put in
      return;
    }
    restored = true;
    observer.disconnect();
    if (box.value !== remembered) {
      box.value = remembered;
      box.dispatchEvent(new Event("input", { bubbles: true }));  // Gradio takes the value
    }
    box.readOnly = false;
  }
  const observer = new MutationObserver(restore);
  observer.observe(document, { childList: true, subtree: true });
  window.kestrelRestoreNotebook = (text) => {
    // Not a text (never seen): the box keeps the text it was built with, and is unlocked.
    remembered = typeof text === "string" ? text : null;
    if (remembered === null) {
      const box = document.querySelector("#notebook-text textarea");
      remembered = box === null ? "" : box.value;
    }
    restore();
  };
})();
</script>
"""


def holder() -> gr.Textbox:
    """The hidden box the page load sends the remembered text to."""
    # "hidden": on the page but not shown, so the script is given its value as it is now.
    return gr.Textbox(visible="hidden", elem_id="notebook-remembered", show_label=False)


def wire(load: gr.events.Dependency, text: gr.Textbox) -> None:
    """After the page load (`load`) has filled the holder `text`, the page restores it."""
    load.then(None, [text], None, js="(text) => { window.kestrelRestoreNotebook(text); }")
