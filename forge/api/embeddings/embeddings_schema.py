"""POST /v1/embeddings on the wire: the request Struct, its checks, what it becomes for the engine (one
prompt per input, pooled instead of sampled), and the response body. Pure: no I/O.

As OpenAI's: `input` a string, a list of strings, a list of token ids or a list of such lists (at most
MAX_INPUTS, none empty); `encoding_format` float or base64 (the little-endian float32 bytes);
`dimensions` keeps the first N values and L2-normalises them again; an input longer than the model takes
is a 400 naming `input` (OpenAI does not truncate). `user` is accepted and ignored.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

from forge.api.openai.openai_prepare import check_model
from forge.api.openai.openai_schema import TokenId
from forge.api.wire_decode import decode_body
from forge.engine.pooling import l2_normalised
from forge.errors import InvalidRequest
from forge.sampling.sampling_params import SamplingParams

# OpenAI's bound on the inputs of one request; each input is one sequence in the engine.
MAX_INPUTS = 2048


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """POST /v1/embeddings. Unknown fields are ignored; a null field counts as absent."""

    input: str | list[str | TokenId | list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None


@dataclass(frozen=True, slots=True)
class PreparedEmbedding:
    request: EmbeddingRequest
    params: SamplingParams             # pooling set: the engine returns a vector, never a token
    inputs: list[str | list[int]]      # one per embedding: text or token ids


def decode_embeddings(body: bytes) -> EmbeddingRequest:
    """The body as an EmbeddingRequest, or InvalidRequest naming the field ("input[3]")."""
    req = decode_body(body, EmbeddingRequest)
    inputs = req.input
    if isinstance(inputs, str):
        if not inputs:
            raise InvalidRequest("input must not be an empty string", param="input")
        return req
    if not inputs:
        raise InvalidRequest("input must not be empty", param="input")
    first = type(inputs[0])
    if first is not int and len(inputs) > MAX_INPUTS:
        raise InvalidRequest(f"input may hold at most {MAX_INPUTS} inputs, got {len(inputs)}", param="input")
    for i, item in enumerate(inputs):
        if type(item) is not first:
            raise InvalidRequest("input must be a string, a list of strings, a list of token ids or a list of "
                                 "token id lists", param=f"input[{i}]")
        if first is not int and not item:
            raise InvalidRequest("input must not hold an empty string or token list", param=f"input[{i}]")
    return req


def prepare_embeddings(body: bytes, *, served_model_name: str, embedding_size: int, vocab_size: int,
                       pooling: str, max_input_tokens: int | None = None) -> PreparedEmbedding:
    """Decode and check a request against the model: its name (404), `dimensions` at most its embedding
    size, token ids inside its vocabulary, token lists no longer than `max_input_tokens` (None: the
    engine checks)."""
    req = decode_embeddings(body)
    check_model(req.model, served_model_name)
    if req.dimensions is not None and req.dimensions > embedding_size:
        raise InvalidRequest(f"dimensions must be at most {embedding_size} for this model, got {req.dimensions}",
                             param="dimensions")
    raw = req.input
    inputs: list[str | list[int]] = []
    if isinstance(raw, str):
        inputs.append(raw)
    elif isinstance(raw[0], int):
        inputs.append([t for t in raw if isinstance(t, int)])
    else:
        inputs.extend(x if isinstance(x, str) else list(x) for x in raw if not isinstance(x, int))
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            continue
        where = "input" if isinstance(raw[0], int) else f"input[{i}]"
        if max(item) >= vocab_size:
            raise InvalidRequest(f"token ids must lie in [0, {vocab_size})", param=where)
        if max_input_tokens is not None and len(item) > max_input_tokens:
            raise InvalidRequest(f"this model takes at most {max_input_tokens} tokens an input, got {len(item)}",
                                 param=where, code="context_length_exceeded")
    return PreparedEmbedding(request=req, params=SamplingParams(max_tokens=1, pooling=pooling), inputs=inputs)


def new_embedding_id() -> str:
    return f"embd-{uuid.uuid4().hex}"


def embedding_value(vector: bytes, *, dimensions: int | None, encoding_format: str) -> list[float] | str:
    """One vector as the wire carries it: its first `dimensions` values L2-normalised again, as floats or
    as base64 of their little-endian float32 bytes."""
    v = np.frombuffer(vector, dtype="<f4")                                   # [H]
    if dimensions is not None and dimensions < v.size:
        v = l2_normalised(v[:dimensions])                                    # [dimensions]
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
    values: list[float] = v.astype(np.float64).tolist()
    return values


def embeddings_body(req: EmbeddingRequest, vectors: list[bytes], *, model: str, prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's list of embeddings, in input order, with the tokens the inputs ran as."""
    data = [{"object": "embedding", "index": i,
             "embedding": embedding_value(v, dimensions=req.dimensions, encoding_format=req.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
