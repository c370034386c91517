"""The edits that teach text-generation-webui (TGW) the Kestrel loader.

Every edit inserts whole lines, wrapped in marker comments, into one top-level function or
assignment (its "unit") of a TGW file; nothing of TGW's own text is changed, so removing
the marked lines gives the original file back byte for byte. An edit lands after (or
before) an exact anchor text that must occur once in its unit, or after the unit itself.

TGW picks its code paths by the model's class name (shared.model.__class__.__name__), so
the hooks do the same with KestrelTGWModel. They import Kestrel only through the
generated modules/kestrel.py, and only when a Kestrel model is in use.
"""

from __future__ import annotations

from dataclasses import dataclass

from loader.tgw.names import CACHE_TYPES, LOADER_NAME, TGW_PARAMS, TGW_SAMPLERS

MODEL_CLASS = "KestrelTGWModel"
SHIM_FILE = "modules/kestrel.py"


@dataclass(frozen=True)
class Edit:
    name: str  # shown in the markers and messages
    file: str  # relative to the TGW root
    unit: str  # the top-level function or assignment the edit lives in
    lines: tuple[str, ...]  # what is inserted (indented), without the markers
    anchor: str | None = None  # exact text in the unit; None: insert after the unit
    before: bool = False  # insert before the anchor instead of after it


def _list_literal(target: str, items: tuple[str, ...], brackets: str) -> tuple[str, ...]:
    open_, close = brackets[0], brackets[1]
    return (f"{target} = {open_}", *(f"    {item!r}," for item in items), close)


