"""The LoRA lab tab: prompts × variants (the base model, adapters from the loras directory,
mixes with scales) generated together as one continuous batch with the Parameters tab's
sampling settings and one seed, shown side by side as they stream, with the words that
differ from the base column marked; tokens/s per cell; on request each variant's
perplexity on a text file the user picks (the same windows for all); grids saved as JSON
and Markdown under user_data/lora_grids/ and reopened from there.

The grid itself is loader.lora_grid's (the same code as tools/lora_compare.py): every cell
is one job of one `stream_many` batch with the variant's `loras` ({} for the base, whatever
the LoRA panel applied). Adapters a variant names are loaded onto the model when missing
(not applied: the panel's selection stays as it is).
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from loader.base import LoadedModel
from loader.lora_grid import (
    LoraGrid,
    adapter_names,
    grid_perplexity,
    parse_variants,
    run_grid,
    variant_label,
)
from webui import lora_lab_view, sampler_controls
from webui.context import AppContext, Job
from webui.lora_grids import GridStore, default_name
from webui.lora_panel import lora_choices
from webui.parameters_tab import ParametersTab

DEFAULT_PROMPTS = "Describe a kestrel in one sentence.\nWhat is the capital of France?"
PPL_WINDOW = 256
PPL_WINDOWS = 4
# Page updates while the grid streams: each re-renders the whole grid in the browser, so at
# most 10 a second, and fewer as the grid grows (at most this many characters a second), as
# the chat does for one reply.
MIN_UPDATE_SECONDS = 0.1
RENDERED_CHARS_PER_SECOND = 20_000


@dataclass
class LoraLab:
    prompts: gr.Textbox
    chat: gr.Checkbox
    adapters: gr.Dropdown
    refresh: gr.Button
    fill: gr.Button
    variants: gr.Textbox
    run: gr.Button
    stop: gr.Button
    status: gr.Markdown
    grid: gr.HTML
    ppl_file: gr.File
    ppl_window: gr.Number
    ppl_windows: gr.Number
    ppl_run: gr.Button
    save_name: gr.Textbox
    save: gr.Button
    saved: gr.Dropdown
    open: gr.Button
    state: gr.State  # the grid shown, as LoraGrid.to_json()
    tab: gr.Tab


def _error(message: str) -> str:
    return f"<div class='kestrel-error' id='lab-error'>Error: {html.escape(message)}</div>"


def fill_variants(names: list[str] | None) -> str:
    """base, each chosen adapter, and (two or more) an even mix of them."""
    names = list(names or [])
    lines = ["base", *names]
    if len(names) > 1:
        lines.append(variant_label({n: round(1 / len(names), 4) for n in names}))
    return "\n".join(lines)


def build(ctx: AppContext) -> LoraLab:
    """The tab, inside the app's gr.Tabs."""
    with gr.Tab("LoRA lab", id="lora-lab", elem_id="tab-lora-lab") as tab:
        return _build(ctx, tab)


def _build(ctx: AppContext, tab: gr.Tab) -> LoraLab:
    gr.Markdown(
        "Compare the base model with LoRA adapters and mixes: every prompt × variant is "
        "generated in **one batch** with the Parameters tab's settings and one seed (a "
        "random one when the seed is -1). Words that differ from the base are marked."
    )
    with gr.Row():
        prompts = gr.Textbox(
            DEFAULT_PROMPTS, lines=4, label="Prompts (one per line)", elem_id="lab-prompts",
            scale=3,
        )  # fmt: skip
        variants = gr.Textbox(
            "base", lines=4, elem_id="lab-variants", scale=2,
            label="Variants (one per line): base, NAME, NAME=0.5, A=0.5 + B=0.5",
        )  # fmt: skip
    with gr.Row():
        adapters = gr.Dropdown(
            lora_choices(ctx), multiselect=True, label=f"Adapters in {ctx.manager.loras_dir}",
            elem_id="lab-adapters", scale=4,
        )  # fmt: skip
        refresh = gr.Button("Refresh list", elem_id="lab-refresh", scale=1)
        fill = gr.Button("Variants from adapters", elem_id="lab-fill", scale=1)
        chat = gr.Checkbox(True, label="Chat template", elem_id="lab-chat", scale=1)
    with gr.Row():
        run = gr.Button("Run grid", variant="primary", elem_id="lab-run")
        stop = gr.Button("Stop", variant="stop", visible=False, elem_id="lab-stop")
    status = gr.Markdown(elem_id="lab-status")
    grid = gr.HTML(lora_lab_view.render(None), elem_id="lab-grid")
    with gr.Accordion("Perplexity per variant", open=False):
        with gr.Row():
            ppl_file = gr.File(
                label="Text file (UTF-8)", file_types=[".txt", ".md", ".utf8", ".text"],
                elem_id="lab-ppl-file", scale=3,
            )  # fmt: skip
            ppl_window = gr.Number(PPL_WINDOW, label="tokens per window", precision=0,
                                   elem_id="lab-ppl-window", minimum=2)  # fmt: skip
            ppl_windows = gr.Number(PPL_WINDOWS, label="windows (0: all)", precision=0,
                                    elem_id="lab-ppl-windows", minimum=0)  # fmt: skip
            ppl_run = gr.Button("Measure perplexity", elem_id="lab-ppl-run")
    with gr.Accordion("Saved grids", open=True):
        with gr.Row():
            save_name = gr.Textbox(label="Save as", placeholder=default_name(),
                                   elem_id="lab-save-name")  # fmt: skip
            save = gr.Button("Save grid", elem_id="lab-save")
            saved = gr.Dropdown(GridStore(ctx.user_data.root).names(), label="Saved grids",
                                elem_id="lab-saved")  # fmt: skip
            open_ = gr.Button("Open", elem_id="lab-open")
    state = gr.State(None)
    return LoraLab(
        prompts, chat, adapters, refresh, fill, variants, run, stop, status, grid,
        ppl_file, ppl_window, ppl_windows, ppl_run, save_name, save, saved, open_, state, tab,
    )  # fmt: skip


