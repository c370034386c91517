"""What the hooks the installer adds to text-generation-webui (TGW) call.

These functions run inside TGW's process and read its globals (`modules.shared`); they are
reached through the generated `modules/kestrel.py` in the TGW tree, imported only when
the Kestrel loader is used, so TGW starts as before when it is not.
"""

from __future__ import annotations

from typing import Any

import torch

from loader.base import LoaderError
from loader.tgw.model import KestrelTGWModel


def load_model(model_name: str) -> tuple[KestrelTGWModel, KestrelTGWModel]:
    """models.load_model's entry for the 'Kestrel' loader."""
    return KestrelTGWModel.from_pretrained(model_name)


def encode(prompt: str, add_bos_token: bool = True, truncation_length: int | None = None) -> Any:
    """text_generation.encode for a Kestrel model: LongTensor [1, n], last tokens kept."""
    from modules import shared

    ids: torch.Tensor = shared.model.encode(str(prompt), add_bos=add_bos_token)
    if truncation_length is not None:
        ids = ids[:, -truncation_length:]
    return ids


def add_lora_to_model(lora_names: list[str]) -> None:
    """LoRA.add_lora_to_model for a Kestrel model: exactly `lora_names` active, scale 1.

    A failure (bad adapter, or a Kestrel without LoRA support) leaves shared.lora_names as
    it was and raises an error whose message says why; in the web UI it is shown as such.
    """
    from modules import shared
    from modules.logging_colors import logger
    from modules.LoRA import get_lora_path

    model: KestrelTGWModel = shared.model
    names = list(lora_names)
    if names:
        logger.info(f"Applying the following LoRAs to {shared.model_name}: {', '.join(names)}")
    try:
        model.set_tgw_loras({name: get_lora_path(name) for name in names})
    except LoaderError as e:
        logger.error(f"Kestrel could not apply the LoRAs {names}: {e}")
        ui_error = _gradio_error(e)
        if ui_error is None:
            raise
        raise ui_error from e
    shared.lora_names = names


def _gradio_error(error: Exception) -> Exception | None:
    """Gradio shows the message of a gr.Error only; None where there is no web UI."""
    import sys

    if "gradio" not in sys.modules:
        return None
    import gradio as gr

    return gr.Error(str(error))
