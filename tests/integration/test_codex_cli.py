"""OpenAI's Codex CLI against forge (issue 55): `@openai/codex` at the version pinned in tests/node/package.json
(its native binary comes with it, as the optional dependency for the platform), run as scripts run it,
`codex exec --json PROMPT`, with its default features, through a custom model provider on forge's /v1 with
`wire_api = "responses"`, as docs/api.md tells users to configure it. No internet: the config turns off
the update check and analytics, and CODEX_HOME and HOME are the test's own directories.

What Codex sends is its own: every default tool (its functions, the multi-agent tools as a `namespace`,
the hosted `web_search`, which forge leaves out with a warning), `reasoning`, `include`, `store: false`,
no `max_output_tokens` (forge's default bound applies), a stream. Two settings keep a run short and its end
certain on a 135M model and two shared cores, without turning any feature off:
- `model_instructions_file`: Codex's own instructions (about 3,800 tokens) replaced by one line. With them,
  its first request is about 9,200 tokens, over SmolLM2-135M's 8,192-token context (forge answers 400
  context_length_exceeded, which Codex reports as running out of room); the tools still go whole.
- `--output-schema`: Codex sends it as the Responses API's `text.format` json_schema and forge holds the
  answer to it, so the model ends its turn in a few tokens (a tiny model left free writes on to the bound,
  which Codex reports as a failed turn).
The sandbox stays Codex's default for `exec` (read-only): the model runs no command here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest

from actors.http.gateway import GatewayConfig
from actors.runtime.model_set import ModelEntry
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from forge.api.responses.responses_schema import DEFAULT_MAX_OUTPUT_TOKENS
from tests.integration.harness import HANG_GUARD_S, NODE, SERVED_MODEL, MakeDaemon, engine_config, sample

CONTEXT = 8192                    # SmolLM2-135M's whole context: Codex's prompt needs most of it
CODEX_GUARD_S = 4 * HANG_GUARD_S  # a hang guard: a ~5,400-token prefill on two busy cores, a model load
GREETING = {"type": "object", "properties": {"greeting": {"type": "string", "enum": ["hi", "hello"]}},
            "required": ["greeting"], "additionalProperties": False}
# Codex has no metadata (context window, instructions) for a model it does not know and says so as an error
# item, then uses its fallback; a note, not a failure of the turn
UNKNOWN_MODEL_NOTE = re.compile(r"Model metadata for `[^`]+` not found")


def codex_home(tmp_path: Path, url: str, model: str) -> Path:
    """A CODEX_HOME whose config.toml points Codex at forge and reaches nothing else."""
    home = tmp_path / "codex-home"
    home.mkdir()
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a coding agent. Answer the user briefly.\n")
    (home / "config.toml").write_text(f"""\
model = "{model}"
model_provider = "forge"
model_instructions_file = "{instructions}"
check_for_update_on_startup = false

[model_providers.forge]
name = "forge"
base_url = "{url}/v1"
wire_api = "responses"
request_max_retries = 0          # a request forge refused fails the run rather than being retried
stream_max_retries = 0

[analytics]
enabled = false
""")
    return home


async def codex_exec(daemon: Daemon, node_dir: Path, tmp_path: Path, model: str) -> list[dict[str, Any]]:
    """Serve `daemon`, run `codex exec --json` on a tiny prompt against it, and return its JSON events."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(GREETING))
    work = tmp_path / "work"
    work.mkdir()
    codex = node_dir / "node_modules" / "@openai" / "codex" / "bin" / "codex.js"
    with anyio.fail_after(CODEX_GUARD_S):
        async with running_daemon(daemon) as url:
            home = codex_home(tmp_path, url, model)
            env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(home), "NO_COLOR": "1"}
            done = await anyio.run_process(
                [str(NODE), str(codex), "exec", "--json", "--skip-git-repo-check", "--output-schema", str(schema),
                 "Say hi."], cwd=work, env=env, input=b"", check=False)
    err = done.stderr.decode()
    events = [json.loads(line) for line in done.stdout.decode().splitlines() if line.strip()]
    assert done.returncode == 0, f"codex exec exited {done.returncode}: {events[-3:]} {err[-2000:]}"
    return events


def assert_turn_completed(events: list[dict[str, Any]], context: int) -> None:
    """One turn, completed, whose agent message is the model's answer held to the schema, bounded."""
    types = [event["type"] for event in events]
    assert types[0] == "thread.started" and types.count("turn.started") == 1 and types[-1] == "turn.completed", types
    assert "turn.failed" not in types and "error" not in types, events
    items = [event["item"] for event in events if event["type"] == "item.completed"]
    notes = [item for item in items if item["type"] == "error"]
    assert all(UNKNOWN_MODEL_NOTE.match(item["message"]) for item in notes), notes
    [message] = [item for item in items if item["type"] == "agent_message"]
    jsonschema.validate(json.loads(message["text"]), GREETING)
    usage = events[-1]["usage"]
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] < DEFAULT_MAX_OUTPUT_TOKENS, usage
    assert usage["input_tokens"] + usage["output_tokens"] < context, usage


def assert_served_cleanly(daemon: Daemon, capsys: pytest.CaptureFixture[str]) -> None:
    """Every request Codex sent was answered below 400, its responses ended by the model (the schema
    complete), not by a bound."""
    access = [line for line in capsys.readouterr().out.splitlines() if "access" in line and "path=/" in line]
    statuses = [int(m.group(1)) for line in access if (m := re.search(r"status=(\d+)", line))]
    assert statuses and all(status < 400 for status in statuses), access
    assert any("path=/v1/responses" in line and "status=200" in line for line in access), access
    answered = sample(daemon, "forge:request_success_total")
    assert answered >= 1 and sample(daemon, "forge:request_success_total", {"finished_reason": "stop"}) == answered


async def test_codex_exec_against_one_model(make_daemon: MakeDaemon, node_clients: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    daemon = make_daemon(max_model_len=CONTEXT, max_num_batched_tokens=1024)
    events = await codex_exec(daemon, node_clients, tmp_path, SERVED_MODEL)
    assert_turn_completed(events, CONTEXT)
    assert_served_cleanly(daemon, capsys)


async def test_codex_exec_against_several_models(default_model_path: Path, gemma3_model_path: Path,
                                                 node_clients: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma 3 270M beside SmolLM2, Codex on Gemma: loaded on demand, its own chat template over Codex's
    developer messages and tools."""
    models = [ModelEntry(model_id="smollm2", source=str(default_model_path)),
              ModelEntry(model_id="gemma-3-270m", source=str(gemma3_model_path))]
    daemon = Daemon(DaemonConfig(engine=engine_config(max_model_len=CONTEXT, max_num_batched_tokens=1024),
                                 gateway=GatewayConfig(), models=models, drain_timeout=5.0))
    events = await codex_exec(daemon, node_clients, tmp_path, "gemma-3-270m")
    assert_turn_completed(events, CONTEXT)
    assert_served_cleanly(daemon, capsys)
