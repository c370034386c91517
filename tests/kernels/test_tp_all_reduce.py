"""kernels/tp_all_reduce.py on the CPU (Triton interpreter), the ranks simulated in one
process: each rank's buffer is a CPU tensor, and the kernel addresses the other rank's
buffer through its raw address as it would a peer GPU's over NVLink.

A rank's kernel waits for its peers' flags, so the tests run the ranks one after the
other: the first rank's peer flags are written by the test (the peer "has published"),
later ranks find the flags the earlier ranks' kernels published.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from helpers.rank_partials import order_sensitive_partials, rank_order_sum
from helpers.sm90_compile import compiled_facts
from kernels.rms_norm import add_rms_norm
from kernels.tp_all_reduce import (
    SiteBuffers,
    site_all_reduce,
    site_all_reduce_add_rms_norm,
    wait_flag,
)

# CPU buffers stand for the ranks' GPU memory: only the interpreter runs kernels on them
# (the kernel on 2 GPUs: tools/check_tp_all_reduce.py).
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"
)

SITES, SITE_FLOATS, MAX_ROWS = 3, 4 * 96, 4


def _ranks(
    world: int, data_dtype: torch.dtype = torch.float32
) -> tuple[list[SiteBuffers], list[torch.Tensor]]:
    """Every rank's SiteBuffers over CPU buffers, and every rank's flags [sites, world, rows].
    `data_dtype`: the partials' (float32 for decode sites; the prompt slices' half types)."""
    data_floats = SITES * SITE_FLOATS * data_dtype.itemsize // 4  # float32 words
    flag_ints = SITES * world * MAX_ROWS
    buffers = [torch.zeros(data_floats + flag_ints) for _ in range(world)]
    data_bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    flag_bases = data_bases + data_floats * 4
    ranks = [
        SiteBuffers(
            data=b[:data_floats].view(data_dtype),
            data_bases=data_bases,
            flag_bases=flag_bases,
            epochs=torch.zeros(SITES, MAX_ROWS, dtype=torch.int32),
            rank=r,
            world=world,
            sites=SITES,
            site_elements=SITE_FLOATS,
            max_rows=MAX_ROWS,
        )
        for r, b in enumerate(buffers)
    ]
    flags = [b[data_floats:].view(torch.int32).view(SITES, world, MAX_ROWS) for b in buffers]
    return ranks, flags


# Bounds every wait of these tests: a flag that never came fails a check, never hangs.
SPINS = 64


def _publish_later_ranks(flags: list[torch.Tensor], site: int, rows: int, epoch: int) -> None:
    """The ranks run one after the other here: what each rank's later peers (not run yet)
    would have published into its flags by the time it waits."""
    world = len(flags)
    for r in range(world):
        for q in range(r + 1, world):
            flags[r][site, q, :rows] = epoch


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sum_in_rank_order_same_bits_on_every_rank(world: int, dtype: torch.dtype) -> None:
    ranks, flags = _ranks(world)
    rows, hidden, site = 3, 96, 1
    for call in (1, 2, 3):  # the epochs advance; the slices are reused each call
        parts = order_sensitive_partials(world, rows, hidden, call, dtype)
        for r, sites in enumerate(ranks):
            sites.site_slice(site, rows, hidden).copy_(parts[r])
        _publish_later_ranks(flags, site, rows, call)
        outs = [site_all_reduce(s, site, rows, hidden, dtype, max_spins=SPINS) for s in ranks]
        expected = rank_order_sum(parts).to(dtype)
        for out in outs:
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
        for r, sites in enumerate(ranks):
            assert sites.epochs[site, :rows].tolist() == [call] * rows
            assert int(sites.epochs[site, rows:].abs().sum()) == 0  # rows not called
            assert int(sites.epochs[0].abs().sum()) == 0  # other sites untouched
            # Every rank published this call to every rank, itself included.
            for q in range(world):
                assert flags[q][site, r, :rows].tolist() == [call] * rows
    if world == 3:
        # The order matters for these partials: the rank-order sum is a real constraint.
        swapped = (parts[2] + parts[1] + parts[0]).to(dtype)
        assert float(expected[0, 0]) == 1.0 and float(swapped[0, 0]) > 1.0
        assert not torch.equal(swapped, expected)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_partials_sum_in_float32_rank_order(world: int, dtype: torch.dtype) -> None:
    """The prompt slices hold the partials in the activation dtype: the kernel sums them in
    float32 in rank order and rounds once; for two ranks that is the half-precision add
    NCCL makes (one correctly rounded sum), the same bits on every rank."""
    ranks, flags = _ranks(world, dtype)
    rows, hidden = 3, 96
    for call, site in ((1, 0), (1, 1), (2, 0), (2, 1)):  # two slices taken in turn
        parts = [p.to(dtype) for p in order_sensitive_partials(world, rows, hidden, call, dtype)]
        for r, sites in enumerate(ranks):
            sites.site_slice(site, rows, hidden).copy_(parts[r])
        _publish_later_ranks(flags, site, rows, call)
        outs = [site_all_reduce(s, site, rows, hidden, dtype, max_spins=SPINS) for s in ranks]
        expected = rank_order_sum([p.float() for p in parts]).to(dtype)
        for out in outs:
            assert out.dtype == dtype
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
        if world == 2:
            assert torch.equal(expected.view(torch.int16), (parts[0] + parts[1]).view(torch.int16))
        for sites in ranks:
            assert sites.epochs[site, :rows].tolist() == [call] * rows
    assert int(ranks[0].epochs[2].abs().sum()) == 0  # the third site never called


_COMPILE = """
import inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.tp_all_reduce import _tp_all_reduce_kernel as kernel
consts = {"WORLD": 2, "MAX_ROWS": 2048, "ADD_NORM": sys.argv[2] == "1", "UNIT_OFFSET": False,
          "BLOCK_D": 4096, "EMULATE_BF16": False, "USE_PDL": True, "MAX_SPINS": 0,
          "TIMEOUT_NS": 0, "DATA_KIND": int(sys.argv[1])}
