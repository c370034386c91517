"""The LoRA lab in a real browser: `python ui.py` with SmolLM2-135M-Instruct (FP16, CPU) and
two PEFT adapters made by peft here (rank 8 on attention, rank 4 on the MLP with its own
alpha), driven by headless Chromium through Playwright.

A 2-prompt × 4-variant grid (base, each adapter, a mix) runs as one batch, greedy. Every
cell must equal what that variant writes alone through the loader in this process (same
settings, same seed), the base column what the model writes without adapters; then the
perplexity per variant, and the saved grid reopens in a fresh page. Skipped, saying why,
where Chromium, Playwright or the model is missing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import loader
from helpers.browser import (
    ROOT,
    SLOW,
    choose,
    desktop_context,
    open_page,
    require_browser,
    running_ui,
    set_value,
    tab,
)
from helpers.model_factory import CORPUS
from loader.perplexity import bos_id, text_windows, window_nll

MODEL = "SmolLM2-135M-Instruct-fp16"
MODEL_DIR = ROOT / "models" / MODEL
if not (MODEL_DIR / "config.json").is_file():
    pytest.skip(f"needs the tiny model {MODEL_DIR} (setup.sh fetches it)", allow_module_level=True)
sync_api = require_browser()
expect = sync_api.expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=SLOW)

PROMPTS = ["Write a short poem about the sea.", "What is 2 + 3?"]
VARIANTS = ["base", "attn", "mlp", "attn=0.5 + mlp=0.5"]
NEW_TOKENS = 12
PPL_WINDOW, PPL_WINDOWS = 24, 2
PPL_TEXT = "\n\n".join(CORPUS)


def _adapter(path: Path, seed: int, **config) -> None:
    """A peft adapter with random non-zero A and B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # coherent text, yet each variant writes its own
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    loras = root / "loras"
    _adapter(loras / "attn", 1, r=8, lora_alpha=16, target_modules=["q_proj", "k_proj",
             "v_proj", "o_proj"])  # fmt: skip
    _adapter(loras / "mlp", 2, r=4, lora_alpha=3, target_modules=["gate_proj", "down_proj"])
    (root / "ppl.txt").write_text(PPL_TEXT, encoding="utf-8")
    return {"root": root, "loras": loras, "user": root / "user_data"}


