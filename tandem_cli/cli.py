"""The ``tandem`` command: run the services, talk to them, export the model.

Every service setting is a flag whose default comes from a ``TANDEM_*`` variable (see
docs/configuration.md). Only this module may start both services (``tandem serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem import __version__
from tandem.errors import TandemError
from tandem.shared_dir import UnsafeSharedDir, prepare_shared_dir
from tandem.shutdown import DEFAULT_GRACE_S, STOP_MARGIN_S
from tandem.sizes import parse_size
from tandem.tls import TlsConfigError, TlsFiles

DEFAULT_TARGET = "localhost:50051"
ROUTER_REMOVED = ("tandem router was removed in favour of `tandem gateway` (Envoy + the "
                  "endpoint picker): see docs/routing.md")


class SettingsError(ValueError):
    """A setting the user must fix (the command exits with status 2 and the message)."""


DESCRIPTION = ("Run Tandem's services, talk to them, export the model. Every service setting "
               "is a flag whose default comes from a TANDEM_* variable "
               "(docs/configuration.md).")


def size_arg(text: str) -> int:
    """``parse_size`` for argparse: its message, not argparse's "invalid size_arg value"."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_arg(text: str, least: int = 1) -> int:
    """An integer of at least ``least``, for argparse."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
    return value


def threads_arg(text: str) -> int:
    """A thread count, 0 for automatic, for argparse."""
    return positive_arg(text, least=0)


def fraction_arg(text: str) -> float:
    """A number in (0, 1], for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _served_names(text: str) -> list[str]:
    """TANDEM_SERVED_MODEL_NAME: names separated by commas or whitespace."""
    return text.replace(",", " ").split()


def _add_served_name_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   default=_served_names(_env("SERVED_MODEL_NAME", "")),
                   help="the model's name(s) in the APIs: the first is reported, any is "
                        "accepted (default: --model)")


def networks_arg(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Comma-separated CIDR networks (``10.0.0.0/8,fd00::/8``; empty = none), for argparse."""
    try:
        return tuple(ipaddress.ip_network(n.strip()) for n in text.split(",") if n.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (expected networks like 10.0.0.0/8, "
                                         "comma-separated)") from None


def seconds_arg(text: str) -> float:
    """A finite number of seconds >= 0, for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TANDEM_{name}", default)


def _bool_env(name: str, default: bool) -> bool:
    raw = os.environ.get(f"TANDEM_{name}")
    return default if raw is None else raw.strip().lower() in ("1", "true", "yes", "on")


def _add_common(p: argparse.ArgumentParser, shm_default: str) -> None:
    p.add_argument("--model", default=_env("MODEL", "tiny"),
                   help="preset (tiny, tiny-mrope, small, small-mrope) or model directory")
    p.add_argument("--shm-dir", default=_env("SHM_DIR", shm_default),
                   help="directory shared by the cell's scheduler and workers")
    p.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", "16")))
    p.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "0")),
                   help="Prometheus /metrics port (0 = off); serve's worker r uses port + 1 + r")
    _add_shutdown_grace(p)
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    _add_tracing_flags(p)


def _add_shutdown_grace(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shutdown-grace", type=seconds_arg,
                   default=_env("SHUTDOWN_GRACE", str(DEFAULT_GRACE_S)),
                   help="seconds running streams may finish after SIGTERM (a worker: steps "
                        "of a scheduler still streaming to it); docs/reliability.md")


def _add_tracing_flags(p: argparse.ArgumentParser) -> None:
    # Both default to their variables, read by tandem.tracing.setup (None = not given).
    p.add_argument("--otlp-endpoint", default=None,
                   help="OTLP/gRPC collector host:port or URL (default: "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT; tracing is off without it or a trace file)")
    p.add_argument("--trace-file", default=None,
                   help="append finished spans to this file as OTLP JSON lines, read by "
                        "'tandem traces' (default: $TANDEM_TRACE_FILE)")