EDITS: tuple[Edit, ...] = (
    Edit(
        "loader-params",
        "modules/loaders.py",
        "loaders_and_params",
        _list_literal(f"loaders_and_params[{LOADER_NAME!r}]", TGW_PARAMS, "[]"),
    ),
    Edit(
        "loader-samplers",
        "modules/loaders.py",
        "loaders_samplers",
        _list_literal(f"loaders_samplers[{LOADER_NAME!r}]", TGW_SAMPLERS, "{}"),
    ),
    Edit(
        "cache-types",
        "modules/loaders.py",
        "make_loader_params_visible",
        (
            f"    if 'cache_type' in all_params and loader == {LOADER_NAME!r}:",
            "        # Kestrel's cache types only (TGW's q8_0/q4_0 map to them when typed)",
            f"        kestrel_cache_types = {list(CACHE_TYPES)!r}",
            "        updates = [gr.update(visible=k in params) for k in all_params]",
            "        updates[all_params.index('cache_type')] = gr.update(",
            "            visible=True,",
            "            choices=kestrel_cache_types,",
            "            info=f'Kestrel: {\", \".join(kestrel_cache_types)} (q8_0, q4_0: q8, q4)',",
            "        )",
            "        return updates",
            "    if 'cache_type' in all_params:  # TGW's own list back for the other loaders",
            "        from modules import shared",
            "",
            "        dropdown = shared.gradio.get('cache_type')",
            "        if dropdown is not None and getattr(dropdown, 'choices', None):",
            "            updates = [gr.update(visible=k in params) for k in all_params]",
            "            updates[all_params.index('cache_type')] = gr.update(",
            "                visible='cache_type' in params,",
            "                choices=dropdown.choices,",
            "                info=dropdown.info,",
            "            )",
            "            return updates",
        ),
        anchor="    return [gr.update(visible=True) if k in params else gr.update(visible=False) "
        "for k in all_params]\n",
        before=True,
    ),
    Edit(
        "load-func",
        "modules/models.py",
        "load_model",
        (f"        {LOADER_NAME!r}: Kestrel_loader,",),
        anchor="        'TensorRT-LLM': TensorRT_LLM_loader,\n",
    ),
    Edit(
        "context-length",
        "modules/models.py",
        "load_model",
        (
            f"    if loader == {LOADER_NAME!r}:",
            "        shared.settings['truncation_length'] = model.max_seq_len",
        ),
        anchor="    shared.is_multimodal = False\n",
        before=True,
    ),
    Edit(
        "loader-function",
        "modules/models.py",
        "TensorRT_LLM_loader",
        (
            "",
            "",
            "def Kestrel_loader(model_name):",
            "    from modules.kestrel import load_model as kestrel_load_model",
            "",
            "    return kestrel_load_model(model_name)",
        ),
    ),
    Edit(
        "unload",
        "modules/models.py",
        "unload_model",
        (f"    if model_class_name == {MODEL_CLASS!r}:", "        shared.model.unload()"),
        anchor="    elif model_class_name == 'LlamaServer':\n        shared.model.stop()\n",
    ),
    Edit(
        "parallel",
        "modules/text_generation.py",
        "generate_reply",
        (
            f"    if state.get('stop_event') is not None and "
            f"shared.model.__class__.__name__ == {MODEL_CLASS!r}:",
            "        use_parallel = True  # Kestrel's scheduler batches concurrent requests",
        ),
        anchor="        and (shared.model.__class__.__name__ != 'LlamaServer' or "
        "shared.args.parallel > 1)\n    )\n",
    ),
    Edit(
        "generate-func",
        "modules/text_generation.py",
        "_generate_reply",
        (
            f"        if shared.model.__class__.__name__ == {MODEL_CLASS!r}:",
            "            generate_func = generate_reply_custom",
        ),
        anchor="        else:\n            generate_func = generate_reply_HF\n",
    ),
    Edit(
        "logprobs-keep",
        "modules/text_generation.py",
        "generate_reply_custom",
        (
            "    kestrel_processors = None",
            f"    if shared.model.__class__.__name__ == {MODEL_CLASS!r}:",
            "        kestrel_processors = state.get('logits_processor')",
        ),
        anchor="    state = copy.deepcopy(state)\n",
        before=True,
    ),
    Edit(
        "logprobs-restore",
        "modules/text_generation.py",
        "generate_reply_custom",
        (
            "    if kestrel_processors is not None:",
            "        # the API reads logprobs from its own LogprobProcessor, not from a copy",
            "        state['logits_processor'] = kestrel_processors",
        ),
        anchor="    state = copy.deepcopy(state)\n",
    ),
    Edit(
        "encode",
        "modules/text_generation.py",
        "encode",
        (
            f"    if shared.model.__class__.__name__ == {MODEL_CLASS!r}:",
            "        from modules.kestrel import encode as kestrel_encode",
            "        return kestrel_encode(prompt, add_bos_token, truncation_length)",
        ),
        anchor="    # llama.cpp case\n",
        before=True,
    ),
    Edit(
        "logits",
        "modules/logits.py",
        "_get_next_logits",
        (
            "        kestrel_state = None",
            f"        if shared.model.__class__.__name__ == {MODEL_CLASS!r}:",
            "            is_non_hf_exllamav3 = True  # the same get_logits(token_ids) contract",
            "            if use_samplers:  # raw logits below, then Kestrel's samplers on them",
            "                kestrel_state, use_samplers = state, False",
        ),
        anchor=(
            "        is_non_hf_exllamav3 = shared.model.__class__.__name__ == 'Exllamav3Model'\n"
        ),
    ),
    Edit(
        "logits-samplers",
        "modules/logits.py",
        "_get_next_logits",
        (
            "        if kestrel_state is not None:",
            "            scores = shared.model.apply_samplers(scores, tokens, kestrel_state)",
        ),
        anchor="        probs = torch.softmax(scores.detach(), dim=-1, dtype=torch.float)\n",
        before=True,
    ),
    Edit(
        "lora",
        "modules/LoRA.py",
        "add_lora_to_model",
        (
            f"    if shared.model.__class__.__name__ == {MODEL_CLASS!r}:",
            "        from modules.kestrel import add_lora_to_model as kestrel_add_lora",
            "        return kestrel_add_lora(lora_names)",
        ),
        anchor="def add_lora_to_model(lora_names):\n",
    ),
    Edit(
        "loader-name",
        "modules/shared.py",
        "fix_loader_name",
        ("    if name == 'kestrel':", f"        return {LOADER_NAME!r}"),
        anchor="    name = name.lower()\n",
    ),
    Edit(
        "infer-loader",
        "modules/models_settings.py",
        "infer_loader",
        (
            "    elif hf_quant_method == 'exl2' or re.match(r'.*exl2', model_name.lower()):",
            f"        loader = {LOADER_NAME!r}",
        ),
        anchor="    elif re.match(r'.*exl3', model_name.lower()):\n        loader = 'ExLlamav3'\n",
    ),
    Edit(
        "truncation-length",
        "modules/ui_model_menu.py",
        "update_truncation_length",
        (
            f"    if state.get('loader') == {LOADER_NAME!r} and "
            f"shared.model.__class__.__name__ == {MODEL_CLASS!r}:",
            "        return shared.settings['truncation_length']",
        ),
        anchor="def update_truncation_length(current_length, state):\n",
    ),
)

