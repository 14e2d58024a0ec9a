"""Cache pressure in a real cell: a segment that refuses objects (over the max object size,
or full with everything pinned) and a KV pool small enough that concurrent long requests
preempt each other. Requests must still succeed with the same greedy outputs, the refusals
are counted and logged, and nothing leaks.
"""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem_testing.cells import Cell, free_port, png, running_cell

SMALL = (112, 84)  # 48 patches: ~113 KB processed, fits the segment
BIG = (224, 224)  # 256 patches: ~602 KB processed, over the max object size


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cell]:
    metrics = free_port()
    with running_cell(tmp_path_factory.mktemp("pressure"), "--kv-cache-size", "1Mi",
                      "--mm-cache-size", "200Ki", "--mm-cache-max-object-size", "200Ki",
                      "--metrics-port", str(metrics), "--log-level", "INFO") as c:
        c.metrics_port = metrics  # type: ignore[attr-defined]
        yield c


def _log(cell: Cell) -> str:
    return (Path(cell.shm_dir).parent / "cell.log").read_text()


def _refused(cell: Cell) -> dict[str, float]:
    """tandem_mm_cache_refused_total by reason, from the scheduler's /metrics."""
    url = f"http://127.0.0.1:{cell.metrics_port}/metrics"  # type: ignore[attr-defined]
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(
        r'^tandem_mm_cache_refused_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def _assert_clean(cell: Cell) -> None:
    stats = cell.stats()
    assert stats.shm_unacked_refs == 0 and stats.kv_blocks_free == stats.kv_blocks_total, stats
    assert stats.shm_used_bytes <= stats.shm_capacity_bytes


def test_object_over_the_max_size_travels_inline(cell: Cell) -> None:
    big = png(5, *BIG)
    before = _refused(cell).get("oversize", 0)
    first = cell.generate("Big <image> here.", [big], max_tokens=6)
    again = cell.generate("Big <image> here.", [big], max_tokens=6)
    assert first[0] == again[0]
    assert first[2].usage.mm_items == 1 and again[2].usage.mm_cache_hits == 0
    assert _refused(cell)["oversize"] == before + 2
    assert re.search(r"sent inline: segment refused it \(oversize, \d+ bytes\)", _log(cell))
    assert cell.stats().shm_objects == 0
    _assert_clean(cell)


def test_full_segment_with_everything_pinned_travels_inline(cell: Cell) -> None:
    """The segment holds one small image; a request with two new ones pins the first while
    storing the second, so the second is refused (full) and sent by value."""
    images = [png(20, *SMALL), png(21, *SMALL)]
    before = _refused(cell).get("full", 0)
    ids, _, last = cell.generate("Two: <image> and <image>.", images, max_tokens=6)
    assert last.usage.mm_items == 2 and len(ids) == 6
    assert _refused(cell)["full"] == before + 1
    assert re.search(r"sent inline: segment refused it \(full, \d+ bytes\)", _log(cell))
    assert cell.stats().shm_objects == 1
    # The same request again: the first image hits, the second is refused again.
    assert cell.generate("Two: <image> and <image>.", images, max_tokens=6)[0] == ids
    _assert_clean(cell)


def test_concurrent_long_requests_preempt_and_resume(cell: Cell) -> None:
    """A 32-block pool and requests whose outputs outgrow it: the most recent ones are
    preempted, some after their covered image was stripped, and recomputed later."""
    prompts = [(f"Story {n % 2}: <image> and then a long tale.", png(30 + n % 2, *BIG))
               for n in range(5)]
    expected = [cell.generate(p, [im], max_tokens=60, ignore_eos=True)[0]
                for p, im in prompts[:2]]
    preemptions = _log(cell).count("preempting request")
    results: dict[int, list[int]] = {}

    def client(n: int) -> None:
        prompt, image = prompts[n]
        results[n] = cell.generate(prompt, [image], max_tokens=60, ignore_eos=True)[0]

    threads = [threading.Thread(target=client, args=(n,)) for n in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert _log(cell).count("preempting request") > preemptions
    assert all(results[n] == expected[n % 2] for n in range(5)), results
    _assert_clean(cell)