def _add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=_env("LISTEN", "localhost:50051"))
    _add_served_name_flag(p)
    p.add_argument("--tool-call-parser", choices=("auto", "hermes", "llama3_json", "none"),
                   default=_env("TOOL_CALL_PARSER", "auto"),
                   help="how the OpenAI API reads tool calls in the model's output (auto: "
                        "from the chat template; none: requests with tools are refused)")
    p.add_argument("--mm-cache", choices=("shm", "lru", "none"), default=_env("MM_CACHE", "shm"))
    p.add_argument("--mm-cache-size", type=size_arg, default=_env("MM_CACHE_SIZE", "256Mi"))
    p.add_argument("--mm-cache-max-object-size", type=size_arg,
                   default=_env("MM_CACHE_MAX_OBJECT_SIZE", "64Mi"))
    p.add_argument("--mm-cache-target-fraction", type=fraction_arg,
                   default=_env("MM_CACHE_TARGET_FRACTION", "0.95"),
                   help="CacheStats recommends the smallest cache reaching this fraction of "
                        "the hit ratio an unbounded one would get (docs/cache-sizing.md)")
    p.add_argument("--shm-group-mode", action=argparse.BooleanOptionalAction,
                   default=_bool_env("SHM_GROUP_MODE", False))
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_bool_env("ENABLE_PREFIX_CACHING", True))
    p.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", "16")))
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=int(_env("MAX_NUM_BATCHED_TOKENS", "512")))
    p.add_argument("--max-waiting-requests", type=positive_arg,
                   default=_env("MAX_WAITING_REQUESTS", "256"),
                   help="requests waiting to run at most; more get RESOURCE_EXHAUSTED / 429")
    p.add_argument("--max-waiting-image-bytes", type=size_arg,
                   default=_env("MAX_WAITING_IMAGE_BYTES", "512Mi"),
                   help="client image bytes the waiting requests may hold; likewise (a "
                        "request with more is admitted only when no other holds any)")
    p.add_argument("--encoder-cache-size", type=int,
                   default=int(_env("ENCODER_CACHE_SIZE", "4096")),
                   help="image embeddings the workers keep encoded (must hold the largest image)")
    p.add_argument("--min-pixels", type=int, default=int(_env("MIN_PIXELS", "0")),
                   help="images are resized to at least this many pixels (0 = the model's)")
    p.add_argument("--max-pixels", type=int, default=int(_env("MAX_PIXELS", "0")),
                   help="... and at most this many (0 = the model's, at most what one step and "
                   "the encoder cache hold; built-in models: 448x448, 256 image tokens)")
    p.add_argument("--step-timeout", type=float, default=float(_env("STEP_TIMEOUT", "60")),
                   help="seconds a worker may take for one step before it counts as lost")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=_bool_env("ASYNC_SCHEDULING", True),
                   help="schedule and send the next step while the workers run one (same "
                        "tokens; --no-async-scheduling waits for each step)")
    _add_limit_flags(p)
    _add_tls_serving_flags(p)
    _add_health_listen(p)
    _add_http_flags(p)
    p.add_argument("--http-metrics", action=argparse.BooleanOptionalAction,
                   default=_bool_env("HTTP_METRICS", False),
                   help="serve GET /metrics on the HTTP port too, where an inference "
                        "gateway's endpoint picker scrapes it (docs/routing.md); off: only "
                        "on --metrics-port")


def _add_http_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-listen", default=_env("HTTP_LISTEN", ""),
                   help="host:port of the OpenAI-compatible HTTP API (empty = off); TLS as "
                        "the gRPC port (--tls-*)")
    p.add_argument("--http-allow-remote-images", action=argparse.BooleanOptionalAction,
                   default=_bool_env("HTTP_ALLOW_REMOTE_IMAGES", False),
                   help="fetch image_url http(s) URLs (public addresses only); off: data: URIs")
    p.add_argument("--http-remote-image-max-bytes", type=size_arg,
                   default=_env("HTTP_REMOTE_IMAGE_MAX_BYTES", "20Mi"),
                   help="largest remote image fetched")
    p.add_argument("--http-remote-image-timeout", type=float,
                   default=float(_env("HTTP_REMOTE_IMAGE_TIMEOUT", "10")),
                   help="seconds all of a request's remote images may take together, "
                        "redirects included")
    p.add_argument("--http-remote-image-allow-networks", type=networks_arg,
                   default=_env("HTTP_REMOTE_IMAGE_ALLOW_NETWORKS", ""),
                   help="comma-separated CIDR networks remote images may also come from "
                        "although not public (an in-cluster image store); default none")


