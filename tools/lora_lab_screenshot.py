"""A screenshot of the web UI's LoRA lab for the docs, taken with headless Chromium.

    .venv/bin/python tools/lora_lab_screenshot.py [--model models/SmolLM2-135M-Instruct-fp16]

Makes two demo PEFT adapters with peft for the model (random A and B, rank 8 on the
attention projections and rank 4 on the MLP: not trained, they only perturb the model),
starts `ui.py` on a free loopback port with them in a scratch loras folder, runs a
2-prompt × 4-variant grid (greedy, the Deterministic preset), measures each variant's
perplexity on this checkout's README.md and saves lora-lab.png (the grid, desktop width)
under --out. Needs Chromium at /usr/bin/chromium and playwright.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-sync"]  # fmt: skip
PROMPTS = ["Write a short poem about the sea.", "Give me one tip for learning to cook."]
DEMO_ADAPTERS = {
    "demo-attn": {"r": 8, "lora_alpha": 16,
                  "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "demo-mlp": {"r": 4, "lora_alpha": 3, "target_modules": ["gate_proj", "down_proj"]},
}  # fmt: skip


def make_demo_adapters(model: Path, loras: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for seed, (name, config) in enumerate(DEMO_ADAPTERS.items(), start=1):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, trust_remote_code=False
        )
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
        with torch.no_grad():
            for key, p in peft_model.named_parameters():
                if "lora_B" in key:
                    p.normal_(0, 0.2)
        peft_model.save_pretrained(loras / name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct-fp16")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    from playwright.sync_api import expect, sync_playwright

    model = args.model.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    with tempfile.TemporaryDirectory() as scratch:
        loras, user_data = Path(scratch) / "loras", Path(scratch) / "user_data"
        make_demo_adapters(model, loras)
        command = [
            sys.executable, "ui.py", "--port", str(port), "--models-dir", str(model.parent),
            "--model", model.name, "--loras-dir", str(loras), "--user-data-dir", str(user_data),
        ]  # fmt: skip
        server = subprocess.Popen(command, cwd=ROOT)
        try:
            deadline = time.monotonic() + 600
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("ui.py did not start") from None
                    time.sleep(1)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(300_000)
                expect.set_options(timeout=300_000)
                page.goto(f"http://127.0.0.1:{port}")
                page.wait_for_selector("#chat-input textarea:not([disabled])")
                page.get_by_role("tab", name="Parameters").click()
                page.click("#preset input")
                page.locator('[role=option][aria-label="Deterministic"]').click()
                expect(page.locator("#params-status")).to_contain_text("Deterministic")
                box = page.locator("#param-max_new_tokens input[type=number]")
                box.fill(str(args.max_new_tokens))
                box.press("Enter")
                page.get_by_role("tab", name="LoRA lab").click()
                page.fill("#lab-prompts textarea", "\n".join(PROMPTS))
                for name in DEMO_ADAPTERS:
                    page.click("#lab-adapters input")
                    page.locator(f'[role=option][aria-label^="{name}"]').first.click()
                page.click("#lab-fill")
                page.click("#lab-run")
                expect(page.locator("#lab-status")).to_contain_text("Done:")
                # Each variant's perplexity on a text file (this checkout's README).
                page.get_by_text("Perplexity per variant").click()
                page.set_input_files("#lab-ppl-file input[type=file]", str(ROOT / "README.md"))
                page.click("#lab-ppl-run")
                expect(page.locator("#lab-status")).to_contain_text("Perplexity on README.md")
                page.mouse.move(0, 0)  # no hover highlight in the picture
                page.screenshot(path=args.out / "lora-lab.png", full_page=True)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {args.out / 'lora-lab.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
