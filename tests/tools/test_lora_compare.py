"""LoRA grids on the CPU: tools/lora_compare.py and loader/lora_grid.py (what the web UI's
LoRA lab runs), on a tiny random Llama with two peft adapters of different ranks and target
modules.

A grid's cells must equal what each variant writes alone, its per-variant perplexities
must equal peft's (the reference implementation of LoRA) over the same windows, the files
it writes must read back, and the benchmark mode the lead runs on a GPU must work on a tiny
shape here.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model

import loader
from engine.lora import LoraError
from helpers.model_factory import CORPUS, make_tiny_llama
from loader.lora_grid import (
    Cell,
    GridError,
    LoraGrid,
    parse_variant,
    parse_variants,
    run_grid,
)
from tools.lora_compare import main

TEXT = " ".join(CORPUS)
PROMPTS = ["Once upon a time", "The quick brown fox"]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ban_eos_token": True, "seed": 3}
SELECTIONS = {
    "base": {},
    "A": {"A": 1.0},
    "B": {"B": 1.0},
    "A=0.5 + B=0.5": {"A": 0.5, "B": 0.5},
}


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _adapter(base: Path, path: Path, seed: int, **config) -> None:
    torch.manual_seed(seed)
    model = get_peft_model(_hf(base), LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A: rank 8 on attention, rslora; B: rank 4 on gate/down with alpha != r."""
    root = tmp_path_factory.mktemp("compare")
    make_tiny_llama(root / "tiny")
    _adapter(root / "tiny", root / "A", 1, r=8, lora_alpha=16, use_rslora=True,
             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    _adapter(root / "tiny", root / "B", 2, r=4, lora_alpha=3,
             target_modules=["gate_proj", "down_proj"])  # fmt: skip
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    return {"root": root, "model": root / "tiny", "A": root / "A", "B": root / "B"}


def _peft_perplexity(files: dict[str, Path], scales: dict[str, float], windows) -> float:
    """exp(mean NLL) over `windows` (BOS in front) from peft's PeftModel at `scales`."""
    model = _hf(files["model"])
    if scales:
        names = list(scales)
        model = PeftModel.from_pretrained(model, files[names[0]], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(files[name], adapter_name=name)
        model.base_model.set_adapter(names)
        for module in model.modules():
            if hasattr(module, "set_scale"):
                for name, scale in scales.items():
                    module.set_scale(name, scale)
        model.eval()
    nll, count = 0.0, 0
    for window in windows:
        ids = [0, *window]  # make_tiny_llama's BOS is id 0 (checked below)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        nll += float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return math.exp(nll / count)


def test_tool_grid_equals_each_variant_alone_and_peft_perplexity(files, tmp_path):
    out_json, out_md = tmp_path / "grid.json", tmp_path / "grid.md"
    result = main([
        "-m", str(files["model"]), "--loader", "kestrel", "--device", "cpu", "--dtype", "float32",
        "--lora", str(files["A"]), f"B={files['B']}",
        "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
        "--max-new-tokens", "8", "--ban-eos", "--seed", "3", "--sequential",
        "--ppl-text", str(files["root"] / "text.txt"), "--ppl-window", "24", "--ppl-windows", "3",
        "--json", str(out_json), "--markdown", str(out_md), "--quiet",
    ])  # fmt: skip
    grid = LoraGrid.from_json(result["grid"])
    # Without --variant: base, each adapter, an even mix.
    assert [v.label for v in grid.variants] == list(SELECTIONS)
    assert result["batch"]["jobs"] == 8
    assert result["cells_equal_to_sequential"] == "8/8"

    m = loader.load(files["model"], "kestrel", device="cpu", dtype="float32")
    m.load_lora(files["A"])
    m.load_lora(files["B"], name="B")
    alone = [
        [m.generate(m.encode(p), {**GREEDY, "loras": sel}) for sel in SELECTIONS.values()]
        for p in PROMPTS
    ]
    texts = [[c.text for c in row] for row in grid.cells]
    assert texts == alone
    assert all(len(set(row)) > 1 for row in texts), texts  # the adapters change the text
    assert all(c.tokens == 8 and c.finish_reason == "length" for row in grid.cells for c in row)

    # Perplexity per variant: the same windows for all, each equal to peft's.
    ppl = result["perplexity"]
    assert (ppl["window"], ppl["windows"], ppl["add_bos"]) == (24, 3, True)
    from loader.perplexity import text_windows

    assert m.backend.tokenizer.bos_token_id == 0
    windows = text_windows(m, TEXT, window=24, windows=3)
    for label, scales in SELECTIONS.items():
        want = _peft_perplexity(files, scales, windows)
        assert ppl["values"][label] == pytest.approx(want, rel=1e-4), label
    assert len(set(ppl["values"].values())) == 4  # each variant scores differently

    # The files read back: the JSON is the grid, the Markdown holds every cell.
    saved = json.loads(out_json.read_text())
    assert LoraGrid.from_json(saved["grid"]).to_json() == grid.to_json()
    markdown = out_md.read_text()
    assert markdown.count("| A=0.5 + B=0.5 |") == 2
    assert "perplexity: " in markdown and f"{ppl['values']['B']:.4f}" in markdown
    m.unload()


def test_grid_uses_its_own_selection_not_the_models_default(files):
    """A base variant runs without adapters even when set_loras applied one, and a random
    seed (-1) becomes one seed shared by every cell (sampling: equal cells prove it)."""
    m = loader.load(files["model"], "kestrel", device="cpu", dtype="float32")
    m.load_lora(files["A"])
    plain = m.generate(m.encode(PROMPTS[0]), {**GREEDY, "loras": {}})
    m.set_loras({"A": 1.0})
    sampled = {"temperature": 1.0, "max_new_tokens": 8, "ban_eos_token": True, "seed": -1}
    grid = LoraGrid.new(m, [PROMPTS[0], PROMPTS[0]], parse_variants(["base"]), sampled)
    assert grid.seed != -1 and grid.settings["seed"] == grid.seed
    for _ in run_grid(m, grid):
        pass
    assert grid.cells[0][0].text == grid.cells[1][0].text  # one seed for both
    greedy = LoraGrid.new(m, [PROMPTS[0]], parse_variants(["base"]), GREEDY)
    for _ in run_grid(m, greedy):
        pass
    assert greedy.cells[0][0].text == plain
    m.unload()


def test_transformers_loader_refuses_per_variant_adapters_clearly(files):
    m = loader.load(files["model"], "transformers", device="cpu", dtype="float32")
    m.load_lora(files["A"])
    grid = LoraGrid.new(m, [PROMPTS[0]], parse_variants(["base", "A"]), GREEDY)
    with pytest.raises(LoraError, match="per-request LoRA needs the kestrel loader"):
        for _ in run_grid(m, grid):
            pass
    with pytest.raises(LoraError, match="per-request LoRA needs the kestrel loader"):
        m.logits([1, 2, 3], loras={"A": 1.0})
    m.unload()


def test_variant_specs_and_bad_grid_files():
    assert parse_variant(" base ").loras == {}
    assert parse_variant("pirate").loras == {"pirate": 1.0}
    mix = parse_variant("a=0.5 + b = -1.5")
    assert mix.loras == {"a": 0.5, "b": -1.5} and mix.label == "a=0.5 + b=-1.5"
    for bad, why in [
        ("a=x", "not a number"),
        ("a=inf", "finite"),
        ("a + a=2", "twice"),
        ("=1", "not NAME"),
        ("", "empty variant"),
    ]:
        with pytest.raises(GridError, match=why):
            parse_variant(bad)
    with pytest.raises(GridError, match="given twice"):
        parse_variants(["a", "a=1"])
    with pytest.raises(GridError, match="not a Kestrel LoRA grid"):
        LoraGrid.from_json({"prompts": []}, source="x.json")
    with pytest.raises(GridError, match="x.json: 'cells' must hold 1 rows of 1 cells"):
        LoraGrid.from_json(
            {"format": "kestrel-lora-grid", "prompts": ["p"], "variants": [{"loras": {}}],
             "cells": []},
            source="x.json",
        )  # fmt: skip


@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_benchmark_mode_on_a_tiny_shape(tmp_path, fmt):
    """The GPU command's path (random-weight quantized model of a shape, random adapters of
    different ranks and targets, random prompts, batch against one variant after another):
    each cell of the batch equals its variant run on its own, on GPTQ and EXL2 bases."""
    result = main([
        "--shape", "tiny", "--format", fmt, "--device", "cpu", "--dtype", "float32",
        "--work", str(tmp_path), "--random-loras", "3", "--random-prompts", "2",
        "--prompt-tokens", "16", "--max-new-tokens", "6", "--sequential", "--quiet",
    ])  # fmt: skip
    labels = [v["label"] for v in result["grid"]["variants"]]
    assert labels == ["base", "r8-all-0", "r16-attn-1", "r32-mlp-2", labels[-1]]
    assert labels[-1].startswith("r8-all-0=0.3333 + ")
    assert result["batch"]["jobs"] == 10 and result["batch"]["tokens"] == 60
    assert result["sequential"]["tokens"] == 60
    assert result["cells_equal_to_sequential"] == "10/10"
    assert result["speedup"] > 0
    configs = [json.loads((tmp_path / f"tiny-lora-{n}" / "adapter_config.json").read_text())
               for n in labels[1:4]]  # fmt: skip
    assert [(c["r"], len(c["target_modules"])) for c in configs] == [(8, 7), (16, 4), (32, 3)]


def test_the_lab_marks_only_what_differs_from_the_base():
    from webui.lora_lab_view import diff_html

    same = "The sea is calm."
    assert diff_html(same, same) == "The sea is calm."
    changed = diff_html("The sea is calm and blue.", "The sea is wild, dark and blue.")
    assert changed == 'The sea is <mark class="lab-diff">wild, dark</mark> and blue.'
    dropped = diff_html("a b c", "a c")  # a bar where "b" was; the text shown stays "a c"
    assert re.sub(r"<[^>]+>", "", dropped) == "a c"
    assert re.search(r'<span class="lab-del" title="removed: \s?b\s?"></span>', dropped)
    assert diff_html("", "<b>") == '<mark class="lab-diff">&lt;b&gt;</mark>'


def test_a_grid_through_the_openai_client(files):
    """The README's recipe: concurrent requests, one per cell, each naming its `loras`
    ({} for the base), give what each variant writes alone."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from extensions.openai import run_api_server
    from loader.manager import ModelManager
    from serving import shared

    manager = ModelManager(files["root"], files["root"])
    model = manager.load("tiny", "kestrel", device="cpu", dtype="float32")
    model.load_lora(files["A"])
    model.load_lora(files["B"])
    model.set_loras({"A": 1.0})  # the default of requests that name none: not the base
    previous, shared.manager = shared.manager, manager
    server = run_api_server("127.0.0.1", 0, manager=manager)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def cell(prompt: str, loras: dict[str, float]) -> str:
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8,
                temperature=0, seed=3, extra_body={"loras": loras, "ban_eos_token": True},
            )  # fmt: skip
            return reply.choices[0].message.content

        with ThreadPoolExecutor(len(PROMPTS) * len(SELECTIONS)) as pool:
            futures = {
                (p, label): pool.submit(cell, p, loras)
                for p in PROMPTS
                for label, loras in SELECTIONS.items()
            }
        got = {key: f.result() for key, f in futures.items()}
        for (prompt, label), text in got.items():
            messages = [{"role": "user", "content": prompt}]
            ids = model.encode(model.apply_chat_template(messages, add_generation_prompt=True),
                               add_bos=False)  # fmt: skip
            want = model.generate(ids, {**GREEDY, "loras": SELECTIONS[label]})
            assert text == want, (prompt, label)
        assert len({got[(PROMPTS[0], label)] for label in SELECTIONS}) > 1
        with pytest.raises(openai.BadRequestError, match="no LoRA adapter named 'missing'"):
            cell(PROMPTS[0], {"missing": 1.0})
    finally:
        server.stop()
        shared.manager = previous
        manager.unload()


def test_saved_grids_round_trip_and_bad_names_or_files(tmp_path):
    from serving.storage import StorageError
    from webui.lora_grids import GridStore

    grid = LoraGrid(model="m", prompts=["p | q"], variants=parse_variants(["base", "a=0.5"]),
                    settings={"temperature": 0.0}, seed=7)  # fmt: skip
    grid.cells = [[Cell(text="x", tokens=2, finish_reason="stop"),
                   Cell(text="y\nz", tokens=3, finish_reason="length")]]  # fmt: skip
    store = GridStore(tmp_path)
    json_path, md_path = store.save(grid, "first try")
    assert store.names() == ["first try"]
    again = store.open("first try")
    assert again.to_json() == grid.to_json() and again.name == "first try"
    assert "| a=0.5 | 3 |" in md_path.read_text() and "y<br>z" in md_path.read_text()
    for bad in ("../escape", ".hidden", "a/b"):
        with pytest.raises(StorageError, match="invalid grid name"):
            store.save(grid, bad)
    json_path.write_text('{"format": "kestrel-lora-grid", "prompts": "p"}')
    with pytest.raises(StorageError, match=r"first try\.json: 'prompts' must be a list"):
        store.open("first try")
    with pytest.raises(StorageError, match="does not exist"):
        store.open("never saved")