types = {"data_bases_ptr": "*i64", "flag_bases_ptr": "*i64", "epoch_ptr": "*i32", "eps": "fp32"}
params = inspect.signature(kernel.fn).parameters
half = "*bf16" if consts["DATA_KIND"] == 2 else "*fp16"  # the activations' dtype
signature = {n: "constexpr" if n in consts else
             types.get(n, half if n.endswith("_ptr") else "i32") for n in params}
ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
print(json.dumps({"b16_loads": len(re.findall(r"ld\\.global[.a-z]*\\.b16", ptx)),
                  "b32_loads": len(re.findall(r"ld\\.global[.a-z0-9]*\\.b32", ptx))}))
"""


@pytest.mark.parametrize("add_norm", [False, True])
@pytest.mark.parametrize("kind", [0, 1, 2])
def test_the_kernel_compiles_for_each_partial_dtype(kind: int, add_norm: bool) -> None:
    """The GPU build (sm_90, no GPU needed) for float32, float16 and bfloat16 partials
    (DATA_KIND), summed alone or with the residual add and norm (ADD_NORM: decode rows, and
    prompt rows in the half kinds): the interpreter accepts what the compiler may not (a
    pointer whose type depends on a branch). Each thread of 8 warps loads 16 of a 4096-wide
    row per rank: the half kinds as 16-bit words, float32 as 32-bit ones; the norm adds
    loads of the residual and the weight (16-bit)."""
    facts = compiled_facts(
        _COMPILE,
        str(kind),
        str(int(add_norm)),
        what=f"the flags kernel, DATA_KIND {kind}, ADD_NORM {add_norm}",
    )
    partial_b16 = 0 if kind == 0 else 32
    if kind == 0:
        assert facts["b32_loads"] >= 32, facts
    if add_norm:  # the residual's and the weight's 16 values a thread, beside the partials'
        assert facts["b16_loads"] >= partial_b16 + 32, facts
    else:
        assert facts["b16_loads"] == partial_b16, facts


@pytest.mark.parametrize("half_partials", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_fused_add_rms_norm_matches_the_separate_ops(
    dtype: torch.dtype, unit_offset: bool, half_partials: bool
) -> None:
    """Float32 partials (decode sites) or partials in the activations' dtype (the prompt
    slices, whose sums that feed a norm are deferred into it too)."""
    ranks, flags = _ranks(2, dtype if half_partials else torch.float32)
    rows, hidden, site, eps = 4, 80, 2, 1e-5
    g = torch.Generator().manual_seed(7)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    for call in (1, 2):
        parts = [torch.randn(rows, hidden, generator=g) * 3 for _ in ranks]
        if half_partials:
            parts = [p.to(dtype) for p in parts]
        residual = (torch.randn(rows, hidden, generator=g) * 4).to(dtype)
        for r, sites in enumerate(ranks):
            sites.site_slice(site, rows, hidden).copy_(parts[r])
        _publish_later_ranks(flags, site, rows, call)
        results = [
            site_all_reduce_add_rms_norm(
                s, site, residual, weight, eps, unit_offset=unit_offset, max_spins=SPINS
            )
            for s in ranks
        ]
        summed = (parts[0].float() + parts[1].float()).to(dtype)  # float32, in rank order
        normed_ref, residual_ref = add_rms_norm(
            summed, residual, weight, eps, unit_offset=unit_offset, backend="triton"
        )
        for normed, new_residual in results:
            assert torch.equal(new_residual.view(torch.int16), residual_ref.view(torch.int16))
            assert torch.equal(normed.view(torch.int16), normed_ref.view(torch.int16))
        # And the torch reference, up to the norm kernel's own rounding of rsqrt.
        torch_normed, _ = add_rms_norm(
            summed, residual, weight, eps, unit_offset=unit_offset, backend="torch"
        )
        torch.testing.assert_close(results[0][0], torch_normed, rtol=1e-2, atol=1e-2)
        assert ranks[0].epochs[site, 0] == call


@triton.jit
def _wait_kernel(flag_ptr, expected, out_ptr, MAX_SPINS: tl.constexpr):
    tl.store(out_ptr, wait_flag(flag_ptr, expected, MAX_SPINS, 0).to(tl.int32))


@pytest.mark.parametrize(("flag", "arrives"), [(4, True), (3, False), (5, False), (0, False)])
def test_wait_returns_only_for_this_calls_epoch(flag: int, arrives: bool) -> None:
    """The kernel's wait: a stale flag (the previous call's, or never set) keeps it
    spinning; bounded here, it gives up and says so."""
    flags = torch.tensor([flag], dtype=torch.int32)
    out = torch.full((1,), -1, dtype=torch.int32)
    _wait_kernel[(1,)](flags, 4, out, MAX_SPINS=16)
    assert bool(out[0]) is arrives


def test_a_rank_whose_peer_has_not_published_reads_no_partial() -> None:
    """Rank 0 run twice while rank 1 has published only the first call: the second call's
    wait (bounded) finds the stale flag. The first call's flag stays what rank 1 wrote."""
    ranks, flags = _ranks(2)
    rows, hidden, site = 2, 96, 0
    _publish_later_ranks(flags, site, rows, 1)
    site_all_reduce(ranks[0], site, rows, hidden, torch.float16, max_spins=4)
    arrived = torch.zeros(1, dtype=torch.int32)
    _wait_kernel[(1,)](flags[0][site, 1], int(ranks[0].epochs[site, 0]) + 1, arrived, MAX_SPINS=4)
    assert int(arrived[0]) == 0  # call 2 of rank 0 would wait for rank 1
    assert flags[1][site, 0, :rows].tolist() == [1, 1]  # rank 0 published call 1 to rank 1


def test_rows_that_do_not_fit_are_refused() -> None:
    ranks, _ = _ranks(2)
    with pytest.raises(ValueError):
        site_all_reduce(ranks[0], 0, MAX_ROWS + 1, 96, torch.float16)
    with pytest.raises(ValueError):
        site_all_reduce(ranks[0], SITES, 1, 96, torch.float16)
