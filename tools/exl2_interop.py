"""EXL2/GPTQ interchangeability with exllamav2, checked on a GPU.

    python tools/exl2_interop.py --work /tmp/interop [--json out.json]

Needs a CUDA GPU and the exllamav2 wheel (0.3.2) importable, with the one-line causal fix
of its `attn.py` applied (without flash-attn its multi-token forward is otherwise not
causal: remove `or causal` from `if self.layer_idx in attn_params.block_diag_layers or
causal:`). Three checks, each printing max |a - b| / max |b| over a 64-token prompt:

  a) a model written by Kestrel's EXL2 writer (mixed 8..2-bit groups, act-order) loads in
     exllamav2; its logits match Kestrel's and the dequantized fp32 reference;
  b) a model quantized by exllamav2's own converter loads in Kestrel; logits match
     exllamav2's;
  c) a GPTQ 4-bit checkpoint (g128, act-order, v1 zeros) loads in both; logits match.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import loader
from engine.quant.exl2 import Exl2Tensors, dequantize_exl2
from engine.quant.exl2_writer import quantize_rtn_exl2
from engine.quant.gptq import GptqTensors, dequantize_gptq, quantize_rtn_gptq
from tests.helpers.model_factory import make_tiny_llama

ROOT = Path(__file__).resolve().parent.parent

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# exllamav2's kernels want hidden sizes in multiples of 128 and head dims it supports.
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def top1(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of positions where both logits pick the same token."""
    return (a.float().cpu().argmax(-1) == b.float().cpu().argmax(-1)).float().mean().item()


def compare(results: dict, key: str, a: torch.Tensor, b: torch.Tensor) -> None:
    results[key] = rel_err(a, b)
    results[key + "_top1"] = top1(a, b)


def exllamav2_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from exllamav2 import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config(str(model_dir))
    config.max_seq_len = 256
    model = ExLlamaV2(config)
    model.load()
    with torch.inference_mode():
        logits = model.forward(torch.tensor([ids]))[0].float().cpu()
    model.unload()
    return logits


def kestrel_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    m = loader.load(model_dir, "kestrel", device="cuda", dtype="float16", max_seq_len=256)
    logits = m.logits(ids)
    m.unload()
    return logits


def _bits_for(k: int) -> list[int]:
    widths = [8, 6, 5, 4, 3, 2]
    groups = -(-k // 128)
    return [widths[min(i * len(widths) // groups, 5)] for i in range(groups)]


def quantize_dir(src: Path, dst: Path, fmt: str) -> torch.nn.Module:
    """Write `src` quantized as `fmt` into `dst`; return transformers' model with the
    dequantized weights (the fp32 reference)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    out, dequantized = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        leaf = module.split(".")[-1]
        if not (name.endswith(".weight") and (leaf in LINEARS or module == "lm_head")):
            out[name] = t.half()
            continue
        w = t.float().cuda()
        k = w.shape[1]
        if fmt == "exl2":
            perm = torch.argsort(w.norm(dim=0), descending=True)  # stands in for diag(H)
            bits = [6] * -(-k // 128) if module == "lm_head" else _bits_for(k)
            packed = quantize_rtn_exl2(w, bits, 128, perm=perm)
            deq = dequantize_exl2(Exl2Tensors.from_dict(packed)).t()
        else:
            packed = quantize_rtn_gptq(w, 4, 128, sym=True, act_order=True)
            deq = dequantize_gptq(GptqTensors.from_dict(packed, bits=4)).t()
        out.update({f"{module}.{k_}": v.cpu().contiguous() for k_, v in packed.items()})
        dequantized[name] = deq.cpu()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name not in ("model.safetensors",):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    if fmt == "exl2":
        cfg["quantization_config"] = {"quant_method": "exl2", "version": "kestrel", "bits": 4.0}
    else:
        cfg["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": True,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    ref = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = ref.state_dict()
    state.update(dequantized)
    ref.load_state_dict(state)
    return ref.eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", default="/tmp/kestrel-interop")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-converter", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    fp16 = work / "fp16"
    make_tiny_llama(fp16, dtype=torch.float16, vocab_size=384, **SHAPE)
    ids = torch.randint(3, 384, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    results: dict[str, float | str] = {"device": torch.cuda.get_device_name()}

    # Baseline: both engines on the unquantized fp16 model, so the quantized comparisons
    # below can be read against each engine's own fp16 rounding.
    from transformers import LlamaForCausalLM

    with torch.no_grad():
        ref16 = LlamaForCausalLM.from_pretrained(fp16, dtype=torch.float32)
        expected16 = ref16(torch.tensor([ids])).logits[0]
    compare(results, "fp16_kestrel_vs_reference", kestrel_logits(fp16, ids), expected16)
    compare(results, "fp16_exllamav2_vs_reference", exllamav2_logits(fp16, ids), expected16)

    for fmt in ("exl2", "gptq"):
        ref = quantize_dir(fp16, work / fmt, fmt)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        ours = kestrel_logits(work / fmt, ids)
        theirs = exllamav2_logits(work / fmt, ids)
        compare(results, f"{fmt}_kestrel_vs_reference", ours, expected)
        compare(results, f"{fmt}_exllamav2_vs_reference", theirs, expected)
        compare(results, f"{fmt}_kestrel_vs_exllamav2", ours, theirs)

    if not args.skip_converter:
        converted = work / "converted"
        cmd = [
            sys.executable, "-m", "exllamav2.conversion.convert_exl2",
            "-i", str(fp16), "-o", str(work / "convert-job"), "-cf", str(converted),
            "-b", "4.0", "-hb", "6", "-r", "16", "-mr", "8", "-l", "512", "-ml", "512",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (work / "convert.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not (converted / "config.json").is_file():
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            results["converter"] = f"failed (rc {proc.returncode})"
        else:
            ours = kestrel_logits(converted, ids)
            theirs = exllamav2_logits(converted, ids)
            compare(results, "converted_kestrel_vs_exllamav2", ours, theirs)

    for key, value in results.items():
        print(f"{key:34s} {value:.2e}" if isinstance(value, float) else f"{key:34s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
