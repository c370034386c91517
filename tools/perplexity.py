"""Perplexity over fixed-length windows of a text, for any loader, measured one way.

    python tools/perplexity.py -m models/exl2-4.0 --text ../shared/data/wiki.utf8 \
        --window 1024 --windows 40 --start-fraction 0.8 --no-bos
    python tools/perplexity.py -m models/fp16 --loader transformers --text FILE
    python tools/perplexity.py -m models/fp16 --text FILE --cache-type q4 q6 q8 fp8 fp16
    python tools/perplexity.py -m models/exl2-4.0 --domains          # every held-out domain
    python tools/perplexity.py -m models/exl2-4.0 --domains wiki code --windows 8

Held-out domains (--domains; tools/heldout/README.md says where each text comes from and
that none of it is in the shipped calibration text): wiki, web, code, multilingual, chat.
Each is scored the one way the quantizer comparisons use: `--windows` (default 20) windows
of 1024 tokens from the start of its file, with BOS in front where the model's tokenizer
adds one (Gemma: without it its fp16 wiki perplexity is 19.2 instead of 11.5) and none where
it does not (SmolLM2), or none with --no-bos. Several models or domains print one table
(model rows, domain columns).

Contract (loader/perplexity.py, shared with tools/lora_compare.py and the LoRA lab): the
text from character `start_fraction·len` to the end is tokenized once (no BOS), cut into
consecutive non-overlapping windows of `window` tokens (a short tail is dropped) and the
first `windows` of them (all when not given) are scored. Each window goes through
`LoadedModel.token_nll(ids)` (with a BOS token in front unless --no-bos), and every token of
the window after its first (every token, with BOS) is predicted from the tokens before it
in the window. Perplexity = exp(Σ NLL / number of predictions). The Kestrel and
transformers loaders are measured by the same code, so their numbers compare.

KV cache types (--cache-type, several for a table; the Kestrel loader): each window's
prefill writes K/V into the paged cache and attention reads every key back from there, the
keys of the window's own chunk included, so every prediction is made from quantized K/V,
as in decoding. --prefill-chunk below the window length additionally splits each window
into chunks (later chunks read earlier ones from the cache); with this write-then-read
design the numbers do not depend on it (beyond float rounding). The model is loaded once
per cache type.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import loader
from loader.base import LoadedModel
from loader.perplexity import NllSum, bos_id, text_windows, window_nll

ROOT = Path(__file__).resolve().parent.parent

HELDOUT_DIR = ROOT / "tools" / "heldout"
DOMAINS = ("wiki", "web", "code", "multilingual", "chat")
DOMAIN_WINDOWS = 20  # windows of 1024 tokens per domain, as in the measurement


def domain_texts(names: list[str] | None = None, directory: Path = HELDOUT_DIR) -> dict[str, str]:
    """{domain: held-out text} for `names` (all DOMAINS when None or empty)."""
    texts = {}
    for name in names or DOMAINS:
        path = directory / f"{name}.utf8"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in directory.glob("*.utf8")))
            raise SystemExit(f"no held-out text for domain '{name}' ({path}); known: {known}")
        texts[name] = path.read_text(encoding="utf-8")
    return texts


def domain_perplexities(
    model: LoadedModel,
    texts: dict[str, str],
    *,
    window: int = 1024,
    windows: int = DOMAIN_WINDOWS,
    progress: bool = False,
    add_bos: bool | None = None,
) -> dict[str, float]:
    """{domain: perplexity}: each text's first `windows` windows of `window` tokens, BOS in
    front as `add_bos` says (None: where the model's tokenizer adds one). The model needs
    `window + 1` positions when a BOS goes in front."""
    bos = model_adds_bos(model) if add_bos is None else add_bos
    out = {}
    for name, text in texts.items():
        if progress:
            print(f"{name}:", file=sys.stderr)
        out[name] = perplexity(
            model, text, window=window, windows=windows, add_bos=bos, progress=progress
        )
    return out


def model_adds_bos(model: LoadedModel) -> bool:
    """Whether the model's tokenizer puts BOS in front of a text (tokenizer_config's
    add_bos_token, else what its tokenizer.json does): how the model reads text in use."""
    tokenizer = model.backend.tokenizer
    return bool(tokenizer.add_bos_default and tokenizer.bos_token_id is not None)


def bos_words(add_bos: bool | None) -> str:
    """How a table's windows began, for its caption."""
    if add_bos is None:
        return "BOS in front where the model's tokenizer adds one"
    return "BOS in front" if add_bos else "no BOS"


def eval_options(model_dir: str | Path, loader_name: str | None) -> dict[str, bool]:
    """Loader options for scoring alone: the Kestrel loader captures no decode CUDA graphs
    (perplexity never decodes; on a GPU each load would capture one per batch bucket)."""
    name = loader_name or loader.detect(Path(model_dir))
    return {"cuda_graphs": False} if name == "kestrel" else {}