@pytest.fixture(scope="module")
def server(dirs):
    args = [
        "--models-dir", str(ROOT / "models"), "--model", MODEL, "--device", "cpu",
        "--loras-dir", str(dirs["loras"]), "--user-data-dir", str(dirs["user"]),
    ]  # fmt: skip
    with running_ui(args, dirs["root"] / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def context(browser):
    with desktop_context(browser) as context:
        yield context


def _open_lab(context, url: str):
    page = open_page(context, url)
    tab(page, "LoRA lab")
    return page


def _cells(page) -> list[list[str]]:
    return [
        [
            page.locator(f"#lab-cell-{i}-{j}").get_attribute("data-text") or ""
            for j in range(len(VARIANTS))
        ]
        for i in range(len(PROMPTS))
    ]


def _alone(dirs, settings: dict) -> tuple[list[list[str]], list[str], object]:
    """What each variant writes alone through the loader, and the model without adapters."""
    m = loader.load(MODEL_DIR, "kestrel", device="cpu")
    without = []
    for prompt in PROMPTS:
        ids = _chat_ids(m, prompt)
        without.append(m.generate(ids, settings))
    for name in ("attn", "mlp"):
        m.load_lora(dirs["loras"] / name, name)
    loras = [{}, {"attn": 1.0}, {"mlp": 1.0}, {"attn": 0.5, "mlp": 0.5}]
    alone = [
        [m.generate(_chat_ids(m, p), {**settings, "loras": sel}) for sel in loras] for p in PROMPTS
    ]
    return alone, without, m


def _chat_ids(m, prompt: str) -> list[int]:
    text = m.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return m.encode(text, add_bos=False)


def test_grid_equals_each_variant_alone_and_reopens(context, server, dirs):
    page = _open_lab(context, server)
    # Greedy, short replies: the Parameters tab's settings are the grid's.
    tab(page, "Parameters")
    choose(page, "preset", "Deterministic")
    expect(page.locator("#params-status")).to_contain_text("Deterministic")
    set_value(page, "param-max_new_tokens", NEW_TOKENS)
    tab(page, "LoRA lab")
    page.fill("#lab-prompts textarea", "\n".join(PROMPTS))
    # A variant naming an adapter that is not in the loras folder: a message, no grid.
    page.fill("#lab-variants textarea", "base\nnot-there=0.5")
    page.click("#lab-run")
    expect(page.locator("#lab-error")).to_contain_text("no LoRA named 'not-there'")
    page.click("#lab-refresh")
    choose(page, "lab-adapters", "attn")
    choose(page, "lab-adapters", "mlp")
    page.click("#lab-fill")
    expect(page.locator("#lab-variants textarea")).to_have_value("\n".join(VARIANTS))
    page.click("#lab-run")
    status = page.locator("#lab-status")
    expect(status).to_contain_text("Done: 2 prompt(s) × 4 variant(s) in one batch")
    for i in range(len(PROMPTS)):
        for j in range(len(VARIANTS)):
            cell = page.locator(f"#lab-cell-{i}-{j}")
            expect(cell).to_have_attribute("data-finish", re.compile("^(stop|length)$"))
            expect(page.locator(f"#lab-cell-{i}-{j} .lab-meta")).to_contain_text("tok/s")
    grid = _cells(page)
    # What is shown is the text (the highlighting adds no characters).
    shown = page.locator("#lab-cell-1-1 .lab-text").inner_text()
    assert shown.strip() == grid[1][1].strip()

    # Save, and read the settings the grid ran with.
    page.fill("#lab-save-name textarea, #lab-save-name input", "two-by-four")
    page.click("#lab-save")
    expect(status).to_contain_text("Saved grid two-by-four")
    saved = json.loads((dirs["user"] / "lora_grids" / "two-by-four.json").read_text())
    assert (dirs["user"] / "lora_grids" / "two-by-four.md").read_text().count("| base |") == 2
    settings = {**saved["settings"], "seed": saved["seed"]}
    assert settings.get("do_sample") is False or settings.get("temperature") == 0, settings
    assert [[c["text"] for c in row] for row in saved["cells"]] == grid

    alone, without, m = _alone(dirs, settings)
    try:
        assert grid == alone  # every cell: what its variant writes on its own
        assert [row[0] for row in grid] == without  # base column: no adapters at all
        for row in grid:  # the adapters change the text (else this tests nothing)
            assert len(set(row)) > 1, row
        # The changed words are marked in the adapters' cells.
        differs = [(i, j) for i in range(2) for j in range(1, 4) if grid[i][j] != grid[i][0]]
        i, j = differs[0]
        assert page.locator(f"#lab-cell-{i}-{j} mark.lab-diff").count() > 0

        # Perplexity per variant on a file, the same windows for all.
        page.get_by_text("Perplexity per variant").click()
        page.set_input_files("#lab-ppl-file input[type=file]", str(dirs["root"] / "ppl.txt"))
        set_value(page, "lab-ppl-window", PPL_WINDOW)
        set_value(page, "lab-ppl-windows", PPL_WINDOWS)
        page.click("#lab-ppl-run")
        expect(status).to_contain_text("Perplexity on ppl.txt: 2 window(s) of 24 tokens")
        windows = text_windows(m, PPL_TEXT, window=PPL_WINDOW, windows=PPL_WINDOWS)
        bos = bos_id(m, True)
        for j, sel in enumerate([{}, {"attn": 1.0}, {"mlp": 1.0}, {"attn": 0.5, "mlp": 0.5}]):
            total = window_nll(m, windows[0], bos=bos, loras=sel)
            total.add(window_nll(m, windows[1], bos=bos, loras=sel))
            head = page.locator(f"#lab-head-{j}")
            expect(head).to_contain_text(f"ppl {total.perplexity:.3f}")
    finally:
        m.unload()

    # The saved grid reopens in a fresh page, perplexities and all.
    page.fill("#lab-save-name textarea, #lab-save-name input", "two-by-four-ppl")
    page.click("#lab-save")
    expect(status).to_contain_text("Saved grid two-by-four-ppl")
    fresh = _open_lab(context, server)
    fresh.click("#lab-saved input")
    fresh.locator('[role=option][aria-label="two-by-four"]').click()  # not two-by-four-ppl
    fresh.click("#lab-open")
    expect(fresh.locator("#lab-status")).to_contain_text("Opened grid two-by-four")
    expect(fresh.locator("#lab-cell-1-3")).to_have_attribute("data-text", grid[1][3])
    assert _cells(fresh) == grid
    expect(fresh.locator("#lab-variants textarea")).to_have_value("\n".join(VARIANTS))
