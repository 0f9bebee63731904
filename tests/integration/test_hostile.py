"""Hostile and odd input at the HTTP edge: each gets the right answer (served, or a 4xx in the
OpenAI error envelope), never a 500 or a traceback, and never an effect on a well-formed request
running beside it. One daemon takes them all, a normal stream in flight throughout. The Messages API's
routes answer in that API's envelope, the message naming the field; the Responses API's in OpenAI's,
`param` naming it."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx

from actors.supervisor import running_daemon
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    assert_messages_error,
    data_payloads,
    wait_idle,
)

JSON = {"content-type": "application/json"}


def peak_rss() -> int:
    """This process's peak resident memory in bytes (the daemon under test runs in it)."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines())
    return int(status["VmHWM"].split()[0]) * 1024


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# (what, path, raw body, headers, the statuses that are right)
HOSTILE: list[tuple[str, str, bytes, dict[str, str], set[int]]] = [
    ("NUL bytes in the prompt and a stop string", "/v1/completions",
     json.dumps({"prompt": "a\u0000b", "stop": ["\u0000"], "max_tokens": 3}).encode(), JSON, {200}),
    ("NUL bytes in a chat message", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "hi\u0000there"}], "max_tokens": 3}).encode(), JSON,
     {200}),
    ("a lone surrogate in the prompt", "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 3}', JSON,
     {400}),
    ("a lone surrogate in a stop string", "/v1/completions",
     b'{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 3}', JSON, {400}),
    ("a lone surrogate in a chat message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 3}', JSON, {400}),
    ("invalid UTF-8 in a stop string", "/v1/completions", b'{"prompt": "hi", "stop": ["\xc3\x28"]}', JSON, {400}),
    ("invalid UTF-8 in a chat message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', JSON, {400}),
    ("a 150,000-character stop string", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 1, "stop": ["x" * 150_000]}).encode(), JSON, {400}),
    ("four 4,096-character stop strings (the longest allowed) and n 8", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 4, "n": 8, "stop": [c * 4096 for c in "xyzw"]}).encode(), JSON, {200}),
    ("2,000 stop token ids", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 1, "stop_token_ids": list(range(2000))}).encode(), JSON, {400}),
    ("10,000 stop strings", "/v1/completions",
     json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(10_000)]}).encode(), JSON, {400}),
    ("a 100,000-deep array in an unknown field", "/v1/completions",
     b'{"prompt": "hi", "max_tokens": 2, "x": ' + nested(100_000) + b"}", JSON, {400}),
    ("a 100,000-deep array as the prompt", "/v1/completions", b'{"prompt": ' + nested(100_000) + b"}", JSON,
     {400}),
    ("a 10,000-deep object as a JSON schema", "/v1/completions",
     b'{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": '
     b'{"name": "x", "schema": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_000 + b"}}}", JSON, {400}),
    ("unknown fields", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 2, "frobnicate": {"a": [1, 2]}, "x-extra": None}).encode(), JSON,
     {200}),
    ("a body sent as text (what a page sends cross-site unasked)", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), {"content-type": "text/plain"}, {415}),
    ("a body sent as a form (curl -d without -H)", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), {"content-type": "application/x-www-form-urlencoded"},
     {415}),
    ("no content type", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), {}, {200}),
    ("duplicate keys", "/v1/completions", b'{"prompt": "a", "prompt": "b", "max_tokens": 2}', JSON, {200}),
    ("a number too large for any field", "/v1/completions",
     b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}", JSON, {400}),
    ("NaN where a number goes", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', JSON, {400}),
    ("a huge seed", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "seed": 18446744073709551616}', JSON,
     {400}),
    ("a body that is only whitespace", "/v1/completions", b" \n\t ", JSON, {400}),
    ("a UTF-8 byte order mark", "/v1/completions", b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}', JSON,
     {400}),
    ("a prompt of a million digits (a token each)", "/v1/completions",
     json.dumps({"prompt": "1" * 1_000_000, "max_tokens": 1}).encode(), JSON, {400}),
    ("a chat message of a million digits", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "1" * 1_000_000}], "max_tokens": 1}).encode(), JSON, {400}),
    ("150,000 one-character prompts x n 8", "/v1/completions",
     json.dumps({"prompt": ["a"] * 150_000, "n": 8, "max_tokens": 1}).encode(), JSON, {400}),
    ("a prompt of 20,000 emoji", "/v1/completions", json.dumps({"prompt": "\U0001f600" * 20_000}).encode(), JSON,
     {400}),
    ("token ids of the wrong type", "/v1/completions", b'{"prompt": [1, "2", 3.5]}', JSON, {400}),
    ("a tokenize request with a NUL", "/tokenize", json.dumps({"prompt": "a\u0000"}).encode(), JSON, {200}),
]