def domain_table(rows: dict[str, dict[str, float]]) -> str:
    """A Markdown table: one row per model, one column per domain."""
    domains = list(next(iter(rows.values())))
    lines = ["| model | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]
    for label, ppl in rows.items():
        lines.append(f"| {label} | " + " | ".join(f"{ppl[d]:.2f}" for d in domains) + " |")
    return "\n".join(lines)


def perplexity(
    model: LoadedModel,
    text: str,
    *,
    window: int = 1024,
    windows: int | None = None,
    start_fraction: float = 0.0,
    add_bos: bool = True,
    progress: bool = False,
) -> float:
    chunks = text_windows(
        model, text, window=window, windows=windows, start_fraction=start_fraction
    )
    bos = bos_id(model, add_bos)
    total = NllSum()
    started = time.perf_counter()
    for i, chunk in enumerate(chunks):
        total.add(window_nll(model, chunk, bos=bos))
        if progress:
            rate = (i + 1) / (time.perf_counter() - started)
            print(
                f"\rwindow {i + 1}/{len(chunks)}  ppl {total.perplexity:.4f}  {rate:.2f} windows/s",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)
    return total.perplexity


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description="Perplexity of a model over windows of a text.")
    p.add_argument("-m", "--model", required=True, nargs="+", help="model directory (several "
                   "with --domains)")  # fmt: skip
    p.add_argument("--loader", help="kestrel, transformers, ... (default: auto)")
    p.add_argument("--text", help="UTF-8 text file")
    p.add_argument(
        "--domains", nargs="*", help=f"held-out domains (none named: all of {', '.join(DOMAINS)})"
    )
    p.add_argument("--window", type=int, default=1024, help="tokens per window")
    p.add_argument(
        "--windows", type=int, help=f"windows to score (default: all; {DOMAIN_WINDOWS} a domain)"
    )
    p.add_argument("--start-fraction", type=float, default=0.0, help="skip this part of the text")
    p.add_argument("--no-bos", action="store_true", help="do not put BOS in front of windows")
    p.add_argument("--device", help="cpu or cuda (default: the loader's choice)")
    p.add_argument("--dtype", help="float16, bfloat16 or float32 (default: the loader's)")
    p.add_argument(
        "--cache-type",
        nargs="+",
        default=None,
        help="KV cache type(s): fp16 fp8 q8 q6 q4; several print a table (Kestrel loader)",
    )
    p.add_argument("--prefill-chunk", type=int, help="tokens per prefill chunk (Kestrel loader)")
    args = p.parse_args(argv)
    if (args.text is None) == (args.domains is None):
        p.error("give either --text FILE or --domains [NAME ...]")
    if args.domains is not None:
        return _domains_main(args)
    if len(args.model) > 1:
        p.error("several models need --domains")
    args.model = args.model[0]
    text = Path(args.text).read_text(encoding="utf-8")
    extra: dict[str, object] = dict(eval_options(args.model, args.loader))
    if args.prefill_chunk is not None:
        extra["prefill_chunk"] = args.prefill_chunk
    results: list[tuple[str, float]] = []
    for cache_type in args.cache_type or [None]:
        if cache_type is not None:
            extra["cache_type"] = cache_type
        model = loader.load(
            args.model,
            args.loader,
            device=args.device,
            dtype=args.dtype,
            max_seq_len=args.window + (0 if args.no_bos else 1),
            **extra,
        )
        ppl = perplexity(
            model,
            text,
            window=args.window,
            windows=args.windows,
            start_fraction=args.start_fraction,
            add_bos=not args.no_bos,
            progress=True,
        )
        label = f", cache {cache_type}" if cache_type else ""
        print(
            f"perplexity {ppl:.4f}  ({args.model}, {model.loader_name}, window {args.window}"
            f"{label})"
        )
        results.append((cache_type or "default", ppl))
        model.unload()
    if len(results) > 1:
        base = dict(results).get("fp16", results[0][1])
        print("\n| cache type | perplexity | vs fp16 |\n|---|---|---|")
        for name, ppl in results:
            print(f"| {name} | {ppl:.4f} | {ppl - base:+.4f} ({(ppl / base - 1) * 100:+.2f}%) |")
    return results[-1][1]


def _domains_main(args: argparse.Namespace) -> float:
    texts = domain_texts(args.domains)
    rows: dict[str, dict[str, float]] = {}
    for model_dir in args.model:
        model = loader.load(
            model_dir,
            args.loader,
            device=args.device,
            dtype=args.dtype,
            max_seq_len=args.window + 1,  # room for a BOS in front
            **eval_options(model_dir, args.loader),
        )
        try:
            rows[model_dir] = domain_perplexities(
                model,
                texts,
                window=args.window,
                windows=args.windows or DOMAIN_WINDOWS,
                progress=True,
                add_bos=False if args.no_bos else None,
            )
        finally:
            model.unload()
        print(f"{model_dir}: " + "  ".join(f"{d} {v:.4f}" for d, v in rows[model_dir].items()))
    bos = bos_words(False if args.no_bos else None)
    print(f"\n{args.windows or DOMAIN_WINDOWS} windows of {args.window} tokens a domain, {bos}\n")
    print(domain_table(rows))
    return next(iter(rows[args.model[-1]].values()))


if __name__ == "__main__":
    main()
