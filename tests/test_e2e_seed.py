"""The seed scenario on a real local cell: the same image and prompt twice, with prefix
caching and the SHM processor cache both on (the crash this project exists to prevent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem_testing.cells import png, running_cell

PROMPT = "Describe this picture: <image> in a few words, please, and be brief about it."


@pytest.mark.parametrize(
    ("flags", "prompt"),
    [
        pytest.param((), PROMPT, id="rope-1-worker"),
        pytest.param(("--workers", "2"), PROMPT, id="rope-2-workers"),
        pytest.param(("--model", "tiny-mrope"), PROMPT, id="mrope"),
        pytest.param((), "A long preamble that fills some blocks first, then <image>",
                     id="image-at-end"),
    ],
)
def test_same_image_and_prompt_twice(tmp_path: Path, flags: tuple[str, ...], prompt: str) -> None:
    image = png(1)
    with running_cell(tmp_path, *flags) as cell:
        ids1, text1, last1 = cell.generate(prompt, [image], max_tokens=12)
        ids2, text2, last2 = cell.generate(prompt, [image], max_tokens=12)
        u1, u2 = last1.usage, last2.usage
        assert ids1 == ids2 and text1 == text2, "greedy outputs must be identical"
        assert len(ids1) == u1.completion_tokens > 0
        assert (u1.mm_items, u1.mm_cache_hits, u1.encoder_runs) == (1, 0, 1)
        assert u1.cached_prompt_tokens == 0
        assert u2.cached_prompt_tokens > 0 and u2.mm_cache_hits == 1
        image_at_end = prompt.endswith("<image>")
        # An image ending the prompt is never fully covered (the last block is recomputed),
        # but its embeddings are still in the workers' encoder cache.
        assert u2.encoder_runs == 0
        if not image_at_end:
            assert u2.cached_prompt_tokens >= u2.prompt_tokens - 16
        stats = cell.stats()
        assert stats.shm_unacked_refs == 0
        assert stats.mm_cache_hits_total == 1 and stats.mm_cache_misses_total == 1
        assert stats.shm_objects == 1 and stats.prefix_cache_blocks > 0
        assert stats.kv_blocks_free == stats.kv_blocks_total
    assert cell.proc.returncode == 0
    assert not cell.shm_dir.exists(), "the segment and its directory are removed on exit"
