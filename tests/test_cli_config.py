"""Flags and TANDEM_* variables reach the scheduler's configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_svc.config import SchedulerConfig
from tandem_cli.cli import _scheduler_config, build_parser, main


def test_limit_flags_reach_the_scheduler_config() -> None:
    args = build_parser().parse_args([
        "scheduler", "--max-images", "2", "--max-image-bytes", "1Mi", "--max-prompt-tokens",
        "100", "--max-tokens-limit", "50", "--default-max-tokens", "7", "--min-pixels", "1000",
        "--max-pixels", "9000", "--encoder-cache-size", "99", "--step-timeout", "3.5",
        "--max-waiting-requests", "3", "--max-waiting-image-bytes", "2Mi"])
    c = _scheduler_config(args, ["unix:///tmp/w.sock"])
    assert (c.max_waiting_requests, c.max_waiting_image_bytes) == (3, 2 * 2**20)
    assert (c.limits.max_images, c.limits.max_image_bytes, c.limits.max_prompt_tokens) == (
        2, 2**20, 100)
    assert (c.limits.max_tokens, c.limits.default_max_tokens) == (50, 7)
    assert (c.min_pixels, c.max_pixels, c.encoder_cache_embeds, c.step_timeout_s) == (
        1000, 9000, 99, 3.5)


def test_environment_sets_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_MAX_IMAGES", "3")
    monkeypatch.setenv("TANDEM_MM_CACHE", "lru")
    monkeypatch.setenv("TANDEM_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("TANDEM_MAX_WAITING_REQUESTS", "9")
    monkeypatch.setenv("TANDEM_MAX_WAITING_IMAGE_BYTES", "1Gi")
    c = _scheduler_config(build_parser().parse_args(["scheduler"]), ["unix:///tmp/w.sock"])
    assert (c.limits.max_images, c.mm_cache, c.enable_prefix_caching) == (3, "lru", False)
    assert (c.max_waiting_requests, c.max_waiting_image_bytes) == (9, 2**30)
    flag = build_parser().parse_args(["scheduler", "--max-images", "5"])
    assert _scheduler_config(flag, ["unix:///tmp/w.sock"]).limits.max_images == 5


def test_images_larger_than_the_encoder_budget_are_refused_at_start() -> None:
    SchedulerConfig().check_image_budget(28)  # defaults: 256-token images fit
    with pytest.raises(ValueError, match="--max-pixels 1000000 allows images of 1275 tokens"):
        SchedulerConfig(max_pixels=1_000_000).check_image_budget(28)


def test_sizes_take_the_common_spellings_and_a_bad_one_lists_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["scheduler", "--mm-cache-size", "16MiB",
                                      "--max-image-bytes", "2MB"])
    c = _scheduler_config(args, ["unix:///tmp/w.sock"])
    assert (c.mm_cache_size, c.limits.max_image_bytes) == (16 * 2**20, 2 * 10**6)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--mm-cache-size", "16MiX"])
    err = capsys.readouterr().err
    assert "invalid size '16MiX'" in err and "Mi, Gi" in err and "MiB" in err
    assert "invalid size_arg value" not in err


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["serve", "--help"], ["traces", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        out = capsys.readouterr().out
        assert "`" not in out, f"reStructuredText markup in tandem {' '.join(argv)}"


def test_a_bad_model_directory_fails_serve_at_start_with_the_file_and_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mamba"}')
    shm = tmp_path / "shm"
    assert main(["serve", "--model", str(model), "--shm-dir", str(shm)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem serve: error: ") and "Traceback" not in err
    assert f"{model / 'config.json'}: key 'model_type' is 'mamba'" in err
    assert not list(shm.glob("*.sock")), "no worker was started"


def test_the_removed_router_says_where_to_go(capsys: pytest.CaptureFixture[str]) -> None:
    """Old scripts, with the router's flags, get one line and exit status 2."""
    assert main(["router", "--cells", "a:1,b:2", "--load-factor", "1.5"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "tandem router was removed in favour of `tandem gateway`" in captured.err
    assert "docs/routing.md" in captured.err