# TGW releases since ExLlamaV2 left TGW (v4.0, March 2026), oldest first.
RELEASES: tuple[str, ...] = (
    "v4.0",
    "v4.1",
    "v4.1.1",
    "v4.2",
    "v4.3",
    "v4.3.1",
    "v4.3.2",
    "v4.3.3",
    "v4.4",
    "v4.5",
    "v4.5.1",
    "v4.5.2",
    "v4.6",
    "v4.6.1",
    "v4.6.2",
    "v4.7",
    "v4.7.1",
    "v4.7.2",
    "v4.7.3",
)


def _releases(first: str, last: str) -> tuple[str, ...]:
    return RELEASES[RELEASES.index(first) : RELEASES.index(last) + 1]


# sha256 (first 16 hex digits) of each unit's source in the TGW releases the edits were
# checked against (`python -m loader.tgw hashes PATH` prints a tree's); the installer
# refuses a TGW whose units are not all listed here.
KNOWN_UNITS: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {
    ("modules/loaders.py", "loaders_and_params"): {
        "3d6cab033945a7b5": ("v4.0",),
        "4fa46c6aa1b20875": ("v4.1", "v4.1.1", "v4.2"),
        "1cbc665d10becd48": _releases("v4.3", "v4.6.2"),
        "c04c7465247a7210": _releases("v4.7", "v4.7.3"),
    },
    ("modules/loaders.py", "loaders_samplers"): {
        "8b00ce80a3841c78": ("v4.0",),
        "60358f5862457347": _releases("v4.1", "v4.5.2"),
        "c8121d18cebba9ad": _releases("v4.6", "v4.7.3"),
    },
    ("modules/loaders.py", "make_loader_params_visible"): {
        "dfe6b5ca66266362": ("v4.0",),
        "44ca149ad14f0825": _releases("v4.1", "v4.7.3"),
    },
    ("modules/models.py", "load_model"): {
        "6e66551b4e5a9c5b": ("v4.0",),
        "1dc472f3e1e2fef3": ("v4.1", "v4.1.1", "v4.2"),
        "bf5630a41d671c5f": _releases("v4.3", "v4.7.3"),
    },
    ("modules/models.py", "TensorRT_LLM_loader"): {
        "bd764f8bec3adbe0": _releases("v4.0", "v4.7.3"),
    },
    ("modules/models.py", "unload_model"): {
        "a01bf59b0ea2a09a": _releases("v4.0", "v4.7.3"),
    },
    ("modules/text_generation.py", "generate_reply"): {
        "6a435eca63080923": _releases("v4.0", "v4.2"),
        "0b2b1382685574a2": _releases("v4.3", "v4.7.3"),
    },
    ("modules/text_generation.py", "_generate_reply"): {
        "cf9a022de83dee05": ("v4.0",),
        "5752e39e842a44b8": _releases("v4.1", "v4.7.3"),
    },
    ("modules/text_generation.py", "generate_reply_custom"): {
        "858ae2708f41228b": _releases("v4.0", "v4.1.1"),
        "d1ebcda369a89396": _releases("v4.2", "v4.7.3"),
    },
    ("modules/text_generation.py", "encode"): {
        "822d5dcb7596febf": _releases("v4.0", "v4.2"),
        "1fe32377e454066d": _releases("v4.3", "v4.7.3"),
    },
    ("modules/logits.py", "_get_next_logits"): {
        "a5debfca3f54bb43": _releases("v4.0", "v4.4"),
        "412f7a1b40834f10": _releases("v4.5", "v4.7.3"),
    },
    ("modules/LoRA.py", "add_lora_to_model"): {
        "7d88cbad7e35b5f0": _releases("v4.0", "v4.7.3"),
    },
    ("modules/shared.py", "fix_loader_name"): {
        "353ee4d72626662d": _releases("v4.0", "v4.7.3"),
    },
    ("modules/models_settings.py", "infer_loader"): {
        "b0bd81bbec90172d": _releases("v4.0", "v4.7.3"),
    },
    ("modules/ui_model_menu.py", "update_truncation_length"): {
        "8d5bc38f8a3ee2b8": ("v4.0",),
        "7b301d51c54a73de": _releases("v4.1", "v4.7.3"),
    },
}
