"""/v1/embeddings: each input's final hidden states, pooled and L2-normalised by the
loaded model (loader/embeddings.py), as OpenAI's list of vectors.

Inputs are a string, a list of strings, a list of token ids or a list of such lists (at
most MAX_INPUTS). `encoding_format` "float" gives JSON numbers, "base64" little-endian
float32 bytes (what the openai client asks for by default). `dimensions` keeps that many
leading components (then normalises); `pooling` ("mean" or "last") overrides the model's.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from extensions.openai.errors import ApiError, error_for
from extensions.openai.params import check_text
from extensions.openai.prompt_size import check_prompt_size
from extensions.openai.schemas import EmbeddingRequest
from loader.base import LoadedModel
from loader.embeddings import EmbeddingError

MAX_INPUTS = 2048  # as OpenAI: inputs per request
FORMATS = ("float", "base64")


def _inputs(body: EmbeddingRequest, vocab_size: int) -> list[str | list[int]]:
    raw = body.input
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [list(raw)]
    else:
        items = list(raw)
    if not items:
        raise ApiError(400, "input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise ApiError(
            400, f"input holds {len(items)} items; at most {MAX_INPUTS} per request", param="input"
        )
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise ApiError(400, f"input[{i}] is an empty string", param="input")
            check_text(item, "input")
        else:
            bad = [t for t in item if not 0 <= t < vocab_size]
            if not item or bad:
                what = (
                    "is empty"
                    if not item
                    else f"holds token ids {bad[:5]} outside [0, {vocab_size})"
                )
                raise ApiError(400, f"input[{i}] {what}", param="input")
    return items


def _encoded(vector: Any, encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector.tolist()
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")


async def embeddings(body: EmbeddingRequest, model: LoadedModel, name: str) -> dict[str, Any]:
    if body.encoding_format not in FORMATS:
        raise ApiError(
            400,
            f"encoding_format must be one of {', '.join(FORMATS)}, got {body.encoding_format!r}",
            param="encoding_format",
        )
    if body.dimensions is not None and body.dimensions < 1:
        raise ApiError(400, f"dimensions must be >= 1, got {body.dimensions}", param="dimensions")
    items = _inputs(body, model.vocab_size)
    await check_prompt_size(model, [i for i in items if isinstance(i, str)], "input")

    def run() -> tuple[list[Any], int]:
        ids = [model.encode_for_embedding(i) if isinstance(i, str) else i for i in items]
        return model.embed_many(ids, body.pooling, body.dimensions), sum(map(len, ids))

    try:
        vectors, tokens = await asyncio.to_thread(run)
    except EmbeddingError as error:  # pooling, dimensions past the width, a bad pooling config
        raise ApiError(400, str(error), param=error.param) from error
    except Exception as error:
        raise error_for(error, "input") from error
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
