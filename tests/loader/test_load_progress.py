"""Real load progress (issue 24, item 8): the engine reports how far a load is, weight by
weight, through `loader.load(progress=...)` and the model manager the Model tab uses."""

from __future__ import annotations

from pathlib import Path

import pytest

import loader
from helpers.model_factory import make_tiny_llama
from loader.manager import ModelManager
from tools.bench import build_model


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("progress") / "tiny-gptq", "tiny", "gptq", "cpu")


def _heard(path: Path, loader_name: str | None) -> list[tuple[float, str]]:
    heard: list[tuple[float, str]] = []
    model = loader.load(path, loader_name, device="cpu", progress=lambda f, w: heard.append((f, w)))
    model.unload()
    return heard


def test_a_quantized_load_reports_every_linear_then_every_weight(quantized: Path) -> None:
    heard = _heard(quantized, None)
    fractions = [f for f, _ in heard]
    assert fractions[0] == 0.0 and fractions[-1] == 1.0
    assert fractions == sorted(fractions), "progress never goes back"
    linears = [w for _, w in heard if w.startswith("quantized linears")]
    # The tiny bench model: 2 layers x 7 linears (q, k, v, o, gate, up, down) quantized.
    assert linears[-1] == f"quantized linears {len(linears)}/{len(linears)}"
    assert len(linears) >= 14
    assert any(w.startswith("weights ") for _, w in heard)
    # Fine-grained: no jump of more than a quarter of the bar between two reports.
    assert max(b - a for a, b in zip(fractions, fractions[1:], strict=False)) <= 0.25


def test_loaders_that_do_not_report_still_load(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "tiny")
    assert _heard(tmp_path / "tiny", "transformers") == []


def test_the_manager_passes_it_on(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "tiny")
    manager = ModelManager(tmp_path)
    stages: list[str] = []
    fractions: list[float] = []
    manager.load("tiny", None, progress=stages.append,
                 weights_progress=lambda f, w: fractions.append(f), device="cpu")  # fmt: skip
    manager.unload()
    assert stages == ["loading tiny"]
    assert fractions[0] == 0.0 and fractions[-1] == 1.0 and len(fractions) > 5


def test_a_load_imports_no_compiler_stack(quantized: Path) -> None:
    """The model is built on the meta device and then filled from the checkpoint: building
    it must not run torch's random init there, which imports torch._dynamo, sympy and FSDP
    (~4 s of a process's first load on an H100 machine: issue 27's load regression). A
    fresh process, since the suite itself may have imported them."""
    import subprocess
    import sys

    script = (
        "import sys, loader\n"
        f"loader.load({str(quantized)!r}, None, device='cpu').unload()\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy', 'torch.distributed.fsdp') "
        "if m in sys.modules))\n"
    )
    from helpers.checkout import ROOT

    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