def _http_config(args: argparse.Namespace):
    from tandem.openai_api.http_server import HttpConfig
    from tandem.openai_api.remote_images import RemoteImageLimits

    return HttpConfig(args.http_listen, args.http_allow_remote_images, RemoteImageLimits(
        args.http_remote_image_max_bytes, args.http_remote_image_timeout,
        args.http_remote_image_allow_networks))


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Per-request limits: a request over any of them gets INVALID_ARGUMENT."""
    p.add_argument("--max-prompt-tokens", type=int, default=int(_env("MAX_PROMPT_TOKENS", "4096")),
                   help="prompt tokens with image placeholders expanded")
    p.add_argument("--max-images", type=int, default=int(_env("MAX_IMAGES", "8")),
                   help="images per request")
    p.add_argument("--max-image-bytes", type=size_arg, default=_env("MAX_IMAGE_BYTES", "20Mi"),
                   help="encoded size of one image")
    p.add_argument("--max-image-pixels", type=int,
                   default=int(_env("MAX_IMAGE_PIXELS", str(4096 * 4096))),
                   help="decoded pixels of one image, checked from its header")
    p.add_argument("--max-tokens-limit", type=int, default=int(_env("MAX_TOKENS_LIMIT", "1024")),
                   help="the largest max_tokens a client may ask for")
    p.add_argument("--default-max-tokens", type=int,
                   default=int(_env("DEFAULT_MAX_TOKENS", "64")),
                   help="max_tokens of a request that sets none")
    p.add_argument("--max-constraint-chars", type=positive_arg,
                   default=_env("MAX_CONSTRAINT_CHARS", "65536"),
                   help="characters of a structured-output constraint (schema, regex, "
                        "grammar, choices)")
    p.add_argument("--constraint-compile-timeout", type=seconds_arg,
                   default=_env("CONSTRAINT_COMPILE_TIMEOUT", "10"),
                   help="seconds a constraint may take to compile; longer is INVALID_ARGUMENT")


def _add_tls_serving_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=_env("TLS_CERT", ""),
                   help="PEM certificate chain: the public port speaks TLS")
    p.add_argument("--tls-key", default=_env("TLS_KEY", ""), help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=_env("TLS_CLIENT_CA", ""),
                   help="PEM CA bundle: clients must present a certificate it signed (mTLS)")


def _add_health_listen(p: argparse.ArgumentParser) -> None:
    p.add_argument("--health-listen", default=_env("HEALTH_LISTEN", ""),
                   help="extra host:port serving only gRPC health, in plaintext (probes)")


def _add_epp_flags(p: argparse.ArgumentParser) -> None:
    """The endpoint picker's settings (``tandem epp`` and ``tandem gateway``): its cells, how
    it picks one and reaches it, its port's TLS, metrics and shutdown."""
    p.add_argument("--cells", default=_env("EPP_CELLS", ""),
                   help="comma-separated cells: host:GRPC_PORT or host:GRPC_PORT/HTTP_PORT "
                        "(IPv6 hosts in brackets)")
    p.add_argument("--cells-file", default=_env("EPP_CELLS_FILE", ""),
                   help="read the cells from this file instead (the --cells syntax, commas "
                        "or newlines), and again whenever it changes")
    p.add_argument("--pool", default=_env("EPP_POOL", ""),
                   help="follow this InferencePool instead: its selector's ready pods are "
                        "the cells, its target port their gRPC port (docs/routing.md)")
    p.add_argument("--http-pool", default=_env("EPP_HTTP_POOL", ""),
                   help="the InferencePool of the same pods' OpenAI HTTP port (default: "
                        "--http-port)")
    p.add_argument("--pool-namespace", default=_env("EPP_POOL_NAMESPACE", ""),
                   help="the pools' namespace (default: the pod's own, else the "
                        "kubeconfig context's)")
    p.add_argument("--kubeconfig", default=_env("EPP_KUBECONFIG", ""),
                   help="kubeconfig for --pool (default: the in-cluster service account, "
                        "else $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--http-port", type=int, default=int(_env("EPP_HTTP_PORT", "8000")),
                   help="the cells' OpenAI HTTP port, for entries of --cells without one")
    p.add_argument("--queue-bound", type=int, default=int(_env("EPP_QUEUE_BOUND", "0")),
                   help="a cell with this many requests in flight takes no more; 429 when "
                        "every cell is there (0 = no bound)")
    p.add_argument("--body-timeout", type=seconds_arg, default=_env("EPP_BODY_TIMEOUT", "30"),
                   help="seconds a request's body may take to arrive")
    p.add_argument("--load-factor", type=float,
                   default=float(_env("EPP_LOAD_FACTOR", "1.25")),
                   help="a cell above this many times the mean in-flight count spills")
    p.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", "16")),
                   help="the cells' KV block size: a text prompt's key is its first block")
    p.add_argument("--health-interval", type=float,
                   default=float(_env("EPP_HEALTH_INTERVAL", "1.0")), help="seconds")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    p.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "0")),
                   help="Prometheus /metrics port (0 = off)")
    _add_shutdown_grace(p)
    _add_tls_serving_flags(p)
    _add_health_listen(p)
    p.add_argument("--cell-tls-ca", default=_env("EPP_CELL_TLS_CA", ""),
                   help="PEM CA bundle of the cells' certificates: connect to them with TLS")
    p.add_argument("--cell-tls-cert", default=_env("EPP_CELL_TLS_CERT", ""),
                   help="PEM client certificate presented to cells that ask for mutual TLS")
    p.add_argument("--cell-tls-key", default=_env("EPP_CELL_TLS_KEY", ""),
                   help="PEM private key of --cell-tls-cert")
    _add_tracing_flags(p)  # a tandem.route span per pick (docs/observability.md)


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=_env("DEVICE", "auto"))
    p.add_argument("--dtype", default=_env("DTYPE", "auto"),
                   choices=("auto", "bfloat16", "float16", "float32"),
                   help="serving dtype of the weights (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--kv-cache-size", type=size_arg, default=_env("KV_CACHE_SIZE", "256Mi"))
    p.add_argument("--gpu-memory-fraction", type=float,
                   default=float(_env("GPU_MEMORY_FRACTION", "0.8")))
    p.add_argument("--tensor-parallel-size", type=int,
                   default=int(_env("TENSOR_PARALLEL_SIZE", "1")),
                   help="workers sharing one copy of the model (divides --workers)")
    p.add_argument("--torch-threads", type=threads_arg, default=_env("TORCH_THREADS", "0"),
                   help="torch threads of each worker (0: the CPUs the process may use, "
                        "capped by its container's CPU quota; serve: shared by its workers)")
    p.add_argument("--adapt-torch-threads", action=argparse.BooleanOptionalAction,
                   default=_bool_env("ADAPT_TORCH_THREADS", True),
                   help="with --torch-threads 0, run fewer threads while they wait for CPUs "
                        "other jobs hold, and more again when those are idle")


