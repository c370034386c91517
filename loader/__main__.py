"""Command-line generation: `python -m loader [MODEL_DIR] -p "prompt"`.

Without MODEL_DIR the default model (SmolLM2-135M-Instruct) is prepared on first use.

Prints the completion as it streams, then tokens/s. `--chat` wraps the prompt in the
model's chat template. `--lora DIR[=SCALE]` (repeatable) loads PEFT adapters and applies
them at their scales (default 1.0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import loader
from engine.sampling_settings import SamplingSettingsError
from engine.tensor_parallel.launched import launched_rank
from loader import early_ranks
from loader.placement_args import add_placement_arguments, placement_options
from loader.program_name import program_name

# The checkout's models/ (where ui.py looks too), wherever the command is run from.
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        early_ranks.discard()  # ranks started for a load that never took them


def _main(argv: list[str] | None) -> int:
    # --tp N: the other ranks start now, before this process imports torch (building the
    # parser below lists the loaders, which imports it), so that their start-up runs beside
    # this one's.
    early_ranks.prestart_from_argv(sys.argv[1:] if argv is None else argv)
    from loader.hub import resolve_model
    from loader.kestrel_loader import serve_tensor_parallel_rank

    parser = argparse.ArgumentParser(prog=program_name("python -m loader"), description=__doc__)
    parser.add_argument(
        "model",
        nargs="?",
        help="model directory (Hugging Face layout), a name in --models-dir, or a Hugging Face "
        "id (owner/name, or owner/name:branch) downloaded into --models-dir once; default: "
        "SmolLM2-135M-Instruct, prepared in --models-dir on first use",
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=MODELS_DIR,
        help="where named, downloaded and default models live (default: models/ of the checkout)",
    )
    parser.add_argument("-p", "--prompt", default="Once upon a time,")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--loader", default=None, choices=loader.available())
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: a GPU)")
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32")
    parser.add_argument("--max-seq-len", type=int, default=None)
    add_placement_arguments(parser)
    parser.add_argument(
        "--cache-type",
        default="fp16",
        help="KV cache storage: fp16 (the model's dtype), fp8, q8, q6 or q4",
    )
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("-t", "--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=-1)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--ban",
        action="append",
        default=[],
        metavar="STRING",
        help="banned string, never generated (case-insensitive; repeatable)",
    )
    parser.add_argument(
        "--speculative",
        choices=["ngram", "draft"],
        default=None,
        help="speculative decoding: ngram (prompt lookup) or draft (needs --draft-model)",
    )
    parser.add_argument(
        "--draft-model", default=None, help="draft model directory (same tokenizer)"
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, default=None, help="tokens drafted per step (default 4)"
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="accepted for compatibility: decode is always bitwise reproducible on one GPU "
        "(same prompt, settings and seed: same tokens and logits every run)",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="DIR[=SCALE]",
        help="PEFT LoRA adapter directory, optionally with its scale (repeatable)",
    )
    args = parser.parse_args(argv)

    settings = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "do_sample": args.temperature > 0,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "stop": args.stop,
        "banned_strings": args.ban,
    }
    # Only what was asked for: other loaders do not know these options.
    kestrel_options = {
        key: value
        for key, value in (
            ("speculative", args.speculative),
            ("draft_model", args.draft_model),
            ("num_draft_tokens", args.num_draft_tokens),
            ("deterministic", args.deterministic or None),
        )
        if value is not None
    }
    model = None
    last = None
    try:
        if args.model is None:
            from loader.default_model import ensure_default_model

            args.model = str(ensure_default_model(args.models_dir))
            print(f"model: {args.model} (the default)", file=sys.stderr)
        else:  # a name, a path or a Hugging Face id (downloaded first)
            args.model = str(resolve_model(args.model, args.models_dir))
        rank = launched_rank()
        if args.tp is not None and rank is not None and rank.rank > 0:
            # torchrun started this process as another rank: serve rank 0, print nothing.
            # It loads with rank 0's options, which rank 0 sends (not this command line's).
            serve_tensor_parallel_rank(Path(args.model))
            return 0
        model = loader.load(
            args.model,
            args.loader,
            device=args.device,
            dtype=args.dtype,
            max_seq_len=args.max_seq_len,
            **placement_options(args),
            **kestrel_options,
            cache_type=args.cache_type,
        )
        if args.tp is not None or args.gpu_split or args.autosplit:
            print(f"placement: {model.info().get('placement')}", file=sys.stderr)
        selection = {}
        for spec in args.lora:
            path, scale = _lora_spec(spec)
            selection[model.load_lora(path)] = scale
        if selection:
            model.set_loras(selection)
        prompt = args.prompt
        if args.chat:
            prompt = model.apply_chat_template([{"role": "user", "content": prompt}])
            settings["add_bos_token"] = False  # the template writes its own BOS
        for chunk in model.stream(prompt, settings):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
    except (ValueError, OSError, SamplingSettingsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if model is not None:
            model.unload()  # stops tensor-parallel worker processes
    if last is not None:
        print(
            f"\n\n[{last.prompt_tokens} prompt tokens in {last.prompt_seconds:.2f} s, "
            f"{last.generated_tokens} tokens at {last.tokens_per_second:.1f} tokens/s, "
            f"finish: {last.finish_reason}"
            + (
                f", {last.accepted_tokens}/{last.draft_tokens} drafts accepted"
                if last.draft_tokens
                else ""
            )
            + "]",
            file=sys.stderr,
        )
    return 0


def _lora_spec(spec: str) -> tuple[str, float]:
    path, sep, scale = spec.rpartition("=")
    if sep:
        try:
            return path, float(scale)
        except ValueError:
            pass  # an "=" inside the path
    return spec, 1.0


if __name__ == "__main__":
    raise SystemExit(main())
