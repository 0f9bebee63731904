"""The `forge` command: pull, generate, serve and bench.

Only the completion text goes to stdout; progress and logs go to stderr. A user error (a missing
model, a bad flag value) is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from forge.errors import ForgeError


def _cmd_bench(args: argparse.Namespace) -> int:
    from forge import bench

    result = bench.toy_bench(num_requests=args.requests, prompt_len=args.prompt_len,
                             max_new=args.max_new, max_batch_size=args.max_batch_size,
                             num_blocks=args.blocks, block_size=args.block_size,
                             lookahead=args.lookahead, seed=args.seed)
    print(json.dumps(result) if args.json else bench.format_toy(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forge", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="offline benchmark of the engine")
    bench.add_argument("--requests", type=int, default=64)
    bench.add_argument("--prompt-len", type=int, default=32)
    bench.add_argument("--max-new", type=int, default=64)
    bench.add_argument("--max-batch-size", type=int, default=8)
    bench.add_argument("--blocks", type=int, default=256)
    bench.add_argument("--block-size", type=int, default=16)
    bench.add_argument("--lookahead", type=int, default=4)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", action="store_true", help="print JSON instead of text")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ForgeError as exc:
        print(f"forge: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
