"""What the model is built as, decided before it is built: the build plan.

A `BuildPlan` is made from the options and the checkpoint's tensors before any module
exists (`plan_build`), and the architecture builds the modules it describes:

- **projection fusion** (`fuse_projections`): linears that read the same input (q/k/v,
  gate/up) are built as one linear whose output is the parts' outputs side by side, where
  the stored formats allow it. The decision is made per module from the stored tensors
  (`parts_fuse`), so a fused module is built as such from the start; the loader then
  concatenates the checkpoint's parts into it as it reads them (engine/loading.py, the
  module's `load_sources`), the way gpt-fast's `load_hook` concatenates wq/wk/wv.
- **kernel fusion** (`fuse_kernels`): modules that have fused small-op kernels
  (engine/modules.py's `FusesKernels`) are built with them on or off.

At batch 1 a quantized GEMV costs a fixed few microseconds before it moves any bytes, so
three small launches (q, k, v: 4096x4096 and two 4096x1024 at 8B) cost about twice one
launch over their concatenation. Formats fuse when:

- dense (FP16/BF16/FP32): always (every part is read in the model's dtype);
- EXL2: the parts share their groups (`q_groups`: bits and rows of every group) and their
  permutation (`q_invperm`), and none is padded past its width; a converter gives q/k/v
  one permutation (one Hessian), and equal bits when its optimizer chose them;
- GPTQ: the parts share `g_idx` (or have none) and their group count.
Outputs are unchanged: a column of the fused product is computed as the column of its part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.quantized_linear import linear_format
from engine.weights import WeightStore


@dataclass(frozen=True)
class BuildPlan:
    """How to build a model. `store`: the checkpoint that projection fusion reads its
    decisions from (None: nothing is fused, as for a model built without weights)."""

    fuse_projections: bool = False
    fuse_kernels: bool = True
    store: WeightStore | None = None

    def fuse(self, parts: Sequence[tuple[str, int]]) -> bool:
        """Whether the linears `parts` (checkpoint name, output width) are built as one."""
        if not self.fuse_projections or self.store is None:
            return False
        return parts_fuse(self.store, parts)


def plan_build(
    store: WeightStore, *, fuse_projections: bool = True, fuse_kernels: bool = True
) -> BuildPlan:
    return BuildPlan(fuse_projections=fuse_projections, fuse_kernels=fuse_kernels, store=store)


def _equal(store: WeightStore, names: list[str]) -> bool:
    """The stored tensors `names` are all present with equal values, or all absent."""
    present = [n in store for n in names]
    if not all(present):
        return not any(present)
    first = store.get(names[0])
    return all(torch.equal(first, store.get(n)) for n in names[1:])


def parts_fuse(store: WeightStore, parts: Sequence[tuple[str, int]]) -> bool:
    """Whether the stored linears `parts` (name, output width) can run as one linear: the
    same format, and for a quantized one the same layout (see the module docstring)."""
    names = [name for name, _ in parts]
    formats = {linear_format(store, n) for n in names}
    if len(formats) != 1:
        return False
    fmt = formats.pop()
    if fmt == "dense":
        return all(f"{n}.weight" in store for n in names)
    if fmt == "exl2":
        if any(
            f"{n}.q_weight" not in store or store.info(f"{n}.q_weight").shape[-1] != out
            for n, out in parts
        ):
            return False  # a padded part's extra columns would sit inside the fused output
        return _equal(store, [f"{n}.q_groups" for n in names]) and _equal(
            store, [f"{n}.q_invperm" for n in names]
        )
    if fmt == "gptq":
        if any(store.info(f"{n}.qweight").shape[-1] != out for n, out in parts):
            return False
        if len({store.info(f"{n}.scales").shape[0] for n in names}) != 1:
            return False
        return _equal(store, [f"{n}.g_idx" for n in names])
    return False
