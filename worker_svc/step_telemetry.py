"""What a worker reports about its steps: totals for ``/metrics`` and, while tracing is
on, one ``tandem.worker.step`` span per step.

A step serves many requests, so its span has no single parent: it carries a span link to
each request span it served (their traceparents arrive in ``StepInput.trace_context``).
Attributes are counts only, never token ids or feature payloads.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry import trace

from tandem import tracing
from tandem.metrics import worker_mask_wait_seconds
from worker_svc.step import StepInput, StepOutput


class StepTelemetry:
    """Totals since the worker started, written by the step thread only (read at scrape
    time by the event loop; each is a single int, so a read never sees a torn value)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps = 0
        self.encoder_runs = 0
        self.shm_resolved = 0
        self.shm_acked = 0
        self.mask_wait = worker_mask_wait_seconds()

    def run(self, step: StepInput, run: Callable[[StepInput], StepOutput]) -> StepOutput:
        """``run(step)``, traced when tracing is on, and counted."""
        output = run(step) if not tracing.enabled() else self._traced(step, run)
        self.steps += 1
        self.encoder_runs += output.encoder_runs
        self.shm_resolved += output.shm_resolved
        self.shm_acked += output.shm_acked
        if step.deferred_masks is not None:
            self.mask_wait.observe(step.deferred_masks.waited_s)
        return output

    def _traced(self, step: StepInput, run: Callable[[StepInput], StepOutput]) -> StepOutput:
        links = [link for rid, header in step.trace_context.items()
                 if (link := tracing.link_to(header, {
                     "tandem.request.scheduled_tokens": step.num_scheduled_tokens.get(rid, 0)}))]
        span = tracing.tracer().start_span("tandem.worker.step", kind=trace.SpanKind.SERVER,
                                           links=links, attributes={
            "tandem.worker.rank": self.rank, "tandem.step.id": step.step_id,
            "tandem.step.num_requests": len(step.num_scheduled_tokens),
            "tandem.step.new_requests": len(step.new_requests),
            "tandem.step.scheduled_tokens": step.total_num_scheduled_tokens})
        try:
            output = run(step)
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)  # never the message
            span.set_status(trace.StatusCode.ERROR)
            span.end()
            raise
        span.set_attributes({"tandem.shm.resolved": output.shm_resolved,
                             "tandem.shm.acked": output.shm_acked,
                             "tandem.encoder.runs": output.encoder_runs})
        span.end()
        return output

    def metric_values(self) -> dict[str, float]:
        """The worker's totals under their tandem.metrics names."""
        return {"tandem_steps_total": self.steps,
                "tandem_encoder_runs_total": self.encoder_runs,
                "tandem_shm_resolved_total": self.shm_resolved,
                "tandem_shm_acked_total": self.shm_acked}
