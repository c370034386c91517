"""The Model tab: the models directory, a loader with its controls, load/unload with a
progress bar, what is loaded (loader, architecture, context, devices, VRAM per device) and
any load error, shown in the page.

Loading is one at a time for the whole server (Gradio's concurrency id "model"); the model
is shared by every browser session, as it is in TGW.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import gradio as gr

import loader
from loader.manager import ModelManager
from webui import hub_panel, load_options
from webui.cli import CACHE_TYPES
from webui.context import AppContext
from webui.load_check import LoadCheckError, check_load, loader_for
from webui.load_options import AUTO, OPTION_NAMES


@dataclass
class ModelTab:
    model: gr.Dropdown
    refresh: gr.Button
    loader: gr.Dropdown
    options: list[gr.components.Component]  # in load_options.OPTION_NAMES order
    load: gr.Button
    unload: gr.Button
    status: gr.Markdown


def size_text(size_bytes: float) -> str:
    """Sizes such as 540 MB, 3.2 GB or 87 KB: a small model is never "0.00 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size_bytes >= scale:
            value = size_bytes / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(size_bytes)} B"


def model_choices(manager: ModelManager) -> list[tuple[str, str]]:
    """(label, name) for the dropdown: "SmolLM2-135M-Instruct-fp16 (fp16, 540 MB)"."""
    out = []
    for e in manager.list_models():
        bits = f" {e.bits:g} bpw" if e.bits is not None else ""
        out.append((f"{e.name} ({e.format}{bits}, {size_text(e.size_bytes)})", e.name))
    return out


def _system_memory_line(info: dict[str, Any]) -> str:
    """RAM of this process and of the machine (a CPU model's weights and cache live there)."""
    import psutil

    rss = psutil.Process().memory_info().rss
    memory = psutil.virtual_memory()
    line = (
        f"system memory: this server uses {rss / 2**30:.2f} GiB; "
        f"{memory.available / 2**30:.1f} of {memory.total / 2**30:.1f} GiB free"
    )
    tokens, per_token = info.get("cache_tokens"), info.get("cache_bytes_per_token")
    if isinstance(tokens, int) and isinstance(per_token, (int, float)):
        line += f" (KV cache {size_text(tokens * per_token)} for {tokens} tokens)"
    return line


def _vram_lines(info: dict[str, Any]) -> list[str]:
    lines = []
    vram = info.get("vram_gib") or {}
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        cuda = False
    for device in info.get("devices") or []:
        if device in vram:
            used = f"{float(vram[device]):.2f} GiB used by the model"
            if cuda and device.startswith("cuda"):
                free, total = torch.cuda.mem_get_info(torch.device(device))
                used += f"; {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
            lines.append(f"- `{device}`: {used}")
        else:
            lines.append(f"- `{device}`: {_system_memory_line(info)}")
    return lines


def describe_loaded(manager: ModelManager) -> str:
    """Markdown for the status box: what is loaded, or that nothing is."""
    if not manager.is_loaded():
        return "No model loaded. Pick one above and press **Load**."
    model = manager.current()
    try:
        info = model.info()
    except Exception as e:  # display only
        return f"Loaded **{manager.name}** (info unavailable: {e})"
    facts = [
        f"loader `{info.get('loader', model.loader_name)}`",
        f"`{info.get('arch', '?')}`",
        f"context {info.get('context', '?')} tokens",
        f"cache {info.get('cache_type', 'fp16')}",
    ]
    if info.get("dtype"):
        facts.append(f"weights {info['dtype']}")
    if info.get("load_seconds") is not None:
        facts.append(f"loaded in {info['load_seconds']:.1f} s")
    lines = [f"Loaded **{manager.name}**: " + ", ".join(facts), "", "Memory per device:"]
    return "\n".join(lines + _vram_lines(info))


