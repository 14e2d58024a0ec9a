"""The descriptor that travels from the writer to every reader instead of the bytes."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShmDescriptor:
    """Names one object of one segment generation and the references it stands for.

    It carries everything a reader needs to acknowledge it: the reader adds `refs` to its
    own ack counter of the chunk, so no reader has to guess how many references the writer
    took for a delivery (the flaw of vLLM's shared reader counter).
    """

    generation: int
    """Segment generation: random nonzero u64 chosen when the writer created the segment."""
    address: int
    """Byte offset of the chunk from the start of the data area (64-byte aligned)."""
    monotonic_id: int
    """Id stamped in the chunk header; never repeats within a generation."""
    refs: int
    """Writer references this descriptor stands for (1 per delivery normally)."""
    nbytes: int
    """Payload length in bytes."""
