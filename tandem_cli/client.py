"""Client commands: ``tandem generate`` streams one request, ``tandem stats`` shows caches."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc
from google.protobuf import text_format

from tandem.cell_stats import format_value
from tandem.tls import TlsFiles, channel_credentials
from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_cli.attribution import usage_columns

IMAGE_MARKER = "<image>"  # where --image files go in the prompt (the built-in models' marker)


def add_client_commands(sub: argparse._SubParsersAction, default_target: str) -> None:
    p = sub.add_parser("generate", help="stream one Generate call and print usage")
    p.add_argument("prompt", help='prompt text; each "<image>" takes the next --image (with '
                   "--chat, for any model; without it, the model's own image marker)")
    p.add_argument("--image", action="append", default=[], type=Path, help="PNG or JPEG file")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user turn, rendered with the model's chat "
                   "template (images where the prompt says <image>, else before the text)")
    p.add_argument("--system", default="", help="with --chat: a system message first")
    _add_sampling_flags(p)
    p.add_argument("--cache-salt", default="")
    p.add_argument("--target", default=default_target)
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    _add_tls_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("model-info", help="show the served model and the request limits")
    p.add_argument("--target", default=default_target)
    _add_tls_flags(p)
    p.set_defaults(func=cmd_model_info)

    p = sub.add_parser("stats", help="show the cell's cache counters")
    p.add_argument("--target", default=default_target)
    _add_tls_flags(p)
    p.add_argument("--per-cell", action="store_true",
                   help="in front of many cells: each cell's figures next to the total")
    p.set_defaults(func=cmd_stats)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """SamplingParams, one flag per field (docs/api.md gives the ranges; the server checks)."""
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]; 0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 0; 1 = off (the default)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="tokens before EOS, stop ids or stop strings may end the output")
    p.add_argument("--stop", action="append", default=[],
                   help="a stop string (repeat the flag for more)")
    p.add_argument("--include-stop", action="store_true",
                   help="end the text with the stop string instead of before it")
    p.add_argument("--stop-token-id", action="append", default=[], type=int,
                   help="a token id that ends generation (repeat for more)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each token's logprob and its N (0..20) most likely "
                   "alternatives to stderr")


def _sampling(args: argparse.Namespace) -> generate_pb2.SamplingParams:
    s = generate_pb2.SamplingParams(
        temperature=args.temperature, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens, stop=args.stop,
        include_stop_str_in_output=args.include_stop, stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs is not None,
        top_logprobs=args.logprobs or 0)
    for name in ("max_tokens", "top_p", "seed", "repetition_penalty"):  # unset = the default
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    return s


def _add_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls", action="store_true",
                   help="connect with TLS, trusting the system CAs (implied by --tls-ca)")
    p.add_argument("--tls-ca", default="", help="PEM CA bundle the server certificate must "
                   "chain to")
    p.add_argument("--tls-cert", default="", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext, or TLS when any --tls* flag is given."""
    files = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
    if not (args.tls or files.enabled):
        return grpc.insecure_channel(args.target)
    return grpc.secure_channel(args.target, channel_credentials(files))


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    prompt = args.prompt
    if args.image and IMAGE_MARKER not in prompt:
        prompt = IMAGE_MARKER * len(args.image) + prompt  # images first when not placed
    msg = generate_pb2.GenerateRequest(cache_salt=args.cache_salt)
    if args.chat:
        if args.system:
            msg.messages.add(role="system").content.add(text=args.system)
        msg.messages.append(chat_turn("user", prompt, [p.read_bytes() for p in args.image]))
    else:
        if args.system:
            raise SystemExit("error: --system needs --chat")
        msg.prompt = prompt
        for path in args.image:
            msg.images.add(encoded=path.read_bytes())
    msg.sampling.CopyFrom(_sampling(args))
    return msg


def chat_turn(role: str, text: str, images: list[bytes]) -> generate_pb2.ChatMessage:
    """One message whose content is ``text`` split at each ``<image>``, the images between."""
    if text.count(IMAGE_MARKER) != len(images):
        raise SystemExit(f"error: {text.count(IMAGE_MARKER)} {IMAGE_MARKER} in the prompt but "
                         f"{len(images)} --image files")
    turn = generate_pb2.ChatMessage(role=role)
    for i, piece in enumerate(text.split(IMAGE_MARKER)):
        if i:
            turn.content.add(image=generate_pb2.MediaItem(encoded=images[i - 1]))
        if piece:
            turn.content.add(text=piece)
    return turn


def cmd_generate(args: argparse.Namespace) -> int:
    request = build_request(args)
    with open_channel(args) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        start = time.monotonic()
        ttft = None
        last = None
        logprobs: list[generate_pb2.PositionLogprobs] = []
        try:
            for msg in stub.Generate(request, timeout=args.timeout):
                if ttft is None and msg.token_ids:
                    ttft = time.monotonic() - start
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                logprobs.extend(msg.logprobs)
                last = msg
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        total = time.monotonic() - start
    print()
    if last is not None and last.HasField("usage"):
        u = last.usage
        reason = generate_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
        print(f"[{reason.lower()}] prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} "
              f"cached), {u.completion_tokens} generated; images {u.mm_items} "
              f"({u.mm_cache_hits} cache hits, {u.encoder_runs} encoded)", file=sys.stderr)
        for i, image in enumerate(u.images, 1):
            print(f"  image {i}  {usage_columns(image)}", file=sys.stderr)
    for position in logprobs:
        print(format_logprobs(position), file=sys.stderr)
    print(f"ttft {1000 * (ttft or total):.1f} ms, total {1000 * total:.1f} ms", file=sys.stderr)
    return 0


def format_logprobs(p: generate_pb2.PositionLogprobs) -> str:
    """One line per generated token: its logprob, id and text, then the alternatives."""
    line = f"{p.token.logprob:9.4f}  {p.token.token_id:>7}  {p.token.text!r}"
    if p.top_logprobs:
        line += "  | " + ", ".join(f"{t.text!r} {t.logprob:.4f}" for t in p.top_logprobs)
    return line


def cmd_model_info(args: argparse.Namespace) -> int:
    with open_channel(args) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(text_format.MessageToString(info).rstrip())
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with open_channel(args) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            stats, call = stub.CacheStats.with_call(generate_pb2.CacheStatsRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.per_cell:
        from tandem.cell_stats import format_per_cell, parse_per_cell

        print(format_per_cell(stats, parse_per_cell(call.trailing_metadata())))
    else:
        print(format_stats(stats))
    return 0


def format_stats(stats: generate_pb2.CacheStatsResponse) -> str:
    rows = [(field.name, format_value(stats, field.name)) for field in stats.DESCRIPTOR.fields]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
