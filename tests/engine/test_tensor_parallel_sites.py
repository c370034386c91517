"""The site all-reduce's plumbing in a real model, on the CPU: a tiny Llama (FP16, EXL2 and
GPTQ layers) sharded for one rank of a one-rank group, its row-parallel linears given CPU
site buffers, run in float16 through the Triton interpreter. The decode path of TP=2 on
GPUs runs the same code: the deferred sums of o_proj and of all but the last down_proj
reach their norm's fused kernel (engine/tensor_parallel/fused_sites.py), the rest are
summed and cast by the kernel, with either exchange kernel (`flags`, `push`). The kernels
themselves with two and three ranks: tests/kernels/test_tp_all_reduce.py and
tests/kernels/test_tp_push_all_reduce.py."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import kernels
import loader
from engine.fusion import set_kernel_fusion
from engine.quantized_linear import QuantizedLinear
from engine.tensor_parallel.fused_sites import ReducingRMSNorm, wire_sites
from engine.tensor_parallel.site_reduce import PROMPT_SLOTS, SiteAllReduce
from engine.tensor_parallel.transform import AllReduceLinear, shard_model
from helpers.mixed_model import build_mixed_model
from kernels.tp_all_reduce import SiteBuffers
from kernels.tp_push_all_reduce import RECV_SLOTS, SENTINEL, PushBuffers, recv_words

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU)"
)

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ban_eos_token": True}


def _cpu_sites(
    sites: int,
    hidden: int,
    max_rows: int,
    kernel: str = "flags",
    dtype: torch.dtype = torch.float32,
) -> SiteAllReduce:
    """One rank's site buffers on the CPU, the rank alone in its group: float32 decode
    sites, or (`dtype` half, sites=PROMPT_SLOTS) the prompt slices as
    SiteAllReduce.build_prompt lays them out."""
    elements = max_rows * hidden
    data_words = sites * elements * dtype.itemsize // 4
    buffer = torch.zeros(data_words + sites * max_rows)
    bases = torch.tensor([buffer.data_ptr()], dtype=torch.int64)
    push = None
    if kernel == "push":
        recv = torch.full((recv_words(1, max_rows, hidden),), SENTINEL, dtype=torch.int32)
        push = PushBuffers(
            recv=recv.view(RECV_SLOTS, 1, max_rows, hidden),
            recv_bases=torch.tensor([recv.data_ptr()], dtype=torch.int64),
            slots=torch.zeros(max_rows, dtype=torch.int32),
            rank=0,
            world=1,
            max_rows=max_rows,
            row_floats=hidden,
        )
    return SiteAllReduce(
        SiteBuffers(
            data=buffer[:data_words].view(dtype),
            data_bases=bases,
            flag_bases=bases + data_words * 4,
            epochs=torch.zeros(sites, max_rows, dtype=torch.int32),
            rank=0,
            world=1,
            sites=sites,
            site_elements=elements,
            max_rows=max_rows,
        ),
        push,
    )


def _calls(sites: SiteAllReduce) -> torch.Tensor:
    """Kernel calls so far with a row 0: per site (flags), or in all modulo RECV_SLOTS (push:
    row 0's next slot)."""
    if sites.push is not None:
        return sites.push.slots[:1].clone()
    return sites.buffers.epochs[:, 0].clone()


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """A gloo group of this process alone: the dense layers' AllReduceLinear sum through it."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kernel", ["flags", "push"])
def test_deferred_sums_reach_their_norms_and_match_the_unsharded_model(
    tmp_path: Path, one_rank_group: None, kernel: str
) -> None:
    path = build_mixed_model(tmp_path / "mixed")
    ids = torch.randint(3, 384, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    model = loader.load(path, "kestrel", device="cpu", dtype="float16")
    try:
        expected_logits = model.logits(ids)
        expected_text = model.generate(ids[:6], GREEDY)
        causal = model.engine.model
        shard_model(causal, rank=0, world=1)
        layers = causal.model.layers
        linears = [m for m in causal.modules() if isinstance(m, AllReduceLinear)]
        hidden = linears[0].out_features
        sites = _cpu_sites(len(linears), hidden, max_rows=16, kernel=kernel)
        deferred = wire_sites(layers, linears, sites)
        # o_proj of 3 layers, down_proj of the first 2 (the last feeds the head).
        assert deferred == 5
        assert not isinstance(layers[0].input_layernorm, ReducingRMSNorm)
        assert all(isinstance(layer.post_attention_layernorm, ReducingRMSNorm) for layer in layers)
        assert all(isinstance(layer.input_layernorm, ReducingRMSNorm) for layer in layers[1:])

        start = _calls(sites)
        logits = model.logits(ids)
        torch.testing.assert_close(logits, expected_logits, rtol=2e-2, atol=2e-2)
        assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))
        # The quantized sites ran the kernel once per forward (row 0's count); dense ones
        # (layer 0) summed through the group. Nothing was left pending.
        quantized = [isinstance(x.inner, QuantizedLinear) for x in linears]
        counts = (_calls(sites) - start).tolist()
        if kernel == "push":
            assert [c % RECV_SLOTS for c in counts] == [sum(quantized) % RECV_SLOTS]
            assert sites.buffers.epochs.abs().sum() == 0  # the flag kernel never ran
        else:
            assert [c == 1 for c in counts] == quantized and set(counts) <= {0, 1}
        assert sites.take(logits) is None
        assert model.generate(ids[:6], GREEDY) == expected_text

        # Fused kernels off: DecoderLayer.forward adds the sums itself; none is deferred.
        before = _calls(sites)
        set_kernel_fusion(causal, False)
        unfused = model.logits(ids)
        torch.testing.assert_close(unfused, expected_logits, rtol=2e-2, atol=2e-2)
        ran = (_calls(sites) - before).tolist()
        if kernel == "push":
            assert [n % RECV_SLOTS for n in ran] == [sum(quantized) % RECV_SLOTS]
        else:
            assert [bool(n) for n in ran] == quantized
    finally:
        model.unload()


def test_prompt_rows_take_the_prompt_slices_in_turn(
    tmp_path: Path, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows past FLOAT32_REDUCE_MAX_ROWS (a prompt) at the quantized sites: each product is
    copied into the prompt slice of its site's parity and summed by the flags kernel in
    float16, inside the next norm where the decode sum would be deferred too, and the
    logits are the unsharded model's and the undeferred path's; shorter prompts and dense
    layers keep their paths."""
    path = build_mixed_model(tmp_path / "mixed")
    ids = torch.randint(3, 384, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    model = loader.load(path, "kestrel", device="cpu", dtype="float16")
    try:
        expected = model.logits(ids)
        causal = model.engine.model
        shard_model(causal, rank=0, world=1)
        quantized = [
            m
            for m in causal.modules()
            if isinstance(m, AllReduceLinear) and isinstance(m.inner, QuantizedLinear)
        ]
        hidden = quantized[0].out_features
        sites = _cpu_sites(len(quantized), hidden, max_rows=16)
        prompt = _cpu_sites(PROMPT_SLOTS, hidden, 96, dtype=torch.float16)
        deferred = wire_sites(causal.model.layers, quantized, sites, prompt)
        norms = [m for m in causal.modules() if isinstance(m, ReducingRMSNorm)]
        assert all(m.prompt_sites is prompt for m in [*quantized, *norms])
        # In call order, consecutive calls must take alternate slices, and a slice is
        # written (the product copied in) only right before its own call: the deferred sums
        # run inside their norms (sum + residual add + norm, one kernel), with nothing
        # between the copy and the norm.
        events: list[tuple[str, int]] = []
        staging, summed, normed = prompt.staging, prompt.sum, prompt.add_rms_norm

        def recording_staging(site: int, shape: tuple[int, ...]) -> torch.Tensor | None:
            events.append(("copy", site))
            return staging(site, shape)

        def recording_sum(site: int, staged: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            events.append(("sum", site))
            return summed(site, staged, dtype)

        def recording_norm(site: int, *args: object, **kwargs: object) -> object:
            events.append(("norm", site))
            return normed(site, *args, **kwargs)  # type: ignore[arg-type]

        prompt.staging = recording_staging  # type: ignore[method-assign]
        prompt.sum = recording_sum  # type: ignore[method-assign]
        prompt.add_rms_norm = recording_norm  # type: ignore[method-assign,assignment]
        logits = model.logits(ids)
        model.logits(ids[:70])  # a second forward: its first call follows the last one's
        copies, calls = events[0::2], events[1::2]
        assert len(calls) == 2 * len(quantized) and len(quantized) % PROMPT_SLOTS == 0
        assert all(kind == "copy" for kind, _ in copies), events
        assert [site for _, site in copies] == [site for _, site in calls], events
        order = [site for _, site in calls]
        assert all(a != b for a, b in zip(order, order[1:], strict=False)), events
        assert deferred > 0 and len(norms) == deferred
        assert sum(kind == "norm" for kind, _ in calls) == 2 * deferred, events
        assert sum(kind == "sum" for kind, _ in calls) == 2 * (len(quantized) - deferred)
        torch.testing.assert_close(logits, expected, rtol=2e-2, atol=2e-2)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
        # One call of 80 rows per quantized site and forward (two forwards), on the slice
        # of its site's parity.
        per_slot = [2 * len(quantized[s::PROMPT_SLOTS]) for s in range(PROMPT_SLOTS)]
        epochs = prompt.buffers.epochs
        assert epochs[:, 0].tolist() == per_slot and min(per_slot) > 0
        assert bool((epochs[:, :70] == epochs[:, :1]).all()) and int(epochs[:, 80:].sum()) == 0
        assert bool((epochs[:, 70:80] * 2 == epochs[:, :1]).all())  # the 80-row forward only
        assert int(sites.buffers.epochs.abs().sum()) == 0  # no decode site ran
        # A short prompt (decode-sized rows) takes the decode sites, not the prompt slices.
        model.logits(ids[:12])
        assert epochs[:, 0].tolist() == per_slot
        assert int(sites.buffers.epochs[:, 0].sum()) == len(quantized)
        # Deferred or not, the same sums: the fused kernel rounds the sum to the activations'
        # dtype before the residual add, as the sum and the norm apart do. The norms apart
        # run the Triton kernel, as on a GPU; their sum of squares is reduced in another
        # order than the fused kernel's, so a few normed values differ in the last bit.
        triton_add_rms_norm = partial(kernels.add_rms_norm, backend="triton")
        monkeypatch.setattr(kernels, "add_rms_norm", triton_add_rms_norm)
        for linear in quantized:
            linear.defer_sum = False
        before = len(events)
        apart = model.logits(ids)
        assert ("norm", 0) not in events[before:] and ("norm", 1) not in events[before:]
        torch.testing.assert_close(apart, logits, rtol=1e-2, atol=1e-2)
        assert torch.equal(apart.argmax(-1), logits.argmax(-1))
    finally:
        model.unload()


def test_a_deferred_partial_must_be_taken_before_the_next() -> None:
    sites = _cpu_sites(2, 8, 2)
    staged = sites.staging(0, (1, 8))
    assert staged is not None and sites.staging(0, (3, 8)) is None  # rows past max_rows
    sites.defer(0, staged)
    with pytest.raises(RuntimeError, match="never summed"):
        sites.defer(1, staged)
    assert sites.take(staged.clone()) is None  # another tensor is not the partial
    assert sites.take(staged) == 0
    assert sites.take(staged) is None


def test_the_exchange_kernel_is_named_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.tensor_parallel.site_reduce import site_kernel

    monkeypatch.delenv("KESTREL_TP_SITE_KERNEL", raising=False)
    assert site_kernel() == "push"
    assert site_kernel("flags") == "flags"
    monkeypatch.setenv("KESTREL_TP_SITE_KERNEL", "flags")
    assert site_kernel() == "flags"
    monkeypatch.setenv("KESTREL_TP_SITE_KERNEL", "nccl")
    with pytest.raises(ValueError, match="KESTREL_TP_SITE_KERNEL 'nccl'"):
        site_kernel()
    with pytest.raises(ValueError, match="site all-reduce kernel 'fast'"):
        site_kernel("fast")
