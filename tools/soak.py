"""Soak test of the OpenAI-compatible server: many concurrent streaming clients for a while,
random prompt lengths, max_tokens and client disconnects, then checks that nothing leaked.

    python tools/soak.py --model models/SmolLM2-135M-Instruct-exl2-4.0 --clients 64 \
        --duration 600 --json bench/results/soak.json
    python tools/soak.py --shape llama3-8b --format gptq --clients 64 --duration 600 \
        --json bench/results/soak-8b.json          # the random 8B model of tools/bench.py (GPU)

The server runs in this process (uvicorn in a thread, as `ui.py --api` runs it) so that its
scheduler and cache can be inspected; the clients are asyncio tasks with httpx in another
thread. Each client sends streaming /v1/completions requests back to back: a prompt of
random token ids (1..--max-prompt), max_tokens 1..--max-tokens, greedy or sampled, and with
probability --cancel-rate it disconnects after a random number of chunks. A warm-up round
(every client once, before the clock starts) lets the engine make its CUDA graphs and
allocator pools; the baselines are taken after it.

Checks (any failure: exit status 1, and the JSON says which):
- no server error: every request answered 200, no error event in a stream, nothing logged at
  ERROR level by the server, no client exception other than our own disconnects;
- the scheduler is idle afterwards and every cache page is free again (prefix-cached pages
  count as free: they are reclaimable);
- on a GPU, torch.cuda.memory_allocated() is back to the baseline (within --leak-mib).

Recorded: requests started / finished / cancelled, TTFT p50/p90/p99, inter-token latency
p50/p99 (between streamed chunks as the client receives them), time per output token per
request p50/p90/p99, aggregate tok/s, pages and memory before and after, the GPU,
torch and Triton versions.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import platform
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

import loader
from extensions.openai import run_api_server
from loader.base import LoadedModel
from loader.manager import ModelManager

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class SoakConfig:
    clients: int = 64
    duration: float = 600.0
    max_prompt: int = 1024
    max_tokens: int = 256
    cancel_rate: float = 0.2
    seed: int = 0
    leak_mib: float = 64.0  # allowed growth of torch.cuda.memory_allocated
    idle_timeout: float = 120.0  # for the scheduler to drain after the clients stop


@dataclass
class RequestResult:
    ttft: float | None = None  # seconds to the first streamed chunk with a token
    gaps: list[float] = field(default_factory=list)  # seconds between later chunks
    decode: float = 0.0  # seconds from the first chunk to the last
    tokens: int = 0
    cancelled: bool = False
    error: str | None = None


class _ErrorLog(logging.Handler):
    """Counts what the server logs at ERROR (error_for logs every 500 it makes)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def _one_request(
    client: httpx.AsyncClient, url: str, rng: random.Random, config: SoakConfig, vocab: int
) -> RequestResult:
    prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(1, config.max_prompt))]
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": rng.randint(1, config.max_tokens),
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "top_p": rng.choice([1.0, 0.9]),
        "seed": rng.randrange(2**31),
    }
    cancel_after = rng.randint(1, max(1, body["max_tokens"])) if (
        rng.random() < config.cancel_rate
    ) else None  # fmt: skip
    result = RequestResult()
    started = time.perf_counter()
    last = started
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                try:
                    event = json.loads(line[6:])
                except json.JSONDecodeError as error:
                    result.error = f"unparseable stream event ({error}): {line[:200]!r}"
                    return result
                if "error" in event:
                    result.error = f"error event: {event['error']}"
                    return result
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                if not event.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - started
                else:
                    result.gaps.append(now - last)
                    result.decode = now - started - result.ttft
                last = now
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    result.cancelled = True
                    result.tokens = chunks
                    return result  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def _clients(url: str, config: SoakConfig, vocab: int, warmup: bool) -> list[RequestResult]:
    results: list[RequestResult] = []
    deadline = time.perf_counter() + config.duration
    limits = httpx.Limits(max_connections=config.clients * 2, max_keepalive_connections=0)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker(index: int) -> None:
            rng = random.Random(config.seed * 100_003 + index + (7 if warmup else 0))
            while True:
                results.append(await _one_request(client, url, rng, config, vocab))
                if warmup or time.perf_counter() >= deadline:
                    return

        await asyncio.gather(*(worker(i) for i in range(config.clients)))
    return results


