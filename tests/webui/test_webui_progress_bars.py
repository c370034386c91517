"""A progress bar open while the page is built (the default model's conversion runs in a
thread while ui.py builds the page) survives Gradio's tqdm patch: the Model tab's download
panel asks Gradio to track bars, which patches tqdm's class; a bar opened before that and
updated after raised AttributeError, and the first start's conversion died at random."""

from __future__ import annotations

import subprocess
import sys

from helpers.checkout import ROOT

# A fresh process each time: tqdm's class is patched once per process.
SCRIPT = """
import io
from tqdm import tqdm
import gradio as gr
{install}
bar = tqdm(total=3, file=io.StringIO())  # the conversion's bar, opened first
gr.Progress(track_tqdm=True)  # what building the download panel does
bar.update(1)
bar.close()
print("updated")
"""


def _run(install: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(install=install)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bars_survive_the_page_build_once_tracking_is_installed() -> None:
    done = _run("from webui.startup import track_progress_bars; track_progress_bars()")
    assert done.returncode == 0 and done.stdout.strip() == "updated", done.stderr[-2000:]


def test_without_it_gradio_breaks_a_bar_opened_before_its_patch() -> None:
    """Why start_preparing installs the tracking first (if Gradio stops patching the class
    this way, this test says so and the workaround can go)."""
    done = _run("")
    assert done.returncode != 0 and "_progress" in done.stderr, done.stdout + done.stderr[-2000:]
