"""kernels/argmax.py: the two-kernel argmax gives torch's `argmax(dim=-1)` exactly: ties to
the first index, NaN above everything (the first NaN), a row of -inf answers 0, rows whose
length is no multiple of a part, float32/16/bfloat16. Run by the Triton interpreter here,
compiled on a GPU (`gpu` marks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import generator
from engine.sampling_settings import SamplingSettings
from engine.tokenizer import Tokenizer
from helpers.model_factory import write_tokenizer
from helpers.sm90_compile import compiled_facts
from kernels.argmax import argmax_rows

VOCAB = 5000  # three parts of 2048 tokens, the last one partly past the row's end


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, VOCAB, generator=g)
    x[0, :] = float("-inf")  # nothing allowed: index 0
    x[1, [100, 2047, 2048, 4999]] = 50.0  # a tie across parts: the first wins
    x[2, [4999]] = 50.0  # the last token, in the part that runs past the end
    x[3, [3000, 10]] = float("inf")  # +inf twice: the first
    x[4, [4100, 4200]] = float("nan")  # a NaN outranks the larger +inf before it
    x[4, 5] = float("inf")
    x[5, [2500, 700]] = float("nan")  # two NaNs in different parts: the first
    x[6, 1024:] = float("-inf")  # the maximum in the first part's first block
    x[6, 3] = x[6, :1024].max()  # tied within one block
    x[7, :] = 0.0  # all equal: index 0
    x[7, 4096] = -0.0
    x[8, 10] = 100.0  # a NaN in a later block of the same part beats an earlier larger value
    x[8, 1500] = float("nan")
    x[8, 3000] = 200.0  # and a larger value in a later part
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax(dtype: torch.dtype) -> None:
    logits = _rows().to(dtype)
    got = argmax_rows(logits, backend="triton")
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 1024, 2048, 2049])
def test_argmax_rows_short_and_boundary_rows(vocab: int, dtype: torch.dtype) -> None:
    logits = _rows()[:, :vocab].to(dtype).contiguous()
    logits[1, vocab - 1] = 1e4  # the row's last token
    assert argmax_rows(logits, backend="triton").tolist() == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits, backend="triton")[1].item() == vocab - 1


def test_argmax_rows_of_a_strided_batch() -> None:
    big = _rows()
    view = big[::2]  # rows apart by two rows' stride, each contiguous
    assert argmax_rows(view, backend="triton").tolist() == view.argmax(dim=-1).tolist()


def test_argmax_rows_errors_and_empty() -> None:
    assert argmax_rows(torch.empty(0, 10), backend="triton").shape == (0,)
    with pytest.raises(ValueError, match="V = 0"):
        argmax_rows(torch.empty(2, 0), backend="triton")
    with pytest.raises(ValueError, match=r"\[N, V\] float"):
        argmax_rows(torch.zeros(4, dtype=torch.float32), backend="triton")
    with pytest.raises(ValueError, match="contiguous"):
        argmax_rows(torch.zeros(10, 3).t(), backend="triton")


def test_draw_jobs_takes_every_argmax_through_the_kernel(tmp_path: Path) -> None:
    """The draw (engine/generator.py draw_jobs) with the kernel as its argmax, as the runner
    gives it on a GPU: all rows plain greedy (one argmax of the batch), plain rows among
    sampled ones (the argmax of the rows picked out, then the sampled rows' two), and all
    rows sampled (two argmaxes of the whole batch); every token as torch's argmax draws it."""
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    seen: list[int] = []

    def through_the_kernel(logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits.shape[0])
        return argmax_rows(logits, backend="triton")

    greedy = SamplingSettings.from_any({"temperature": 0})
    sampled = SamplingSettings.from_any({"temperature": 0.8, "seed": 3})
    logits = _rows()[:, :384].contiguous()

    def jobs(settings: list[SamplingSettings]) -> list[generator.JobSampler]:
        return [generator.JobSampler(s, tok, torch.device("cpu"), [11, 12], 4) for s in settings]

    drawn = generator.draw_jobs(jobs([greedy] * 9), logits, argmax=through_the_kernel)
    assert drawn.tolist() == logits.argmax(dim=-1).tolist()
    mixed = [greedy, sampled, greedy, greedy, sampled, greedy, greedy, greedy, sampled]
    finite = logits.clone()
    for i in (1, 4, 8):  # the sampled rows: finite, as a sampler needs them
        finite[i] = finite[i].nan_to_num(nan=0.0, posinf=60.0)
    drawn = generator.draw_jobs(jobs(mixed), finite, argmax=through_the_kernel)
    plain = [i for i, s in enumerate(mixed) if s is greedy]
    assert [drawn[i].item() for i in plain] == [finite[i].argmax().item() for i in plain]
    # The same seeds drawn with torch's argmax give the same tokens, sampled rows included.
    assert torch.equal(drawn, generator.draw_jobs(jobs(mixed), finite))
    # One argmax of the batch; then one of the plain rows, and the sampled rows' two in
    # sample_batched (the best allowed token, the noisy draw).
    sampled_rows = len(mixed) - len(plain)
    assert seen == [9, len(plain), sampled_rows, sampled_rows]
    seen.clear()
    every = finite.nan_to_num(nan=0.0, posinf=60.0)
    drawn = generator.draw_jobs(jobs([sampled] * 9), every, argmax=through_the_kernel)
    assert torch.equal(drawn, generator.draw_jobs(jobs([sampled] * 9), every))
    assert seen == [9, 9]  # the whole batch drawn together: no rows picked out


_COMPILE = """
import importlib, inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
m = importlib.import_module("kernels.argmax")
def ptx(kernel, types, consts):
    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
parts = ptx(m._argmax_parts_kernel, {"x_ptr": "*" + sys.argv[1], "best_ptr": "*fp32",
            "where_ptr": "*i32", "nan_ptr": "*i8"}, {"PART": 2048, "BLOCK": 1024})
rows = ptx(m._argmax_rows_kernel, {"best_ptr": "*fp32", "where_ptr": "*i32",
           "nan_ptr": "*i8", "out_ptr": "*i64"}, {"PARTS": 64})
print(json.dumps({"unordered": parts.count("setp.nan") + parts.count("setp.neu"),
                  "loads": parts.count("ld.global"), "row_stores": rows.count("st.global")}))
"""


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_argmax_kernels_compile_for_sm90_with_the_nan_rule(dtype: str) -> None:
    """Both kernels compile for a GPU (the interpreter above does not compile), and the NaN
    test `x != x` compiled to unordered compares, the only kind true for a NaN."""
    facts = compiled_facts(_COMPILE, dtype, what=f"argmax kernels ({dtype} logits)")
    assert facts["unordered"] > 0, facts
    assert facts["loads"] > 0 and facts["row_stores"] > 0, facts


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_argmax_rows_on_gpu_matches_torch(rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, 128256, device="cuda", generator=g)
    logits[0, [70000, 90000]] = 40.0
    if rows > 1:
        logits[1, 127000] = float("nan")
    got = argmax_rows(logits)
    assert got.is_cuda
    assert torch.equal(got, logits.argmax(dim=-1))
    for _ in range(3):  # fp16 logits, as the head's slot sum writes them
        half = torch.randn(rows, 128256, device="cuda", generator=g).half()
        assert torch.equal(argmax_rows(half), half.argmax(dim=-1))


@pytest.mark.gpu
def test_argmax_rows_past_two_to_the_31_elements_on_gpu() -> None:
    """Rows whose offset passes 2^31 elements (16,800 rows of 128,256: 4.3 GB of fp16):
    the kernels address rows in 64 bits."""
    logits = torch.zeros(16800, 128256, dtype=torch.float16, device="cuda")
    rows = torch.tensor([0, 16743, 16744, 16799], device="cuda")
    cols = torch.tensor([5, 128255, 77, 100000], device="cuda")
    logits[rows, cols] = 1.0
    got = argmax_rows(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[rows].tolist() == cols.tolist()
