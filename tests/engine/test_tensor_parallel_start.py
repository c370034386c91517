"""How early a tensor-parallel load starts its other ranks, and what a rank imports (issue 33:
a 70B TP=2 load on 2x H100 spent 4-5 s waiting for rank 1's start-up and imports).

On the CPU (gloo): the ranks start before rank 0 reads the config or the weights, and, for
`loader.load(..., tp=N)` in a fresh process, before that process imports torch; a launch
that fails after starting them leaves none running; a spawned rank imports none of the
front ends' or the converter's heavy modules. No timings are asserted: the order of events
and the modules loaded are.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loader
from engine.tensor_parallel import spawned
from helpers.mixed_model import build_mixed_model
from loader import early_ranks

ROOT = Path(__file__).resolve().parents[2]

# Modules a rank never needs: the tokenizer (rank 0's), the front ends, the converter and
# the optional format libraries. Each costs a rank's start-up time if pulled in.
HEAVY = (
    "transformers",
    "tokenizers",
    "jinja2",
    "gradio",
    "fastapi",
    "uvicorn",
    "starlette",
    "llguidance",
    "gguf",
    "sympy",  # torch's symmetric memory: imported in a thread beside the reads (rank.py)
    "engine.tokenizer",
    "engine.engine",
    "engine.scheduler",
    "engine.quantizer",
    "loader",
    "serving",
    "webui",
    "extensions",
    "tools",
)


def _run_python(code: str, timeout: float = 600) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mixed_model(tmp_path_factory.mktemp("tp_start"))


def test_a_spawned_rank_imports_none_of_the_heavy_modules():
    # What spawned.rank_main imports before it takes its spec, in a clean interpreter.
    out = _run_python(
        "import json, sys\n"
        "import engine.tensor_parallel.spawned\n"
        "from engine.tensor_parallel.load_phases import LoadPhases\n"
        "from engine.tensor_parallel.rank import worker_main\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    modules = set(json.loads(out))
    assert "torch" in modules and "engine.tensor_parallel.cut_load" in modules  # it did run
    pulled = sorted(m for m in modules for h in HEAVY if m == h or m.startswith(h + "."))
    assert not pulled, f"a tensor-parallel rank imports {pulled}"


def test_starting_ranks_early_imports_no_torch():
    out = _run_python(
        "import json, sys\n"
        "import loader\n"
        "from loader import early_ranks\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    modules = set(json.loads(out))
    assert not {"torch", "triton", "numpy", "engine.tensor_parallel.rank"} & modules


def test_loader_load_with_tp_starts_the_ranks_before_it_imports_torch(mixed_model: Path):
    # A fresh script's first call: the ranks must exist by the time this process begins to
    # import torch, and the launch must then take exactly those.
    code = f"""
import json, sys
from engine.tensor_parallel import spawned

seen = {{}}

class FirstTorchImport:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "pids" not in seen:
            ranks = spawned._prestarted
            seen["pids"] = [p.pid for p in ranks.processes] if ranks is not None else []
        return None

sys.meta_path.insert(0, FirstTorchImport())
import loader

model = loader.load({str(mixed_model)!r}, "kestrel", device="cpu", dtype="float32", tp=2)
try:
    ranks = model.engine.runner.ranks
    seen["workers"] = [w.pid for w in ranks.workers]
    seen["first"] = ranks.load_phases[0]["spans"][0][0]
    seen["text"] = model.generate([5, 17, 33], {{"max_new_tokens": 4, "temperature": 0}})
finally:
    model.unload()
seen["left"] = spawned._prestarted is not None
print(json.dumps(seen))
"""
    seen = json.loads(_run_python(code))
    assert seen["pids"], "torch was imported before the ranks were started"
    assert seen["workers"] == seen["pids"]
    assert seen["first"] == "spawn ranks"
    assert seen["text"]
    assert seen["left"] is False


def test_a_launch_spawns_its_ranks_before_it_reads_the_config_or_the_tokenizer(
    mixed_model: Path,
):
    tp = loader.load(mixed_model, "kestrel", device="cpu", dtype="float32", tp=2)
    try:
        spans = tp.engine.runner.ranks.load_phases[0]["spans"]
        names = [name for name, _, _ in spans]
        assert names[:3] == ["spawn ranks", "shard spec", "staging plan"]
        # Rank 0 reads first; its tokenizer, which the ranks do not need, waits for that.
        order = [names.index(n) for n in ("read and cut shard", "tokenizer", "wait for ranks")]
        assert order == sorted(order)
    finally:
        tp.unload()


def test_a_launch_that_fails_after_spawning_stops_its_ranks(mixed_model: Path, tmp_path: Path):
    # 3 ranks cannot share the tiny model's heads: the shard spec refuses it after the ranks
    # were started, and they must not be left waiting for a spec.
    broken = tmp_path / "m"
    shutil.copytree(mixed_model, broken)
    with pytest.raises(loader.LoaderError, match="heads do not divide among 3 ranks"):
        loader.load(broken, "kestrel", device="cpu", dtype="float32", tp=3)
    assert multiprocessing.active_children() == []
    assert not spawned.has_prestarted()


def test_a_command_line_starts_ranks_only_for_a_tp_load_it_makes():
    cases = [
        ([], None),
        (["--tp", "1"], None),
        (["--tp"], None),  # every GPU: counted later, with torch
        (["--tp", "2", "--loader", "transformers"], None),
        (["--tp", "x"], None),  # malformed: the full parser says so
        (["--tp", "2"], "--model"),  # the API server without --model loads nothing
    ]
    for argv, flag in cases:
        assert early_ranks.prestart_from_argv(argv, model_flag=flag) is False, argv
        assert not spawned.has_prestarted()
    try:
        assert early_ranks.prestart_from_argv(["m", "--tp", "2"]) is True
        ranks = spawned._prestarted
        assert ranks is not None and len(ranks.processes) == 1
        # Already started (by the caller): left for the launch, not started twice.
        assert (
            early_ranks.prestart_from_argv(["--model", "m", "--tp", "2"], model_flag="--model")
            is False
        )
        assert spawned._prestarted is ranks
    finally:
        early_ranks.discard()
    assert not spawned.has_prestarted()
    assert all(not p.is_alive() for p in ranks.processes)


def test_a_broken_tokenizer_read_after_the_shard_stops_the_ranks(mixed_model: Path, tmp_path: Path):
    # Rank 0 loads the tokenizer while it waits for the other ranks: its error must still
    # end the launch cleanly (no rank left running, no process group left behind).
    broken = tmp_path / "m"
    shutil.copytree(mixed_model, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot load"):
        loader.load(broken, "kestrel", device="cpu", dtype="float32", tp=2)
    assert multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized()
