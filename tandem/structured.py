"""Structured output: a request's constraint, compiled once, matched token by token.

A constraint (``SamplingParams.constraint`` of ``generate.proto``: a JSON schema, any JSON
object, a regex, a Lark grammar or a list of choices) becomes a :class:`Matcher` the
scheduler keeps on the request. Before each step that samples for the request, the matcher
gives the tokens allowed next as a packed bitmap (the workers set every other logit to
-inf); after the step, the token actually applied is consumed. The matcher therefore only
ever sees applied tokens: a step that was refused, never run or preempted needs no rollback.

Two layers, so the library can be swapped (the issue's benchmark decides):

* :class:`ConstraintBackend` compiles a :class:`Constraint` into a :class:`Grammar`
  (blocking, CPU-bound) and a grammar hands out fresh matchers. :class:`GuidanceBackend`
  is the llguidance implementation.
* :class:`ConstraintCompiler` runs compiles off the event loop on its own small thread
  pool, keeps an LRU of results *and* errors (a client resending a bad schema costs a
  dictionary lookup), lets concurrent requests with the same spec share one compile,
  bounds the spec's size and each compile's time.

JSON is generated with bounded whitespace by default (at most :data:`JSON_MAX_WHITESPACE`
characters between tokens of the JSON syntax): unbounded whitespace lets a weak model pad
with newlines until ``max_tokens``, the most common complaint about JSON modes. A schema's
own ``x-guidance`` options override it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol

import llguidance
import numpy as np

from tandem.cpus import usable_cpus
from tandem.errors import BadConstraint
from tandem.text import Tokenizer
from tandem.v1 import generate_pb2

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
JSON_MAX_WHITESPACE = 2
_JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": True,
    "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{JSON_MAX_WHITESPACE}}}",
}
# NOTE: verbose errors would copy the parser state and the whole grammar into every
# message (and so into logs and client answers); the first line is what a user needs.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
DEFAULT_MAX_SPEC_CHARS = 64 * 1024
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256
MAX_CHOICES = 256
MAX_ERROR_CHARS = 1000


@dataclass(frozen=True, slots=True)
class Constraint:
    """One request's constraint. ``spec``: the schema's JSON text, the regex, the grammar,
    the choices as a JSON array, or "" for ``json_object``. Hashable: the compile cache key."""

    kind: ConstraintKind
    spec: str


@dataclass(frozen=True, slots=True)
class ConstraintUse:
    """What a request's constraint cost it, for its usage and its span."""

    kind: ConstraintKind
    # Waited for the compiled constraint: the compile it started, ~0 on a cached one, the
    # rest of one another request had started.
    compile_ms: float
    cache_hit: bool  # an earlier request's compile (cached or in flight) served it