def _scheduler_config(args: argparse.Namespace, addresses: Sequence[str]):
    from scheduler_svc.config import Limits, SchedulerConfig

    limits = Limits(
        max_prompt_tokens=args.max_prompt_tokens, max_images=args.max_images,
        max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
        max_tokens=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
        max_constraint_chars=args.max_constraint_chars,
        constraint_compile_timeout_s=args.constraint_compile_timeout)
    return SchedulerConfig(
        model=args.model, listen=args.listen, shm_dir=args.shm_dir, mm_cache=args.mm_cache,
        mm_cache_size=args.mm_cache_size, mm_cache_max_object_size=args.mm_cache_max_object_size,
        mm_cache_target_fraction=args.mm_cache_target_fraction,
        shm_group_mode=args.shm_group_mode, enable_prefix_caching=args.enable_prefix_caching,
        block_size=args.block_size, worker_addresses=tuple(addresses),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_image_bytes=args.max_waiting_image_bytes,
        metrics_port=args.metrics_port, http_metrics=args.http_metrics,
        shutdown_grace_s=args.shutdown_grace, health_listen=args.health_listen,
        tls=TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca),
        encoder_cache_embeds=args.encoder_cache_size, min_pixels=args.min_pixels,
        max_pixels=args.max_pixels, step_timeout_s=args.step_timeout,
        async_scheduling=args.async_scheduling, limits=limits, http=_http_config(args),
        served_model_names=tuple(args.served_model_name),
        tool_call_parser=args.tool_call_parser)


