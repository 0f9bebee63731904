"""SamplingParams: one request's sampling knobs, their validation, and the generator its seed gives.

Owns the ranges a request may ask for (validate() raises InvalidRequest at the edge) and how a seed
becomes a numpy Generator. Holds no per-step state and never touches logits.
"""

from __future__ import annotations

import msgspec
import numpy as np

from forge.errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4
# A stop string's length in characters, and stop token ids a request may list: the matcher is linear in
# both, and these keep one request's share of it (and of its memory) small.
MAX_STOP_LENGTH = 4096
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 100.0
# The ranges a request may ask for: the wire schema (forge.api.openai.openai_schema) declares them from these, and
# validate() holds every other caller (LLM, the offline engine) to them.
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0              # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_REPETITION_PENALTY = 2.0   # [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]
# A positive logit is divided by the penalty in float32: one that rounds to 0 there (below ~1e-45) is a
# division by zero in the step, and a tiny one overflows the logits; none below this means anything.
MIN_REPETITION_PENALTY = 1e-3
POOLING_MODES = ("mean", "last", "cls")   # how an embedding request pools its hidden states
_MIN_TEMPERATURE = 1e-5        # below this a row is greedy: it is argmax up to ties anyway
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class Thinking(msgspec.Struct, frozen=True, kw_only=True):
    """A reasoning model's thinking section as the runner follows it (forge.sampling.reasoning.SectionFollower): at
    most `budget` tokens inside it (None: no bound), after which the runner forces `close_ids` (the closing
    tag and what the template writes after it) so that the model goes on to answer."""
    budget: int | None = None
    close_ids: tuple[int, ...] = ()


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """One request's sampling knobs. Construction checks nothing; call validate() at the edge."""

    max_tokens: int = 16                # 0: generate nothing, only run the prompt (and score it, if asked)
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None         # k: the sampled token's logprob plus the top k
    # k: every prompt token's logprob (after the tokens before it) plus the top k, computed while the prompt
    # runs; such a prompt takes no prefix-cache hit (every position is computed). None: not scored.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias): added to the logits before all else
    grammar: str | None = None          # a constraint as llguidance grammar text (forge.sampling.structured)
    close_within: int = 0               # a JSON grammar's last tokens of max_tokens spent closing it; 0: none
    cache_salt: str | None = None       # prefix-cache isolation: blocks are shared only within a salt
    # An embedding request: no token is sampled; the prompt's final normed hidden states are pooled
    # ("mean", "last" or "cls", forge.engine.pooling) into one L2-normalised vector. None: generation.
    pooling: str | None = None
    # A reasoning model's request: the runner follows its thinking section, counts its tokens and closes
    # it at the budget. None: the output is not read for a section.
    thinking: Thinking | None = None
    # Where the scheduler puts it among waiting requests (forge.engine.fair_share): lower is more urgent (vLLM's
    # `priority`); then the tenant with the least recent service for its share goes first. The daemon sets
    # tenant and tenant_share from the request's key (None: no tenant; all such requests are one tenant).
    priority: int = 0
    tenant: str | None = None
    tenant_share: float = 1.0

    @property
    def is_greedy(self) -> bool:
        """Argmax with no randomness: temperature 0 (below 1e-5), or top_k 1."""
        return self.temperature < _MIN_TEMPERATURE or self.top_k == 1

    def limited_to(self, max_tokens: int) -> SamplingParams:
        """These params with max_tokens at most `max_tokens` (the room the context leaves) and a JSON closing
        window at most a quarter of it, as one made for that limit would have: the one limit every reader
        of a sequence (the runner's closing, the draft budget, capacity) sees."""
        if max_tokens >= self.max_tokens:
            return self
        return msgspec.structs.replace(self, max_tokens=max_tokens,
                                       close_within=min(self.close_within, max_tokens // 4))

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, *, vocab_size: int) -> None:
        """Raise InvalidRequest naming the first out-of-range field. NaN fails every range."""
        _require(self.max_tokens >= 0, "max_tokens", f"must be at least 0, got {self.max_tokens}")
        _require(0.0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
                 f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name, value in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            _require(-MAX_PENALTY <= value <= MAX_PENALTY, name,
                     f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        _require(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
                 f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        _require(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _require(self.close_within >= 0, "close_within", f"must be at least 0, got {self.close_within}")
        _require(len(self.stop) <= MAX_STOP_STRINGS, "stop",
                 f"at most {MAX_STOP_STRINGS} stop sequences, got {len(self.stop)}")
        _require(all(self.stop), "stop", "stop sequences must not be empty")
        _require(all(len(s) <= MAX_STOP_LENGTH for s in self.stop), "stop",
                 f"sequences must be at most {MAX_STOP_LENGTH} characters long, "
                 f"got {max(map(len, self.stop), default=0)}")
        _require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                 f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        bad_ids = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        _require(not bad_ids, "stop_token_ids", f"token ids must be in [0, {vocab_size}), got {bad_ids[:4]}")
        _require(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
                 f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _require(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                 f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        _require(self.prompt_logprobs is None or self.pooling is None, "prompt_logprobs",
                 "is for generation requests, not embeddings")
        bad_bias_ids = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
        _require(not bad_bias_ids, "logit_bias", f"token ids must be in [0, {vocab_size}), got {bad_bias_ids[:4]}")
        bad_biases = [b for _, b in self.logit_bias if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS]
        _require(not bad_biases, "logit_bias",
                 f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bad_biases[:4]}")
        _require(self.pooling in POOLING_MODES or self.pooling is None, "pooling",
                 f"must be one of {', '.join(POOLING_MODES)}, got {self.pooling!r}")
        if self.thinking is not None:
            budget, close = self.thinking.budget, self.thinking.close_ids
            _require(budget is None or budget >= 0, "thinking_budget", f"must be at least 0, got {budget}")
            _require(all(0 <= t < vocab_size for t in close), "thinking_budget",
                     f"the closing token ids must be in [0, {vocab_size})")
        _require(self.seed is None or _INT64_MIN <= self.seed <= _INT64_MAX, "seed",
                 f"must fit in a signed 64-bit integer, got {self.seed}")


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(f"{param} {message}", param=param)


def make_generator(seed: int | None) -> np.random.Generator:
    """A request's own generator: from `seed` (any signed 64-bit int) when given, else fresh entropy."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(seed & 0xFFFF_FFFF_FFFF_FFFF)   # two's complement: negatives are seeds too
