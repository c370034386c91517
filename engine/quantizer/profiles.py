"""Bit profiles of one linear, their EXL2 group layout and exact storage cost.

A `Profile` says how the rows of a linear (its input features, in act-order) are split
between bit widths: a list of (bits, fraction of rows, group size), widest first, as
exllamav2's QParams does. `layout(k)` turns it into EXL2 groups (bits non-increasing, every
group but the last a multiple of 32 rows, 16 at 2 bits); `storage_bits(k, n)` counts the
bits of the tensors pack_exl2 writes for it (q_weight with n padded to 32, q_scale,
q_scale_max, q_groups, q_invperm, bias), so bit budgets are met by what lands on disk.

`LADDER` is the table of profiles the measurement tries (2.1 to 8 bits per weight); a
module candidate (`ModuleCandidate`) picks one ladder rung per linear role. Profiles
serialize to short names such as "4b128" or "0.25:5b64+0.75:4b64".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.quant.bitpack import packed_rows
from engine.quant.exl2 import EXL2_BITS, exl2_group_rows_multiple


@dataclass(frozen=True)
class Profile:
    parts: tuple[tuple[int, float, int], ...]  # (bits, fraction of rows, group size)

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a profile needs at least one part")
        previous = 9
        for bits, fraction, group in self.parts:
            if bits not in EXL2_BITS:
                raise ValueError(f"bits must be one of {EXL2_BITS}, got {bits}")
            if bits >= previous:
                raise ValueError(f"profile bits must be strictly decreasing: {self.parts}")
            if group <= 0 or group % exl2_group_rows_multiple(bits):
                raise ValueError(f"group size {group} is not a multiple of the {bits}-bit step")
            if not 0 < fraction <= 1:
                raise ValueError(f"row fraction must lie in (0, 1], got {fraction}")
            previous = bits
        if abs(sum(p[1] for p in self.parts) - 1) > 1e-6:
            raise ValueError(f"row fractions must sum to 1: {self.parts}")

    @property
    def name(self) -> str:
        if len(self.parts) == 1:
            bits, _, group = self.parts[0]
            return f"{bits}b{group}"
        return "+".join(f"{f:g}:{b}b{g}" for b, f, g in self.parts)

    @classmethod
    def parse(cls, name: str) -> Profile:
        try:
            if "+" not in name and ":" not in name:
                bits, group = name.split("b")
                return cls(((int(bits), 1.0, int(group)),))
            parts = []
            for part in name.split("+"):
                fraction, rest = part.split(":")
                bits, group = rest.split("b")
                parts.append((int(bits), float(fraction), int(group)))
            return cls(tuple(parts))
        except ValueError as e:
            raise ValueError(f"not a profile name: {name!r} ({e})") from None

    def layout(self, k: int) -> tuple[list[int], list[int]]:
        """(bits per group, rows per group) for k input rows."""
        bits_out: list[int] = []
        sizes: list[int] = []
        remaining = k
        for i, (bits, fraction, group) in enumerate(self.parts):
            if remaining <= 0:
                break
            last = i == len(self.parts) - 1
            # Whole groups for every level but the last, which takes what is left.
            rows = remaining if last else min(remaining, math.ceil(k * fraction / group) * group)
            full, rest = divmod(rows, group)
            bits_out += [bits] * full
            sizes += [group] * full
            if rest:
                bits_out.append(bits)
                sizes.append(rest)
            remaining -= rows
        return bits_out, sizes

    def storage_bits(self, k: int, n: int, *, bias: bool = False) -> int:
        width = -(-n // 32) * 32
        bits, sizes = self.layout(k)
        groups = len(bits)
        q_weight = sum(packed_rows(s, b) for b, s in zip(bits, sizes, strict=True)) * 32 * width
        q_scale = groups * width * 4
        return (
            q_weight
            + q_scale
            + groups * 16
            + groups * 2 * 16
            + k * 32
            + (16 * width if bias else 0)
        )


def _p(*parts: tuple[int, float, int]) -> Profile:
    return Profile(tuple(parts))


# Rungs in increasing cost, about 0.3-1 bpw apart (storage bits at 576 columns in the
# comments). Mixed rungs put the wider bits on the most active inputs (act-order), which
# is where they buy the most. Ten rungs keep the measurement to ten GPTQ runs per linear.
LADDER: tuple[Profile, ...] = (
    _p((3, 0.1, 64), (2, 0.9, 64)),  # 2.23
    _p((3, 0.5, 64), (2, 0.5, 64)),  # 2.62
    _p((3, 1.0, 128)),  # 3.09
    _p((4, 0.4, 64), (3, 0.6, 64)),  # 3.56
    _p((4, 1.0, 128)),  # 4.09
    _p((5, 0.4, 64), (4, 0.6, 64)),  # 4.56
    _p((5, 1.0, 128)),  # 5.09
    _p((6, 1.0, 128)),  # 6.09
    _p((8, 0.5, 128), (6, 0.5, 128)),  # 7.09
    _p((8, 1.0, 128)),  # 8.09
)

# Head profiles by -hb, as exllamav2's converter has them.
HEAD_PROFILES: dict[int, Profile] = {
    2: _p((4, 0.3, 32), (2, 0.7, 32)),
    3: _p((4, 0.15, 32), (3, 0.85, 32)),
    4: _p((6, 0.15, 32), (4, 0.85, 32)),
    5: _p((6, 0.15, 128), (5, 0.85, 128)),
    6: _p((8, 0.15, 128), (6, 0.85, 128)),
    8: _p((8, 1.0, 128)),
}


@dataclass(frozen=True)
class ModuleCandidate:
    """One option for a module (attention or MLP): a ladder rung per linear role."""

    rungs: tuple[tuple[str, int], ...]  # (role, index into LADDER)

    def profile(self, role: str) -> Profile:
        return LADDER[dict(self.rungs)[role]]


# Roles: the attention's input side (q/k/v, or a fused qkv), its values and its output;
# the MLP's input side (gate/up) and its output (down). The offsets give the output-side
# and value projections one rung more, which exllamav2's tables also favour.
ROLE_OF_LINEAR = {
    "q_proj": "qk",
    "k_proj": "qk",
    "qkv_proj": "qk",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "in",
    "up_proj": "in",
    "gate_up_proj": "in",
    "down_proj": "out",
}
_ATTN_OFFSETS = ((0, 0, 0), (0, 1, 0), (0, 1, 1), (0, 0, 1))
_MLP_OFFSETS = ((0, 0), (0, 1), (1, 0))


def module_candidates(kind: str) -> list[ModuleCandidate]:
    top = len(LADDER) - 1
    seen: dict[tuple[tuple[str, int], ...], None] = {}
    for base in range(len(LADDER)):
        if kind == "attn":
            for dq, dv, do in _ATTN_OFFSETS:
                key = (
                    ("qk", min(base + dq, top)),
                    ("v", min(base + dv, top)),
                    ("o", min(base + do, top)),
                )
                seen.setdefault(key)
        else:
            for di, do in _MLP_OFFSETS:
                seen.setdefault((("in", min(base + di, top)), ("out", min(base + do, top))))
    return [ModuleCandidate(key) for key in seen]