def _worker_config(args: argparse.Namespace, rank: int, world_size: int, metrics_port: int,
                   listen: str = "", tp_master: tuple[str, int] = ("127.0.0.1", 29500),
                   health_listen: str = "", threads: int | None = None):
    """``metrics_port`` is the port this worker serves, exactly (0 = off); ``threads``
    overrides ``--torch-threads``."""
    from worker_svc.config import WorkerConfig

    return WorkerConfig(
        model=args.model, shm_dir=args.shm_dir, rank=rank, world_size=world_size,
        worker_listen=listen, health_listen=health_listen, device=args.device,
        dtype=args.dtype, block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_size, gpu_memory_fraction=args.gpu_memory_fraction,
        tensor_parallel_size=args.tensor_parallel_size, tp_master_addr=tp_master[0],
        tp_master_port=tp_master[1], metrics_port=metrics_port,
        shutdown_grace_s=args.shutdown_grace,
        threads=args.torch_threads if threads is None else threads,
        adapt_threads=args.adapt_torch_threads and not args.torch_threads)


def worker_address(shm_dir: str, rank: int) -> str:
    return f"unix://{Path(shm_dir).absolute()}/worker-{rank}.sock"


def cmd_serve(args: argparse.Namespace) -> int:
    """The embedded local pair: N worker processes plus the scheduler in this process."""
    import multiprocessing

    from scheduler_svc.server import serve as serve_scheduler
    from tandem.cpus import usable_cpus
    from tandem.text import load_tokenizer
    from tandem_cli.supervisor import WorkerSupervisor
    from worker_svc.checkpoint import check_model

    shm_dir = Path(args.shm_dir)
    prepare_shared_dir(shm_dir, args.shm_group_mode)  # refused: nothing started or removed
    check_model(args.model)  # a bad model directory fails here, before any process starts
    load_tokenizer(args.model)
    ctx = multiprocessing.get_context("spawn")  # grpc and fork don't mix
    tracing_args = (args.otlp_endpoint, args.trace_file)

    # the local workers share this machine's CPUs rather than each taking all of them
    threads = args.torch_threads or max(1, usable_cpus() // args.workers)

    def start_group(ranks: range) -> list:
        tp_master = ("127.0.0.1", _free_port())  # where the tensor-parallel ranks meet
        procs = [ctx.Process(target=_run_worker,
                             args=(_worker_config(args, r, args.workers,
                                                  _child_metrics_port(args.metrics_port, r),
                                                  tp_master=tp_master, threads=threads),
                                   tracing_args, os.getpid()),
                             name=f"tandem-worker-{r}") for r in ranks]
        for p in procs:
            p.start()
        return procs

    # One torch.distributed world spans every worker under tensor parallelism: a restart
    # restarts them all.
    group = args.workers if args.tensor_parallel_size > 1 else 1
    supervisor = WorkerSupervisor(start_group, args.workers, group)
    supervisor.start()
    _setup_tracing("tandem-scheduler", args)
    try:
        addresses = [worker_address(args.shm_dir, r) for r in range(args.workers)]
        asyncio.run(serve_scheduler(_scheduler_config(args, addresses)))
    except KeyboardInterrupt:
        pass
    finally:
        # The workers outlive the scheduler's last step: they are stopped only now, and
        # may take their own grace (steps of a scheduler still streaming) and then some.
        supervisor.stop(timeout=args.shutdown_grace + STOP_MARGIN_S)
        _shutdown_tracing()
        if args.remove_shm_dir:
            shutil.rmtree(shm_dir, ignore_errors=True)
    return 0


def _child_metrics_port(port: int, rank: int) -> int:
    """The /metrics port of ``tandem serve``'s worker ``rank``: the scheduler has ``port``,
    the workers the next ones (0 = off for all)."""
    return port + 1 + rank if port else 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_worker(config, tracing_args: tuple[str | None, str | None], parent: int) -> None:
    from tandem import tracing
    from worker_svc.server import serve

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker-{config.rank} %(name)s "
                        "%(levelname)s %(message)s")
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops workers with SIGTERM
    _stop_with(parent)
    tracing.setup("tandem-worker", *tracing_args)
    try:
        serve(config)
    except TandemError as exc:  # e.g. a model that passed the start-up check fails to load
        print(f"tandem worker {config.rank}: error: {exc.message}", file=sys.stderr)
        sys.exit(2)
    finally:
        tracing.shutdown()


