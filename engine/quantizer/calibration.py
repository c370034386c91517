"""Calibration text -> token rows [rows, length] for the quantizer.

Contract:
- `read_calibration_text(path)` reads a user file: `.txt` or `.utf8` (the whole file; in
  a file of `<doc …>` … `</doc>` articles, as Wikipedia dumps and exllamav2's standard
  calibration text are, the markup lines are dropped), `.jsonl` (the
  "text" field of every line, joined by blank lines) or `.parquet` (a "text" column, else
  the first string column; needs pyarrow). Anything unreadable, empty or of another type
  raises `CalibrationError` (a ValueError) naming the file and the reason.
- `read_calibration_texts(paths)` reads several such files, one source each.
- `default_calibration_texts()` returns the texts that ship in engine/quantizer/data, one
  per source (encyclopedia, web, code, multilingual, chat, stories; sources and licenses
  in data/README.md), so a conversion needs no network and no file outside the package.
  A mix, because both the bit allocation and the GPTQ Hessians fit what they see: with
  English encyclopedia text alone, other languages and code lose more than they need to.
- `calibration_rows(tokenizer, texts, rows, length)` tokenizes each text without BOS, cuts
  it into consecutive rows of `length` tokens and interleaves the sources' rows (one of
  each source in turn, so every prefix of the rows is a mix). Fewer tokens than one row
  raises `CalibrationError`; fewer than asked gives the rows there are (the caller reports
  it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_SOURCES = (
    "wiki.utf8",
    "web.utf8",
    "code.utf8",
    "multilingual.utf8",
    "chat.utf8",
    "tinystories.utf8",
)
DEFAULT_DATASET_NAME = "kestrel-default-2 (wiki, web, code, multilingual, chat, stories)"
SUFFIXES = (".txt", ".utf8", ".jsonl", ".parquet")


class CalibrationError(ValueError):
    """The calibration text cannot be read or is too short."""


class Encoder(Protocol):
    def encode(self, text: str, *, add_bos: bool | None = True) -> list[int]: ...


def read_calibration_text(path: str | Path) -> str:
    path = Path(path).expanduser()
    if not path.exists():
        raise CalibrationError(f"calibration file not found: {path}")
    if not path.is_file():
        raise CalibrationError(f"calibration path is not a file: {path}")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise CalibrationError(
            f"calibration file {path} has an unsupported type '{suffix or '(none)'}' "
            f"(use {', '.join(SUFFIXES)})"
        )
    try:
        if suffix in (".txt", ".utf8"):
            text = _drop_doc_markup(path.read_text(encoding="utf-8"))
        elif suffix == ".jsonl":
            text = _read_jsonl(path)
        else:
            text = _read_parquet(path)
    except CalibrationError:
        raise
    except UnicodeDecodeError as e:
        raise CalibrationError(f"calibration file {path} is not UTF-8 text: {e}") from e
    except OSError as e:
        raise CalibrationError(f"cannot read calibration file {path}: {e}") from e
    if not text.strip():
        raise CalibrationError(f"calibration file {path} holds no text")
    return text


def read_calibration_texts(paths: Sequence[str | Path]) -> list[str]:
    if not paths:
        raise CalibrationError("no calibration file given")
    return [read_calibration_text(p) for p in paths]


def _read_jsonl(path: Path) -> str:
    texts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationError(f"{path}, line {number}: not JSON ({e.msg})") from e
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CalibrationError(f'{path}, line {number}: no string field "text"')
            texts.append(record["text"])
    return "\n\n".join(texts)


def _read_parquet(path: Path) -> str:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CalibrationError(
            f"reading {path} needs the package pyarrow (pip install pyarrow), "
            "or pass the text as .txt or .jsonl"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own error types for a damaged file
        raise CalibrationError(f"cannot read parquet file {path}: {e}") from e
    columns = [c for c in table.column_names if _is_string_column(table.schema.field(c).type)]
    if not columns:
        raise CalibrationError(f"parquet file {path} has no text column")
    column = "text" if "text" in columns else columns[0]
    return "\n\n".join(str(v) for v in table.column(column).to_pylist() if v)


def _is_string_column(arrow_type: object) -> bool:
    return str(arrow_type) in ("string", "large_string")


def default_calibration_texts(names: Sequence[str] = DEFAULT_SOURCES) -> list[str]:
    return [_drop_doc_markup((DATA_DIR / name).read_text(encoding="utf-8")) for name in names]


def _drop_doc_markup(raw: str) -> str:
    """Articles of a `<doc …>` file joined by blank lines, without the markup lines (the
    header is attribution, not text); any other text as it is."""
    if not raw.lstrip().startswith("<doc"):
        return raw
    # Strip first: every article but the first begins with the newline after "</doc>".
    articles = [a.strip().split("\n", 1)[-1].strip() for a in raw.split("</doc>")]
    return "\n\n".join(a for a in articles if a)


def calibration_rows(
    tokenizer: Encoder, texts: Sequence[str], rows: int, length: int
) -> torch.Tensor:
    """int64 [min(rows, available), length] token ids (see the module docstring)."""
    if rows <= 0 or length <= 0:
        raise CalibrationError(f"rows and length must be positive, got {rows} and {length}")
    per_source: list[list[torch.Tensor]] = []
    for text in texts:
        # Tokenize a generous prefix first (tokens are rarely over 8 characters); the whole
        # text only when the prefix falls short.
        prefix = text[: rows * length * 8]
        ids = torch.tensor(tokenizer.encode(prefix, add_bos=False), dtype=torch.int64)
        if ids.numel() < rows * length and len(prefix) < len(text):
            ids = torch.tensor(tokenizer.encode(text, add_bos=False), dtype=torch.int64)
        usable = ids.numel() // length * length
        per_source.append(list(ids[:usable].view(-1, length)) if usable else [])
    interleaved: list[torch.Tensor] = []
    for i in range(max((len(s) for s in per_source), default=0)):
        interleaved.extend(s[i] for s in per_source if i < len(s))
    if not interleaved:
        total = sum(len(tokenizer.encode(t, add_bos=False)) for t in texts)
        raise CalibrationError(
            f"the calibration text has {total} tokens, fewer than one row of {length}"
        )
    return torch.stack(interleaved[:rows])
