"""POST /tokenize and /detokenize (vLLM's): a prompt or chat messages to the ids the model would run, and ids
back to text, served beside the generation routes by the gateway. The encoding runs off the event loop
(ModelHandle.off_loop), so a megabyte posted here stalls no stream."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.edge import json_response
from actors.http.lifetime import ResolveModel
from forge.api.openai import openai_schema as api
from forge.api.openai.openai_prepare import chat_template_messages, check_model, functions
from forge.errors import RequestError


class TextRoutes:
    def __init__(self, *, resolve: ResolveModel) -> None:
        """`resolve`: the gateway's resolution of the model a body names (lifetime.ResolveModel)."""
        self._resolve = resolve

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def tokenize(self, request: Request) -> Response:
        async with self._resolve(request) as (pipe, body):
            req = api.decode_tokenize(body)
            check_model(req.model, pipe.serving.served_model_name)
            if req.messages is not None:
                messages, tools = chat_template_messages(req.messages), functions(req.tools)
                ids = await pipe.off_loop(lambda: pipe.chat_prompt_ids(
                    messages, tools, add_generation_prompt=req.add_generation_prompt))
            else:
                tok = pipe.tokenizer
                ids = await pipe.off_loop(lambda: tok.encode(req.prompt or "",
                                                             add_special_tokens=req.add_special_tokens))
            return json_response({"tokens": ids, "count": len(ids), "max_model_len": pipe.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        async with self._resolve(request) as (pipe, body):
            req = api.decode_detokenize(body)
            check_model(req.model, pipe.serving.served_model_name)
            tok = pipe.tokenizer
            if any(t >= tok.vocab_size for t in req.tokens):
                raise RequestError(f"token ids must lie in [0, {tok.vocab_size})", param="tokens")
            return json_response({"prompt": await pipe.off_loop(lambda: tok.decode(req.tokens))})
