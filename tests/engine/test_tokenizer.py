"""Tokenizer layer against transformers (and sentencepiece itself) on tokenizers built here.

Two real tokenizers are trained in a temporary directory: a byte-level BPE saved as
tokenizer.json, and a SentencePiece BPE with byte fallback saved as tokenizer.model. Both have
non-ASCII text (é, 中文, 🦅) split across tokens, which is what incremental decoding must get
right.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.tokenizer import (
    ChatTemplateError,
    IncrementalDecoder,
    Tokenizer,
    TokenizerError,
    TokenizerFilesNotFound,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Café au lait, naïve résumé, déjà vu.",
    "中文文本测试，你好世界。我们的模型一次生成一个词元。",
    "Eagles 🦅 fly high over the mountains 🏔️ and the sea 🌊! Ünïcödé everywhere: ß, ø, å.",
    "Hello world, hello there. The model generates tokens one at a time, streaming text.",
    "Numbers like 12345 and symbols like {braces}, [brackets] and <angles> appear too.",
]

TEXTS = [
    "Hello world",
    "Eagles 🦅 fly, 中文文本 and café!",
    "🦅🦅🦅 中文 naïve résumé",
    "line one\nline two\n\n  indented",
    "trailing space ",
    "rare: 𝔘𝔫𝔦 ☃ ж ✓",
    "<|im_start|>user\nHi 🦅<|im_end|>\n",
    "Hi <|im_start|> x</s> tail",
    "<s>Hello</s> world",
]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if tools %}{{ dict(tools=tools, n=tools | length) | tojson(indent=2) }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Exercises what Hub templates use: bos/eos variables, raise_exception, namespace, loop
# controls, tojson on tools, trim_blocks/lstrip_blocks whitespace handling.
LLAMA_LIKE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if message['role'] == 'user' %}
[INST] {% if ns.system %}<<SYS>>{{ ns.system }}<</SYS>> {% endif %}{{ message['content'] }} [/INST]
    {% elif message['role'] == 'assistant' %}
 {{ message['content'] }}{{ eos_token }}
    {% else %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
{% endfor %}
{% if tools %}Tools: {{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Réponds en français, s'il te plaît."},
    {"role": "user", "content": "Quel oiseau est 🦅 ? 中文?"},
    {"role": "assistant", "content": 'Un aigle <b>&</b> "quotes".'},
    {"role": "user", "content": "Merci!"},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo <now> & 天气",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _added(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
        "special": True,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    out = tmp_path_factory.mktemp("bpe")
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS * 4, trainer)
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    raw.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": _added("<|im_end|>"),
            "pad_token": "<pad>",
            "clean_up_tokenization_spaces": False,
            "chat_template": CHATML,
        },
    )
    # EOS comes from three places; generation_config's order wins.
    _write_json(out / "generation_config.json", {"eos_token_id": [1, 4]})
    _write_json(out / "config.json", {"eos_token_id": 4, "bos_token_id": 0})
    return out


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sentencepiece

    out = tmp_path_factory.mktemp("sp")
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 4), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(out / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.98,  # leaves rare characters to byte fallback
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        # Llama's settings: text is kept byte for byte, whitespace runs are pieces.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        minloglevel=2,
    )
    corpus.unlink()
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {
                "400": _added("<|im_start|>"),
                "401": _added("<|im_end|>"),
            },
            "chat_template": LLAMA_LIKE,
        },
    )
    return out


@pytest.fixture(scope="module")
def sp_json_dir(tmp_path_factory: pytest.TempPathFactory, sp_dir: Path) -> Path:
    """The SentencePiece model as transformers converts it: a Llama-2-style tokenizer.json
    (Metaspace, byte fallback, a decoder that strips one leading space)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("sp_json")
    AutoTokenizer.from_pretrained(sp_dir).save_pretrained(out)
    (out / "tokenizer.model").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module", params=["bpe", "sp", "sp_json"])
def case(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, object]:
    from transformers import AutoTokenizer

    model_dir = request.getfixturevalue(f"{request.param}_dir")
    return request.param, Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)


def _hf_decode(hf: object, ids: list[int], skip: bool) -> str:
    return hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _valid_utf8(tok: Tokenizer, ids: list[int]) -> bool:
    try:
        b"".join(tok.token_bytes(i) for i in ids).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# --- encode / decode -----------------------------------------------------------------------


def test_encode_decode_match_transformers(case: tuple) -> None:
    _, tok, hf = case
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_bos=False) == ids, text
        with_bos = ids if ids[:1] == [tok.bos_token_id] else [tok.bos_token_id, *ids]
        assert tok.encode(text) == with_bos, text
        for skip in (True, False):
            assert tok.decode(ids, skip_special=skip) == _hf_decode(hf, ids, skip), text
        # special=False keeps special-token strings as text, like split_special_tokens=True.
        plain = hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert tok.encode(text, add_bos=False, special=False) == plain, text


