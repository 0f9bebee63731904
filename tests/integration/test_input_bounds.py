"""Bounds on what a request may nest, and seeds at the edge of int64, through a real daemon with a stream
in flight: a schema, tool parameters or a grammar nested past forge's limits is a 400 naming the limit in the
route's envelope (not a 500, and not a crashed process: the deepest were a SIGSEGV in llguidance's compiler),
and the stream beside them finishes with the same text; n choices of the largest seed are served."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx

from actors.supervisor import running_daemon
from forge.sampling.nesting import MAX_GRAMMAR_DEPTH, MAX_SCHEMA_DEPTH
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
STRING = '{"type": "string"}'
CHAT = '"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4'


def any_of(levels: int) -> str:
    """A schema of `levels` anyOf around a string, as JSON text (2 levels of objects and arrays each)."""
    return '{"anyOf": [' * levels + STRING + "]}" * levels


def ref_chain(links: int) -> str:
    """A schema whose root refers down a chain of `links` definitions (106 KB at 3,000)."""
    defs = ", ".join([f'"d{i}": {{"$ref": "#/$defs/d{i + 1}"}}' for i in range(links)] + [f'"d{links}": {STRING}'])
    return f'{{"type": "object", "properties": {{"a": {{"$ref": "#/$defs/d0"}}}}, "$defs": {{{defs}}}}}'


def rule_chain(num_rules: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(num_rules)) + f'r{num_rules}: "a"\n'


def tool(schema: str) -> str:
    return f'{{"type": "function", "function": {{"name": "f", "parameters": {schema}}}}}'


# (what, path, body, the error's param, what its message names)
TOO_DEEP: list[tuple[str, str, str, str, str]] = [
    ("240 levels of anyOf in response_format", "/v1/chat/completions",
     f'{{{CHAT}, "response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": '
     f'{any_of(120)}}}}}}}',
     "response_format.json_schema.schema", f"more than {MAX_SCHEMA_DEPTH} levels"),
    ("a chain of 3,000 $refs in a tool's parameters (SIGSEGV before)", "/v1/chat/completions",
     f'{{{CHAT}, "tools": [{tool(ref_chain(3000))}], "tool_choice": "required"}}', "tools[0].function.parameters",
     f"more than {MAX_SCHEMA_DEPTH} levels"),
    ("deep tool parameters the template would render (tool_choice auto)", "/v1/chat/completions",
     f'{{{CHAT}, "tools": [{tool(any_of(150))}]}}', "tools[0].function.parameters",
     f"more than {MAX_SCHEMA_DEPTH} levels"),
    ("a chain of 5,000 rules in guided_grammar (SIGSEGV before)", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 2, "guided_grammar": rule_chain(5000)}), "guided_grammar",
     f"more than {MAX_GRAMMAR_DEPTH} levels"),
    ("a chain of 3,000 $refs as guided_json, a string", "/v1/completions",
     json.dumps({"prompt": "hi", "max_tokens": 2, "guided_json": ref_chain(3000)}), "guided_json",
     f"more than {MAX_SCHEMA_DEPTH} levels"),
    ("240 levels of anyOf in the Responses API's text.format", "/v1/responses",
     f'{{"input": "Hi", "text": {{"format": {{"type": "json_schema", "name": "x", "schema": {any_of(120)}}}}}}}',
     "text.format.schema", f"more than {MAX_SCHEMA_DEPTH} levels"),
]

MESSAGES_TOO_DEEP = (f'{{"model": "{SERVED_MODEL}", "max_tokens": 4, '
                     '"messages": [{"role": "user", "content": "Hi"}], '
                     f'"tools": [{{"name": "f", "input_schema": {ref_chain(3000)}}}], '
                     '"tool_choice": {"type": "any"}}')

AT_THE_LIMIT = (f'{{{CHAT}, "response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": '
                '{"type": "object", "properties": {"a": ' + '{"type": "array", "items": ' * (MAX_SCHEMA_DEPTH - 3)
                + STRING + "}" * (MAX_SCHEMA_DEPTH - 3) + "}}}}}")


async def test_nested_schemas_and_grammars_get_a_400_naming_the_limit_and_harm_no_other_request(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon()
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "stream": True}
            alone = data_payloads((await http.post("/v1/completions", json=body)).content)
            beside: list[Any] = []

            async def well_formed_stream() -> None:
                beside.extend(data_payloads((await http.post("/v1/completions", json=body)).content))

            async with anyio.create_task_group() as tg:
                tg.start_soon(well_formed_stream)
                for what, path, raw, param, names in TOO_DEEP:
                    resp = await http.post(path, content=raw.encode(), headers=JSON)
                    err = assert_error(resp, 400, param=param)
                    assert names in err["message"], (what, err)
                resp = await http.post("/v1/messages", content=MESSAGES_TOO_DEEP.encode(), headers=JSON)
                assert_messages_error(resp, 400, type="invalid_request_error",
                                      naming=f"more than {MAX_SCHEMA_DEPTH} levels")
                served = await http.post("/v1/chat/completions", content=AT_THE_LIMIT.encode(), headers=JSON)
                assert served.status_code == 200, served.text
            assert beside == alone or [p["choices"] for p in beside] == [p["choices"] for p in alone]
            assert (await http.get("/healthz")).status_code == 200
            await wait_idle(daemon)


async def test_several_choices_of_the_largest_seed_are_served_their_seeds_wrapping(make_daemon: MakeDaemon) -> None:
    """{"n": 2, "seed": 2^63 - 1} was a 400: choice 1's seed (seed + 1) left int64. It wraps to -2^63."""
    daemon = make_daemon()
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
            both = await http.post("/v1/completions", json={**body, "n": 2, "seed": 2**63 - 1})
            assert both.status_code == 200, both.text
            texts = {c["index"]: c["text"] for c in both.json()["choices"]}
            second = await http.post("/v1/completions", json={**body, "seed": -(2**63)})
            assert second.status_code == 200, second.text
            assert texts[1] == second.json()["choices"][0]["text"]
            chat = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 3, "seed": 2**63 - 2})
            assert chat.status_code == 200, chat.text
            assert len(chat.json()["choices"]) == 3
            await wait_idle(daemon)
