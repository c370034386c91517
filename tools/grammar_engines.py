"""Compare the token-mask engines Kestrel could use: llguidance and xgrammar.

For each engine and each tokenizer (a model directory or a bare tokenizer directory):
- coverage: which of the test schemas (tests/data/constrained/tool_schemas.json) and GBNF
  grammars (tests/data/constrained/*.gbnf) compile, and whether a valid instance of each is
  accepted token by token;
- time: compile time per schema, and the mask time per token (compute the next token's
  bitmask, then consume the token) over those instances, median and p99 in microseconds.

    python3 tools/grammar_engines.py --tokenizer models/SmolLM2-135M-Instruct-fp16 \
        --tokenizer /tmp/llama3-tokenizer --json OUT.json

xgrammar is not a Kestrel dependency: install it next to llguidance to run this (the engine
missing is reported, not fatal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "constrained"

# One valid instance per schema (what a tool call could send).
INSTANCES: dict[str, Any] = {
    "get_current_weather": {"location": "Paris, France", "unit": "celsius"},
    "book_flight": {"origin": "SFO", "destination": "JFK", "passengers": 2, "cabin": "economy"},
    "create_calendar_event": {
        "title": "Team sync", "start": {"hour": 9, "minute": 30}, "duration_minutes": 45
    },
    "search_products": {"query": "garden hose", "max_price": 49.5, "categories": ["garden"]},
    "send_email": {"to": ["ann@example.com"], "subject": "Lunch", "priority": "normal"},
    "set_thermostat": {"room": "office", "temperature": 21.5, "mode": "heat"},
    "create_order": {
        "customer": {"name": "Ada", "vip": True}, "items": [{"sku": "SKU-0042", "quantity": 3}]
    },
    "get_stock_price": {"ticker": "NVDA", "exchange": "NASDAQ", "include_history": False},
    "translate_text": {
        "text": "Good morning", "source_language": "en", "target_language": "fr",
        "formality": None,
    },
    "schedule_reminder": {
        "message": "Stretch", "delay": {"amount": 2, "unit": "hours"}, "repeat": True,
        "tags": ["health"],
    },
}  # fmt: skip

GRAMMAR_SAMPLES = {
    "arithmetic": "(2+y)*3=x\nfoo/7=bar\n",
    "json": '{"a": [1, 2.5, true, null], "b": {"c": "d"}}',
    "list": "- milk\n- eggs\n- bread\n",
    "chess": "1. e4 e5\n2. Nf3 Nc6\n3. Bb5 a6\n",
}


def _hf_tokenizer(path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_dir: Path) -> None:
        import llguidance
        import llguidance.hf

        self.lib = llguidance
        hf = _hf_tokenizer(tokenizer_dir)
        self.hf = hf
        start = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf)
        self.tokenizer_seconds = time.perf_counter() - start
        self.vocab = self.tok.vocab_size

    def compile(self, kind: str, text: str) -> Any:
        fmt = {"schema": "json_schema", "gbnf": "gbnf"}[kind]
        grammar = self.lib.grammar_from(fmt, text)
        matcher = self.lib.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def new_mask(self) -> Any:
        import llguidance.torch as lt

        return lt.allocate_token_bitmask(1, self.vocab)

    def step(self, matcher: Any, mask: Any, token: int) -> bool:
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(matcher, mask)
        allowed = bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
        return allowed and matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_dir: Path) -> None:
        import xgrammar

        self.lib = xgrammar
        hf = _hf_tokenizer(tokenizer_dir)
        self.hf = hf
        start = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.tokenizer_seconds = time.perf_counter() - start
        self.vocab = self.info.vocab_size

    def compile(self, kind: str, text: str) -> Any:
        if kind == "schema":
            compiled = self.compiler.compile_json_schema(text, strict_mode=True)
        else:
            compiled = self.compiler.compile_grammar(text)
        return self.lib.GrammarMatcher(compiled)

    def new_mask(self) -> Any:
        return self.lib.allocate_token_bitmask(1, self.vocab)

    def step(self, matcher: Any, mask: Any, token: int) -> bool:
        matcher.fill_next_token_bitmask(mask)
        allowed = bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
        return allowed and matcher.accept_token(token)


def _cases() -> list[tuple[str, str, str, str]]:
    """(name, kind, grammar text, a string it accepts)."""
    schemas = json.loads((DATA / "tool_schemas.json").read_text())
    cases = [
        (name, "schema", json.dumps(schema), json.dumps(INSTANCES[name]))
        for name, schema in schemas.items()
    ]
    for name, sample in GRAMMAR_SAMPLES.items():
        cases.append((f"gbnf:{name}", "gbnf", (DATA / f"{name}.gbnf").read_text(), sample))
    return cases


def measure(engine_type: Callable[[Path], Any], tokenizer_dir: Path) -> dict[str, Any]:
    try:
        engine = engine_type(tokenizer_dir)
    except ImportError as error:
        return {"error": f"not installed ({error})"}
    per_case, times = {}, []
    for name, kind, text, sample in _cases():
        ids = engine.hf.encode(sample, add_special_tokens=False)
        start = time.perf_counter()
        try:
            matcher = engine.compile(kind, text)
        except Exception as error:  # a library's own error type: report it, go on
            per_case[name] = {"compiles": False, "error": str(error)[:300]}
            continue
        compile_s = time.perf_counter() - start
        mask = engine.new_mask()
        steps, accepted = [], True
        for token in ids:
            start = time.perf_counter()
            ok = engine.step(matcher, mask, token)
            steps.append(time.perf_counter() - start)
            if not ok:
                accepted = False
                break
        times += steps
        per_case[name] = {
            "compiles": True,
            "accepts_sample": accepted,
            "compile_ms": round(compile_s * 1e3, 2),
            "tokens": len(ids),
            "mask_us_median": round(statistics.median(steps) * 1e6, 1),
        }
    return {
        "vocab": engine.vocab,
        "tokenizer_setup_s": round(engine.tokenizer_seconds, 3),
        "compiled": sum(c["compiles"] for c in per_case.values()),
        "accepted": sum(c.get("accepts_sample", False) for c in per_case.values()),
        "cases": len(per_case),
        "mask_us_median": round(statistics.median(times) * 1e6, 1) if times else None,
        "mask_us_p99": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1e6, 1)
        if times
        else None,
        "mask_us_mean": round(statistics.fmean(times) * 1e6, 1) if times else None,
        "per_case": per_case,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, action="append", required=True)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    for tokenizer_dir in args.tokenizer:
        for engine_type in (Llguidance, Xgrammar):
            result = measure(engine_type, tokenizer_dir)
            results[f"{engine_type.name} @ {tokenizer_dir.name}"] = result
            summary = {k: v for k, v in result.items() if k != "per_case"}
            print(f"{engine_type.name} @ {tokenizer_dir}: {json.dumps(summary)}")
            for name, case in result.get("per_case", {}).items():
                if not case.get("accepts_sample"):
                    print(f"    {name}: {case}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