def _run_clients(url: str, config: SoakConfig, vocab: int, warmup: bool) -> list[RequestResult]:
    # A thread of its own, so the clients' event loop is not the server's.
    out: list[list[RequestResult]] = []
    thread = threading.Thread(
        target=lambda: out.append(asyncio.run(_clients(url, config, vocab, warmup))),
        name="soak-clients",
    )
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("the client thread failed (see the traceback above)")
    return out[0]


def wait_idle(model: LoadedModel, timeout: float) -> dict[str, Any]:
    """The scheduler's stats once nothing runs or waits (or after `timeout`)."""
    scheduler = model.backend.scheduler
    deadline = time.monotonic() + timeout
    stats = scheduler.stats()
    while (stats["running"] or stats["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = scheduler.stats()
    return stats


def page_failures(stats: dict[str, Any]) -> list[str]:
    failures = []
    if stats["running"] or stats["waiting"]:
        failures.append(
            f"the scheduler did not drain: {stats['running']} running, {stats['waiting']} waiting"
        )
    if stats["free_pages"] != stats["usable_pages"]:
        failures.append(
            f"cache pages leaked: {stats['usable_pages'] - stats['free_pages']} of "
            f"{stats['usable_pages']} still in use after every request ended"
        )
    return failures


def _memory() -> int | None:
    if not torch.cuda.is_available():
        return None
    gc.collect()  # finished jobs in reference cycles hold their samplers' tensors until then
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _record_allocation_sites(on: bool) -> None:
    """From the baseline on, CUDA allocations remember their Python stack (state only, not
    an event history), so memory still held at the end can be traced to its allocator."""
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history("state" if on else None, stacks="python")


def _growth_sites(top: int = 12) -> list[dict[str, Any]]:
    """Blocks allocated after the baseline and still live, summed by the innermost frame in
    the project's code (tools/soak.py and the server's threads excluded): where a growth
    of torch.cuda.memory_allocated() comes from."""
    if not torch.cuda.is_available():
        return []
    sites: dict[str, list[int]] = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            frames = block.get("frames") or []
            if block["state"] != "active_allocated" or not frames:
                continue  # free, or allocated before the baseline (no stack recorded)
            ours = [
                f
                for f in frames
                if str(ROOT) in f["filename"] and not f["filename"].endswith("soak.py")
            ]
            where = ours[:3] or frames[:1]
            key = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in where)
            entry = sites.setdefault(key, [0, 0])
            entry[0] += block["size"]
            entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"site": k, "mib": round(v[0] / 2**20, 2), "blocks": v[1]} for k, v in ranked]


def _latency(results: list[RequestResult], seconds: float) -> dict[str, Any]:
    ttft = [r.ttft for r in results if r.ttft is not None]
    gaps = [g for r in results for g in r.gaps]
    # Time per output token of each request (its decode time over its later chunks): robust
    # to chunks that reach the client together, which the gaps between chunks are not.
    tpot = [r.decode / len(r.gaps) for r in results if r.gaps]
    tokens = sum(r.tokens for r in results)
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "ttft_ms": {f"p{q}": ms(percentile(ttft, q)) for q in (50, 90, 99)},
        "inter_token_ms": {f"p{q}": ms(percentile(gaps, q)) for q in (50, 99)},
        "time_per_output_token_ms": {f"p{q}": ms(percentile(tpot, q)) for q in (50, 90, 99)},
        "completion_tokens": tokens,
        "tok_s_aggregate": round(tokens / seconds, 1) if seconds > 0 else None,
    }


