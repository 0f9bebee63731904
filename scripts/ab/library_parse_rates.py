"""How often the client libraries get a parsed object back from forge: tests/library_cases.py's 20 extraction
prompts through instructor, LangChain and the OpenAI Agents SDK, greedy and at temperature 0.7 with a seed,
against a daemon serving the default model (or --model) on loopback with forge's defaults. Prints a markdown
table of parses per library mode and, with --failures, why each failure failed.

    .venv/bin/python scripts/ab/library_parse_rates.py [--modes "instructor TOOLS,langchain json_schema"] [--failures]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio

from actors.http.gateway import GatewayConfig
from actors.ops.logs import configure_logging
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from forge.config import EngineConfig
from forge.models.loading import LoadedModel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.library_cases import CASES, MODES, TEMPERATURES, UNCONSTRAINED, parse_rates  # noqa: E402

SERVED = "forge"


Results = dict[tuple[str, float], list[str | None]]


async def measure(model: str | None, modes: list[str] | None, concurrency: int) -> Results:
    loaded = await anyio.to_thread.run_sync(lambda: LoadedModel.load(model, progress=lambda _: None))
    daemon = Daemon(DaemonConfig(engine=EngineConfig(max_num_seqs=16), gateway=GatewayConfig(served_model_name=SERVED),
                                 model=model), loaded)
    async with running_daemon(daemon) as url:
        return await parse_rates(url + "/v1", SERVED, modes, concurrency=concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF path (default: the default model)")
    parser.add_argument("--modes", default=None, help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--failures", action="store_true", help="say why each failure failed")
    args = parser.parse_args()
    modes = args.modes.split(",") if args.modes else None
    configure_logging("warning")
    results = anyio.run(measure, args.model, modes, args.concurrency)
    print("| library mode | " + " | ".join(f"temperature {t:g}" for t in TEMPERATURES) + " |")
    print("|---|" + "---|" * len(TEMPERATURES))
    for mode in modes or list(MODES):
        cells = [f"{sum(w is None for w in results[(mode, t)])}/{len(CASES)}" for t in TEMPERATURES]
        note = " (unconstrained)" if mode in UNCONSTRAINED else ""
        print(f"| {mode}{note} | " + " | ".join(cells) + " |")
    if args.failures:
        for (mode, t), outcomes in results.items():
            for i, why in enumerate(outcomes):
                if why is not None:
                    print(f"{mode} at {t:g}, case {i} ({CASES[i].model.__name__}): {why[:200]}")


if __name__ == "__main__":
    main()
