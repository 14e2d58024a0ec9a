"""The sampling features and GetModelInfo through a real ``tandem serve --model DIR``.

The model is a tiny random Llama checkpoint with the real Qwen vocabulary and tokenizer
(so tokens are multi-character, byte-level BPE pieces), served by two cells at once:
``cached`` (prefix caching on, a roomy KV pool) and ``small`` (prefix caching off, a KV
pool of 7 blocks of 16 tokens, so two 44-token prompts growing together preempt the later
one, and the same model directory without a chat template). Every feature must give the
same stream on both and the same as an independent reference: transformers' logits, a
plain-Python implementation of the penalty formulas (``sampling_reference.py``), and
transformers' tokenizer for the text. Bad values of every new field are refused with
INVALID_ARGUMENT and leave no SHM reference or KV block behind.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from hf_checkpoints import reference, save
from sampling_reference import greedy, hf_logits

from tandem.errors import error_info
from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, running_cell
from tandem_testing.text_checkpoints import qwen2_vl_dir, reference_tokenizer

pytestmark = pytest.mark.slow  # two cells of a 151936-token vocabulary (~1 min)

VOCAB = 151936
EOS_IDS = [151643, 151645]
PROMPT = ("Tandem serves language models with images. This test sends the same long prompt "
          "to two cells and checks that logprobs, penalties and stop strings behave the "
          "same way on both of them, preempted or not.")
MAX_NEW = 16
LOGPROB_ATOL = 1e-4  # float32 on CPU; transformers' logits differ by ~1e-6
# KV pool of the small cell: 7 blocks of 16 tokens (512 bytes of KV per token). A prompt
# takes 3 blocks and a 4th from its 5th output. The victim, arriving while the hog holds at
# most 4 blocks, is admitted (3 free); at its 5th output both hold 4 (8 > 7) and it is
# preempted, provided the hog still runs: HOG_NEW outputs keep it running for any arrival
# up to the hog's 20th output. (With 6 blocks it had to arrive within the hog's first 4
# outputs, a few milliseconds once steps got fast: CI missed it.)
SMALL_KV = str(7 * 16 * 512)
HOG_NEW = 44  # 44 + 44 tokens: 6 blocks, alone in the pool


@dataclass
class Model:
    hf: torch.nn.Module
    dir: Path
    no_template_dir: Path
    prompt_ids: list[int] = field(default_factory=list)

    def decode(self, ids: list[int]) -> str:
        return reference_tokenizer(self.dir).decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    out = tmp_path_factory.mktemp("llama-qwen-vocab")
    hf = reference("llama", vocab_size=VOCAB)
    save(hf, out / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen2_vl_dir() / name, out / "model" / name)
    (out / "model" / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": EOS_IDS}))
    shutil.copytree(out / "model", out / "no-template")
    config = json.loads((out / "no-template" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (out / "no-template" / "tokenizer_config.json").write_text(json.dumps(config))
    prompt_ids = reference_tokenizer(out / "model")(PROMPT)["input_ids"]
    assert 40 < len(prompt_ids) <= 44, "the KV sizing above assumes a 3-block prompt of 41-44"
    return Model(hf, out / "model", out / "no-template", prompt_ids)


@pytest.fixture(scope="module")
def cells(model: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Cell]]:
    tmp = tmp_path_factory.mktemp("sampling-cells")
    managers = {
        "cached": running_cell(tmp / "cached", "--model", str(model.dir)),
        "small": running_cell(tmp / "small", "--model", str(model.no_template_dir),
                              "--no-enable-prefix-caching", "--kv-cache-size", SMALL_KV,
                              "--log-level", "INFO"),
    }
    started: dict[str, Cell] = {}
    threads = [threading.Thread(target=lambda k=k, m=m: started.__setitem__(k, m.__enter__()))
               for k, m in managers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert started.keys() == managers.keys(), "a cell failed to start (see its log)"
        yield started
    finally:
        for k in started:
            managers[k].__exit__(None, None, None)


def _log(cell: Cell) -> str:
    return (cell.shm_dir.parent / "cell.log").read_text(errors="replace")


def _request(rid: str, **sampling: object) -> generate_pb2.GenerateRequest:
    msg = generate_pb2.GenerateRequest(request_id=rid, prompt=PROMPT)
    msg.sampling.max_tokens = MAX_NEW
    msg.sampling.ignore_eos = True  # random weights: run to max_tokens unless a stop hits
    for key, value in sampling.items():
        if isinstance(value, list):
            getattr(msg.sampling, key).extend(value)
        else:
            setattr(msg.sampling, key, value)
    return msg


@dataclass
class Stream:
    messages: list[generate_pb2.GenerateResponse]

    @property
    def ids(self) -> list[int]:
        return [t for m in self.messages for t in m.token_ids]

    @property
    def text(self) -> str:
        return "".join(m.text for m in self.messages)

    @property
    def last(self) -> generate_pb2.GenerateResponse:
        return self.messages[-1]


def _run(cell: Cell, msg: generate_pb2.GenerateRequest) -> Stream:
    stream = Stream(list(cell.stub.Generate(msg, timeout=120)))
    assert stream.last.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
    return stream


def _preempting(cell: Cell, hog: generate_pb2.GenerateRequest,
                victim: generate_pb2.GenerateRequest) -> tuple[Stream, Stream]:
    """``hog`` then, once it streams, ``victim``: the later arrival is preempted when the
    small pool runs out; asserts that it was."""
    before = _log(cell).count(f"preempting request {victim.request_id} ")
    messages: list[generate_pb2.GenerateResponse] = []
    started = threading.Event()

    def run_hog() -> None:
        for m in cell.stub.Generate(hog, timeout=120):
            messages.append(m)
            started.set()

    thread = threading.Thread(target=run_hog)
    thread.start()
    assert started.wait(60)
    victim_stream = _run(cell, victim)
    thread.join(120)
    assert _log(cell).count(f"preempting request {victim.request_id} ") > before, \
        "the small pool did not preempt the second request"
    return Stream(messages), victim_stream


def _nothing_held(cell: Cell) -> None:
    stats = cell.stats()
    assert stats.shm_unacked_refs == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


# -- GetModelInfo -----------------------------------------------------------------------


def test_model_info(cells: dict[str, Cell], model: Model) -> None:
    cached = cells["cached"].stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    small = cells["small"].stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert cached.model_id == str(model.dir) and small.model_id == str(model.no_template_dir)
    for info in (cached, small):
        assert info.model_type == "llama" and info.vocab_size == VOCAB
        assert list(info.eos_token_ids) == EOS_IDS
        assert not info.HasField("image_limits"), "a text-only model takes no images"
        assert info.mm_cache_type == "shm"
        assert info.default_max_tokens <= info.max_output_tokens
        assert info.max_prompt_tokens > 0
    assert cached.has_chat_template and not small.has_chat_template
    assert cached.prefix_caching and not small.prefix_caching
    assert small.max_context_length == 7 * 16  # the KV pool, below max_position_embeddings
    assert cached.max_context_length == 4096  # max_position_embeddings, below the pool


# -- logprobs ---------------------------------------------------------------------------


def test_logprobs_equal_transformers_and_align_with_the_stream(cells: dict[str, Cell],
                                                               model: Model) -> None:
    sampling = dict(logprobs=True, top_logprobs=4, temperature=0.8, seed=11,
                    presence_penalty=0.4, repetition_penalty=1.2, min_p=0.01)
    streams = [_run(cells["cached"], _request("lp-1", **sampling)),
               _run(cells["cached"], _request("lp-2", **sampling))]  # the prefix cached
    assert streams[1].last.usage.cached_prompt_tokens > 0
    _, victim = _preempting(cells["small"], _request("lp-hog", max_tokens=HOG_NEW),
                            _request("lp-3", **sampling))
    streams.append(victim)
    ids = streams[0].ids
    ref = torch.log_softmax(hf_logits(model.hf, model.prompt_ids + ids)[
        len(model.prompt_ids) - 1:-1], dim=-1)
    tok = reference_tokenizer(model.dir)
    for s in streams:
        assert s.ids == ids and len(ids) == MAX_NEW
        for m in s.messages:
            assert [lp.token.token_id for lp in m.logprobs] == list(m.token_ids)
        entries = [lp for m in s.messages for lp in m.logprobs]
        for i, lp in enumerate(entries):
            assert lp.token.logprob == pytest.approx(float(ref[i, ids[i]]), abs=LOGPROB_ATOL)
            assert lp.token.text == tok.decode([ids[i]], skip_special_tokens=False)
            assert [t.logprob for t in lp.top_logprobs] == pytest.approx(
                ref[i].topk(4).values.tolist(), abs=LOGPROB_ATOL)
            for t in lp.top_logprobs:
                assert t.logprob == pytest.approx(float(ref[i, t.token_id]), abs=LOGPROB_ATOL)
                assert t.text == tok.decode([t.token_id], skip_special_tokens=False)
        assert s.text == model.decode(ids)
    _nothing_held(cells["cached"])


# -- penalties --------------------------------------------------------------------------


def test_greedy_with_penalties_equals_the_reference(cells: dict[str, Cell],
                                                    model: Model) -> None:
    # Negative presence and frequency and a repetition penalty under 1 favour repeats: a
    # random model with this vocabulary seldom repeats a token on its own.
    penalties = dict(presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.5)
    want = greedy(model.hf, model.prompt_ids, MAX_NEW, -1.0, -0.5, 0.5)
    assert want != greedy(model.hf, model.prompt_ids, MAX_NEW), "penalties change nothing"
    cold = _run(cells["cached"], _request("pen-1", **penalties))
    warm = _run(cells["cached"], _request("pen-2", **penalties))
    assert warm.last.usage.cached_prompt_tokens > 0
    hog, victim = _preempting(cells["small"], _request("pen-hog", **penalties),
                              _request("pen-3", **penalties))
    for s in (cold, warm, hog, victim):
        assert s.ids == want
        assert s.last.finish_reason == generate_pb2.FINISH_REASON_LENGTH


# -- stop strings -----------------------------------------------------------------------


def _clean_ends(model: Model, ids: list[int]) -> list[int | None]:
    """Per token k, the characters of the one-shot text that ids[:k + 1] decode to, or None
    where that decode is not a prefix of the whole text (a character cut in two)."""
    text, ends = model.decode(ids), []
    for k in range(len(ids)):
        head = model.decode(ids[:k + 1])
        ends.append(len(head) if text.startswith(head) else None)
    return ends


def _stop_across_tokens(model: Model, ids: list[int], first: int) -> tuple[str, int]:
    """A 4-character stop string made of the last two characters of token k >= ``first``
    and the first two of token k + 1, found nowhere earlier; and k + 1 (the token that
    completes it)."""
    text, ends = model.decode(ids), _clean_ends(model, ids)
    for k in range(first, len(ids) - 1):
        before, b, after = ends[k - 1], ends[k], ends[k + 1]
        if before is None or b is None or after is None:
            continue
        stop = text[b - 2:b + 2]
        if before <= b - 2 and after >= b + 2 and stop.strip() and text.find(stop) == b - 2:
            return stop, k + 1
    raise AssertionError("no suitable boundary in the greedy text")


def _stop_inside_a_token(model: Model, ids: list[int], first: int) -> tuple[str, int]:
    """The first two characters of a token k >= ``first`` whose text has at least three,
    found nowhere earlier; and k."""
    text, ends = model.decode(ids), _clean_ends(model, ids)
    for k in range(first, len(ids)):
        start, end = ends[k - 1], ends[k]
        if start is None or end is None:
            continue
        stop = text[start:start + 2]
        if end - start >= 3 and stop.strip() and text.find(stop) == start:
            return stop, k
    raise AssertionError("no suitable token in the greedy text")


def _check_stopped(s: Stream, ids: list[int], kept: int, want: str) -> None:
    assert s.last.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert s.ids == ids[:kept] and s.last.usage.completion_tokens == kept
    streamed = ""
    for m in s.messages:
        streamed += m.text
        assert want.startswith(streamed), "the stream ran past the stop string"
    assert streamed == want


@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
def test_stop_strings_are_found_and_cut_in_the_stream(cells: dict[str, Cell], model: Model,
                                                      include: bool) -> None:
    ids = _run(cells["cached"], _request(f"plain-{include}")).ids
    text = model.decode(ids)
    # Late in the output, so that on the small cell it comes after the preemption (at the
    # victim's third or so output).
    across, k = _stop_across_tokens(model, ids, first=8)
    inside, j = _stop_inside_a_token(model, ids, first=8)
    for n, (stop, last) in enumerate([(across, k), (inside, j)]):  # last: completes stop
        at = text.find(stop)
        want = text[:at + len(stop)] if include else text[:at]
        msg = _request(f"stop-{include}-{n}", stop=[stop, "never appears: \u2603\u2603"],
                       include_stop_str_in_output=include)
        _check_stopped(_run(cells["cached"], msg), ids, last + 1, want)
    victim = _request(f"stop-{include}-small", stop=[across],
                      include_stop_str_in_output=include)
    _, stopped = _preempting(cells["small"], _request(f"stop-hog-{include}", max_tokens=HOG_NEW),
                              victim)
    at = text.find(across)
    _check_stopped(stopped, ids, k + 1, text[:at + len(across)] if include else text[:at])
    _nothing_held(cells["cached"])


def test_min_tokens_defers_stop_ids_and_stop_strings(cells: dict[str, Cell],
                                                     model: Model) -> None:
    ids = _run(cells["cached"], _request("plain-min")).ids
    first_text = model.decode(ids[:1])
    assert first_text.strip() and "\ufffd" not in first_text, "the first token shows no text"
    # The first token is a stop id and (its text) a stop string: neither may end output 1.
    s = _run(cells["cached"], _request("min", stop_token_ids=[ids[0]], min_tokens=2,
                                       max_tokens=4, ignore_eos=False))
    assert s.ids[0] != ids[0] and len(s.ids) >= 2
    now = _run(cells["cached"], _request("min-str-0", stop=[first_text]))
    assert now.ids == ids[:1] and now.text == ""
    later = _run(cells["cached"], _request("min-str-1", stop=[first_text], min_tokens=1))
    assert later.ids[:2] == ids[:2] and later.text.startswith(first_text)


# -- validation -------------------------------------------------------------------------


BAD = [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(presence_penalty=-2.01), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=3.0), "frequency_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=math.nan), "frequency_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=math.inf), "repetition_penalty must be > 0"),
    (dict(min_p=-0.1), "min_p must be in [0, 1]"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs must be in 0..20"),
    (dict(top_logprobs=3), "top_logprobs needs logprobs"),
    (dict(min_tokens=30), "min_tokens (30) must not exceed max_tokens (16)"),
    (dict(stop=[""]), "stop string 0 is 0 characters"),
    (dict(stop=["x" * 257]), "stop string 0 is 257 characters"),
    (dict(stop=[f"s{i}" for i in range(17)]), "17 stop strings; the limit is 16"),
    (dict(stop_token_ids=[VOCAB]), "outside the vocabulary"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[m for _, m in BAD])
def test_bad_values_are_invalid_argument_and_leak_nothing(cells: dict[str, Cell], bad: dict,
                                                          message: str) -> None:
    cell = cells["cached"]
    with pytest.raises(grpc.RpcError) as info:
        _run(cell, _request("bad", **bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    detail = error_info(info.value)
    assert detail is not None and detail.reason == "BAD_SAMPLING"
    _nothing_held(cell)
    assert _run(cell, _request("good", max_tokens=1)).ids, "the cell still serves"


# -- the CLI ----------------------------------------------------------------------------


def test_cli_flags_reach_the_request(cells: dict[str, Cell], capsys: pytest.CaptureFixture,
                                     ) -> None:
    """``tandem generate`` with every sampling flag streams what the same request over
    gRPC does; ``tandem model-info`` prints the model."""
    from tandem_cli.cli import main

    target = cells["cached"].target
    assert main(["model-info", "--target", target]) == 0
    out = capsys.readouterr().out
    assert 'model_type: "llama"' in out and "has_chat_template: true" in out

    sampling = dict(temperature=0.9, seed=5, top_k=50, top_p=0.95, min_p=0.02,
                    presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3,
                    min_tokens=2, logprobs=True, top_logprobs=2)
    plain = _run(cells["cached"], _request("cli-plain", **sampling))
    stop = plain.text[len(plain.text) // 2:][:3]
    assert stop.strip(), "a stop string from the middle of the output"
    grpc_run = _run(cells["cached"], _request("cli-grpc", stop=[stop], **sampling))
    assert main(["generate", PROMPT, "--target", target, "--max-tokens", str(MAX_NEW),
                 "--ignore-eos", "--temperature", "0.9", "--seed", "5", "--top-k", "50",
                 "--top-p", "0.95", "--min-p", "0.02", "--presence-penalty", "0.5",
                 "--frequency-penalty", "0.25", "--repetition-penalty", "1.3",
                 "--min-tokens", "2", "--logprobs", "2", "--stop", stop]) == 0
    cli = capsys.readouterr()
    assert grpc_run.last.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert cli.out == grpc_run.text + "\n" and "[stop]" in cli.err
    lines = [line for line in cli.err.splitlines() if " | " in line]
    assert len(lines) == len(grpc_run.ids)
    for line, lp in zip(lines, [lp for m in grpc_run.messages for lp in m.logprobs],
                        strict=True):
        assert line.split()[:2] == [f"{lp.token.logprob:.4f}", str(lp.token.token_id)]
