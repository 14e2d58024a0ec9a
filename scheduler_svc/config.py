"""Scheduler settings (flags and ``TANDEM_*`` variables map onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from scheduler_svc.image_processor import ImageProcessorConfig
from tandem.openai_api.http_server import HttpConfig
from tandem.shutdown import DEFAULT_GRACE_S
from tandem.tls import TlsFiles


@dataclass(frozen=True)
class Limits:
    """Per-request limits; a request over any of them gets INVALID_ARGUMENT."""

    max_prompt_tokens: int = 4096  # after image placeholders are expanded
    max_images: int = 8
    max_image_bytes: int = 20 * 2**20  # encoded size
    max_image_pixels: int = 4096 * 4096  # decoded size, before resizing (bomb guard)
    max_tokens: int = 1024  # largest max_tokens a client may ask for
    default_max_tokens: int = 64
    # Structured output (tandem.structured): a constraint's size, and its compile time
    max_constraint_chars: int = 64 * 1024
    constraint_compile_timeout_s: float = 10.0


@dataclass(frozen=True)
class SchedulerConfig:
    model: str = "tiny"
    # The model's names in the APIs (--served-model-name): the first is reported, any is
    # accepted; empty = ``model`` itself.
    served_model_names: tuple[str, ...] = ()
    # How the OpenAI API reads the model's tool calls (--tool-call-parser): hermes,
    # llama3_json, none, or auto (told by the chat template)
    tool_call_parser: str = "auto"
    listen: str = "localhost:50051"
    shm_dir: str = ""
    mm_cache: str = "shm"  # shm | lru | none
    mm_cache_size: int = 256 * 2**20
    mm_cache_max_object_size: int = 64 * 2**20
    # CacheStats recommends the smallest cache reaching this fraction of the achievable
    # hit ratio (docs/cache-sizing.md)
    mm_cache_target_fraction: float = 0.95
    shm_group_mode: bool = False
    enable_prefix_caching: bool = True
    block_size: int = 16
    worker_addresses: tuple[str, ...] = ()
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    encoder_cache_embeds: int = 4096  # worker encoder-cache capacity, in embeddings
    # Admission (scheduler_svc.admission): what may wait to run, by count and by the
    # client's image bytes; more is refused with RESOURCE_EXHAUSTED / HTTP 429.
    max_waiting_requests: int = 256
    max_waiting_image_bytes: int = 512 * 2**20
    min_pixels: int = 0  # images are resized into this range; 0 = the model's
    max_pixels: int = 0
    step_timeout_s: float = 60.0
    # Send step N+1 while the workers run step N (docs/scheduler.md, "Asynchronous
    # scheduling"); off: one step at a time.
    async_scheduling: bool = True
    metrics_port: int = 0
    # GET /metrics on the HTTP port too (--http-metrics): where an inference extension's
    # endpoint picker scrapes a pool's target port by default; off keeps metrics off the
    # public port (docs/security.md).
    http_metrics: bool = False
    shutdown_grace_s: float = DEFAULT_GRACE_S  # running streams may finish (tandem.shutdown)
    tls: TlsFiles = field(default_factory=TlsFiles)  # public port; ca = client CA (mTLS)
    health_listen: str = ""  # extra plaintext port with health only (probes under TLS)
    http: HttpConfig = field(default_factory=HttpConfig)  # OpenAI-compatible port (TLS: tls)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not 0.0 < self.mm_cache_target_fraction <= 1.0:
            raise ValueError(f"--mm-cache-target-fraction must be in (0, 1], got "
                             f"{self.mm_cache_target_fraction}")
        if self.max_waiting_requests < 1 or self.max_waiting_image_bytes < 0:
            raise ValueError(f"--max-waiting-requests must be at least 1 and "
                             f"--max-waiting-image-bytes not negative, got "
                             f"{self.max_waiting_requests} and {self.max_waiting_image_bytes}")

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)

    @property
    def num_workers(self) -> int:
        return len(self.worker_addresses)

    def image_processor(self, model: ImageProcessorConfig) -> ImageProcessorConfig:
        """The model's image processing under this config's limits.

        ``--min-pixels`` / ``--max-pixels`` win when set. Otherwise the model's range holds,
        its top lowered to the largest image one step and the encoder cache can take (a
        Qwen2-VL checkpoint allows 1280-token images; the default step budget is 512).
        """
        self.check_image_budget(model.factor)
        largest = min(self.encoder_cache_embeds, self.max_num_batched_tokens) * model.factor**2
        max_pixels = self.max_pixels or min(model.max_pixels, largest)
        min_pixels = self.min_pixels or min(model.min_pixels, max_pixels)
        return replace(model, min_pixels=min_pixels, max_pixels=max_pixels,
                       max_image_bytes=self.limits.max_image_bytes,
                       max_image_pixels=self.limits.max_image_pixels)

    def check_image_budget(self, factor: int) -> None:
        """The largest image (``factor`` pixels per merged-patch side) must fit one step's
        encoder budget and the encoder cache, or a request carrying it would never run."""
        largest = self.max_pixels // factor**2  # 0: the model's range, lowered to fit
        if largest > min(self.encoder_cache_embeds, self.max_num_batched_tokens):
            raise ValueError(
                f"--max-pixels {self.max_pixels} allows images of {largest} tokens, more than "
                f"--encoder-cache-size {self.encoder_cache_embeds} or --max-num-batched-tokens "
                f"{self.max_num_batched_tokens}: raise those or lower --max-pixels")