def _stop_with(parent: int) -> None:
    """SIGTERM for this worker when ``tandem serve`` (pid ``parent``) dies, however it dies.

    Its supervisor stops the workers when it gets to run its stop; a SIGKILL (the OOM
    killer, a supervisor of its own out of patience) left them running, orphans holding
    their memory and the segment. Linux's parent-death signal is sent when the thread that
    started the worker ends: the main thread, or the supervisor's, which ends in its stop.
    """
    import ctypes
    import signal

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0):
        logging.getLogger(__name__).warning("worker: no parent-death signal (prctl: %s)",
                                            os.strerror(ctypes.get_errno()))
    elif os.getppid() != parent:  # it died before the prctl
        sys.exit(f"tandem worker: tandem serve (pid {parent}) exited as the worker started")


def _setup_tracing(service_name: str, args: argparse.Namespace) -> None:
    """Tracing from the flags (their defaults are the OTEL_* / TANDEM_TRACE_FILE variables)."""
    from tandem import tracing

    tracing.setup(service_name, args.otlp_endpoint, args.trace_file)


def _shutdown_tracing() -> None:
    from tandem import tracing

    tracing.shutdown()  # exports the spans still buffered


def cmd_scheduler(args: argparse.Namespace) -> int:
    from scheduler_svc.server import serve

    addresses = ([a.strip() for a in args.worker_addresses.split(",") if a.strip()]
                 if args.worker_addresses
                 else [worker_address(args.shm_dir, r) for r in range(args.workers)])
    _setup_tracing("tandem-scheduler", args)
    try:
        asyncio.run(serve(_scheduler_config(args, addresses)))
    finally:
        _shutdown_tracing()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from worker_svc.checkpoint import check_model
    from worker_svc.server import serve

    check_model(args.model)
    _setup_tracing("tandem-worker", args)
    try:
        serve(_worker_config(args, args.rank, args.workers, args.metrics_port,
                             args.worker_listen, (args.tp_master_addr, args.tp_master_port),
                             args.health_listen))
    finally:
        _shutdown_tracing()
    return 0


def cmd_traces(args: argparse.Namespace) -> int:
    from tandem_cli.traces_view import render_file

    if not args.file:
        print("error: no trace file: pass --file or set TANDEM_TRACE_FILE", file=sys.stderr)
        return 2
    try:
        print(render_file(Path(args.file), args.n))
    except FileNotFoundError:
        print(f"error: {args.file} does not exist (start 'tandem serve --trace-file "
              f"{args.file}' and send a request)", file=sys.stderr)
        return 1
    return 0


def cmd_operator(args: argparse.Namespace) -> int:
    from tandem_operator.main import run

    return run([])


