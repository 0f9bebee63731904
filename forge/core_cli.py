"""The core's command line: pull, generate and the offline bench (the daemon adds `serve`).

Only the completion text goes to stdout; progress and logs go to stderr. A user error (a missing
model, a bad flag value) is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any, overload

from forge.config import KV_CACHE_DTYPES, EngineConfig, parse_size
from forge.errors import ForgeError
from forge.kernels import KERNELS, NUMERICS
from forge.sampling.reasoning import PARSERS
from forge.spec_decode.speculation import SPECULATIVE_METHODS


@overload
def env(name: str, default: str) -> str: ...
@overload
def env(name: str, default: None) -> str | None: ...
def env(name: str, default: str | None) -> str | None:
    """A setting from the environment; unset or empty means the default."""
    value = os.environ.get(name)
    return value if value else default


def _progress(message: str) -> None:
    print(f"forge: {message}", file=sys.stderr, flush=True)


def _size_or_auto(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else parse_size(text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    speculative = args.speculative          # unset: a named draft means "draft", else "ngram"
    if speculative is None:
        speculative = "draft" if args.draft_model is not None or args.draft_layers is not None else "ngram"
    try:
        return EngineConfig(block_size=args.block_size, kv_cache_memory=_size_or_auto(args.kv_cache_memory),
                            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            enable_prefix_caching=not args.no_prefix_caching,
                            blas_threads=args.blas_threads, matmul_strategy=args.matmul_strategy,
                            kernels=args.kernels, numerics=args.numerics, kv_cache_dtype=args.kv_cache_dtype,
                            kv_cache_commit=args.kv_cache_commit == "on", max_step_ms=args.max_step_ms,
                            scheduling_policy=args.scheduling_policy, speculative=speculative,
                            num_speculative_tokens=args.num_speculative_tokens,
                            speculative_max_batch=args.speculative_max_batch, draft_model=args.draft_model,
                            draft_layers=args.draft_layers, draft_p_min=args.draft_p_min,
                            pooling=args.pooling, reasoning_parser=args.reasoning_parser,
                            kv_cache_dir=args.kv_cache_dir, kv_cache_disk_size=parse_size(args.kv_cache_disk_size))
    except ValueError as exc:
        raise SystemExit(f"forge: {exc}") from None


def add_engine_flags(p: argparse.ArgumentParser, *, many_models: bool = False) -> None:
    """`many_models`: --model may be given several times (forge serve), a list in args.model."""
    g = p.add_argument_group("engine")
    if many_models:
        g.add_argument("--model", action="append", default=None,
                       help="GGUF model file, or a name from `forge pull --list`; give it several times to "
                            "serve several models (ID=MODEL names one's id, unless the whole value is an "
                            "existing file: a file name may hold '='; the variable comma-separated) "
                            "[FORGE_MODEL; the default model]")
    else:
        g.add_argument("--model", default=env("FORGE_MODEL", None),
                       help="GGUF model file, or a name from `forge pull --list` [FORGE_MODEL; the default model]")
    g.add_argument("--max-num-seqs", type=int, default=int(env("FORGE_MAX_NUM_SEQS", "64")),
                   help="sequences running at once [FORGE_MAX_NUM_SEQS; 64]")
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=int(env("FORGE_MAX_NUM_BATCHED_TOKENS", "512")),
                   help="token budget of one step; long prompts are prefilled in chunks of at most this "
                        "[FORGE_MAX_NUM_BATCHED_TOKENS; 512]")
    g.add_argument("--scheduling-policy", choices=["shortest-first", "fcfs"],
                   default=env("FORGE_SCHEDULING_POLICY", "shortest-first"),
                   help="who gets a step's token budget first: shortest-first (decodes, then the prompts "
                        "with the fewest tokens left; long waits age into first place) or fcfs "
                        "[FORGE_SCHEDULING_POLICY; shortest-first]")
    g.add_argument("--pooling", choices=["last", "mean", "cls"], default=env("FORGE_POOLING", "last"),
                   help="how POST /v1/embeddings pools a decoder's final normed hidden states (then L2-normalised): "
                        "last token, mean over the input, or first token [FORGE_POOLING; last]")
    g.add_argument("--reasoning-parser", choices=list(PARSERS), default=env("FORGE_REASONING_PARSER", "auto"),
                   help="how chat splits a reasoning model's thinking section (<think>...</think>) from its "
                        "answer: auto (from the chat template), none, qwen3 (the model opens the section), "
                        "deepseek_r1 (the output starts inside it) or harmony (gpt-oss's channels) "
                        "[FORGE_REASONING_PARSER; auto]")
    g.add_argument("--max-step-ms", type=_step_ms, default=env("FORGE_MAX_STEP_MS", "300"),
                   help="while sequences decode, size each step to about this many milliseconds by its "
                        "measured cost (less prompt per step, steadier streams); off: the token budget "
                        "alone [FORGE_MAX_STEP_MS; 300]")
    g.add_argument("--speculative", choices=list(SPECULATIVE_METHODS), default=env("FORGE_SPECULATIVE", None),
                   help="speculative decoding: ngram lets each decoding sequence guess its next tokens from "
                        "its own prompt and output, verified in the same step (output unchanged); draft: a "
                        "draft model guesses (--draft-model or --draft-layers); off: one token per sequence "
                        "per step [FORGE_SPECULATIVE; ngram, or draft when a draft is named]")
    g.add_argument("--draft-model", default=env("FORGE_DRAFT_MODEL", None),
                   help="the draft model of --speculative draft: a GGUF file or a name from `forge pull "
                        "--list`, with the model's vocabulary and ideally ~10x fewer weights [FORGE_DRAFT_MODEL; none]")
    g.add_argument("--draft-layers", type=int, default=_int_or_none(env("FORGE_DRAFT_LAYERS", None)),
                   help="draft with the model's own first N layers instead of a second model (pays only for "
                        "models trained to exit early) [FORGE_DRAFT_LAYERS; none]")
    g.add_argument("--draft-p-min", type=float, default=float(env("FORGE_DRAFT_P_MIN", "0.75")),
                   help="a sequence stops guessing at the first guess its draft model gives a lower "
                        "probability [FORGE_DRAFT_P_MIN; 0.75]")
    g.add_argument("--num-speculative-tokens", type=int, default=int(env("FORGE_NUM_SPECULATIVE_TOKENS", "8")),
                   help="most guesses a sequence carries into a step (4 at most while over 4 sequences decode) "
                        "[FORGE_NUM_SPECULATIVE_TOKENS; 8]")
    g.add_argument("--speculative-max-batch", type=int, default=int(env("FORGE_SPECULATIVE_MAX_BATCH", "32")),
                   help="speculate only while at most this many sequences decode [FORGE_SPECULATIVE_MAX_BATCH; 32]")
    g.add_argument("--kv-cache-memory", default=env("FORGE_KV_CACHE_MEMORY", "auto"),
                   help="memory for the K/V arrays, e.g. 512MiB; auto: --max-num-seqs sequences of 1,024 tokens "
                        "or one whole context, whichever is more, at most 40%% of the machine's memory "
                        "[FORGE_KV_CACHE_MEMORY; auto]")
    g.add_argument("--max-model-len", type=int, default=_int_or_none(env("FORGE_MAX_MODEL_LEN", None)),
                   help="longest sequence (prompt + completion) [FORGE_MAX_MODEL_LEN; the model's context]")
    g.add_argument("--block-size", type=int, default=int(env("FORGE_BLOCK_SIZE", "16")),
                   help="tokens per KV block [FORGE_BLOCK_SIZE; 16]")
    g.add_argument("--no-prefix-caching", action="store_true",
                   default=env("FORGE_PREFIX_CACHING", "1") == "0",
                   help="do not reuse cached prompt prefixes [FORGE_PREFIX_CACHING=0; caching on]")
    g.add_argument("--blas-threads", type=int,
                   default=_int_or_none(env("FORGE_BLAS_THREADS", str(os.cpu_count() or 1))),
                   help="threads for the forward's matmuls: the pool of EngineConfig.matmul_strategy 'split' "
                        "(the default; BLAS pinned to 1), or BLAS's own under 'blas' "
                        "[FORGE_BLAS_THREADS; the number of cores]")
    g.add_argument("--kernels", choices=list(KERNELS), default=env("FORGE_KERNELS", "auto"),
                   help="who holds and multiplies the weights: blocks (the file's blocks read in place by "
                        "forge's compiled kernel), onnxruntime (quantized in memory), amx (onnxruntime, and "
                        "prefill-sized steps on the CPU's AMX tiles in bfloat16x3), fast (onnxruntime with "
                        "int8 activations), numpy (the float32 reference), auto (blocks with AVX-512, AMX "
                        "hosts included, else onnxruntime) [FORGE_KERNELS; auto]")
    g.add_argument("--numerics", choices=list(NUMERICS), default=env("FORGE_NUMERICS", "reference"),
                   help="how exactly the weights multiply: reference (float32 over the file's values; "
                        "the same bits for a row whatever the batch), fast (bfloat16 products on "
                        "blocks, int8 activations on onnxruntime: about twice the prefill speed, a few "
                        "1e-3 relative) or deterministic (blocks: x as 15-bit integers per block of 32, "
                        "exact integer sums, one fixed order of float roundings: the products' bits the "
                        "same on every x86 CPU; docs/design.md) [FORGE_NUMERICS; reference]")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=env("FORGE_KV_CACHE_DTYPE", "float16"),
                   help="how the K/V cache stores values: float16 (half float32's bytes, logprobs within "
                        "~1e-2), float32 (exact), bfloat16, or int8 (3.76x float32's tokens per byte, "
                        "logprobs within ~0.3; docs/design.md); attention computes in float32 either way "
                        "[FORGE_KV_CACHE_DTYPE; float16]")
    g.add_argument("--kv-cache-commit", choices=["on", "off"], default=env("FORGE_KV_CACHE_COMMIT", "on"),
                   help="write every page of the KV cache at start: its memory is taken then, and no step "
                        "pays the page faults of first writes (tens of microseconds each on some virtual "
                        "machines) [FORGE_KV_CACHE_COMMIT; on]")
    g.add_argument("--kv-cache-dir", default=env("FORGE_KV_CACHE_DIR", None),
                   help="keep the prefix cache's blocks that RAM forgets in files under this directory, and "
                        "load them back for prompts that miss, across restarts too (under systemd: "
                        "/var/lib/forge/kv) [FORGE_KV_CACHE_DIR; no disk tier]")
    g.add_argument("--kv-cache-disk-size", default=env("FORGE_KV_CACHE_DISK_SIZE", "4GiB"),
                   help="most bytes of block files in --kv-cache-dir; the least recently used go first "
                        "[FORGE_KV_CACHE_DISK_SIZE; 4GiB]")
    g.add_argument("--matmul-strategy", choices=["split", "blas"], default=env("FORGE_MATMUL_STRATEGY", "split"),
                   help="split: each matmul's columns over a pool of 1-thread-BLAS threads (robust when "
                        "other work shares the cores); blas: BLAS's own threads [FORGE_MATMUL_STRATEGY; split]")


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None else None


def _step_ms(text: str) -> float | None:
    """--max-step-ms: a positive number of milliseconds, or off."""
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or off, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or off), got {text!r}")
    return value


def _cmd_pull(args: argparse.Namespace) -> int:
    from forge.models.hub import CATALOG, resolve_model

    if args.list:
        for model in CATALOG.values():
            print(f"{model.name:24} {model.about}")
        return 0
    print(resolve_model(args.name or args.model, _progress))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from forge.llm import LLM
    from forge.sampling.sampling_params import SamplingParams

    llm = LLM(args.model, engine_config(args), progress=_progress)
    prompt = args.prompt
    if args.chat:
        prompt = llm.chat_prompt([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            top_p=args.top_p)
    params.validate(vocab_size=llm.tokenizer.vocab_size)
    for text in llm.stream(prompt, params):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.model is None:
        from forge.seed import toy_bench as toy

        result = toy.toy_bench(num_requests=args.requests, prompt_len=args.prompt_len or 32,
                               max_new=args.max_new or 64, max_batch_size=args.max_batch_size,
                               num_blocks=args.blocks, block_size=args.block_size,
                               lookahead=args.lookahead, seed=args.seed)
        print(json.dumps(result) if args.json else toy.format_toy(result))
        return 0
    from forge import offline_bench as bench

    try:
        concurrency = [int(n) for n in args.concurrency.split(",")]
        result = bench.model_bench(
            None if args.model == "default" else args.model, concurrency=concurrency,
            prompt_len=args.prompt_len or 200, max_new=args.max_new or 128, prefill_len=args.prefill_len,
            max_num_batched_tokens=args.max_num_batched_tokens, blas_threads=args.blas_threads,
            kernels=args.kernels, numerics=args.numerics, kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size, seed=args.seed, progress=_progress)
    except ValueError as exc:
        raise SystemExit(f"forge: {exc}") from None
    print(json.dumps(result) if args.json else bench.format_model(result))
    return 0


def build_parser(register: Callable[[Any], None] | None = None) -> argparse.ArgumentParser:
    """The command line; `register` adds subcommands that live outside the core (serve)."""
    parser = argparse.ArgumentParser(
        prog="forge", description="forge: serve GGUF language models over an OpenAI-compatible HTTP API")
    sub = parser.add_subparsers(dest="command", required=True)

    pull = sub.add_parser("pull", help="fetch a model forge knows by name (default: the default model), or "
                                       "check a model file, and print its path")
    pull.add_argument("name", nargs="?", default=None, help="a name from `forge pull --list`, or a GGUF path")
    pull.add_argument("--model", default=env("FORGE_MODEL", None), help="the same as NAME [FORGE_MODEL]")
    pull.add_argument("--list", action="store_true", help="list the models forge fetches by name")
    pull.set_defaults(func=_cmd_pull)

    gen = sub.add_parser("generate", help="stream a completion of PROMPT to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="send PROMPT as one user message of a chat")
    add_engine_flags(gen)
    # one completion and out: committing the cache's memory would only delay it
    gen.set_defaults(func=_cmd_generate, kv_cache_memory="auto", max_num_seqs=1, kv_cache_commit="off")


    bench = sub.add_parser("bench", help="offline benchmark: the toy engine, or a real model with --model")
    bench.add_argument("--model", default=None,
                       help="'default' or a GGUF path: benchmark that model (without it: the toy engine)")
    bench.add_argument("--concurrency", default="1,8,32,64",
                       help="model: comma-separated numbers of sequences run at once [1,8,32,64]")
    bench.add_argument("--kernels", choices=list(KERNELS), default="auto", help="model: the kernel backend [auto]")
    bench.add_argument("--numerics", choices=list(NUMERICS), default="reference",
                       help="model: reference, fast or deterministic numerics [reference]")
    bench.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="float16",
                       help="model: how the K/V cache stores values [float16]")
    bench.add_argument("--blas-threads", type=int, default=None,
                       help="model: BLAS threads [the BLAS default]")
    bench.add_argument("--max-num-batched-tokens", type=int, default=512,
                       help="model: token budget of one step [512]")
    bench.add_argument("--prefill-len", type=int, default=1000, help="model: prompt tokens of the prefill run")
    bench.add_argument("--prompt-len", type=int, default=None, help="[toy 32, model 200]")
    bench.add_argument("--max-new", type=int, default=None, help="[toy 64, model 128]")
    bench.add_argument("--requests", type=int, default=64, help="toy: number of requests")
    bench.add_argument("--max-batch-size", type=int, default=8, help="toy")
    bench.add_argument("--blocks", type=int, default=256, help="toy")
    bench.add_argument("--block-size", type=int, default=16)
    bench.add_argument("--lookahead", type=int, default=4, help="toy")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", action="store_true", help="print JSON instead of text")
    bench.set_defaults(func=_cmd_bench)
    if register is not None:
        register(sub)
    return parser


def main(argv: list[str] | None = None, register: Callable[[Any], None] | None = None) -> int:
    args = build_parser(register).parse_args(argv)
    try:
        return int(args.func(args))
    except ForgeError as exc:
        print(f"forge: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
