"""Session 16: main's intermittent test_norm_fold_engine failure on an H200 ([True-gptq], 1 in
~6 runs). Decode the tiny GPTQ model with graphs N times per (fold, pdl) and compare each run's
tokens/logits with that setting's first run: which settings ever differ from run to run."""
import json, sys, time
from pathlib import Path
sys.path.insert(0, "tests")
import torch
import importlib.util  # noqa: E402
spec = importlib.util.spec_from_file_location("nf", "tests/engine/test_norm_fold_engine.py")
nf = importlib.util.module_from_spec(spec); spec.loader.exec_module(nf); _decode = nf._decode
from tools.bench import build_model  # noqa: E402

model = build_model(Path("/tmp/race/gptq"), "tiny", "gptq")
out, t0 = {}, time.time()
for fold, pdl in [(True, True), (False, True), (True, False), (False, False)]:
    ref = None; res = []
    for i in range(int(sys.argv[2])):
        tok, lg = _decode(model, True, fold=fold, pdl=pdl)
        if ref is None:
            ref = (tok, lg); res.append("ref"); continue
        same_tok = tok == ref[0]
        d = (lg - ref[1]).abs().max().item()
        res.append(f"{'T' if same_tok else 'x'}{d:.3g}")
    out[f"fold={fold},pdl={pdl}"] = res
    print(fold, pdl, res, f"t={time.time()-t0:.0f}", flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
