"""Worker side of the shared segment: resolve address items and acknowledge them.

Each worker is one reader slot (its rank). The worker's part of the delivery obligation
(stated in ``scheduler_svc/delivery.py``): every address item of an accepted step is
acknowledged, whether or not its payload is read, and only once the whole step was
accepted (``resolve`` reads, ``acknowledge`` acks), so a refused step acknowledges nothing.
A step the worker does not run (answered ``not_run``, worker.proto) is acknowledged too,
without reading anything (``resolve(read=False)``): it arrived, and the slot is this
reader's alone, so no one else could ever settle its references. Per address item:

* ``data is None``: a stripped by-value payload; it carries no reference, so nothing is
  touched (vLLM's #54994 crash came from asserting here);
* an address item whose span the prefix cache covers: acknowledged without reading the
  payload; for M-RoPE models only the small ``keep_on_cpu`` fields are read;
* any other address item: copied out once into private tensors, then acknowledged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tandem.errors import FailedPrecondition
from tandem.feature_codec import item_from_buffer
from tandem.features import MultiModalFeatureSpec
from tandem.shm import SegmentMismatch, ShmDescriptor, ShmReader


@dataclass(frozen=True, slots=True)
class ResolvedFeatures:
    features: list[MultiModalFeatureSpec]  # data: an item or None, never an address
    resolved: int  # address items whose payload was read
    to_ack: list[ShmDescriptor] = field(default_factory=list)  # for `acknowledge`


class ShmReceiverCache:
    """Attaches to the cell's segment lazily and again whenever the writer re-creates it."""

    def __init__(self, shm_dir: str | Path, slot: int,
                 device: torch.device | None = None) -> None:
        self.shm_dir = Path(shm_dir)
        self.slot = slot
        self.device = device  # where the encoder reads pixels: copied there straight away
        self._reader: ShmReader | None = None
        self._name = ""

    @property
    def generation(self) -> int:
        return self._reader.generation if self._reader else 0

    def ensure_segment(self, name: str, generation: int) -> None:
        """Be attached to segment ``name`` of ``generation`` (no-op when already).

        The current attachment is kept when the named one does not exist or has another
        generation (a forged or stale step must not detach a worker).
        """
        if not name:
            return
        if self._reader and self._name == name and self._reader.generation == generation:
            return
        try:
            reader = ShmReader(self.shm_dir / name, self.slot)
        except SegmentMismatch as exc:  # missing, retired, or not a segment of this layout
            raise FailedPrecondition(f"cannot attach segment {name!r}: {exc}",
                                     reason="SHM_SEGMENT_MISSING") from exc
        if reader.generation != generation:
            reader.close()
            raise FailedPrecondition(
                f"segment {name!r} is generation {reader.generation}, the step expects "
                f"{generation}", reason="SHM_GENERATION_MISMATCH")
        self.close()
        self._reader, self._name = reader, name

    def resolve(self, features: Sequence[MultiModalFeatureSpec], num_computed_tokens: int,
                uses_mrope: bool, pending: Counter[int] | None = None) -> ResolvedFeatures:
        """Read what the step needs of each address item; acknowledge nothing yet.

        ``pending`` (chunk address -> refs) carries the refs earlier calls for the same step
        will acknowledge, so a descriptor repeated within a step is refused, not double
        counted; it is updated in place.
        """
        pending = Counter() if pending is None else pending
        out, resolved, to_ack = [], 0, []
        for f in features:
            if not isinstance(f.data, ShmDescriptor):
                out.append(f)
                continue
            reader = self._require_reader(f.data)
            covered = f.is_covered(num_computed_tokens)
            with reader.peek(f.data, pending[f.data.address]) as buf:
                item = None
                if not covered or uses_mrope:  # M-RoPE needs the grid when covered
                    item = item_from_buffer(buf, only_keep_on_cpu=covered, device=self.device)
            resolved += item is not None and not covered
            pending[f.data.address] += f.data.refs
            to_ack.append(f.data)
            out.append(replace(f, data=item))
        return ResolvedFeatures(out, resolved, to_ack)

    def acknowledge(self, descriptors: Sequence[ShmDescriptor]) -> int:
        """Acknowledge what :meth:`resolve` read, once the step is accepted; returns the count."""
        if descriptors:
            reader = self._require_reader(descriptors[0])
            for desc in descriptors:
                reader.ack(desc)
        return len(descriptors)

    def acknowledge_unread(self, descriptors: Sequence[ShmDescriptor]) -> int:
        """Acknowledge address items this worker will never read (a step it does not run,
        or never received): each checked as a step's would be (one repeated beyond its
        outstanding refs is refused), none read; all of them or none. Returns the count."""
        pending: Counter[int] = Counter()  # chunk address -> refs acknowledged below
        for desc in descriptors:
            with self._require_reader(desc).peek(desc, pending[desc.address]):
                pending[desc.address] += desc.refs
        return self.acknowledge(descriptors)

    def _require_reader(self, desc: ShmDescriptor) -> ShmReader:
        if self._reader is None:
            raise FailedPrecondition("address item received but no segment is attached",
                                     reason="SHM_NOT_ATTACHED")
        if desc.generation != self._reader.generation:
            raise FailedPrecondition(
                f"address item of segment generation {desc.generation}, attached to "
                f"{self._reader.generation}", reason="SHM_GENERATION_MISMATCH")
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
            self._name = ""