def _epp_config(args: argparse.Namespace, listen: str):
    from router_svc.epp import parse_cells
    from router_svc.epp_server import CellsFile, EppConfig

    try:
        cells = parse_cells(args.cells, args.http_port)
    except ValueError as exc:
        raise SettingsError(f"--cells: {exc}") from None
    given = [flag for flag, value in (("--cells", cells), ("--cells-file", args.cells_file),
                                      ("--pool", args.pool)) if value]
    if not given:
        raise SettingsError("--cells (or TANDEM_EPP_CELLS) names no cell")
    if len(given) > 1:
        raise SettingsError(f"give one of --cells, --cells-file and --pool, not {given}")
    if args.cells_file:
        try:
            CellsFile(args.cells_file, args.http_port).read()
        except (OSError, ValueError) as exc:
            raise SettingsError(f"--cells-file {args.cells_file}: {exc}") from None
    return EppConfig(
        cells=cells, cells_file=args.cells_file, http_port=args.http_port, listen=listen,
        pool=_pool_source(args),
        load_factor=args.load_factor, block_size=args.block_size,
        health_interval=args.health_interval, queue_bound=args.queue_bound,
        body_timeout_s=args.body_timeout, metrics_port=args.metrics_port,
        shutdown_grace_s=args.shutdown_grace,
        tls=TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca),
        cell_tls=TlsFiles(args.cell_tls_cert, args.cell_tls_key, args.cell_tls_ca),
        health_listen=args.health_listen)


def _pool_source(args: argparse.Namespace):
    """--pool's settings, with credentials found now so that a missing kubeconfig is a
    settings error rather than a picker that never becomes ready."""
    from router_svc.pool_watch import PoolSource, connection

    if not args.pool:
        if args.http_pool:
            raise SettingsError("--http-pool needs --pool")
        return None
    source = PoolSource(args.pool, args.http_pool, args.pool_namespace, args.kubeconfig)
    try:
        connection(source)
    except Exception as exc:  # the client's ConfigException, OSError, bad YAML: all alike
        raise SettingsError(f"--pool {args.pool}: no Kubernetes credentials ({exc}); "
                            "give --kubeconfig outside a cluster") from None
    return source


def cmd_epp(args: argparse.Namespace) -> int:
    from router_svc.epp_server import serve

    config = _epp_config(args, args.listen)
    _setup_tracing("tandem-epp", args)
    try:
        asyncio.run(serve(config))
    finally:
        _shutdown_tracing()
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from tandem_cli.gateway import EnvoyFailed, EnvoyMissing, GatewayConfig, run_gateway

    epp = _epp_config(args, args.epp_listen)
    if epp.cell_tls.enabled and not epp.cell_tls.ca:
        # The picker's checks would trust the system roots; Envoy needs the CA file.
        raise SettingsError("--cell-tls-cert/--cell-tls-key need --cell-tls-ca with tandem "
                            "gateway: Envoy verifies the cells' certificates against it")
    _setup_tracing("tandem-epp", args)  # the picker runs in this process
    try:
        asyncio.run(run_gateway(GatewayConfig(
            epp, listen=args.listen,
            admin_port=args.admin_port, fail_open=args.fail_open,
            envoy_log_level=args.envoy_log_level)))
    except EnvoyMissing as exc:
        raise SettingsError(str(exc)) from None
    except EnvoyFailed as exc:
        print(f"tandem gateway: error: {exc}", file=sys.stderr)
        return 1
    finally:
        _shutdown_tracing()
    return 0


