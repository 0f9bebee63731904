"""POST /v1/embeddings, served beside the completions routes by the gateway.

Each input is one request in the engine, a prompt-only sequence that returns its pooled vector
(forge/engine/pooling.py) instead of a sampled token: it goes through the same admission, tokenizer,
scheduler and batch as a completion, through the same response lifetime (actors/http/lifetime.py), and
its vector comes back on its last TextDelta. A batch of inputs is admitted as one unit and fed to the
engine a window at a time (actors/http/choice_feed.py), up to the API's 2,048 inputs whatever --max-waiting is.
The wire shapes are forge/api/embeddings/embeddings_schema.py's.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.lifetime import ResponseLifetime
from actors.runtime.model_handle import ModelHandle
from forge.api.embeddings.embeddings_schema import MAX_INPUTS, embeddings_body, new_embedding_id, prepare_embeddings
from forge.messages import Submit


class EmbeddingsRoutes:
    def __init__(self, life: ResponseLifetime) -> None:
        """`life`: the gateway's response lifetime. The model named and answered is the handle's."""
        self._life = life

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        return await self._life.run(request, self._create, embeds=True)

    async def _create(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        served = pipe.serving
        prep = prepare_embeddings(body, served_model_name=served.served_model_name,
                                  embedding_size=served.embedding_size,
                                  vocab_size=pipe.vocab_size, pooling=served.pooling,
                                  max_input_tokens=pipe.max_input_tokens)
        base = new_embedding_id()
        request.state.response_id = base
        submits = [Submit(request_id=f"{base}-{i}", params=prep.params, text=x) if isinstance(x, str)
                   else Submit(request_id=f"{base}-{i}", params=prep.params, token_ids=tuple(x))
                   for i, x in enumerate(prep.inputs)]
        reader = await self._life.start(request, pipe, submits, len(body), arrival, max_choices=MAX_INPUTS)

        def body_of() -> dict[str, object]:
            vectors = [c.embedding or b"" for c in reader.choices]
            return embeddings_body(prep.request, vectors, model=served.served_model_name,
                                   prompt_tokens=sum(c.counts.prompt for c in reader.choices))

        return await self._life.respond(request, pipe, reader, body_of)
