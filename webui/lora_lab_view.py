"""The LoRA lab's grid as HTML: one row per prompt, one column per variant, each cell's
text with the words that differ from the base column's marked, and its numbers.

A cell keeps its exact text in `data-text` and its finish reason in `data-finish` (empty
while it streams), so the page (and a browser test) can read what the cell holds without
parsing the highlighting.
"""

from __future__ import annotations

import difflib
import html
import re

from loader.lora_grid import BASE, LoraGrid

_TOKEN = re.compile(r"\s+|\w+|[^\w\s]")

STYLE = """
<style>
#lab-grid .lab-scroll { overflow-x: auto; }
#lab-grid table.lab-table { border-collapse: collapse; width: 100%; table-layout: fixed; }
#lab-grid .lab-table th, #lab-grid .lab-table td { border: 1px solid rgba(128,128,128,.35);
  padding: 6px 8px; vertical-align: top; text-align: left; min-width: 14em; }
#lab-grid .lab-table th.lab-prompt-head, #lab-grid .lab-table td.lab-prompt { width: 14em; }
#lab-grid .lab-text { white-space: pre-wrap; word-break: break-word; font-size: .95em; }
#lab-grid .lab-meta, #lab-grid .lab-ppl { font-size: .8em; opacity: .75; font-weight: normal; }
#lab-grid mark.lab-diff { background: rgba(250, 204, 21, .45); color: inherit;
  border-radius: 3px; padding: 0 1px; }
#lab-grid span.lab-del { border-left: 3px solid rgba(220, 38, 38, .85); margin: 0 1px; }
#lab-grid td.lab-cell[data-finish=""] .lab-meta::after { content: " …"; }
</style>
"""


def words(text: str) -> list[str]:
    """Words, punctuation marks and whitespace runs: what the highlighting compares."""
    return _TOKEN.findall(text)


def diff_html(base: str, text: str) -> str:
    """`text` as HTML with what differs from `base` marked: changed or added words in
    <mark> (one mark over a run of them, the spaces between included), a place where base
    words were dropped as an empty red bar (its title says which), so the cell's visible
    text is exactly `text`."""
    a, b = words(base), words(text)
    pieces: list[tuple[str, str]] = []  # (kind, text): "same", "new", or "gone" (removed)
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            pieces.append(("same", "".join(b[b0:b1])))
            continue
        if b1 > b0:
            pieces.append(("new", "".join(b[b0:b1])))
        if op == "delete":
            pieces.append(("gone", "".join(a[a0:a1])))
    # Whitespace alone between two changed runs joins them: one mark, not a mark per word.
    for i in range(1, len(pieces) - 1):
        kind, segment = pieces[i]
        if kind == "same" and not segment.strip() and pieces[i - 1][0] == pieces[i + 1][0] == "new":
            pieces[i] = ("new", segment)
    out, run = [], []
    for kind, segment in [*pieces, ("end", "")]:
        if kind == "new":
            run.append(segment)
            continue
        if run:
            out.append(f'<mark class="lab-diff">{html.escape("".join(run))}</mark>')
            run = []
        if kind == "same":
            out.append(html.escape(segment))
        elif kind == "gone":
            removed = html.escape(segment, quote=True)
            out.append(f'<span class="lab-del" title="removed: {removed}"></span>')
    return "".join(out)


def render(grid: LoraGrid | None, note: str = "") -> str:
    if grid is None:
        return STYLE + f"<p class='lab-empty'>{html.escape(note or 'No grid yet.')}</p>"
    labels = [v.label for v in grid.variants]
    base_column = labels.index(BASE) if BASE in labels else None
    ppl = (grid.perplexity or {}).get("values") or {}
    head = ["<th class='lab-prompt-head'>prompt</th>"]
    for j, label in enumerate(labels):
        extra = f"<br><span class='lab-ppl'>ppl {ppl[label]:.3f}</span>" if label in ppl else ""
        head.append(f"<th id='lab-head-{j}'>{html.escape(label)}{extra}</th>")
    rows = []
    for i, prompt in enumerate(grid.prompts):
        cells = [f"<td class='lab-prompt'>{html.escape(prompt)}</td>"]
        base = grid.cells[i][base_column].text if base_column is not None else None
        for j, cell in enumerate(grid.cells[i]):
            # Marked while streaming too: the cells of one batch grow at the same pace.
            compare = base is not None and j != base_column
            shown = diff_html(base, cell.text) if compare else html.escape(cell.text)
            meta = f"{cell.tokens} tokens · {cell.tokens_per_second:.1f} tok/s"
            if cell.finish_reason:
                meta += f" · {cell.finish_reason}"
            cells.append(
                f"<td class='lab-cell' id='lab-cell-{i}-{j}' "
                f"data-finish='{html.escape(cell.finish_reason or '', quote=True)}' "
                f"data-text='{html.escape(cell.text, quote=True)}'>"
                f"<div class='lab-meta'>{meta}</div><div class='lab-text'>{shown}</div></td>"
            )
        rows.append("<tr>" + "".join(cells) + "</tr>")
    table = (
        "<div class='lab-scroll'><table class='lab-table'><thead><tr>"
        + "".join(head)
        + "</tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table></div>"
    )
    return STYLE + table
