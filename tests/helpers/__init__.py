"""What the tests share, in one place: tiny models and tokenizers (model_factory), the browser
harness (browser), damaged inputs (bad_inputs), quantized checkpoints (quantized,
quant_weights, mixed_model), LoRA adapters (lora), GGUF files (gguf), architecture configs
(architectures), the source audit's readers (source_audit), parity measures (parity),
decoding comparisons (decoding), the hostile-request server (hostile_server), and the
drivers run in other processes (determinism_probe, tgw_driver, tgw_browser_driver).

tests/conftest.py's folder is on sys.path while pytest runs, so tests import these as
`helpers.<module>`; tools import them as `tests.helpers.<module>`. Inside this package the
modules import each other relatively, which works both ways.
"""