def shown_options(ctx: AppContext, name: str | None, loader_name: str | None) -> set[str]:
    """The load options to show: those of the loader that will load `name` (under "auto",
    the one picked from its files) that this machine can use (no GPU split without CUDA,
    no tensor parallelism without two GPUs)."""
    used = loader_name if loader_name not in (None, "", AUTO) else None
    if used is None and name:
        try:
            used = loader_for(ctx.manager, name, None)
        except Exception:  # an unknown name: the load says so
            used = None
    shown = load_options.visible_options(used or AUTO)
    gpus = load_options.gpu_count()
    if gpus == 0:
        shown -= {"gpu_split", "autosplit", "tensor_parallel"}
    elif gpus == 1:
        shown -= {"tensor_parallel"}
    return shown


def _previous(manager: ModelManager) -> tuple[str, str | None, dict[str, Any]] | None:
    """(name, loader, options) of the loaded model, to reload it if the next load fails;
    None when nothing is loaded or it came from outside the models directory."""
    if not manager.is_loaded() or manager.name is None:
        return None
    try:
        manager.resolve_model(manager.name)
    except Exception:
        return None
    return manager.name, manager.current().loader_name, manager.options


def _still(ctx: AppContext) -> str:
    if ctx.manager.is_loaded():
        return f"\n\n{ctx.manager.name} is still loaded.\n\n" + describe_loaded(ctx.manager)
    return "\n\nNo model is loaded."


def _restore(ctx: AppContext, previous: Any, report: Any) -> str:
    """After a failed load (the old model is unloaded by then): load the old one again."""
    if previous is None:
        return "\n\nNo model is loaded now."
    name, loader_name, options = previous
    try:
        ctx.manager.load(name, loader_name, progress=report, **options)
    except Exception as e:
        return f"\n\nNo model is loaded now: reloading {name} failed too ({html.escape(str(e))})."
    return f"\n\n{name} was loaded again.\n\n" + describe_loaded(ctx.manager)


def _error(message: str) -> str:
    # Error text comes from files on disk; escape it so it shows as text, not markup.
    return f"<div class='kestrel-error' id='model-error'>Error: {html.escape(message)}</div>"


def build(ctx: AppContext, remembered: dict[str, Any]) -> ModelTab:
    values = load_options.values_from_kwargs(remembered.get("load_options") or {})
    with gr.Row():
        model_dd = gr.Dropdown(
            model_choices(ctx.manager),
            value=ctx.manager.name,
            label=f"Model (from {ctx.manager.models_dir})",
            elem_id="model-select",
            scale=4,
        )
        refresh = gr.Button("Refresh list", elem_id="model-refresh", scale=1)
    hub_panel.build(ctx.manager, model_dd, model_choices)  # fetch a Hugging Face id
    loader_dd = gr.Dropdown(
        [AUTO, *loader.available()],
        value=remembered.get("loader") or AUTO,
        label="Loader",
        info="auto: picked from the files",
        elem_id="loader-select",
    )
    with gr.Row():
        with gr.Column():
            max_seq_len = gr.Slider(
                0,
                131072,
                value=values["max_seq_len"],
                step=256,
                label="max_seq_len",
                info="context length in tokens; 0: the model's (capped at 8192)",
                elem_id="opt-max_seq_len",
            )
            cache_type = gr.Dropdown(
                list(CACHE_TYPES),
                value=values["cache_type"],
                label="cache_type",
                info="KV cache storage",
                elem_id="opt-cache_type",
            )
            device = gr.Dropdown(
                load_options.devices(),
                value=values["device"],
                label="device",
                elem_id="opt-device",
            )
            dtype = gr.Dropdown(
                list(load_options.DTYPES),
                value=values["dtype"],
                label="dtype",
                info="auto: float16 on a GPU, float32 on the CPU",
                elem_id="opt-dtype",
            )
        with gr.Column():
            gpu_split = gr.Textbox(
                value=values["gpu_split"],
                label="gpu_split",
                placeholder="20,24",
                info="GiB per GPU, in order",
                elem_id="opt-gpu_split",
            )
            autosplit = gr.Checkbox(
                value=values["autosplit"],
                label="autosplit",
                info="fill the GPUs in order automatically",
                elem_id="opt-autosplit",
            )
            tensor_parallel = gr.Checkbox(
                value=values["tensor_parallel"],
                label="tensor_parallel",
                info="split every layer over the GPUs",
                elem_id="opt-tensor_parallel",
            )
            rope_alpha = gr.Number(
                value=values["rope_alpha"],
                label="rope_alpha",
                minimum=0.01,
                info="NTK RoPE alpha (1: off)",
                elem_id="opt-rope_alpha",
            )
            rope_scale = gr.Number(
                value=values["rope_scale"],
                label="rope_scale",
                minimum=0.01,
                info="linear RoPE scale (1: off)",
                elem_id="opt-rope_scale",
            )
    by_name = dict(
        max_seq_len=max_seq_len,
        cache_type=cache_type,
        gpu_split=gpu_split,
        autosplit=autosplit,
        tensor_parallel=tensor_parallel,
        rope_alpha=rope_alpha,
        rope_scale=rope_scale,
        device=device,
        dtype=dtype,
    )
    # Only what the loader of the selected model takes and this machine can use.
    shown = shown_options(ctx, ctx.manager.name, loader_dd.value)
    for option_name, component in by_name.items():
        component.visible = option_name in shown
    with gr.Row():
        load = gr.Button("Load", variant="primary", elem_id="model-load")
        unload = gr.Button("Unload", elem_id="model-unload")
    status = gr.Markdown(describe_loaded(ctx.manager), elem_id="model-status")
    return ModelTab(
        model_dd, refresh, loader_dd, [by_name[n] for n in OPTION_NAMES], load, unload, status
    )


