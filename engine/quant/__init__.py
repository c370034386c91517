"""Quantized weight formats on disk (EXL2, GPTQ) and their conversion to the runtime layout.

One module per concern, one place per bit layout:

    bitpack      the bit layouts: EXL2/GPTQ bit streams, column packing (q_scale, qzeros),
                 runtime planes
    exl2         Exl2Tensors (+ validate), dequantize_exl2 (reference), exl2_to_runtime
    exl2_writer  pack_exl2, quantize_rtn_exl2 (round-to-nearest with the converter's scales)
    gptq         GptqTensors (+ validate), dequantize_gptq, gptq_to_runtime, pack_gptq,
                 quantize_rtn_gptq
    checks       QuantFormatError (a ValueError naming the offending tensor)

Every reader returns W as fp32 [in_features, out_features] in the original row order
(y = x @ W + bias); every `*_to_runtime` returns a kernels.quant_matmul.QuantizedWeight
whose `dequantize_reference` equals that W (exactly for EXL2 and symmetric GPTQ).
"""

from engine.quant.checks import QuantFormatError
from engine.quant.exl2 import (
    EXL2_BITS,
    EXL2_MAX_IN_FEATURES,
    Exl2Tensors,
    dequantize_exl2,
    exl2_to_runtime,
)
from engine.quant.exl2_writer import pack_exl2, quantize_rtn_exl2
from engine.quant.gptq import (
    GPTQ_BITS,
    GptqTensors,
    dequantize_gptq,
    gptq_to_runtime,
    pack_gptq,
    quantize_rtn_gptq,
)

__all__ = [
    "EXL2_BITS",
    "EXL2_MAX_IN_FEATURES",
    "GPTQ_BITS",
    "Exl2Tensors",
    "GptqTensors",
    "QuantFormatError",
    "dequantize_exl2",
    "dequantize_gptq",
    "exl2_to_runtime",
    "gptq_to_runtime",
    "pack_exl2",
    "pack_gptq",
    "quantize_rtn_exl2",
    "quantize_rtn_gptq",
]