def _model(ctx: AppContext) -> LoadedModel:
    if not ctx.manager.is_loaded():
        raise ValueError("Load a model first (Model tab).")
    return ctx.manager.current()


def _ensure_adapters(ctx: AppContext, model: LoadedModel, names: list[str]) -> None:
    """Load the adapters the variants name that the model does not hold yet (from the
    loras directory; names are confined to it)."""
    with ctx.loras.lock:
        loaded = set(model.loras())
        for name in names:
            if name not in loaded:
                model.load_lora(ctx.manager.resolve_lora(name), name)


def _summary(grid: LoraGrid) -> str:
    cells = len(grid.prompts) * len(grid.variants)
    done = sum(c.finish_reason is not None for row in grid.cells for c in row)
    head = "Done" if grid.done else f"Generating: {done}/{cells} cells done"
    return (
        f"{head}: {len(grid.prompts)} prompt(s) × {len(grid.variants)} variant(s) in one batch, "
        f"{grid.total_tokens} tokens in {grid.seconds:.1f} s "
        f"({grid.tokens_per_second:.1f} tok/s together), seed {grid.seed}."
    )


def wire(ctx: AppContext, lab: LoraLab, params: ParametersTab) -> None:
    store = GridStore(ctx.user_data.root)

    def session(request: gr.Request) -> str:
        return f"{request.session_hash or ''}/lora-lab"

    def begin(request: gr.Request) -> Job:
        job = ctx.start_job(session(request))
        if job is None:
            raise gr.Error("The grid is still running: press Stop first.", duration=6)
        return job

    busy = (gr.update(visible=False), gr.update(visible=True))
    idle = (gr.update(visible=True), gr.update(visible=False))

    def run(request: gr.Request, prompts: str, variants: str, chat: bool, *raw: Any) -> Iterator:
        job = begin(request)
        try:
            try:
                model = _model(ctx)
                parsed = parse_variants(variants.splitlines())
                settings = sampler_controls.validate(params.values(raw))
                _ensure_adapters(ctx, model, adapter_names(parsed))
                grid = LoraGrid.new(
                    model, prompts.splitlines(), parsed, settings, chat_template=bool(chat)
                )
                grid.model = ctx.manager.name or grid.model
            except Exception as e:
                yield gr.update(), _error(str(e)), gr.update(), *idle
                return
            yield lora_lab_view.render(grid), _summary(grid), None, *busy
            last = 0.0
            try:
                for _ in run_grid(model, grid, stop=job.stop):
                    now = time.perf_counter()
                    chars = sum(len(c.text) for row in grid.cells for c in row)
                    due = max(MIN_UPDATE_SECONDS, chars / RENDERED_CHARS_PER_SECOND)
                    if now - last >= due:
                        last = now
                        yield lora_lab_view.render(grid), _summary(grid), None, *busy
            except Exception as e:
                yield lora_lab_view.render(grid), _error(str(e)), None, *idle
                return
            stopped = "" if grid.done and not job.stop.is_set() else " Stopped."
            yield lora_lab_view.render(grid), _summary(grid) + stopped, grid.to_json(), *idle
        finally:
            ctx.end_job(job)

    def measure(
        request: gr.Request, file: str | None, window: float, windows: float, data: Any
    ) -> Iterator:
        if data is None:
            yield gr.update(), _error("Run or open a grid first."), gr.update(), *idle
            return
        job = begin(request)
        try:
            try:
                if not file:
                    raise ValueError("choose a text file for the perplexity first")
                grid = LoraGrid.from_json(data)
                model = _model(ctx)
                _ensure_adapters(ctx, model, adapter_names(grid.variants))
                text = _read_text(Path(file))
                steps = grid_perplexity(
                    model, grid, text, source=Path(file).name,
                    window=_count(window, "tokens per window", PPL_WINDOW),
                    windows=_count(windows, "windows", PPL_WINDOWS) or None, stop=job.stop,
                )  # fmt: skip
                yield gr.update(), "Measuring perplexity…", gr.update(), *busy
                for scored, total in steps:
                    line = f"Measuring perplexity: {scored}/{total} windows (all variants)."
                    yield gr.update(), line, gr.update(), *busy
            except Exception as e:
                yield gr.update(), _error(str(e)), gr.update(), *idle
                return
            if grid.perplexity is None:
                yield gr.update(), "Perplexity stopped.", gr.update(), *idle
                return
            p = grid.perplexity
            line = (
                f"Perplexity on {p['file']}: {p['windows']} window(s) of {p['window']} tokens, "
                "the same for every variant. "
                + ", ".join(f"{k}: {v:.3f}" for k, v in p["values"].items())
                + "\n\n"
                + _summary(grid)
            )
            yield lora_lab_view.render(grid), line, grid.to_json(), *idle
        finally:
            ctx.end_job(job)

    def stop(request: gr.Request) -> None:
        ctx.stop(session(request))

    def save(name: str, data: Any) -> tuple[str, Any, Any]:
        if data is None:
            return _error("Run or open a grid first."), gr.update(), gr.update()
        try:
            grid = LoraGrid.from_json(data)
            json_path, md_path = store.save(grid, (name or "").strip() or default_name())
        except Exception as e:
            return _error(str(e)), gr.update(), gr.update()
        return (
            f"Saved grid **{grid.name}**: `{json_path}` and `{md_path.name}`.",
            gr.update(choices=store.names(), value=grid.name),
            grid.to_json(),
        )

    def open_grid(name: str | None) -> tuple[Any, ...]:
        if not name:
            return gr.update(), _error("choose a saved grid"), gr.update(), gr.update(), gr.update()
        try:
            grid = store.open(name)
        except Exception as e:
            return gr.update(), _error(str(e)), gr.update(), gr.update(), gr.update()
        return (
            lora_lab_view.render(grid),
            f"Opened grid **{grid.name or name}** ({grid.created}, model {grid.model}). "
            + _summary(grid),
            grid.to_json(),
            "\n".join(grid.prompts),
            "\n".join(v.label for v in grid.variants),
        )

    outputs = [lab.grid, lab.status, lab.state, lab.run, lab.stop]
    lab.run.click(
        run,
        [lab.prompts, lab.variants, lab.chat, *params.components],
        outputs,
        concurrency_limit=None,
        show_progress="hidden",
    )
    lab.ppl_run.click(
        measure,
        [lab.ppl_file, lab.ppl_window, lab.ppl_windows, lab.state],
        outputs,
        concurrency_limit=None,
        show_progress="hidden",
    )
    lab.stop.click(stop, None, None, queue=False)

    def lists() -> tuple[Any, Any]:
        # Grids saved and adapters added since the page was built (the choices a page gets
        # are the app's build-time ones).
        return gr.update(choices=lora_choices(ctx)), gr.update(choices=store.names())

    lab.refresh.click(lists, None, [lab.adapters, lab.saved])
    lab.tab.select(lists, None, [lab.adapters, lab.saved], show_progress="hidden")
    lab.fill.click(fill_variants, [lab.adapters], [lab.variants])
    lab.save.click(save, [lab.save_name, lab.state], [lab.status, lab.saved, lab.state])
    lab.open.click(
        open_grid, [lab.saved], [lab.grid, lab.status, lab.state, lab.prompts, lab.variants]
    )


def _count(value: Any, name: str, default: int) -> int:
    """A whole number from a Number box (None when emptied: the default)."""
    if value is None or value == "":
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a whole number of 0 or more, got {value!r}")
    return value


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path.name} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"could not read {path.name}: {e.strerror or e}") from None