def run_soak(model: LoadedModel, name: str, config: SoakConfig) -> dict[str, Any]:
    """Serve `model` on a free loopback port, soak it, and report (see the module doc)."""
    manager = ModelManager(Path(model.path).parent)
    manager.adopt(model, name)
    errors = _ErrorLog()
    logging.getLogger().addHandler(errors)
    server = run_api_server("127.0.0.1", 0, manager=manager)
    url = f"{server.url}/v1/completions"
    vocab = model.vocab_size
    try:
        warm = _run_clients(url, config, vocab, warmup=True)
        idle_before = wait_idle(model, config.idle_timeout)
        graphs = getattr(getattr(model, "engine", None), "graphs", None)
        if graphs is not None:
            # Graphs are captured on first use of a shape; capture them all now so that
            # their pools are part of the baseline and growth means a leak.
            with model.engine.lock:
                graphs.capture_all()
        captured_before = graphs.captured_bytes if graphs is not None else 0
        memory_before = _memory()
        _record_allocation_sites(True)
        started = time.perf_counter()
        results = _run_clients(url, config, vocab, warmup=False)
        seconds = time.perf_counter() - started
        idle_after = wait_idle(model, config.idle_timeout)
        memory_after = _memory()
        growth_sites = _growth_sites()
        captured = (graphs.captured_bytes if graphs is not None else 0) - captured_before
    finally:
        _record_allocation_sites(False)
        server.stop()
        logging.getLogger().removeHandler(errors)
    failures = [f"warm-up: {r.error}" for r in warm if r.error]
    failures += [r.error for r in results if r.error]
    failures += [f"server logged: {line}" for line in errors.records]
    failures += page_failures(idle_after)
    if memory_before is not None and memory_after is not None:
        # Graph captures during the run (LoRA graphs, say) are not leaks: counted apart.
        grown = (memory_after - memory_before - captured) / 2**20
        if grown > config.leak_mib:
            failures.append(
                f"GPU memory grew by {grown:.1f} MiB over the soak, besides "
                f"{captured / 2**20:.1f} MiB of CUDA graph captures (allowed {config.leak_mib})"
            )
    done = [r for r in results if not r.error]
    return {
        "config": asdict(config),
        "model": name,
        "requests": len(results),
        "finished": sum(not r.cancelled for r in done),
        "cancelled": sum(r.cancelled for r in done),
        "errors": sum(bool(r.error) for r in results),
        "seconds": round(seconds, 1),
        **_latency(done, seconds),
        "pages": {
            "usable": idle_after["usable_pages"],
            "free_before": idle_before["free_pages"],
            "free_after": idle_after["free_pages"],
            "preemptions": idle_after["preemptions"],
        },
        "cuda_memory_allocated": {
            "before": memory_before,
            "after": memory_after,
            "graph_captures_during_run": captured,
            "growth_sites": growth_sites,
        },
        "failures": failures[:50],
        "ok": not failures,
        "system": {
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "triton": _triton_version(),
            "python": platform.python_version(),
        },
    }


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a model directory")
    source.add_argument("--shape", help="build tools/bench.py's random model of this shape (GPU)")
    parser.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kestrel-bench"))
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds")
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--cancel-rate", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--leak-mib", type=float, default=64.0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--cache-tokens", type=int, default=None, help="default: 64k tokens")
    parser.add_argument("--max-batch", type=int, default=None, help="default: --clients")
    parser.add_argument("--page-size", type=int, default=None, help="default: the engine's")
    parser.add_argument("--json", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.shape:
        from tools.bench import build_model

        path = build_model(args.work / f"{args.shape}-{args.format}", args.shape, args.format)
    else:
        path = args.model
    config = SoakConfig(
        clients=args.clients, duration=args.duration, max_prompt=args.max_prompt,
        max_tokens=args.max_tokens, cancel_rate=args.cancel_rate, seed=args.seed,
        leak_mib=args.leak_mib,
    )  # fmt: skip
    max_seq_len = args.max_seq_len or max(2048, args.max_prompt + args.max_tokens)
    options = {
        "device": args.device, "dtype": args.dtype, "max_seq_len": max_seq_len,
        "cache_tokens": args.cache_tokens or max(65536, max_seq_len),
        "max_batch": args.max_batch or args.clients, "page_size": args.page_size,
    }  # fmt: skip
    model = loader.load(path, "kestrel", **{k: v for k, v in options.items() if v is not None})
    try:
        report = run_soak(model, Path(path).name, config)
    finally:
        model.unload()
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    for failure in report["failures"]:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