def constraint_from_proto(msg: generate_pb2.SamplingParams) -> Constraint | None:
    """The constraint a request set, or None; a malformed one is BadConstraint."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            raise BadConstraint("json_object must be true when set (leave it unset for "
                                "free text)")
        return Constraint("json_object", "")
    if kind == "choice":
        choices = list(msg.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES or not all(choices):
            raise BadConstraint(f"choice must list 1..{MAX_CHOICES} non-empty strings, got "
                                f"{len(choices)} (empty ones: {choices.count('')})")
        return Constraint("choice", json.dumps(choices))
    return Constraint(kind, getattr(msg, kind))


class Matcher(Protocol):
    """One request's position in its constraint. Only the scheduler's request owns one."""

    def allowed_mask(self) -> bytes:
        """The tokens allowed next: little-endian int32 words, bit ``j`` of word ``i``
        allowing token ``32 * i + j`` (``worker.proto``'s ``token_masks``)."""
        ...

    def consume(self, token_id: int) -> bool:
        """Advance over an applied token; False (and the matcher is spent) if refused."""
        ...

    def is_stopped(self) -> bool:
        """The output is complete: no token but end-of-sequence may follow."""
        ...

    def error(self) -> str:
        """Why the last refused token was refused ("" if none was)."""
        ...


class Grammar(Protocol):
    """A compiled constraint, shared by every request with the same spec."""

    def matcher(self) -> Matcher: ...


class ConstraintBackend(Protocol):
    def compile(self, constraint: Constraint) -> Grammar:
        """Blocking and CPU-bound (run it off the event loop); BadConstraint for a spec
        the library refuses, with the library's message."""
        ...


class _GuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int) -> None:
        self._m = matcher
        self.mask_words = mask_words  # int32 words of its masks

    def allowed_mask(self) -> bytes:
        return self._m.compute_bitmask()

    def consume(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    def error(self) -> str:
        return self._m.get_error()


@dataclass(frozen=True, slots=True)
class _GuidanceGrammar:
    template: llguidance.LLMatcher  # never advanced: each request gets a deep copy
    mask_words: int

    def matcher(self) -> Matcher:
        return _GuidanceMatcher(self.template.deep_copy(), self.mask_words)


# llguidance's mask threads, made on first use; only with enough cores to gain from them
_executor: llguidance.LLExecutor | None = None
MIN_CPUS_FOR_PARALLEL_MASKS = 4


@functools.cache
def _cpus_for_parallel_masks() -> bool:
    return usable_cpus() >= MIN_CPUS_FOR_PARALLEL_MASKS  # read once: cgroup files per step


def allowed_masks(matchers: Sequence[Matcher]) -> list[bytes]:
    """``[m.allowed_mask() for m in matchers]``; with at least
    :data:`MIN_CPUS_FOR_PARALLEL_MASKS` usable CPUs, llguidance's matchers are computed
    together on the library's own threads (they run without the GIL).

    NOTE: on 2 cores one by one wins: 16 rows of the Qwen vocabulary (151,936 tokens), each
    state filled once, took 21-23 ms one by one and 24-25 ms together (medians, loaded
    machine; the library's pool then has a single thread, and handing it work costs).
    ``bench/structured_output.py`` prints both ways for the machine it runs on.
    """
    if (len(matchers) < 2 or not _cpus_for_parallel_masks()
            or not all(isinstance(m, _GuidanceMatcher) for m in matchers)):
        return [m.allowed_mask() for m in matchers]
    return fill_together(matchers)


def fill_together(matchers: Sequence[Matcher]) -> list[bytes]:
    """The masks of llguidance's ``matchers`` computed together on the library's threads."""
    global _executor
    guided = [m for m in matchers if isinstance(m, _GuidanceMatcher)]
    if len(guided) != len(matchers) or len({m.mask_words for m in guided}) > 1:
        raise ValueError("fill_together takes llguidance matchers of one vocabulary")
    if _executor is None:
        _executor = llguidance.LLExecutor()
    words = guided[0].mask_words
    out = np.empty((len(guided), words), dtype=np.int32)
    _executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(guided)],
                                      out.ctypes.data, words * 4, len(guided))
    return [row.tobytes() for row in out]


