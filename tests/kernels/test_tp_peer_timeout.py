"""The decode all-reduce kernels give up on a peer that never comes (issue 33).

Each rank's kernel spins until its peers' partials (push) or flags (flags) arrive. A peer
whose process died, or that took another path, never sends them, and the GPU would spin
until the process is killed: no error, no exit. On GPUs the engine's build bounds the wait
(kernels/tp_all_reduce.py PEER_TIMEOUT_S, read from %globaltimer) and then stops the GPU
with a message. The suite's kernels run interpreted, which has no timer: here both kernels
are compiled for sm_90 in a child process (no GPU needed) and their code must read the
timer and trap, and must not where TIMEOUT_NS is 0; with a GPU, a wait on a flag that
never comes ends in a child process that fails with the message, and one that comes
returns as it did without the bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

_COMPILE = """
import importlib, inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, timeout_ns = sys.argv[1], sys.argv[2], int(sys.argv[3])
kernel = getattr(importlib.import_module(module), name)
types = {"recv_bases_ptr": "*i64", "data_bases_ptr": "*i64", "flag_bases_ptr": "*i64",
         "slot_ptr": "*i32", "epoch_ptr": "*i32", "partial_ptr": "*fp32", "eps": "fp32"}
consts = {"WORLD": 2, "MAX_ROWS": 16, "SLOTS": 3, "ADD_NORM": True, "UNIT_OFFSET": False,
          "BLOCK_D": 4096, "EMULATE_BF16": False, "USE_PDL": True, "MAX_SPINS": 0,
          "TIMEOUT_NS": timeout_ns, "DATA_KIND": 0}
params = inspect.signature(kernel.fn).parameters
consts = {n: v for n, v in consts.items() if n in params}
default = {True: "*fp16", False: "i32"}
signature = {n: "constexpr" if n in consts else types.get(n, default[n.endswith("_ptr")])
             for n in params}
ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
print(json.dumps({"timer": ptx.count("%globaltimer"), "trap": ptx.count("trap;"),
                  "printf": ptx.count("vprintf")}))
"""

KERNELS = [
    ("kernels.tp_push_all_reduce", "_tp_push_all_reduce_kernel"),
    ("kernels.tp_all_reduce", "_tp_all_reduce_kernel"),
]


def _child(code: str, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """`code` run as a script in a fresh process on the GPU build (not interpreted). A file,
    not `python -c`: Triton reads a @jit function's source from its file."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "child.py"
        script.write_text(code)
        return subprocess.run(
            [sys.executable, str(script), *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )


def test_the_bound_is_two_minutes_or_what_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kernels.tp_all_reduce import PEER_TIMEOUT_S, peer_timeout_ns

    monkeypatch.delenv("KESTREL_TP_PEER_TIMEOUT_S", raising=False)
    assert peer_timeout_ns(False) == int(PEER_TIMEOUT_S * 1e9) == 120 * 10**9
    assert peer_timeout_ns(True) == 0  # the interpreter has no timer
    monkeypatch.setenv("KESTREL_TP_PEER_TIMEOUT_S", "2.5")
    assert peer_timeout_ns(False) == 2_500_000_000
    monkeypatch.setenv("KESTREL_TP_PEER_TIMEOUT_S", "0")  # a rank held in a debugger
    assert peer_timeout_ns(False) == 0
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("KESTREL_TP_PEER_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=f"KESTREL_TP_PEER_TIMEOUT_S='{bad}'"):
            peer_timeout_ns(False)


@pytest.mark.parametrize(("module", "name"), KERNELS)
def test_the_gpu_build_bounds_every_wait_on_a_peer(
    module: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernels.tp_all_reduce import peer_timeout_ns

    monkeypatch.delenv("KESTREL_TP_PEER_TIMEOUT_S", raising=False)
    counts = {}
    for timeout_ns in (peer_timeout_ns(False), 0):
        done = _child(_COMPILE, module, name, str(timeout_ns))
        if done.returncode != 0:
            pytest.fail(f"sm_90 compile of {name} failed:\n{done.stderr[-2000:]}")
        counts[timeout_ns] = json.loads(done.stdout.strip().splitlines()[-1])
    bounded, unbounded = counts[peer_timeout_ns(False)], counts[0]
    assert bounded["timer"] > 0 and bounded["trap"] > 0 and bounded["printf"] > 0, bounded
    assert unbounded == {"timer": 0, "trap": 0, "printf": 0}, unbounded


_WAIT = """
import sys, time, torch, triton, triton.language as tl
from kernels.tp_all_reduce import global_ns, wait_flag

@triton.jit
def wait_kernel(flag_ptr, expected, out_ptr, TIMEOUT_NS: tl.constexpr):
    tl.store(out_ptr, wait_flag(flag_ptr, expected, 0, TIMEOUT_NS).to(tl.int32))

@triton.jit
def late_flag_kernel(flag_ptr, value, DELAY_NS: tl.constexpr):
    start = global_ns()
    while global_ns() - start < DELAY_NS:
        pass
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")

flag = torch.tensor([int(sys.argv[1])], dtype=torch.int32, device="cuda")
out = torch.zeros(1, dtype=torch.int32, device="cuda")
late = torch.cuda.Stream()
# Loaded before the wait starts: loading a module waits for the kernels running on the GPU.
late_flag_kernel[(1,)](torch.zeros_like(flag), 4, DELAY_NS=200_000_000)
torch.cuda.synchronize()
began = time.monotonic()
wait_kernel[(1,)](flag, 4, out, TIMEOUT_NS=int(float(sys.argv[2]) * 1e9))
if sys.argv[3] == "late":  # the flag comes 0.2 s later, from another stream
    with torch.cuda.stream(late):
        late_flag_kernel[(1,)](flag, 4, DELAY_NS=200_000_000)
torch.cuda.synchronize()
print("returned", int(out[0]), "after %.3f s" % (time.monotonic() - began))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_peer_that_never_comes_stops_the_gpu_with_a_message() -> None:
    """A flag already there, and one that comes 0.2 s into a 2 s bound, return; one that
    never comes (the previous call's epoch) ends the child process with the message once
    the 0.3 s bound has passed."""
    from kernels.tp_all_reduce import PEER_LATE_MESSAGE

    arrived = _child(_WAIT, "4", "2", "now", timeout=120)
    assert arrived.returncode == 0, arrived.stderr[-2000:]
    assert "returned 1" in arrived.stdout
    late = _child(_WAIT, "3", "2", "late", timeout=120)
    assert late.returncode == 0, late.stderr[-2000:]
    seconds = float(late.stdout.split("after ")[-1].split()[0])
    assert "returned 1" in late.stdout and seconds >= 0.2, late.stdout
    never = _child(_WAIT, "3", "0.3", "never", timeout=120)
    assert never.returncode != 0
    assert PEER_LATE_MESSAGE in never.stdout + never.stderr
    assert (never.stdout + never.stderr).count(PEER_LATE_MESSAGE) == 1  # one program
