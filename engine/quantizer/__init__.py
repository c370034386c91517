"""The EXL2 quantizer: FP16/BF16 (or GGUF) models to EXL2 at any bits per weight.

    from engine.quantizer import ConvertOptions, convert
    convert("models/fp16", "models/exl2-4.0", ConvertOptions(bits=4.0))

Modules, in pipeline order:

    calibration  text (user file or the shipped default) -> token rows
    model        the engine's architecture, one layer materialized at a time; forwards
    capture      Hessians and module inputs/outputs of a layer's calibration forward
    profiles     bit profiles of a linear, EXL2 group layout, exact storage bits, tables
    gptq         GPTQ with act-order and damping into EXL2 groups; packing + check
    measure      error of every candidate bit mix per module (unquantized states)
    optimize     the bit allocation (DP under an exact budget)
    strategy     measurement <-> strategy, feasibility, measurement files
    quantize     the quantization pass (quantized states fed forward), the head
    job          OUT.partial: resumable state, atomic files
    writer       shards, config.json, tokenizer files, the final rename
    pipeline     convert(): the stages in order
"""

from engine.quantizer.pipeline import ConvertError, ConvertOptions, ConvertResult, convert

__all__ = ["ConvertError", "ConvertOptions", "ConvertResult", "convert"]
