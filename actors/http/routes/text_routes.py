"""POST /tokenize and /detokenize (vLLM's): a prompt or chat messages to the ids the model would run, and ids
back to text, served beside the generation routes by the gateway. The encoding runs off the event loop
(ModelHandle.off_loop), so a megabyte posted here stalls no stream."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.edge import json_response
from actors.runtime.model_handle import ModelHandle
from forge.api.openai import openai_schema as api
from forge.api.openai.openai_prepare import chat_template_messages, check_model, functions
from forge.errors import RequestError


class TextRoutes:
    def __init__(self, *, ready: Callable[[Request], ModelHandle], body: Callable[[Request], Awaitable[bytes]]) -> None:
        """`ready`: the gateway's check (key, draining, loaded) giving its pipeline; `body`: its reader of a
        request body within limits."""
        self._ready, self._body = ready, body

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def tokenize(self, request: Request) -> Response:
        pipe = self._ready(request)
        req = api.decode_tokenize(await self._body(request))
        check_model(req.model, pipe.serving.served_model_name)
        if req.messages is not None:
            messages, tools = chat_template_messages(req.messages), functions(req.tools)
            ids = await pipe.off_loop(lambda: pipe.chat_prompt_ids(messages, tools,
                                                                   add_generation_prompt=req.add_generation_prompt))
        else:
            tok = pipe.tokenizer
            ids = await pipe.off_loop(lambda: tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens))
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": pipe.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        pipe = self._ready(request)
        req = api.decode_detokenize(await self._body(request))
        check_model(req.model, pipe.serving.served_model_name)
        tok = pipe.tokenizer
        if any(t >= tok.vocab_size for t in req.tokens):
            raise RequestError(f"token ids must lie in [0, {tok.vocab_size})", param="tokens")
        return json_response({"prompt": await pipe.off_loop(lambda: tok.decode(req.tokens))})
