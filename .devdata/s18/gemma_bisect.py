"""Session 18: Gemma-3-270M gives garbage on a GPU (H200: ' The ciphertal of Frane', wiki
perplexity 183 against 19.2 on the CPU, in bfloat16 and in float32 alike). Bisect on a
random-weight Gemma 3 of the 270M's attention shape (head_dim 256, 4 q heads, 1 kv head,
window 512, 1 global layer in 6, query_pre_attn_scalar 256) against transformers on the same
GPU: the engine as it is, without CUDA graphs, without fused kernels, and with one kernel op
at a time sent to its torch reference. argv: out json, device."""
import json, sys, time
from pathlib import Path
sys.path.insert(0, "tests")
import torch
import transformers as tf
import loader
from helpers.model_factory import make_tiny_model

out, device = sys.argv[1], sys.argv[2]
import os
VOCAB, LAYERS = int(os.environ.get("VOCAB", 384)), int(os.environ.get("LAYERS", 6))
QUICK = os.environ.get("QUICK") == "1"  # as_is and no_graphs only
path = Path("/tmp/gemma_bisect_model")
hf = make_tiny_model(
    path, tf.Gemma3TextConfig, vocab_size=VOCAB, hidden_size=640, intermediate_size=2048, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
    sliding_window=512, sliding_window_pattern=6, max_position_embeddings=4096,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
).to(device)
g = torch.Generator().manual_seed(1)
prompts = {"short": torch.randint(3, VOCAB, (40,), generator=g).tolist(),
           "long": torch.randint(3, VOCAB, (1100,), generator=g).tolist()}
with torch.no_grad():
    ref = {k: hf(torch.tensor([v], device=device)).logits[0].float().cpu() for k, v in prompts.items()}
    gen = hf.generate(torch.tensor([prompts["short"]], device=device), do_sample=False,
                      max_new_tokens=16, min_new_tokens=16, pad_token_id=1)[0, 40:].tolist()

import kernels.backend as kb
ORIG = kb.resolve_backend
def forcing(ops):
    def resolve(backend, *tensors):
        if backend == "auto" and sys._getframe(1).f_code.co_name in ops:
            return "torch"
        return ORIG(backend, *tensors)
    return resolve
def set_resolver(fn):
    for name, mod in list(sys.modules.items()):
        if name.startswith("kernels") and getattr(mod, "resolve_backend", None) is not None:
            mod.resolve_backend = fn

OPS = ["rms_norm", "add_rms_norm", "apply_rope", "apply_rope_write", "paged_attention", "silu_mul"]
variants = [("as_is", {}, []), ("no_graphs", {"cuda_graphs": False}, []),
            ("no_fused_kernels", {"fuse_kernels": False}, []),
            ("all_ops_torch", {}, OPS)] + [(f"torch_{op}", {}, [op]) for op in OPS]
res = {"gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "hf_greedy": gen}
for dtype in ("float32", "bfloat16"):
    for name, opts, ops in variants:
        if QUICK and name not in ("as_is", "no_graphs"):
            continue
        if dtype == "bfloat16" and name not in ("as_is", "all_ops_torch", "torch_paged_attention"):
            continue
        set_resolver(forcing(set(ops)))
        r = {}
        try:
            m = loader.load(path, "kestrel", device=device, dtype=dtype, max_seq_len=2048, **opts)
            for k, ids in prompts.items():
                lg = m.logits(ids).float().cpu()
                r[k] = round(float((lg - ref[k]).abs().max() / ref[k].abs().max()), 6)
                r[k + "_argmax"] = round(float((lg.argmax(-1) == ref[k].argmax(-1)).float().mean()), 4)
            s = {"max_new_tokens": 16, "temperature": 0, "ban_eos_token": True}
            toks = [t for c in m.stream(prompts["short"], s) for t in c.token_ids]
            r["greedy_same"] = toks == gen
            r["greedy_first_diff"] = next((i for i, (a, b) in enumerate(zip(toks, gen)) if a != b), None)
            m.unload()
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"[:300]
        set_resolver(ORIG)
        res[f"{dtype}/{name}"] = r
        print(dtype, name, r, flush=True)
json.dump(res, open(out, "w"), indent=1)