def test_decode_random_ids_matches_transformers(case: tuple) -> None:
    name, tok, hf = case
    rng = random.Random(1)
    checked = 0
    for _ in range(1500):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 6))]
        # Invalid UTF-8 has several replacement conventions, and a leading <0x20> byte piece is
        # where sentencepiece (which Kestrel follows) and transformers' conversion disagree.
        if not _valid_utf8(tok, ids) or (name == "sp" and tok.id_to_piece(ids[0]) == "<0x20>"):
            continue
        checked += 1
        for skip in (True, False):
            assert tok.decode(ids, skip_special=skip) == _hf_decode(hf, ids, skip), ids
    assert checked > 300


def test_sentencepiece_follows_the_library(sp_dir: Path) -> None:
    import sentencepiece

    tok = Tokenizer.from_dir(sp_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    # Leading whitespace is where transformers' converted tokenizer leaves sentencepiece.
    for text in [t for t in TEXTS if "<" not in t] + ["  two leading", " one", "\tTab"]:
        assert tok.encode(text, add_bos=False) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text
    rng = random.Random(2)
    for _ in range(1500):  # invalid UTF-8 included: one U+FFFD per bad byte, as sentencepiece
        ids = [rng.randrange(1, sp.get_piece_size()) for _ in range(rng.randint(1, 6))]
        assert tok.decode(ids) == sp.decode(ids), ids


def test_special_token_ids(bpe_dir: Path, sp_dir: Path) -> None:
    bpe = Tokenizer.from_dir(bpe_dir)
    assert (bpe.bos_token_id, bpe.pad_token_id, bpe.vocab_size) == (0, 2, 420)
    assert bpe.eos_token_ids == [1, 4]  # generation_config first, then the rest, deduplicated
    assert bpe.add_bos_default is True  # from the post-processor
    assert bpe.special_ids >= {0, 1, 2, 3, 4}

    sp = Tokenizer.from_dir(sp_dir)
    assert (sp.bos_token_id, sp.eos_token_ids, sp.pad_token_id) == (1, [2], None)
    assert (sp.vocab_size, sp.add_bos_default) == (402, True)
    assert sp.id_to_piece(400) == "<|im_start|>"
    assert sp.token_to_id("<|im_end|>") == 401
    with pytest.raises(TokenizerError):
        sp.id_to_piece(10_000)


def test_bos_eos_sources(tmp_path: Path, bpe_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    # Qwen style: an explicit null BOS wins over config.json's bos_token_id.
    _write_json(tmp_path / "tokenizer_config.json", {"bos_token": None, "add_bos_token": False})
    _write_json(tmp_path / "config.json", {"bos_token_id": 0, "eos_token_id": [4, 1]})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id is None and tok.add_bos_default is False
    assert tok.eos_token_ids == [4, 1]
    assert tok.encode("Hello") == tok.encode("Hello", add_bos=False)
    assert not tok.has_chat_template

    _write_json(tmp_path / "tokenizer_config.json", {"eos_token": {"content": "</s>"}})
    _write_json(tmp_path / "generation_config.json", {"eos_token_id": 4, "bos_token_id": 0})
    (tmp_path / "config.json").unlink()
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, [4, 1])
    assert tok.encode("<s>Hi")[:2] != [0, 0]  # BOS already there: not added twice


def test_token_bytes(case: tuple) -> None:
    name, tok, _ = case
    for text in TEXTS:
        if "<" in text:
            continue
        ids = tok.encode(text, add_bos=False)
        expected = (" " + text if name != "bpe" else text).encode()  # the dummy-prefix space
        assert b"".join(tok.token_bytes(i) for i in ids) == expected, text
    eagle = tok.encode("🦅", add_bos=False)
    assert len(eagle) > 1, "the test needs the emoji split across tokens"
    assert tok.token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"


# --- chat templates ------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(case: tuple, add_generation_prompt: bool) -> None:
    name, tok, hf = case
    assert tok.has_chat_template
    for tools in (None, TOOLS):
        ours = tok.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tools=tools
        )
        theirs = hf.apply_chat_template(
            MESSAGES, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours == theirs
    if name == "sp":
        assert ours.startswith("<s>") and "</s>" in ours and "Météo <now> & 天气" in ours
        # The rendered prompt already starts with BOS; encode must not add a second one.
        ids = tok.encode(ours)
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id


def test_chat_template_errors_and_sources(tmp_path: Path, bpe_dir: Path, sp_dir: Path) -> None:
    sp = Tokenizer.from_dir(sp_dir)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        sp.apply_chat_template([{"role": "tool", "content": "x"}])

    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)

    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    _write_json(tmp_path / "tokenizer_config.json", {"chat_template": named})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template(MESSAGES) == "D"
    assert tok.apply_chat_template(MESSAGES, tools=TOOLS) == "T"

    _write_json(tmp_path / "tokenizer_config.json", {})
    _write_json(tmp_path / "chat_template.json", {"chat_template": "J{{ messages | length }}"})
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES) == "J4"

    # chat_template.jinja beats every other source, as in transformers.
    _write_json(tmp_path / "tokenizer_config.json", {"chat_template": "config"})
    (tmp_path / "chat_template.jinja").write_text("{{ greeting }} {{ strftime_now('%Y') }}")
    rendered = Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES, greeting="hi")
    assert rendered.startswith("hi 2") and len(rendered) == 7


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    for missing in (tmp_path, tmp_path / "absent"):
        with pytest.raises(TokenizerFilesNotFound) as info:
            Tokenizer.from_dir(missing)
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
        message = str(info.value)
        assert str(missing) in message and "tokenizer.json" in message
        assert "tokenizer.model" in message
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# --- incremental detokenization ------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], **kwargs: object) -> list[str]:
    decoder = IncrementalDecoder(tok, **kwargs)
    out, pos = [], 0
    for size in chunks:
        out.append(decoder.add(ids[pos : pos + size]))
        pos += size
    out.append(decoder.flush())
    return out


