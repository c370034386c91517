"""Compare LoRA variants side by side: prompts × variants (the base model, adapters, mixes
with scales) generated as one continuous batch with the same sampling settings and seed
(loader/lora_grid.py), printed as a table and saved as JSON and/or Markdown; on request each
variant's perplexity on a text file, over the same windows for all.

    python tools/lora_compare.py -m models/Llama-3-8B-exl2 \
        --lora loras/pirate formal=loras/formal-v2 \
        --variant base pirate formal "pirate=0.5 + formal=0.5" \
        --prompt "Tell me about ships." --prompt "Write a haiku." --chat \
        --max-new-tokens 64 --seed 1 --ppl-text notes.txt --json grid.json --markdown grid.md

Without --variant: the base, each adapter alone, and (two or more) an even mix of all.
Sampling is greedy unless --temperature is given; other settings by TGW name with --set
(`--set top_k=40 min_p=0.05`). A saved grid opens in the web UI's LoRA tab when it is
written under user_data/lora_grids/.

Benchmark on a GPU (tools/bench.py's random-weight models of real shapes, random adapters
of different ranks and target modules, random prompts):

    python tools/lora_compare.py --shape llama3-8b --format gptq --random-loras 6 \
        --random-prompts 1 --max-new-tokens 128 --sequential --json lora-grid.json

--sequential also runs the variants one after another (each on its own, after a warm-up of
both ways) and reports the batch's aggregate tok/s against theirs, and how many cells got
the same text both ways.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import torch

import loader
from loader.base import LoadedModel
from loader.lora_grid import (
    LoraGrid,
    Variant,
    grid_perplexity,
    parse_variants,
    run_grid,
    variant_label,
)

ROOT = Path(__file__).resolve().parent.parent

# Random adapters of --random-loras: ranks and target modules in turn, so one batch mixes
# adapters that touch different linears with different ranks.
RANDOM_RANKS = (8, 16, 32, 64)
RANDOM_TARGETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
    "qv": ["q_proj", "v_proj"],
}
BENCH_PROMPT_TOKENS = 128


def parse_lora(spec: str) -> tuple[str, Path]:
    """ "DIR" (named after the directory) or "NAME=DIR"."""
    name, sep, path = spec.partition("=")
    if sep and name and "/" not in name:
        return name, Path(path)
    return Path(spec).name, Path(spec)


def default_variants(names: list[str]) -> list[Variant]:
    """The base, each adapter alone, and (two or more) an even mix of all."""
    specs = ["base", *names]
    if len(names) > 1:
        specs.append(variant_label({n: round(1 / len(names), 4) for n in names}))
    return parse_variants(specs)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "seed": args.seed}
    if args.temperature is None:
        settings["temperature"] = 0  # greedy: the comparison shows the adapters, not luck
    else:
        settings["temperature"] = args.temperature
    if args.ban_eos:
        settings["ban_eos_token"] = True
    for item in args.set or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        try:
            settings[key] = json.loads(raw)
        except json.JSONDecodeError:
            settings[key] = raw  # a plain string
    return settings


def random_adapters(work: Path, shape: str, count: int) -> list[tuple[str, Path]]:
    from tools.bench_lora import build_adapter

    out = []
    kinds = list(RANDOM_TARGETS)
    for i in range(count):
        rank, kind = RANDOM_RANKS[i % len(RANDOM_RANKS)], kinds[i % len(kinds)]
        name = f"r{rank}-{kind}-{i}"
        path = work / f"{shape}-lora-{name}"
        build_adapter(path, shape, rank, seed=100 + i, targets=RANDOM_TARGETS[kind])
        out.append((name, path))
    return out


def load_model(args: argparse.Namespace, cells: int) -> LoadedModel:
    options: dict[str, Any] = {}
    for item in args.option or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    if args.shape:
        from tools.bench import build_model

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        path = build_model(Path(args.work) / f"{args.shape}-{args.format}", args.shape,
                           args.format, device=device)  # fmt: skip
        per_job = args.prompt_tokens + args.max_new_tokens + 16
        options.setdefault("max_batch", max(cells, 1))
        options.setdefault("cache_tokens", (cells + 1) * (per_job + 64))
        options.setdefault("prefix_caching", False)
        return loader.load(path, "kestrel", device=device, dtype=args.dtype or "float16",
                           max_seq_len=per_job, **options)  # fmt: skip
    return loader.load(args.model, args.loader, device=args.device, dtype=args.dtype, **options)


def run_sequential(
    model: LoadedModel, grid: LoraGrid, prompt_ids: list[list[int]] | None
) -> list[LoraGrid]:
    """Each variant on its own (all prompts of it in one batch), one after another."""
    singles = []
    for variant in grid.variants:
        one = LoraGrid(
            grid.model, grid.prompts, [variant], grid.settings, grid.seed, grid.chat_template
        )
        for _ in run_grid(model, one, prompt_ids=prompt_ids):
            pass
        singles.append(one)
    return singles


def print_grid(grid: LoraGrid, width: int = 100) -> None:
    ppl = (grid.perplexity or {}).get("values") or {}
    for i, prompt in enumerate(grid.prompts):
        print(f"\n== prompt {i + 1}: {textwrap.shorten(prompt, width - 16)}")
        for variant, cell in zip(grid.variants, grid.cells[i], strict=True):
            numbers = f"{cell.tokens} tokens, {cell.tokens_per_second:.1f} tok/s"
            if variant.label in ppl:
                numbers += f", ppl {ppl[variant.label]:.4f}"
            print(f"-- {variant.label} ({numbers}, {cell.finish_reason})")
            print(textwrap.indent(textwrap.fill(cell.text, width) or "(empty)", "   "))
    print(
        f"\nbatch: {len(grid.prompts)} prompt(s) x {len(grid.variants)} variant(s) = "
        f"{len(grid.prompts) * len(grid.variants)} jobs, {grid.total_tokens} tokens in "
        f"{grid.seconds:.2f} s: {grid.tokens_per_second:.1f} tok/s together"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_argument_group("model")
    src.add_argument("-m", "--model", help="model directory")
    src.add_argument("--loader", help="kestrel (per-request LoRA) or another (default: auto)")
    src.add_argument("--device", help="cpu or cuda (default: the loader's choice)")
    src.add_argument("--dtype", help="float16, bfloat16 or float32 (default: the loader's)")
    src.add_argument("--option", nargs="+", help="loader options KEY=VALUE (JSON values)")
    src.add_argument("--shape", help="instead of -m: tools/bench.py's random model of this shape")
    src.add_argument("--format", default="gptq", choices=["gptq", "exl2"], help="with --shape")
    src.add_argument("--work", default="/tmp/kestrel-bench", help="where --shape files live")
    grid = p.add_argument_group("grid")
    grid.add_argument("--lora", nargs="+", default=[], help="adapters: DIR or NAME=DIR")
    grid.add_argument("--random-loras", type=int, default=0,
                      help="with --shape: N random adapters (ranks, targets vary)")  # fmt: skip
    grid.add_argument("--variant", nargs="+", help='base, NAME, NAME=0.5, "A=0.5 + B=0.5"')
    grid.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    grid.add_argument("--prompts-file", type=Path, help="prompts, one per line")
    grid.add_argument("--random-prompts", type=int, default=0,
                      help="this many prompts of random token ids (benchmarks)")  # fmt: skip
    grid.add_argument("--prompt-tokens", type=int, default=BENCH_PROMPT_TOKENS,
                      help="tokens of each random prompt")  # fmt: skip
    grid.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    sampling = p.add_argument_group("sampling (the same for every cell)")
    sampling.add_argument("--max-new-tokens", type=int, default=64)
    sampling.add_argument("--temperature", type=float, help="default: 0 (greedy)")
    sampling.add_argument("--seed", type=int, default=0, help="-1: one random seed for all")
    sampling.add_argument("--ban-eos", action="store_true", help="never stop at EOS")
    sampling.add_argument("--set", nargs="+", help="other settings KEY=VALUE (TGW names)")
    ppl = p.add_argument_group("perplexity per variant")
    ppl.add_argument("--ppl-text", type=Path, help="UTF-8 text file to score every variant on")
    ppl.add_argument("--ppl-window", type=int, default=512, help="tokens per window")
    ppl.add_argument("--ppl-windows", type=int, default=8, help="windows (0: all)")
    ppl.add_argument("--ppl-start-fraction", type=float, default=0.0)
    ppl.add_argument("--no-bos", action="store_true", help="no BOS in front of windows")
    out = p.add_argument_group("output")
    out.add_argument("--sequential", action="store_true",
                     help="also run the variants one after another and compare tok/s")  # fmt: skip
    out.add_argument("--warmup", type=int, help="untimed runs first (default: 1 on a GPU)")
    out.add_argument("--json", type=Path, help="write the grid (and the comparison) here")
    out.add_argument("--markdown", type=Path, help="write the grid as Markdown here")
    out.add_argument("--quiet", action="store_true", help="print only the summary")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if bool(args.model) == bool(args.shape):
        raise SystemExit("give a model (-m DIR) or a benchmark shape (--shape), one of them")
    if args.random_loras and not args.shape:
        raise SystemExit("--random-loras builds adapters for a --shape model")
    adapters = [parse_lora(s) for s in args.lora]
    if args.shape:
        adapters += random_adapters(Path(args.work), args.shape, args.random_loras)
        args.ban_eos = True  # random weights: every job writes its max_new_tokens
    variants = (
        parse_variants(args.variant) if args.variant else default_variants([n for n, _ in adapters])
    )
    prompts = list(args.prompt)
    if args.prompts_file:
        text = args.prompts_file.read_text(encoding="utf-8")
        prompts += [line for line in text.splitlines() if line.strip()]
    count = len(prompts) + args.random_prompts
    if count == 0:
        raise SystemExit("no prompts: --prompt, --prompts-file or --random-prompts")
    model = load_model(args, count * len(variants))
    try:
        for name, path in adapters:
            model.load_lora(path, name)
        prompt_ids = None
        if args.random_prompts:
            vocab = int(model.logits([0]).shape[-1])  # the head's width, any loader
            gen = torch.Generator().manual_seed(args.seed if args.seed >= 0 else 0)
            random = [
                torch.randint(2, vocab, (args.prompt_tokens,), generator=gen).tolist()
                for _ in range(args.random_prompts)
            ]
            prompt_ids = [model.encode(p, add_bos=True) for p in prompts] + random
            prompts += [model.decode(ids[:12]) + " ..." for ids in random]
        settings = settings_from_args(args)
        grid = LoraGrid.new(model, prompts, variants, settings, chat_template=args.chat)
        warmup = args.warmup if args.warmup is not None else int(torch.cuda.is_available())
        for _ in range(warmup):  # compiles kernels, captures the batch sizes' graphs
            for _ in run_grid(model, grid, prompt_ids=prompt_ids):
                pass
            if args.sequential:
                run_sequential(model, grid, prompt_ids)
        for _ in run_grid(model, grid, prompt_ids=prompt_ids):
            pass
        result: dict[str, Any] = {"device": _device_name(model), "torch": torch.__version__}
        if args.shape:
            result.update(shape=args.shape, format=args.format, prompt_tokens=args.prompt_tokens)
        result["adapters"] = {n: str(p) for n, p in adapters}
        result["batch"] = {
            "jobs": len(prompts) * len(variants),
            "tokens": grid.total_tokens,
            "seconds": round(grid.seconds, 4),
            "tokens_per_second": round(grid.tokens_per_second, 2),
        }
        if args.sequential:
            singles = run_sequential(model, grid, prompt_ids)
            tokens = sum(s.total_tokens for s in singles)
            seconds = sum(s.seconds for s in singles)
            same = sum(
                singles[j].cells[i][0].text == grid.cells[i][j].text
                for i in range(len(prompts))
                for j in range(len(variants))
            )
            result["sequential"] = {
                "tokens": tokens,
                "seconds": round(seconds, 4),
                "tokens_per_second": round(tokens / seconds, 2) if seconds else 0.0,
                "per_variant_tokens_per_second": {
                    v.label: round(s.tokens_per_second, 2)
                    for v, s in zip(variants, singles, strict=True)
                },
            }
            result["speedup"] = round(grid.tokens_per_second * seconds / tokens, 3)
            result["cells_equal_to_sequential"] = f"{same}/{len(prompts) * len(variants)}"
        if args.ppl_text:
            text = args.ppl_text.read_text(encoding="utf-8")
            for _ in grid_perplexity(
                model,
                grid,
                text,
                source=str(args.ppl_text),
                window=args.ppl_window,
                windows=args.ppl_windows or None,
                start_fraction=args.ppl_start_fraction,
                add_bos=not args.no_bos,
            ):
                pass
            result["perplexity"] = grid.perplexity
        result["grid"] = grid.to_json()
    finally:
        model.unload()
    if not args.quiet:
        print_grid(grid)
    _print_summary(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(grid.to_markdown(), encoding="utf-8")
    return result


def _print_summary(result: dict[str, Any]) -> None:
    batch = result["batch"]
    line = (
        f"{result['device']}: {batch['jobs']} jobs in one batch: "
        f"{batch['tokens_per_second']:.1f} tok/s together"
    )
    if "sequential" in result:
        seq = result["sequential"]
        line += (
            f"; one variant after another: {seq['tokens_per_second']:.1f} tok/s "
            f"(batch {result['speedup']:.2f}x); cells equal both ways: "
            f"{result['cells_equal_to_sequential']}"
        )
    print(line)
    for label, value in ((result.get("perplexity") or {}).get("values") or {}).items():
        print(f"perplexity {label}: {value:.4f}")


def _device_name(model: LoadedModel) -> str:
    devices = model.info().get("devices") or []
    first = str(devices[0]) if devices else "cpu"
    if first.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(first))
    return first


if __name__ == "__main__":
    main()
