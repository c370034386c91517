"""Issue 29 attribution: splice two EXL2 conversions of one model made with the same
allocation (bits per module identical) but different GPTQ calibration text, taking the
tensors of the selected modules from B and the rest from A.

    python splice.py A B OUT SELECTOR
SELECTOR: head | layers:LO-HI | attn | mlp
"""

import re
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file


def selected(name: str, sel: str) -> bool:
    if sel == "head":
        return name.startswith("lm_head.")
    if sel.startswith("layers:"):
        lo, hi = map(int, sel.split(":")[1].split("-"))
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return bool(m) and lo <= int(m.group(1)) <= hi
    if sel in ("attn", "mlp"):
        return f".{'self_attn' if sel == 'attn' else 'mlp'}." in name
    raise SystemExit(f"unknown selector {sel}")


def main() -> None:
    a, b, out, sel = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    out.mkdir(parents=True, exist_ok=True)
    for f in a.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    fa = safe_open(str(a / "output.safetensors"), "pt")
    fb = safe_open(str(b / "output.safetensors"), "pt")
    tensors, taken = {}, 0
    for k in fa.keys():
        if selected(k, sel):
            tensors[k] = fb.get_tensor(k)
            assert tensors[k].shape == fa.get_tensor(k).shape, k
            taken += 1
        else:
            tensors[k] = fa.get_tensor(k)
    save_file(tensors, str(out / "output.safetensors"), metadata=fa.metadata())
    print(f"{out}: {taken} tensors from {b}")


if __name__ == "__main__":
    main()