def _random_chunks(rng: random.Random, n: int) -> list[int]:
    chunks = []
    while n > 0:
        chunks.append(min(n, rng.randint(1, 5)))
        n -= chunks[-1]
    return chunks


def test_incremental_decoder_texts(case: tuple) -> None:
    _, tok, _ = case
    rng = random.Random(3)
    for text in TEXTS + [" ".join(CORPUS)]:
        ids = tok.encode(text)
        for skip in (True, False):
            full = tok.decode(ids, skip_special=skip)
            plans = [[1] * len(ids)] + [_random_chunks(rng, len(ids)) for _ in range(10)]
            for plan in plans:
                out = _stream(tok, ids, plan, skip_special=skip)
                assert "".join(out) == full, (text, plan)
                assert not any("\ufffd" in piece for piece in out), (text, out)


def test_incremental_decoder_random_ids(case: tuple) -> None:
    # Arbitrary sequences, specials included: catches windows that start at skipped tokens,
    # where SentencePiece-style decoders would drop a leading space.
    _, tok, _ = case
    rng = random.Random(4)
    special = sorted(tok.special_ids)
    checked = 0
    for _ in range(1200):
        ids = [
            rng.choice(special) if rng.random() < 0.2 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(1, 12))
        ]
        if not _valid_utf8(tok, ids):
            continue
        checked += 1
        for skip in (True, False):
            out = _stream(tok, ids, _random_chunks(rng, len(ids)), skip_special=skip)
            assert "".join(out) == tok.decode(ids, skip_special=skip), ids
    assert checked > 150


def test_incremental_decoder_holds_partial_characters(case: tuple) -> None:
    _, tok, _ = case
    ids = tok.encode("a🦅", add_bos=False)
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.add([i]) for i in ids]
    assert pieces[-1].endswith("🦅") and "".join(pieces) == tok.decode(ids)
    assert all(p == "" for p in pieces[1:-1])  # the emoji's leading tokens are held back
    decoder = IncrementalDecoder(tok)
    decoder.add(ids[:-1])
    assert decoder.flush().endswith("\ufffd")  # an unfinished character is flushed as-is


def test_incremental_decoder_context_and_cost(case: tuple) -> None:
    _, tok, _ = case
    prompt = tok.encode("Hello world, 中文")
    generated = tok.encode(" the model 🦅 generates tokens one at a time " * 8, add_bos=False)
    lengths: list[int] = []
    decode = tok.decode

    def counting_decode(ids: list[int], **kwargs: object) -> str:
        lengths.append(len(ids))
        return decode(ids, **kwargs)

    tok.decode = counting_decode  # instance attribute: only this test's calls are counted
    try:
        out = _stream(tok, generated, [1] * len(generated), context_ids=prompt)
    finally:
        del tok.decode
    expected = tok.decode(prompt + generated)[len(tok.decode(prompt)) :]
    assert "".join(out) == expected
    assert out[0].startswith(" ")  # the space after the prompt is kept
    assert max(lengths) <= 16  # each step decodes a short window, not the whole stream
