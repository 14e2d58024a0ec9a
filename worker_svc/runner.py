"""Applies one scheduler step: resolve features, encode, forward, sample.

The servicer hands every Step here (in a worker thread); this module owns the worker's
request states, encoder cache and the model's KV cache contents.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from tandem.errors import FailedPrecondition, InvalidInput
from tandem.features import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from tandem.receiver_cache import ResolvedFeatures, ShmReceiverCache
from tandem.sampling import check_sampling
from tandem.shm import ShmDescriptor
from worker_svc.batch import build_batch
from worker_svc.encoder_cache import EncoderCache
from worker_svc.model import Transformer
from worker_svc.request_state import (
    IMAGE_GRID_THW,
    PIXEL_VALUES,
    RequestState,
    new_request_state,
)
from worker_svc.sampler import (
    apply_penalties,
    refused_tokens,
    sample,
    token_logprobs,
    token_seed,
    uniform_draws,
)
from worker_svc.step import (
    Logprobs,
    NewRequestData,
    SamplingParams,
    StepInput,
    StepOutput,
    is_token_mask,
)
from worker_svc.synthetic import synthetic_image
from worker_svc.tensor_parallel import TensorParallelGroup


@dataclass(frozen=True)
class _Scheduled:
    """What validation needs of one scheduled request: tokens [start, end) this step."""

    features: list[MultiModalFeatureSpec]
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class StepRunner:
    """The worker's side of the scheduler protocol, one step at a time.

    Why a separate class: the servicer stays a thin adapter, and tests and the benchmark
    drive steps without a server.

    A step is checked whole before anything changes (ids, counts, block ids, encoder
    inputs and outputs, then the resolved features), so a rejected step leaves the states,
    the encoder cache, the KV cache and the segment's ack counters as they were: address
    items are read during the checks and acknowledged only once the step is accepted. The
    one exception is a step naming a new segment generation (see ``_follow_segment``).
    Under tensor
    parallelism the ranks agree on the checks (``tp.all_ok``) before the commit point, so
    a step is applied by all ranks of the group or by none.

    Invariants: every held request satisfies ``RequestState.check_invariants`` for the
    cache geometry; the encoder cache satisfies its own. Only ``step`` mutates
    ``requests`` and ``encoder_cache``.
    """

    def __init__(self, model: Transformer, receiver: ShmReceiverCache | None,
                 debug_invariants: bool = False, tp: TensorParallelGroup | None = None) -> None:
        assert model.num_blocks > 0, "call model.setup_caches before building a runner"
        self.model = model
        self.tp = tp  # None: the whole model is here
        self.config = model.config
        self.device = model.output.weight.device
        self.receiver = receiver
        self.debug_invariants = debug_invariants
        self.requests: dict[str, RequestState] = {}
        self.encoder_cache = EncoderCache(self.config.dim, self.device, model.output.weight.dtype)

    @torch.inference_mode()
    def step(self, step: StepInput) -> StepOutput:
        try:
            self._follow_segment(step.segment_name, step.segment_generation)
            self._validate(step)
            new_states, resolved, to_ack = self._admit(step)
            self._check_encoder_payloads(step, new_states)
        except Exception:
            if self.tp is not None:
                self.tp.all_ok(False)  # the peers reject the step too and stay paired
            raise
        if self.tp is not None and not self.tp.all_ok(True):
            raise FailedPrecondition("another tensor-parallel rank rejected this step",
                                     reason="PEER_REJECTED_STEP")
        # Address items are acknowledged only by an accepted step (a rejected one leaves
        # every counter as it was); this raises only if the segment was re-created since.
        acked = self.receiver.acknowledge(to_ack) if self.receiver is not None else 0
        # Commit point: nothing below raises for a step that passed the checks above, but
        # a wait for deferred token masks that fails (DeferredMasks.wait: not a refusal).
        for rid in step.finished_request_ids:
            self.requests.pop(rid, None)
        self.encoder_cache.free(step.free_encoder_mm_hashes)
        self.requests.update(new_states)
        for r in step.cached_requests:
            self.requests[r.request_id].block_ids.extend(r.new_block_ids)
        runs = self._run_encoder(step)
        sampled, logprobs = self._forward_and_sample(step)
        if self.debug_invariants:
            self.check_invariants()
        return StepOutput(step.step_id, sampled, resolved, acked, runs, logprobs)

    def _validate(self, step: StepInput) -> None:
        finished = set(step.finished_request_ids)
        live = self.requests.keys() - finished
        ids = [r.request_id for r in step.new_requests] + [
            r.request_id for r in step.cached_requests]
        if len(set(ids)) != len(ids) or set(ids) != step.num_scheduled_tokens.keys():
            raise InvalidInput("num_scheduled_tokens must name each new and cached request "
                               "exactly once", reason="SCHEDULED_MISMATCH")
        scheduled: dict[str, _Scheduled] = {}
        for r in step.new_requests:
            if r.request_id in live:
                raise InvalidInput(f"request {r.request_id} is already running",
                                   reason="DUPLICATE_REQUEST")
            self._validate_new(r)
            n = step.num_scheduled_tokens[r.request_id]
            self._validate_range(r.request_id, r.num_computed_tokens, len(r.token_ids),
                                 r.block_ids, 0, n)
            scheduled[r.request_id] = _Scheduled(r.features, r.num_computed_tokens, n)
        for c in step.cached_requests:
            state = self.requests.get(c.request_id) if c.request_id in live else None
            if state is None:
                raise FailedPrecondition(f"unknown request {c.request_id}",
                                         reason="UNKNOWN_REQUEST")
            if c.num_computed_tokens != state.num_computed_tokens:
                raise FailedPrecondition(
                    f"request {c.request_id}: scheduler counts {c.num_computed_tokens} computed "
                    f"tokens, the worker {state.num_computed_tokens}", reason="COMPUTED_MISMATCH")
            n = step.num_scheduled_tokens[c.request_id]
            self._validate_range(c.request_id, state.num_computed_tokens, state.num_tokens,
                                 c.new_block_ids, len(state.block_ids), n)
            scheduled[c.request_id] = _Scheduled(state.features, state.num_computed_tokens, n)
        self._validate_encoder_inputs(step, scheduled)
        deferred = step.deferred_masks.request_ids if step.deferred_masks is not None else ()
        bad_masks = [rid for rid, m in step.token_masks.items()
                     if rid not in scheduled or not is_token_mask(m) or rid in deferred]
        bad_masks += [rid for rid in deferred if rid not in scheduled]
        if bad_masks:
            raise InvalidInput(f"token masks of {sorted(bad_masks)[:4]}: not scheduled, given "
                               "twice, or not whole int32 words", reason="BAD_TOKEN_MASK")

    def _validate_new(self, r: NewRequestData) -> None:
        n = len(r.token_ids)
        if n == 0 or not r.num_prompt_tokens <= n or any(
                t >= self.config.vocab_size for t in r.token_ids):
            raise InvalidInput(f"request {r.request_id}: empty prompt, prompt count over the "
                               "tokens, or a token outside the vocabulary", reason="BAD_TOKENS")
        check_sampling(r.sampling, self.config.vocab_size)
        ends = 0
        for f in r.features:
            if f.mm_position.offset < ends or f.mm_position.end > n or f.mm_position.length <= 0:
                raise InvalidInput(f"request {r.request_id}: features must be sorted, disjoint "
                                   "and inside the prompt", reason="BAD_FEATURES")
            ends = f.mm_position.end

    def _validate_range(self, rid: str, computed: int, known: int, block_ids: list[int],
                        held_blocks: int, scheduled: int) -> None:
        """``block_ids`` are the blocks this step adds to the ``held_blocks`` the request
        already has (checked when they arrived), so the cost of a decode step does not grow
        with the length of its context."""
        end = computed + scheduled
        if scheduled <= 0 or end > known or end > self.config.max_seq_len:
            raise InvalidInput(f"request {rid}: {scheduled} tokens scheduled after {computed} "
                               f"computed, of {known} known (max {self.config.max_seq_len})",
                               reason="BAD_TOKEN_RANGE")
        if any(not 0 <= b < self.model.num_blocks for b in block_ids):
            raise InvalidInput(f"request {rid}: block id out of range "
                               f"[0, {self.model.num_blocks})", reason="BLOCK_OUT_OF_RANGE")
        blocks = held_blocks + len(block_ids)
        if blocks * self.model.block_size < end:
            raise InvalidInput(f"request {rid}: {blocks} blocks cannot hold {end} "
                               "tokens", reason="BLOCK_TABLE_SHORT")

    def _validate_encoder_inputs(self, step: StepInput,
                                 scheduled: dict[str, _Scheduled]) -> None:
        """Encoder inputs name present payloads; every placeholder this step has embeddings."""
        available = self.encoder_cache.entries.keys() - set(step.free_encoder_mm_hashes)
        for rid, indices in step.scheduled_encoder_inputs.items():
            feats = scheduled[rid].features if rid in scheduled else []
            if rid not in scheduled or any(not 0 <= i < len(feats) for i in indices):
                raise InvalidInput(f"encoder inputs for {rid} name no scheduled feature",
                                   reason="BAD_ENCODER_INPUT")
            for i in indices:
                if feats[i].data is None:
                    raise InvalidInput(f"request {rid}: feature {i} is scheduled for the "
                                       "encoder but carries no data",
                                       reason="MISSING_ENCODER_INPUT")
                available = available | {feats[i].identifier}
        for rid, s in scheduled.items():
            for f in s.features:
                overlaps = f.mm_position.offset < s.end and s.start < f.mm_position.end
                if overlaps and f.identifier not in available:
                    raise FailedPrecondition(f"request {rid}: no encoder output for feature "
                                             f"{f.identifier} and none scheduled",
                                             reason="ENCODER_OUTPUT_MISSING")

    def _follow_segment(self, name: str, generation: int) -> None:
        """Attach to the segment the step names; when that is a new generation of an
        attached segment, a new scheduler took over (the old one died): drop every request
        and encoder output the old one left here, as it will never finish or free them.

        The one change a rejected step can make, and only once the new segment was found
        with the step's generation (a forged step cannot trigger it)."""
        if self.receiver is None or not name:
            return
        before = self.receiver.generation
        self.receiver.ensure_segment(name, generation)
        if before not in (0, self.receiver.generation):
            self.requests.clear()
            self.encoder_cache.free(list(self.encoder_cache.entries))

    def _admit(self, step: StepInput) -> tuple[dict[str, RequestState], int,
                                               list[ShmDescriptor]]:
        """Resolve the new requests' features through the receiver cache (reads their
        address items; acknowledged after the checks) and build their states."""
        if step.segment_name or any(isinstance(f.data, ShmDescriptor)
                                    for r in step.new_requests for f in r.features):
            if self.receiver is None:
                raise FailedPrecondition("address items received but this worker has no "
                                         "shared directory", reason="SHM_NOT_ATTACHED")
            self.receiver.ensure_segment(step.segment_name, step.segment_generation)
        results = self._resolve(step)
        states = {r.request_id: new_request_state(r, res.features, self.config)
                  for r, res in zip(step.new_requests, results, strict=True)}
        return (states, sum(res.resolved for res in results),
                [desc for res in results for desc in res.to_ack])

    def _resolve(self, step: StepInput) -> list[ResolvedFeatures]:
        """Each new request's features through the receiver cache, acknowledging nothing."""
        if self.receiver is None:
            return [ResolvedFeatures(r.features, 0) for r in step.new_requests]
        pending: Counter[int] = Counter()  # chunk address -> refs this step will ack
        return [self.receiver.resolve(r.features, r.num_computed_tokens,
                                      self.config.uses_mrope, pending)
                for r in step.new_requests]

    def skip(self, step: StepInput) -> int:
        """``step`` will not run here (the worker answers it ``not_run``, worker.proto):
        acknowledge its address items as running it would have (:meth:`acknowledge_unseen`)
        and change nothing else; returns the count.

        Why: the scheduler holds a step that failed on a slot in doubt (it may have run)
        and settles by reading the slot's counter, which only this reader may write. Left
        unacknowledged, a live worker's not-run step pins its references for good. Runs on
        the step thread in the step's turn, so settlement's ordering rule holds.
        """
        return self.acknowledge_unseen(step.segment_name, step.segment_generation, [
            f.data for r in step.new_requests for f in r.features
            if isinstance(f.data, ShmDescriptor)])

    def acknowledge_unseen(self, segment_name: str, generation: int,
                           descriptors: list[ShmDescriptor]) -> int:
        """Acknowledge address items of steps that will never run here (a step not run, or
        one that never reached this worker: worker.proto, Acknowledge), reading none:
        checked as a step's would be, all of them or none (raises); returns the count.
        Attaches to the segment the steps named, as a step would (``_follow_segment``)."""
        if self.receiver is None:
            return 0
        self._follow_segment(segment_name, generation)
        return self.receiver.acknowledge_unread(descriptors)

    def _check_encoder_payloads(self, step: StepInput,
                                new_states: dict[str, RequestState]) -> None:
        for rid, indices in step.scheduled_encoder_inputs.items():
            state = new_states.get(rid) or self.requests[rid]
            for i in indices:
                data = state.features[i].data
                if not isinstance(data, MultiModalKwargsItem) or not {
                        PIXEL_VALUES, IMAGE_GRID_THW} <= data.keys():
                    raise InvalidInput(f"request {rid}: feature {i} is scheduled for the "
                                       f"encoder without {PIXEL_VALUES} and {IMAGE_GRID_THW}",
                                       reason="MISSING_ENCODER_INPUT")

    def _run_encoder(self, step: StepInput) -> int:
        runs = 0
        for rid, indices in step.scheduled_encoder_inputs.items():
            for i in indices:
                f = self.requests[rid].features[i]
                if f.identifier in self.encoder_cache:  # same image, encoded earlier
                    continue
                assert isinstance(f.data, MultiModalKwargsItem)
                _, h, w = (int(x) for x in f.data[IMAGE_GRID_THW].data[0])
                pixels = f.data[PIXEL_VALUES].data.to(self.device, non_blocking=True)
                self.encoder_cache.put(f.identifier, self.model.encode_image(pixels, h, w))
                runs += 1
        return runs

    def _forward_and_sample(self, step: StepInput
                            ) -> tuple[dict[str, list[int]], dict[str, list[Logprobs]]]:
        order = [r.request_id for r in step.new_requests] + [
            r.request_id for r in step.cached_requests]
        scheduled = [(self.requests[rid], step.num_scheduled_tokens[rid]) for rid in order]
        if not scheduled:  # a step that only releases state
            return {}, {}
        batch = build_batch(scheduled, self.encoder_cache, self.model.block_size, self.device)
        logits = self.model(batch.inputs)
        masks = step.token_masks
        if step.deferred_masks is not None:  # the forward runs on while the host waits
            masks = {**masks, **step.deferred_masks.wait()}
        tokens, logprobs = self._sample(logits, batch.sampling, masks)
        for state, n in scheduled:
            state.num_computed_tokens += n
        for state, token in zip(batch.sampling, tokens, strict=True):
            state.append_output(token)
        for state, _ in scheduled:
            state.drop_covered_payloads()
        return ({s.request_id: [t] for s, t in zip(batch.sampling, tokens, strict=True)},
                logprobs)

    def _sample(self, logits: torch.Tensor, states: list[RequestState],
                token_masks: dict[str, bytes]) -> tuple[list[int], dict[str, list[Logprobs]]]:
        """The order of :mod:`worker_svc.sampler`; ``logits`` stay raw for the logprobs."""
        if not states:
            return [], {}
        dev = logits.device
        params = [s.sampling for s in states]
        masked = self._mask_stops(self._constrain(logits, states, token_masks), states)
        tokens = self._draw(self._penalised(masked, states), states)
        wanted = [i for i, p in enumerate(params) if p.logprobs]
        if not wanted:
            return tokens.tolist(), {}  # the step's one host sync
        rows = torch.tensor(wanted, device=dev)
        k = max(params[i].top_logprobs for i in wanted)
        chosen, top_ids, top = token_logprobs(logits[rows], tokens[rows], k)
        # Everything is queued before the first read, so the reads wait once, together.
        host_tokens, chosen_l, ids_l, top_l = (
            tokens.tolist(), chosen.tolist(), top_ids.tolist(), top.tolist())
        logprobs = {}
        for j, i in enumerate(wanted):
            n = params[i].top_logprobs
            logprobs[states[i].request_id] = [Logprobs(chosen_l[j], ids_l[j][:n], top_l[j][:n])]
        return host_tokens, logprobs

    def _draw(self, logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        """Tokens (R,) from processed logits; the work no row needs is skipped (an all-greedy
        step draws nothing, filters that every row has off are not run)."""
        params = [s.sampling for s in states]
        if all(p.temperature <= 0 for p in params):
            return logits.argmax(dim=-1)
        dev = logits.device

        def per_row(values: list, dtype: torch.dtype, off: object) -> torch.Tensor | None:
            return (None if all(v == off for v in values)
                    else torch.tensor(values, device=dev, dtype=dtype))

        return sample(
            logits,
            temperature=torch.tensor([p.temperature for p in params], device=dev),
            top_k=per_row([max(p.top_k, 0) for p in params], torch.int64, 0),
            top_p=per_row([p.top_p for p in params], torch.float32, 1.0),
            min_p=per_row([p.min_p for p in params], torch.float32, 0.0),
            uniforms=uniform_draws([token_seed(s.seed, s.num_output_tokens) for s in states],
                                   dev),
        )

    def _constrain(self, logits: torch.Tensor, states: list[RequestState],
                   token_masks: dict[str, bytes]) -> torch.Tensor:
        """Structured output: a row with a mask samples only the tokens it allows. A new
        tensor: the raw logits stay for the logprobs."""
        masks = {r: token_masks[s.request_id] for r, s in enumerate(states)
                 if s.request_id in token_masks}
        if not masks:
            return logits
        refused = refused_tokens(masks, len(states), logits.shape[-1], logits.device)
        # where, not masked_fill: a bool-masked fill of a (16, 152k) float32 tensor costs
        # ~3x as much on CPU
        return torch.where(refused, float("-inf"), logits)

    def _mask_stops(self, logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        """min_tokens: rows short of their minimum cannot sample EOS (unless ignore_eos)
        nor their stop ids. A new tensor: the raw logits stay for the logprobs."""
        rows: list[int] = []
        ids: list[int] = []
        for r, s in enumerate(states):
            p = s.sampling
            if s.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (
                    set() if p.ignore_eos else set(self.config.eos_token_ids))
                rows += [r] * len(stops)
                ids += sorted(stops)
        if not rows:
            return logits
        index = (torch.tensor(rows, device=logits.device),
                 torch.tensor(ids, device=logits.device))
        return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))

    def _penalised(self, logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        """Presence, frequency and repetition penalties on the rows that have any."""
        rows = [r for r, s in enumerate(states) if s.sampling.has_penalties]
        if not rows:
            return logits
        dev, vocab = logits.device, logits.shape[-1]
        counts = [states[r].token_counts(vocab, dev) for r in rows]
        params = [states[r].sampling for r in rows]
        index = torch.tensor(rows, device=dev)
        penalised = apply_penalties(
            logits[index],
            prompt_mask=torch.stack([c.prompt_mask for c in counts]),  # (P, V)
            output_counts=torch.stack([c.output_counts for c in counts]),  # (P, V)
            presence=torch.tensor([p.presence_penalty for p in params], device=dev),
            frequency=torch.tensor([p.frequency_penalty for p in params], device=dev),
            repetition=torch.tensor([p.repetition_penalty for p in params], device=dev),
        )
        return logits.index_copy(0, index, penalised)

    def warm_up(self) -> None:
        """Run one tiny request through every stage (encoder, forward, sampler), then release it.

        The tokens are the model's own: its BOS (token 0 when it has none), then one image
        placeholder when it takes images. It writes block 0 and no request is harmed: a
        slot is always written by the step that computes its token before any request
        reads it.
        """
        rid, c = "__warmup__", self.config
        tokens = [c.bos_token_id if c.bos_token_id is not None else 0]
        features, encoder_inputs = [], {}
        if c.image_token_id is not None:
            image = synthetic_image(c, c.merge_size, c.merge_size, seed=0)
            features = [MultiModalFeatureSpec(rid, "image", PlaceholderRange(1, 1), image)]
            tokens.append(c.image_token_id)
            encoder_inputs = {rid: [0]}
        blocks = list(range(-(-len(tokens) // self.model.block_size)))
        req = NewRequestData(rid, tokens, len(tokens), features, SamplingParams(), blocks, 0)
        self.step(StepInput(0, new_requests=[req], num_scheduled_tokens={rid: len(tokens)},
                            scheduled_encoder_inputs=encoder_inputs))
        self.step(StepInput(0, free_encoder_mm_hashes=[f.identifier for f in features],
                            finished_request_ids=[rid]))

    def check_invariants(self) -> None:
        for state in self.requests.values():
            state.check_invariants(self.model.block_size, self.model.num_blocks)
        self.encoder_cache.check_invariants()