def wire(ctx: AppContext, tab: ModelTab) -> tuple[Any, Any]:
    """Connect the tab; returns the load and unload events, for others to follow."""

    # Gradio finds gr.Progress by its default, and only among positional parameters.
    def load(name: str | None, loader_name: str, progress=gr.Progress(), *raw: Any) -> str:  # noqa: B008
        if not name:
            return _error("choose a model first")
        chosen = None if loader_name in (None, "", AUTO) else loader_name
        shown = shown_options(ctx, name, loader_name)
        try:
            kwargs = load_options.load_kwargs(dict(zip(OPTION_NAMES, raw, strict=True)), shown)
            # Everything that can be known before the working model is unloaded.
            check_load(ctx.manager, name, chosen, kwargs)
        except (ValueError, LoadCheckError) as e:
            return _error(f"could not load {name}: {e}") + _still(ctx)
        previous = _previous(ctx.manager)
        progress(0.05, desc=f"Loading {name}")
        steps = [0.05]

        def report(message: str) -> None:
            steps.append(min(0.9, steps[-1] + 0.2))
            progress(steps[-1], desc=message)

        def weights(fraction: float, what: str) -> None:
            # The load itself: most of the bar, as the loader reports it weight by weight.
            progress(steps[-1] + (0.95 - steps[-1]) * fraction, desc=f"Loading {name}: {what}")

        try:
            ctx.manager.load(name, chosen, progress=report, weights_progress=weights, **kwargs)
        except Exception as e:  # any loader failure is shown, and the server goes on
            return _error(f"could not load {name}: {e}") + _restore(ctx, previous, report)
        progress(1.0, desc="Loaded")
        ctx.user_data.update_settings(model=name, loader=chosen, load_options=kwargs)
        return describe_loaded(ctx.manager)

    def unload() -> str:
        name = ctx.manager.name
        ctx.manager.unload()
        ctx.user_data.update_settings(model=None)
        return f"Unloaded {name}." if name else "No model was loaded."

    def refresh() -> Any:
        return gr.update(choices=model_choices(ctx.manager))

    def show_options(name: str | None, loader_name: str) -> list[Any]:
        shown = shown_options(ctx, name, loader_name)
        return [gr.update(visible=n in shown) for n in OPTION_NAMES]

    loaded = tab.load.click(
        load, [tab.model, tab.loader, *tab.options], [tab.status], concurrency_id="model"
    )
    unloaded = tab.unload.click(unload, None, [tab.status], concurrency_id="model")
    tab.refresh.click(refresh, None, [tab.model])
    for control in (tab.loader, tab.model):
        control.change(show_options, [tab.model, tab.loader], tab.options, show_progress="hidden")
    return loaded, unloaded