def cmd_export_model(args: argparse.Namespace) -> int:
    from worker_svc.checkpoint import export_model

    export_model(args.model, args.out)
    print(f"wrote {args.model} to {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["router"]:  # removed; old scripts get told where to go, whatever flags
        print(ROUTER_REMOVED, file=sys.stderr)
        return 2
    if argv[:1] == ["operator"]:
        # Every flag after "operator" belongs to the operator's own parser (argparse's
        # REMAINDER would refuse the leading "--liveness=..." style ones).
        from tandem_operator.main import run

        return run(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    logging.basicConfig(level=getattr(args, "log_level", "WARNING").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (TlsConfigError, UnsafeSharedDir, SettingsError) as exc:  # settings to fix
        print(f"tandem {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except TandemError as exc:  # e.g. a model directory that cannot be served
        print(f"tandem {argv[0]}: error: {exc.message}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from tandem_cli.client import add_client_commands

    parser = argparse.ArgumentParser(prog="tandem", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(metavar="COMMAND")
    instance = _env("INSTANCE", f"local-{os.getpid()}")

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str):
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    p = add("serve", cmd_serve, "run a local scheduler + worker pair sharing a segment")
    _add_common(p, f"/dev/shm/tandem/{instance}")
    _add_scheduler_flags(p)
    _add_worker_flags(p)
    p.add_argument("--workers", type=int, default=int(_env("WORKERS", "1")))
    p.add_argument("--remove-shm-dir", action=argparse.BooleanOptionalAction, default=True,
                   help="remove the shared directory on exit")

    p = add("scheduler", cmd_scheduler, "run the scheduler alone (connects to its workers)")
    _add_common(p, f"/dev/shm/tandem/{instance}")
    _add_scheduler_flags(p)
    p.add_argument("--workers", type=int, default=int(_env("WORKERS", "1")))
    p.add_argument("--worker-addresses", default=_env("WORKER_ADDRESSES", ""),
                   help="comma-separated worker targets in rank order")

    p = add("worker", cmd_worker, "run one worker alone")
    _add_common(p, f"/dev/shm/tandem/{instance}")
    _add_worker_flags(p)
    p.add_argument("--rank", type=int, default=int(_env("WORKER_RANK", "0")))
    p.add_argument("--workers", type=int, default=int(_env("WORKERS", "1")))
    p.add_argument("--worker-listen", default=_env("WORKER_LISTEN", ""),
                   help="extra TCP host:port serving the Worker API (unauthenticated)")
    _add_health_listen(p)
    p.add_argument("--tp-master-addr", default=_env("TP_MASTER_ADDR", "127.0.0.1"),
                   help="host of worker 0, where the tensor-parallel ranks meet")
    p.add_argument("--tp-master-port", type=int, default=int(_env("TP_MASTER_PORT", "29500")))

    # Dispatched in main() before parsing; listed here for --help.
    add("operator", cmd_operator, "run the Kubernetes operator (kopf); flags: tandem operator -h")

    p = add("epp", cmd_epp, "the endpoint picker: Envoy's ext_proc server that picks a cell "
            "for each request by cache affinity (docs/routing.md)")
    p.add_argument("--listen", default=_env("LISTEN", "localhost:9002"))
    _add_epp_flags(p)

    p = add("gateway", cmd_gateway, "a local Envoy (pip install 'tandem[gateway]') routed by "
            "the endpoint picker across cells (docs/routing.md)")
    p.add_argument("--listen", default=_env("GATEWAY_LISTEN", "localhost:8080"),
                   help="host:port of Envoy's listener (gRPC h2c and HTTP/1.1)")
    p.add_argument("--epp-listen", default=_env("GATEWAY_EPP_LISTEN", "127.0.0.1:0"),
                   help="host:port of the endpoint picker (in this process; port 0 = any)")
    p.add_argument("--admin-port", type=int, default=int(_env("GATEWAY_ADMIN_PORT", "9901")),
                   help="Envoy's admin port, on 127.0.0.1")
    p.add_argument("--fail-open", action=argparse.BooleanOptionalAction,
                   default=_bool_env("GATEWAY_FAIL_OPEN", False),
                   help="while the picker is down, serve round robin without affinity "
                        "(default: answer 503 / UNAVAILABLE)")
    p.add_argument("--envoy-log-level", default=_env("GATEWAY_ENVOY_LOG_LEVEL", "warning"))
    _add_epp_flags(p)

    p = add("traces", cmd_traces, "show the last requests of a trace file as span trees")
    p.add_argument("--file", default=os.environ.get("TANDEM_TRACE_FILE", ""),
                   help="OTLP JSON lines written by 'tandem serve --trace-file'")
    p.add_argument("-n", type=int, default=5, help="requests to show (the most recent)")

    p = add("export-model", cmd_export_model, "write built-in weights as safetensors")
    p.add_argument("--model", default="tiny")
    p.add_argument("out", help="output directory")

    add_client_commands(sub, DEFAULT_TARGET)
    return parser


if __name__ == "__main__":
    sys.exit(main())