class GuidanceBackend:
    """:class:`ConstraintBackend` over llguidance.

    The library's tokenizer (its token trie: about 2 s and 130 MB for a 150k vocabulary)
    is built on the first compile, once, from each token's bytes (:class:`_TokenTable`).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()  # compiles run on several pool threads
        self._ll: llguidance.LLTokenizer | None = None

    def compile(self, constraint: Constraint) -> Grammar:
        try:
            grammar = _grammar_text(constraint)
        except BadConstraint:
            raise
        except ValueError as exc:  # the library's refusal of a schema's shape
            raise BadConstraint(f"{constraint.kind}: {_brief(str(exc))}") from None
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0,
                                       limits=_LIMITS)
        if matcher.is_error():
            raise BadConstraint(f"{constraint.kind}: {_brief(matcher.get_error())}")
        return _GuidanceGrammar(matcher, (self._ll_tokenizer().vocab_size + 31) // 32)

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self._tokenizer)
            return self._ll


def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)),
                                  eos_token=list(tokenizer.special.eos_ids))


class _TokenTable:
    """What llguidance's ``TokenizerWrapper`` reads: each token's bytes, and which are
    special.

    NOTE: not llguidance's own ``tokenizer.json`` reader: it counts every added token as
    special, so a model's plain added tokens (Qwen2.5's ``<tool_call>``, which its
    tool-call format is written with) were allowed by masks yet refused when consumed.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.special.eos_ids[0]
        self.bos_token_id = tokenizer.special.bos_id
        ids = range(tokenizer.vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in ids]
        self.special_token_ids = [i for i in ids if tokenizer.is_special(i)]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def _grammar_text(c: Constraint) -> str:
    """llguidance's grammar for ``c`` (its JSON, regex and Lark front ends)."""
    make = llguidance.LLMatcher
    if c.kind == "json_object":
        return make.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.spec)
        except ValueError as exc:
            raise BadConstraint(f"json_schema is not valid JSON: {exc}") from None
        if schema is False:
            raise BadConstraint("json_schema false allows no output")
        if schema is True:  # JSON Schema's "anything", as the library takes it
            schema = {}
        if not isinstance(schema, dict):
            raise BadConstraint("json_schema must be a JSON object (or true)")
        return make.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if c.kind == "regex":
        return make.grammar_from_regex(c.spec)
    if c.kind == "grammar":
        return make.grammar_from_lark(c.spec)
    choices: Sequence[str] = json.loads(c.spec)  # constraint_from_proto wrote it
    return make.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in choices))


def _brief(message: str) -> str:
    """The library's message, capped (a regex error draws the pattern with a caret)."""
    text = message.strip() or "refused by the compiler"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


class ConstraintCompiler:
    """Compiles off the event loop, caching results and errors (see the module docstring).

    The cache holds one future per spec: in flight, done, or failed. A compile that
    outlives ``timeout_s`` fails its waiters with BadConstraint but keeps running (a
    thread cannot be stopped) and stays cached, so resending the spec starts no second
    one; the library's own limits (``LLParserLimits``) bound how long it can run.
    Call :meth:`close` at shutdown.
    """

    def __init__(self, backend: ConstraintBackend, max_spec_chars: int = DEFAULT_MAX_SPEC_CHARS,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._backend = backend
        self.max_spec_chars = max_spec_chars
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        # (tenant's cache salt, constraint) -> its compile, in flight or done
        self._cache: OrderedDict[tuple[str, Constraint], asyncio.Future[Grammar]] = (
            OrderedDict())
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint-compile")

    async def matcher(self, constraint: Constraint,
                      salt: str = "") -> tuple[Matcher, ConstraintUse]:
        """A fresh matcher for ``constraint`` and what getting it cost; BadConstraint for a
        bad or oversized spec.

        ``salt`` is the request's ``cache_salt``: tenants share compiles only as they share
        the prefix cache, so no client learns from a fast answer which schemas another
        tenant sends."""
        if len(constraint.spec) > self.max_spec_chars:
            raise BadConstraint(f"the {constraint.kind} is {len(constraint.spec)} characters; "
                                f"the limit is {self.max_spec_chars}")
        start = time.perf_counter()
        key = (salt, constraint)
        future = self._cache.get(key)
        cache_hit = future is not None
        if future is None:
            future = asyncio.get_running_loop().run_in_executor(
                self._pool, self._backend.compile, constraint)
            future.add_done_callback(_retrieve)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        try:
            grammar = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise BadConstraint(f"the {constraint.kind} did not compile within "
                                f"{self.timeout_s:g} s; simplify it") from None
        matcher = grammar.matcher()
        return matcher, ConstraintUse(constraint.kind, (time.perf_counter() - start) * 1e3,
                                      cache_hit)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _retrieve(future: asyncio.Future[Grammar]) -> None:
    """Mark a cached failure as seen: every waiter gets it, and one nobody waits for
    any more (all timed out) must not be logged as never retrieved."""
    if not future.cancelled():
        future.exception()
