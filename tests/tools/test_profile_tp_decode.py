"""tools/profile_tp_decode.py's trace arithmetic, on a chrome trace's events as
torch.profiler exports them (ts and dur in µs): kernel families, idle GPU time between
kernels (overlapping kernels counted once), and the host's CUDA calls per step."""

from __future__ import annotations

from tools.profile_tp_decode import analyze, family


def _k(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_families_idle_time_and_host_calls_per_token():
    events = [
        # step 1: GEMV, one-shot all-reduce overlapping it by 2 µs, norm; a gap of 10 µs
        _k("quant_matmul_gemv_kernel", 0, 20),
        _k("one_shot_all_reduce_kernel", 18, 7),
        _k("fused_add_rms_norm_kernel", 25, 3),
        _k("Memcpy DtoH (Device -> Pageable)", 38, 2, "gpu_memcpy"),
        # step 2
        _k("quant_matmul_gemv_kernel", 40, 20),
        _k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 60, 10),
        _k("rotary_embedding_kernel", 70, 5),
        _k("paged_attention_decode", 75, 5),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 39, "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 30, "dur": 9},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 31, "dur": 1},
        {"ph": "i", "cat": "kernel", "name": "ignored instant", "ts": 3},
    ]
    a = analyze(events, steps=2)
    assert a["window_us_per_token"] == 40.0  # 0..80
    assert a["busy_us_per_token"] == 35.0  # 80 less the 10 µs gap, overlap counted once
    assert a["idle_us_per_token"] == 5.0
    assert a["largest_gaps_us"][0][0] == 10.0
    fams = a["families"]
    assert fams["gemv"] == {
        "us_per_token": 20.0,
        "count_per_token": 1.0,
        "largest": [("quant_matmul_gemv_kernel", 20.0)],
    }
    assert fams["all_reduce"]["us_per_token"] == 8.5
    assert fams["all_reduce"]["count_per_token"] == 1.0
    assert {"norm", "rope", "attention", "memcpy"} <= set(fams)
    assert a["graph_launches_per_step"] == 1.0
    assert a["host_waits_per_step"] == 0.5
    assert a["kernel_launches_per_step"] == 0.5


def test_kernel_names_map_to_their_family():
    assert (
        family("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>", "kernel")
        == "elementwise"
    )
    assert family("void at::native::direct_copy_kernel_cuda", "kernel") == "copy_cast"
    assert family("two_shot_all_reduce", "kernel") == "all_reduce"
    assert family("Memset (Device)", "gpu_memset") == "memcpy"
    assert family("_decode_kernel", "kernel") == "attention"  # kernels/attention/decode.py
    assert family("_gemv_kernel", "kernel") == "gemv"
    assert family("_silu_mul_kernel", "kernel") == "elementwise"
    assert family("some_unknown_kernel", "kernel") == "other"
