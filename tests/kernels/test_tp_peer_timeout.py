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
          "TIMEOUT_NS": timeout_ns}
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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


@pytest.mark.parametrize(("module", "name"), KERNELS)
def test_the_gpu_build_bounds_every_wait_on_a_peer(module: str, name: str) -> None:
    from kernels.tp_all_reduce import PEER_TIMEOUT_S, peer_timeout_ns

    assert peer_timeout_ns(False) == PEER_TIMEOUT_S * 10**9
    assert peer_timeout_ns(True) == 0  # the interpreter has no timer
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
import sys, torch, triton, triton.language as tl
from kernels.tp_all_reduce import wait_flag

@triton.jit
def wait_kernel(flag_ptr, expected, out_ptr, TIMEOUT_NS: tl.constexpr):
    tl.store(out_ptr, wait_flag(flag_ptr, expected, 0, TIMEOUT_NS).to(tl.int32))

flag = torch.tensor([int(sys.argv[1])], dtype=torch.int32, device="cuda")
out = torch.zeros(1, dtype=torch.int32, device="cuda")
wait_kernel[(1,)](flag, 4, out, TIMEOUT_NS=50_000_000)  # 50 ms
torch.cuda.synchronize()
print("returned", int(out[0]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_peer_that_never_comes_stops_the_gpu_with_a_message() -> None:
    from kernels.tp_all_reduce import PEER_LATE_MESSAGE

    arrived = _child(_WAIT, "4", timeout=120)
    assert arrived.returncode == 0, arrived.stderr[-2000:]
    assert arrived.stdout.strip().endswith("returned 1")
    never = _child(_WAIT, "3", timeout=120)  # the previous call's epoch: no peer comes
    assert never.returncode != 0
    assert PEER_LATE_MESSAGE in never.stdout + never.stderr
