"""Issue 29 experiment: per layer and group (attention, MLP), the end-to-end effect of RTN-4 g128
on that group alone (d log ppl, 1024 wiki tokens with BOS, transformers float32); the
measurement's candidate errors of that group rescaled so the group's level (geometric mean of
its candidates' errors) squared equals that effect. argv: model, measurement in, out."""
import json, math, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(2)
p, meas, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(p)
m = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
text = open("/work/main/engine/quantizer/data/wiki.utf8").read()[:20000]
ids = tok(text, return_tensors="pt").input_ids[:, :1024]
def ppl():
    with torch.no_grad(): return math.exp(m(ids, labels=ids).loss.item())
def rtn(w, bits=4):
    g = 128 if w.shape[1] % 128 == 0 else 64
    n, k = w.shape; w2 = w.reshape(n, k // g, g); mx = w2.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    q = 2 ** (bits - 1) - 1; s = mx / q
    return (torch.round(w2 / s).clamp(-q - 1, q) * s).reshape(n, k)
groups = {"attn": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"],
          "mlp": ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]}
base = math.log(ppl()); print("base ppl", math.exp(base), flush=True)
M = json.load(open(meas)); sens = []
for i, layer in enumerate(m.model.layers):
    row = {}
    for g, names in groups.items():
        saved = {n: layer.get_submodule(n).weight.data.clone() for n in names}
        for n in names: layer.get_submodule(n).weight.data = rtn(saved[n])
        row[g] = max(math.log(ppl()) - base, 1e-3)
        for n in names: layer.get_submodule(n).weight.data = saved[n]
        cands = M["layers"][i][g]
        level = math.exp(sum(math.log(max(c["err"], 1e-12)) for c in cands) / len(cands))
        f = math.sqrt(row[g]) / level
        for c in cands: c["err"] *= f
    sens.append(row); print(i, row, flush=True)
json.dump(M, open(out, "w")); json.dump(sens, open(out + ".sens.json", "w"))
