"""The gateway's OpenAPI document (GET /openapi.json), generated from the request types themselves.

The request bodies' schemas are msgspec's JSON Schema of the Structs the gateway decodes with
(forge/api/openai/openai_schema.py, forge/api/anthropic/anthropic_schema.py,
forge/api/responses/responses_schema.py, forge/api/ollama/ollama_schema.py), constraints included, so the
document cannot drift from what is accepted. Every error is declared as OpenAI's envelope, but on the
Messages API's routes as that API's and on Ollama's (/api/...) as `{"error": message}`. Success bodies
are described loosely (an object, an SSE stream, Ollama's NDJSON): their exact shapes are OpenAI's, the
Messages API's or Ollama's (docs/api.md).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from forge.api.anthropic import anthropic_schema as anthropic_api
from forge.api.embeddings import embeddings_schema as embeddings_api
from forge.api.ollama import ollama_schema as ollama_api
from forge.api.openai import openai_schema as api
from forge.api.responses import responses_schema as responses_api

_REF = "#/components/schemas/{name}"

_ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string", "minLength": 1},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

_MESSAGES_ERROR = {
    "type": "object", "required": ["type", "error"], "additionalProperties": False,
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string", "minLength": 1}, "message": {"type": "string", "minLength": 1}}}}}

_MESSAGE = {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
            "properties": {"type": {"const": "message"}, "role": {"const": "assistant"},
                           "content": {"type": "array", "items": {"type": "object", "required": ["type"]}}}}

_RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
             "properties": {"object": {"const": "response"}, "status": {"type": "string"},
                            "output": {"type": "array", "items": {"type": "object", "required": ["type"]}}}}

_DELETED = {"type": "object", "required": ["id", "object", "deleted"],
            "properties": {"object": {"const": "response"}, "deleted": {"const": True}}}

# One server-sent event, as an event-stream reader sees it: its name ("message" when the frame gives
# none, as OpenAI's chat chunks do; the Messages and Responses APIs name each) and its data.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}

_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
_MODEL_ID = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]

_TOKEN_COUNT = {"type": "object", "required": ["input_tokens"], "additionalProperties": False,
                "properties": {"input_tokens": {"type": "integer", "minimum": 0}}}

_EMBEDDINGS = {"type": "object", "required": ["object", "data", "model", "usage"],
               "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                   "type": "object", "required": ["object", "index", "embedding"],
                   "properties": {"object": {"const": "embedding"}, "index": {"type": "integer", "minimum": 0},
                                  "embedding": {"type": ["array", "string"]}}}}}}

_GENERATED = {"type": "object", "required": ["text", "prompt_tokens", "completion_tokens"],
              "properties": {"text": {"type": "string"}, "prompt_tokens": {"type": "integer", "minimum": 0},
                             "completion_tokens": {"type": "integer", "minimum": 0}}}

# POST /models/load and /models/unload (a daemon serving several models; one serving one answers 404)
_MODEL_NAMED = {"type": "object", "required": ["model"], "properties": {"model": {"type": "string"}}}
_MODEL_CARD = {"type": "object", "required": ["model", "state"],
               "properties": {"model": {"type": "string"},
                              "state": {"enum": ["unloaded", "loading", "loaded", "unloading"]}}}

# Ollama's routes (/api/...): errors as {"error": message}; a streamed answer is NDJSON, one object a line.
_OLLAMA_ERROR = {"type": "object", "required": ["error"],
                 "properties": {"error": {"type": "string", "minLength": 1}}}
_NDJSON = {"type": "string", "description": "one JSON object a line, the last with done: true"}

_STATUSES = ((400, "the request is malformed or out of range; `param` names the field"),
             (401, "the API key is missing or wrong"),
             (403, "sent by a web page whose origin is not allowed (--allowed-origins)"),
             (404, "no such model, or no such route"),
             (408, "the body did not arrive in time"),
             (413, "the body is over the size limit"),
             (415, "a body not sent as application/json"),
             (421, "a Host the daemon does not answer to (--allowed-hosts)"),
             (503, "overloaded, loading or draining: try again after Retry-After"))
_UNAUTHENTICATED = ("403", "421", "503")      # what a route open without the key may still answer


def _errors(envelope: str) -> dict[str, Any]:
    return {str(status): {"description": what, "content": {"application/json": {"schema": {
        "$ref": _REF.format(name=envelope)}}}} for status, what in _STATUSES}


_ERRORS = _errors("ErrorBody")
_MESSAGES_ERRORS = _errors("MessagesErrorBody")     # the Messages API's envelope: its message names the field
_OLLAMA_ERRORS = _errors("OllamaErrorBody")


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _operation(operation_id: str, summary: str, *, body: dict[str, Any] | None = None, stream: bool = False,
               ok: dict[str, Any] | None = None, auth: bool = True, errors: dict[str, Any] = _ERRORS,
               parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    ok = ok or _json({"type": "object"}, "the result")
    if stream:
        ok = {**ok, "content": {**ok["content"], "text/event-stream": {"schema": _SSE_EVENT}}}
    op: dict[str, Any] = {"operationId": operation_id, "summary": summary,
                          "responses": {"200": ok, **{k: v for k, v in errors.items()
                                                      if auth or k in _UNAUTHENTICATED}}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if parameters is not None:
        op["parameters"] = parameters
    if not auth:
        op["security"] = []
    return op


@cache
def openapi_document() -> dict[str, Any]:
    types = (api.CompletionRequest, api.ChatCompletionRequest, api.TokenizeRequest, api.DetokenizeRequest,
             api.GenerateRequest, anthropic_api.MessagesRequest, anthropic_api.CountTokensRequest,
             embeddings_api.EmbeddingRequest, responses_api.ResponsesRequest, ollama_api.OllamaChat,
             ollama_api.OllamaGenerate, ollama_api.OllamaEmbed, ollama_api.OllamaEmbeddings, ollama_api.OllamaShow)
    bodies, components = msgspec.json.schema_components(types, ref_template=_REF)
    (completion, chat, tokenize, detokenize, generate, messages, count_tokens, embeddings, responses,
     ollama_chat, ollama_generate, ollama_embed, ollama_embeddings, ollama_show) = bodies
    components["ErrorBody"] = _ERROR
    components["MessagesErrorBody"] = _MESSAGES_ERROR
    components["OllamaErrorBody"] = _OLLAMA_ERROR
    ndjson = {"description": "the answer: one object, or NDJSON as it comes (`stream`, true unless false)",
              "content": {"application/json": {"schema": {"type": "object"}},
                          "application/x-ndjson": {"schema": _NDJSON}}}
    text = {"description": "plain text", "content": {"text/plain": {"schema": {"type": "string"}}}}
    paths = {
        "/v1/completions": {"post": _operation("createCompletion", "Complete a prompt", body=completion,
                                               stream=True)},
        "/v1/chat/completions": {"post": _operation("createChatCompletion", "Complete a chat", body=chat,
                                                    stream=True)},
        "/v1/messages": {"post": _operation("createMessage", "A message (the Messages API's wire format of a chat)",
                                            body=messages, stream=True, ok=_json(_MESSAGE, "the message"),
                                            errors=_MESSAGES_ERRORS)},
        "/v1/messages/count_tokens": {"post": _operation(
            "countMessageTokens", "The prompt tokens a message would run", body=count_tokens,
            ok=_json(_TOKEN_COUNT, "the count"), errors=_MESSAGES_ERRORS)},
        "/v1/responses": {"post": _operation("createResponse", "A response (the Responses API's wire format of a chat)",
                                             body=responses, stream=True, ok=_json(_RESPONSE, "the response"))},
        "/v1/responses/{response_id}": {
            "get": _operation("getResponse", "A stored response", ok=_json(_RESPONSE, "the response"),
                              parameters=_RESPONSE_ID),
            "delete": _operation("deleteResponse", "Forget a stored response", ok=_json(_DELETED, "deleted"),
                                 parameters=_RESPONSE_ID)},
        "/v1/embeddings": {"post": _operation("createEmbedding", "Embed inputs (pooled final hidden states)",
                                              body=embeddings, ok=_json(_EMBEDDINGS, "the embeddings"))},
        "/v1/models": {"get": _operation("listModels", "The models served, with their states (Anthropic's "
                                                       "Models API shape with an anthropic-version header)")},
        "/v1/models/{model_id}": {"get": _operation("getModel", "One model served, as the list has it",
                                                    parameters=_MODEL_ID)},
        "/models/load": {"post": _operation("loadModel", "Load a model now (several models; 404 with one)",
                                            body=_MODEL_NAMED, ok=_json(_MODEL_CARD, "the model, loaded"))},
        "/models/unload": {"post": _operation(
            "unloadModel", "Unload an idle model (several models; 404 with one)", body=_MODEL_NAMED,
            ok=_json(_MODEL_CARD, "the model, unloaded"),
            errors={**_ERRORS, "409": {"description": "the model has requests in flight", "content": {
                "application/json": {"schema": {"$ref": _REF.format(name="ErrorBody")}}}}})},
        "/tokenize": {"post": _operation("tokenize", "Token ids of a prompt or chat", body=tokenize)},
        "/detokenize": {"post": _operation("detokenize", "Text of token ids", body=detokenize)},
        "/generate": {"post": _operation("generate", "Greedy completion (the seed's API)", body=generate,
                                         ok=_json(_GENERATED, "the text and its token counts"))},
        "/api/chat": {"post": _operation("ollamaChat", "A chat in Ollama's wire format", body=ollama_chat, ok=ndjson,
                                         errors=_OLLAMA_ERRORS)},
        "/api/generate": {"post": _operation("ollamaGenerate", "A prompt in Ollama's wire format (an empty one loads "
                                             "the model)", body=ollama_generate, ok=ndjson, errors=_OLLAMA_ERRORS)},
        "/api/embed": {"post": _operation("ollamaEmbed", "Embed a string or strings (Ollama's wire format)",
                                          body=ollama_embed, errors=_OLLAMA_ERRORS)},
        "/api/embeddings": {"post": _operation("ollamaEmbeddings", "Embed one prompt (Ollama's older route)",
                                               body=ollama_embeddings, errors=_OLLAMA_ERRORS)},
        "/api/tags": {"get": _operation("ollamaTags", "The models served, as Ollama lists them",
                                        errors=_OLLAMA_ERRORS)},
        "/api/ps": {"get": _operation("ollamaPs", "The models loaded, as Ollama lists them", errors=_OLLAMA_ERRORS)},
        "/api/show": {"post": _operation("ollamaShow", "One model's details, as Ollama shows them", body=ollama_show,
                                         errors=_OLLAMA_ERRORS)},
        "/api/version": {"get": _operation("ollamaVersion", "The Ollama API version forge speaks",
                                           errors=_OLLAMA_ERRORS)},
        "/healthz": {"get": _operation("health", "Ready (200) or loading, draining, stuck (503)", auth=False)},
        "/metrics": {"get": _operation("metrics", "Prometheus metrics", ok=text)},
        "/stats": {"get": _operation("stats", "The dashboard's data")},
        "/openapi.json": {"get": _operation("openapi", "This document")},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "forge", "version": "1",
                 "description": "An OpenAI-compatible API for serving GGUF language models."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
