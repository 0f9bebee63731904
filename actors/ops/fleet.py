"""What an LLM router asks each replica: the worker contract of vLLM's router (`vllm-router`), which the
Gateway API Inference Extension's endpoint pickers share. Served beside the OpenAI routes by the gateway.

    GET  /health                     readiness, as /healthz (no key): the router waits for it at start
    GET  /get_load                   {"load": N}: sequences running and waiting (power_of_two compares them)
    GET  /get_server_info            the model, the served name, the K/V block size, max_model_len, an
                                     instance id (kv_aware's cache identity), forge's version
    GET  /get_model_info             the model's path, name and kind
    POST /flush_cache                forget the prefix cache
    GET  /kv_event_sources           where this replica publishes its KV events (actors.runtime.kv_publisher), as vLLM
                                     lists them: {"sources": [{data_parallel_rank, endpoint, replay_endpoint,
                                     topic}]}; no sources when --kv-events is off. vllm-router 0.1.17 does not
                                     read this shape yet: it takes the sources from --kv-event-source
    POST /v1/completions/render      {"token_ids": [...]}: the ids the request would run (a list of them
    POST /v1/chat/completions/render   for several prompts); cache_aware matches them against its prefix
                                     tree of each replica (it falls back to /tokenize without these)
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.edge import json_response
from actors.http.model_resolver import ModelResolver
from actors.runtime.kv_publisher import KvEventPublisher
from forge.api.openai.openai_prepare import prepare_chat, prepare_completion
from forge.messages import FlushCache, Rejected


class FleetRoutes:
    def __init__(self, resolver: ModelResolver, *, healthz: Callable[[Request], Awaitable[Response]],
                 total_load: Callable[[Request], int]) -> None:
        """`resolver`: the gateway's edge checks and model resolution (the render routes resolve the model
        their body names; the others read the loaded model used last); `healthz`: its health route;
        `total_load`: the sequences running and waiting over every model served."""
        self._resolver, self._healthz = resolver, healthz
        self._total_load = total_load
        self.instance_id = f"forge-{uuid.uuid4().hex[:16]}"      # one per daemon's life
        self.kv_publisher: KvEventPublisher | None = None          # set by the daemon with --kv-events

    def routes(self) -> list[Route]:
        return [Route("/health", self.health, methods=["GET"]),
                Route("/get_load", self.get_load, methods=["GET"]),
                Route("/get_server_info", self.server_info, methods=["GET"]),
                Route("/get_model_info", self.model_info, methods=["GET"]),
                Route("/flush_cache", self.flush_cache, methods=["POST"]),
                Route("/kv_event_sources", self.kv_event_sources, methods=["GET"]),
                Route("/v1/completions/render", self.render_completion, methods=["POST"]),
                Route("/v1/chat/completions/render", self.render_chat, methods=["POST"])]

    async def health(self, request: Request) -> Response:
        return await self._healthz(request)

    async def get_load(self, request: Request) -> Response:
        return json_response({"load": self._total_load(request)})

    async def server_info(self, request: Request) -> Response:
        served = self._resolver.recent(request).serving
        return json_response({
            "model_id": served.served_model_name, "model_path": served.model,
            "served_model_name": served.served_model_name, "instance_id": self.instance_id,
            "kv_block_size": served.block_size, "max_model_len": served.max_model_len,
            "max_num_seqs": served.max_num_seqs, "kv_cache_dtype": served.kv_cache_dtype,
            "prefix_caching": served.prefix_caching == "on", "worker_type": "regular", "version": served.version})

    async def model_info(self, request: Request) -> Response:
        pipe = self._resolver.recent(request)
        served = pipe.serving
        return json_response({"model_path": served.model, "served_model_name": served.served_model_name,
                              "architecture": served.architecture, "is_generation": not pipe.embeds_only,
                              "max_model_len": served.max_model_len})

    async def kv_event_sources(self, request: Request) -> Response:
        self._resolver.recent(request)
        pub = self.kv_publisher
        if pub is None:
            return json_response({"sources": []})
        host = request.url.hostname or "127.0.0.1"
        return json_response({"sources": [{"data_parallel_rank": 0, "endpoint": pub.source_endpoint(host),
                                           "replay_endpoint": None, "topic": pub.config.topic}]})

    async def flush_cache(self, request: Request) -> Response:
        """Forget the prefix cache (BlockAllocator.flush_prefix_cache): running requests keep their blocks,
        later prompts find nothing cached. Sent down the requests' own path, so it lands between steps."""
        pipe = self._resolver.recent(request)
        rid = f"flush-{uuid.uuid4().hex}"
        group = pipe.demux.open([rid])
        try:
            pipe.to_tokenizer.send_nowait(FlushCache(request_id=rid))
            [verdict] = await group.wait_statuses()
        finally:
            pipe.demux.close(group)
        if isinstance(verdict, Rejected):
            raise verdict.error()
        return json_response({"status": "flushed"})

    async def render_completion(self, request: Request) -> Response:
        async with self._resolver.resolve(request) as (pipe, body):
            prep = prepare_completion(body, served_model_name=pipe.serving.served_model_name)
            tok = pipe.tokenizer
            rendered = await pipe.off_loop(lambda: [{"token_ids": p if isinstance(p, list) else tok.encode(p)}
                                                    for p in prep.prompts])
        return json_response(rendered[0] if len(rendered) == 1 else rendered)

    async def render_chat(self, request: Request) -> Response:
        async with self._resolver.resolve(request) as (pipe, body):
            prep = prepare_chat(body, served_model_name=pipe.serving.served_model_name,
                                max_model_len=pipe.max_model_len)
            ids = await pipe.off_loop(lambda: pipe.chat_prompt_ids(prep.messages, prep.functions))
        return json_response({"token_ids": ids})
