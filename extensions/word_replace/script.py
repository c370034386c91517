"""Word replacement: an example TGW-style extension (runs unchanged in text-generation-webui).

Replaces whole words in the user's input before generation and in the model's output
after it. Pairs are written "old=new", one per line or separated by ";", e.g.
"colour=color; favourite=favorite". Settings keys "word_replace-input_pairs" and
"word_replace-output_pairs" (settings.yaml in TGW, serving.shared.settings in Kestrel)
override the defaults below.
"""

import re

params = {
    "display_name": "Word replacement",
    "is_tab": False,
    "activate": True,
    "input_pairs": "",
    "output_pairs": "",
}


def parse_pairs(text):
    """ "a=b; c=d" -> [("a", "b"), ("c", "d")]; entries without "=" or an old word are skipped."""
    pairs = []
    for entry in re.split(r"[;\n]", text or ""):
        old, sep, new = entry.partition("=")
        if sep and old.strip():
            pairs.append((old.strip(), new.strip()))
    return pairs


def replace_words(text, pairs):
    for old, new in pairs:
        text = re.sub(r"\b" + re.escape(old) + r"\b", lambda _m, new=new: new, text)
    return text


def input_modifier(string, state, is_chat=False):
    if not params["activate"]:
        return string
    return replace_words(string, parse_pairs(params["input_pairs"]))


def output_modifier(string, state, is_chat=False):
    if not params["activate"]:
        return string
    return replace_words(string, parse_pairs(params["output_pairs"]))


def ui():
    import gradio as gr

    activate = gr.Checkbox(value=params["activate"], label="Replace words")
    input_pairs = gr.Textbox(
        value=params["input_pairs"], label="In the input (old=new; ...)", lines=2
    )
    output_pairs = gr.Textbox(
        value=params["output_pairs"], label="In the output (old=new; ...)", lines=2
    )
    activate.change(lambda x: params.update({"activate": x}), activate, None)
    input_pairs.change(lambda x: params.update({"input_pairs": x}), input_pairs, None)
    output_pairs.change(lambda x: params.update({"output_pairs": x}), output_pairs, None)