MESSAGE = {"model": SERVED_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}

# The Messages API's routes: (what, path, body, status, error type, what the message names)
MESSAGES_HOSTILE: list[tuple[str, str, Any, int, str, str]] = [
    ("no max_tokens", "/v1/messages", {k: v for k, v in MESSAGE.items() if k != "max_tokens"}, 400,
     "invalid_request_error", "max_tokens"),
    ("a role that is neither user nor assistant", "/v1/messages",
     {**MESSAGE, "messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid_request_error",
     "messages[0].role"),
    ("temperature 1.5 (the Messages API's range is 0-1)", "/v1/messages", {**MESSAGE, "temperature": 1.5}, 400,
     "invalid_request_error", "temperature"),
    ("an image block", "/v1/messages",
     {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]},
     400, "invalid_request_error", "messages[0].content[1]"),
    ("an image in a tool result", "/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}]}]}, 400, "invalid_request_error",
     "messages[0].content[0].content[0]"),
    ("a model not served", "/v1/messages", {**MESSAGE, "model": "claude-none"}, 404, "not_found_error", "claude-none"),
    ("a block type nobody knows", "/v1/messages",
     {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400, "invalid_request_error",
     "messages[0].content[0].type"),
    ("tool_choice any without tools", "/v1/messages", {**MESSAGE, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "tool_choice"),
    ("a 150,000-character stop sequence", "/v1/messages", {**MESSAGE, "stop_sequences": ["x" * 150_000]}, 400,
     "invalid_request_error", "stop_sequences[0]"),
    ("a reply to continue (a prefill)", "/v1/messages",
     {**MESSAGE, "messages": [*MESSAGE["messages"], {"role": "assistant", "content": "Sure"}]}, 400,
     "invalid_request_error", "messages[1].role"),
    ("a 100,000-deep tool input", "/v1/messages", None, 400, "invalid_request_error", "nested"),
    ("count_tokens without messages", "/v1/messages/count_tokens", {"model": SERVED_MODEL}, 400,
     "invalid_request_error", "messages"),
    ("a route under the Messages API that is not one", "/v1/messages/batches", MESSAGE, 404, "not_found_error", ""),
]
RESPONSE = {"model": SERVED_MODEL, "input": "Hi", "max_output_tokens": 4}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}
# The Responses API answers in OpenAI's envelope: (what, fields over RESPONSE (None: drop it), status, param)
RESPONSES_HOSTILE: list[tuple[str, dict[str, Any] | None, int, str]] = [
    ("no input", {"input": None}, 400, "input"),
    ("an empty input", {"input": []}, 400, "input"),
    ("a role nobody has", {"input": [{"role": "bot", "content": "Hi"}]}, 400, "input[0].role"),
    ("an image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, 400,
     "input[0].content[0]"),
    ("an item type nobody knows", {"input": [{"type": "hologram"}]}, 400, "input[0].type"),
    ("a call output without its call", {"input": [{"type": "function_call_output", "output": "x"}]}, 400,
     "input[0].call_id"),
    ("temperature 3", {"temperature": 3}, 400, "temperature"),
    ("max_output_tokens 0", {"max_output_tokens": 0}, 400, "max_output_tokens"),
    ("a tool with no type", {"tools": [{"name": "web_search"}]}, 400, "tools[0].type"),
    ("a namespace of a function with a bad schema", {"tools": [{"type": "namespace", "name": "ns", "tools": [
        {**WEATHER, "parameters": {"type": "array"}}]}]}, 400, "tools[0].tools[0].parameters"),
    ("a function name with a space", {"tools": [{**WEATHER, "name": "bad name"}]}, 400, "tools[0].name"),
    ("tool_choice required without tools", {"tool_choice": "required"}, 400, "tool_choice"),
    ("tool_choice naming another function", {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
     400, "tool_choice.name"),
    ("a json_schema format without a schema", {"text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text.format.schema"),
    ("a schema llguidance cannot read", {"text": {"format": {"type": "json_schema", "name": "x",
                                                             "schema": {"type": "nonesuch"}}}}, 400,
     "text.format.schema"),
    ("a forced call and a format", {"tools": [WEATHER], "tool_choice": "required",
                                    "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ("a background response", {"background": True}, 400, "background"),
    ("a prompt longer than the context", {"input": "word " * 20_000}, 400, "input"),
    ("a model not served", {"model": "gpt-nonesuch"}, 404, "model"),
    ("a previous response nobody stored", {"previous_response_id": "resp_nonesuch"}, 404, "previous_response_id"),
    ("100,000-deep function parameters", None, 400, ""),
]
DEEP_PARAMETERS = (b'{"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {"a": '
                   + nested(100_000) + b"}}]}")
DEEP_INPUT = (b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", '
              b'"id": "t", "name": "f", "input": {"a": ' % SERVED_MODEL.encode() + nested(100_000) + b"}}]}]}")


async def test_hostile_input_gets_the_right_answer_and_harms_no_other_request(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon()
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            neighbour: dict[str, Any] = {}

            async def well_formed_stream() -> None:
                body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
                resp = await http.post("/v1/completions", json=body)
                neighbour["status"] = resp.status_code
                neighbour["payloads"] = data_payloads(resp.content)

            rss_before = peak_rss()
            async with anyio.create_task_group() as tg:
                tg.start_soon(well_formed_stream)
                for what, path, body, headers, allowed in HOSTILE:
                    resp = await http.post(path, content=body, headers=headers)
                    assert resp.status_code in allowed, f"{what}: {resp.status_code} {resp.text[:300]}"
                    if resp.status_code >= 400:
                        error = resp.json()["error"]
                        assert error["message"] and error["type"] == "invalid_request_error", what
                        assert "Traceback" not in resp.text, what
                    assert (await http.get("/healthz")).status_code == 200, what
                for what, path, message, status, kind, naming in MESSAGES_HOSTILE:
                    raw = DEEP_INPUT if message is None else json.dumps(message).encode()
                    resp = await http.post(path, content=raw, headers=JSON)
                    assert_messages_error(resp, status, type=kind, naming=naming)
                    assert "Traceback" not in resp.text, what
                for what, fields, status, param in RESPONSES_HOSTILE:
                    raw = DEEP_PARAMETERS if fields is None else json.dumps(
                        {k: v for k, v in {**RESPONSE, **fields}.items() if v is not None}).encode()
                    resp = await http.post("/v1/responses", content=raw, headers=JSON)
                    error = assert_error(resp, status, param=param or None)
                    assert "Traceback" not in resp.text and (fields is not None or "nested" in error["message"]), what
            assert neighbour["status"] == 200
            # Bounded: nothing above costs memory in proportion to its square (a 150,000-character stop
            # string once took 5 GiB and ended the daemon)
            assert peak_rss() - rss_before < 512 * 2**20, (rss_before, peak_rss())
            text = "".join(p["choices"][0]["text"] for p in neighbour["payloads"] if p.get("choices"))
            plain = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 48, "temperature": 0,
                                                             "ignore_eos": True})
            assert text == plain.json()["choices"][0]["text"]      # the same as with nobody hostile around
            await wait_idle(daemon)


async def test_a_body_that_never_ends_gets_408_and_the_connection_closes(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"body_timeout": 1.0})
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            host, port = url.removeprefix("http://").split(":")
            async with await anyio.connect_tcp(host, int(port)) as conn:
                await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                b"Content-Type: application/json\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")   # and then nothing more
                raw = b""
                with anyio.move_on_after(HANG_GUARD_S):
                    while True:
                        try:
                            raw += await conn.receive()
                        except (anyio.EndOfStream, anyio.BrokenResourceError):
                            break                                  # closed by the server
            head, _, body = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), raw[:200]
            assert b'"body_timeout"' in body
            assert (await http.get("/healthz")).status_code == 200
            await wait_idle(daemon)


async def test_clients_trickling_headers_hold_only_their_own_connections(make_daemon: MakeDaemon) -> None:
    """Slowloris: 50 connections sending their headers a byte at a time. Each costs forge one idle
    connection (cutting them is the proxy's job: deploy/nginx/forge.conf's client_header_timeout);
    requests from everyone else are served meanwhile, and once they go, nothing is left of them."""
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            host, port = url.removeprefix("http://").split(":")
            trickling = anyio.Event()

            async def slow_client() -> None:
                async with await anyio.connect_tcp(host, int(port)) as conn:
                    await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
                    trickling.set()
                    for _ in range(40):
                        await conn.send(b"a")
                        await anyio.sleep(0.05)

            async with anyio.create_task_group() as tg:
                for _ in range(50):
                    tg.start_soon(slow_client)
                await trickling.wait()
                resp = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True})
                assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
                assert (await http.get("/healthz")).status_code == 200
            await wait_idle(daemon)
