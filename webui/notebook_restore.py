"""The Notebook's remembered text is put in its box by the page itself, before the box can
be typed in; and what is typed there is not replaced by Gradio's own replay of older values.

Why not as an update from the page load: Gradio keeps an update sent to a box that is not
on the page yet (the Notebook tab not opened) and applies it again once the box appears;
what the user types in between is replaced by the remembered text (seen in full-suite runs
on a busy machine). So the page load sends the text to a hidden holder, and the script
below copies it into the box when both exist, keeping the box read-only until then.

The replay: when a tab first opens, Gradio 6 (`render_previously_invisible_children`)
waits for an animation frame and then writes each new component's props as Gradio last
knew them, the value included. Typed before that frame, the text is replaced by the box's
earlier value and that value is saved (a busy browser draws late: seen in CI as "Text saved
(17 characters)", the default text's length, after typing 20). The script takes a value
written into the editable box over what was typed as such a replay and puts the typed text
back; its input event saves it. Runs write the box while it is disabled: not replays; and
what was typed before Generate was pressed is never put back over a run's output.
"""

from __future__ import annotations

import gradio as gr

HEAD_JS = """
<script>
(() => {
  const text = Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, "value");
  let remembered = null;  // the text the page load sent, once it has come
  let restored = false;   // whether it has been put in the box (once per page)
  let typed = null;       // the text last typed in the box, kept until a run writes there
  let putBack = 0;        // times it was put back since it was typed (bounds a replay loop)
  let writing = false;    // this script is writing the box (its input is not the user's)
  const guarded = new WeakSet();

  function findBox() {
    const block = document.getElementById("notebook-text");
    return block === null ? null : block.querySelector("textarea");
  }
  function write(box, value) {
    writing = true;
    try {
      text.set.call(box, value);
      box.dispatchEvent(new Event("input", { bubbles: true }));  // Gradio takes the value
    } finally {
      writing = false;
    }
  }
  // Gradio can write the box's first value again after the user has typed (seen on a busy
  // machine right after the Notebook tab first opened: the typed text was replaced and
  // never saved). A value written into the box while it is editable that is not what was
  // typed is such a replay: the typed text is put back, and its input event saves it.
  function putBackTyped(box) {
    if (box.disabled) { typed = null; return; }  // a run writes into the box: not a replay
    if (typed === null || text.get.call(box) === typed || putBack >= 3) return;
    putBack += 1;
    write(box, typed);
  }
  function guard(box) {
    if (guarded.has(box)) return;
    guarded.add(box);
    box.addEventListener("input", () => {
      if (writing) return;
      typed = text.get.call(box);
      putBack = 0;
    });
    Object.defineProperty(box, "value", {
      configurable: true,
      get() { return text.get.call(box); },
      set(value) {
        text.set.call(box, value);
        // After the update that wrote it has been applied (its `disabled` included).
        if (!writing && typed !== null && value !== typed) queueMicrotask(() => putBackTyped(box));
      },
    });
    if (typed !== null) putBackTyped(box);  // a box put on the page again shows the typed text
  }
  function restore() {
    const box = findBox();
    if (box === null) return;
    guard(box);
    if (restored) return;
    if (remembered === null) {
      box.readOnly = true;  // shown, but not typed in before the remembered text is put in
      return;
    }
    restored = true;
    if (box.value !== remembered) {
      write(box, remembered);
      typed = remembered;  // kept as if typed: Gradio can replay the built value over it
      putBack = 0;
    }
    box.readOnly = false;
  }
  // From Generate on, the box's text is the run's to write: a write that follows is never a
  // replay to undo. Without this, a short run whose updates reach the box only once it is
  // editable again (Gradio writes a tab's held props on a frame that comes late on a busy
  // machine, value and `interactive` together) would have its output replaced by the text
  // typed before it, and that text saved over it. Capture phase: before Gradio's handler.
  window.addEventListener("click", (event) => {
    if (event.target.closest && event.target.closest("#notebook-generate")) {
      typed = null;
      putBack = 0;
    }
  }, true);
  // Kept for the page's life: a box put on the page again is guarded too.
  new MutationObserver(restore).observe(document, { childList: true, subtree: true });
  window.kestrelRestoreNotebook = (value) => {
    // Not a text (never seen): the box keeps the text it was built with, and is unlocked.
    remembered = typeof value === "string" ? value : null;
    if (remembered === null) {
      const box = findBox();
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
