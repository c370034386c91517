"""Command-line generation: `python -m loader [MODEL_DIR] -p "prompt"`.

Without MODEL_DIR the default model (SmolLM2-135M-Instruct) is prepared on first use.

Prints the completion as it streams, then tokens/s. `--chat` wraps the prompt in the
model's chat template.
"""

from __future__ import annotations

import argparse
import sys

import loader
from engine.sampling_settings import SamplingSettingsError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loader", description=__doc__)
    parser.add_argument(
        "model",
        nargs="?",
        help="model directory (Hugging Face layout); default: SmolLM2-135M-Instruct, "
        "downloaded into models/ on first use",
    )
    parser.add_argument("-p", "--prompt", default="Once upon a time,")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--loader", default=None, choices=loader.available())
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: a GPU)")
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32")
    parser.add_argument("--max-seq-len", type=int, default=None)
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
    }
    try:
        if args.model is None:
            from loader.default_model import ensure_default_model

            args.model = str(ensure_default_model())
            print(f"model: {args.model} (the default)", file=sys.stderr)
        model = loader.load(
            args.model,
            args.loader,
            device=args.device,
            dtype=args.dtype,
            max_seq_len=args.max_seq_len,
            cache_type=args.cache_type,
        )
        prompt = args.prompt
        if args.chat:
            prompt = model.apply_chat_template([{"role": "user", "content": prompt}])
            settings["add_bos_token"] = False  # the template writes its own BOS
        last = None
        for chunk in model.stream(prompt, settings):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
    except (ValueError, OSError, SamplingSettingsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if last is not None:
        print(
            f"\n\n[{last.prompt_tokens} prompt tokens in {last.prompt_seconds:.2f} s, "
            f"{last.generated_tokens} tokens at {last.tokens_per_second:.1f} tokens/s, "
            f"finish: {last.finish_reason}]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
