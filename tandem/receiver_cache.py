"""Worker side of the shared segment: resolve address items and acknowledge them.

Each worker is one reader slot (its rank). For every new request it receives, every
address item is acknowledged exactly once, whether or not its payload is read:

* ``data is None``: a stripped by-value payload; it carries no reference, so nothing is
  touched (vLLM's #54994 crash came from asserting here);
* an address item whose span the prefix cache covers: acknowledged without reading the
  payload; for M-RoPE models only the small ``keep_on_cpu`` fields are read;
* any other address item: copied out once into private tensors, then acknowledged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.errors import FailedPrecondition
from tandem.feature_codec import item_from_buffer
from tandem.features import MultiModalFeatureSpec
from tandem.shm import SegmentMismatch, ShmDescriptor, ShmReader


@dataclass(frozen=True, slots=True)
class ResolvedFeatures:
    features: list[MultiModalFeatureSpec]  # data: an item or None, never an address
    resolved: int  # address items whose payload was read
    acked: int  # address items acknowledged (read or not)


class ShmReceiverCache:
    """Attaches to the cell's segment lazily and again whenever the writer re-creates it."""

    def __init__(self, shm_dir: str | Path, slot: int) -> None:
        self.shm_dir = Path(shm_dir)
        self.slot = slot
        self._reader: ShmReader | None = None
        self._name = ""

    @property
    def generation(self) -> int:
        return self._reader.generation if self._reader else 0

    def ensure_segment(self, name: str, generation: int) -> None:
        """Be attached to segment ``name`` of ``generation`` (no-op when already)."""
        if not name:
            return
        if self._reader and self._name == name and self._reader.generation == generation:
            return
        self.close()
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
        self._reader, self._name = reader, name

    def resolve(self, features: Sequence[MultiModalFeatureSpec], num_computed_tokens: int,
                uses_mrope: bool) -> ResolvedFeatures:
        out, resolved, acked = [], 0, 0
        for f in features:
            if not isinstance(f.data, ShmDescriptor):
                out.append(f)
                continue
            reader = self._require_reader(f.data)
            if f.is_covered(num_computed_tokens) and not uses_mrope:
                reader.ack(f.data)
                out.append(replace(f, data=None))
            else:
                only_cpu = f.is_covered(num_computed_tokens)
                with reader.view(f.data) as buf:
                    item = item_from_buffer(buf, only_keep_on_cpu=only_cpu)
                resolved += not only_cpu
                out.append(replace(f, data=item))
            acked += 1
        return ResolvedFeatures(out, resolved, acked)

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
