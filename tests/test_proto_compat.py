"""proto/ passes ``buf lint`` and stays backward compatible (``buf breaking``, FILE rules).

buf comes from npm (``@bufbuild/buf``, pinned below), installed into the gitignored
``.cache/buf`` by .ci/run or, failing that, by this test; the test skips only where npm
itself is missing. The breaking check compares the working tree's proto/ against two
copies taken from the git history: HEAD (an uncommitted edit that breaks the API fails
here before it is committed) and ``BASELINE``, the API as it stood before the sampling
and model-info additions of issue 15, so that everything clients had then keeps working.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BUF_VERSION = "1.75.0"
BUF_PREFIX = ROOT / ".cache" / "buf"
BUF = BUF_PREFIX / "node_modules" / ".bin" / "buf"
# The last commit before issue 15 changed the protos.
BASELINE = "649cb3c"
# SamplingParams numbers 8..15 were reserved for logprobs and string stop sequences, and
# issue 15 gave them those fields; buf's RESERVED_MESSAGE_NO_DELETE flags any use of a
# reserved number, so this comparison alone (not buf.yaml) waives it for that file.
BASELINE_WAIVER = {"RESERVED_MESSAGE_NO_DELETE": ["tandem/v1/generate.proto"]}


@pytest.fixture(scope="module")
def buf() -> Path:
    if not (BUF.exists() and _version(BUF) == BUF_VERSION):
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: cannot install buf")
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(BUF_PREFIX),
                        f"@bufbuild/buf@{BUF_VERSION}"], check=True, capture_output=True,
                       timeout=300)
    assert _version(BUF) == BUF_VERSION
    return BUF


def _version(buf: Path) -> str:
    if not buf.exists():
        return ""
    return subprocess.run([str(buf), "--version"], capture_output=True, text=True,
                          check=False).stdout.strip()


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT / "proto", capture_output=True, text=True,
                          timeout=120, check=False)


def _proto_at(ref: str, dest: Path) -> Path:
    """proto/ as committed at ``ref``, extracted under ``dest``."""
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{ref}^{{commit}}"],
                           capture_output=True, check=False)
    assert known.returncode == 0, (
        f"commit {ref} is not in this checkout's history; fetch it (a shallow clone lacks it)")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "proto"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "proto"


def _config(extra_ignore_only: dict[str, list[str]]) -> str:
    """buf.yaml of proto/ as JSON, with ``extra_ignore_only`` added to its breaking rules."""
    config = yaml.safe_load((ROOT / "proto" / "buf.yaml").read_text())
    config["breaking"]["ignore_only"] = extra_ignore_only
    return json.dumps(config)


def test_buf_lint(buf: Path) -> None:
    out = _run([str(buf), "lint"])
    assert out.returncode == 0, out.stdout + out.stderr


def test_buf_breaking_against_head(buf: Path, tmp_path: Path) -> None:
    out = _run([str(buf), "breaking", "--against", str(_proto_at("HEAD", tmp_path))])
    assert out.returncode == 0, out.stdout + out.stderr


def test_buf_breaking_against_the_api_before_issue_15(buf: Path, tmp_path: Path) -> None:
    against = _proto_at(BASELINE, tmp_path)
    out = _run([str(buf), "breaking", "--against", str(against),
                "--config", _config(BASELINE_WAIVER)])
    assert out.returncode == 0, out.stdout + out.stderr
    # The waiver is needed, and waives nothing but the reserved range's use.
    strict = _run([str(buf), "breaking", "--against", str(against)])
    lines = strict.stdout.splitlines()
    assert strict.returncode != 0 and lines, strict.stdout + strict.stderr
    assert all('reserved range "[8,15]" on message "SamplingParams"' in line
               for line in lines), strict.stdout


def test_buf_breaking_catches_a_removed_field(buf: Path, tmp_path: Path) -> None:
    """The check can fail: renumbering a field of the working tree's API is flagged."""
    edited = tmp_path / "edited"
    shutil.copytree(ROOT / "proto", edited)
    proto = edited / "tandem" / "v1" / "generate.proto"
    text = proto.read_text()
    assert "float min_p = 16;" in text
    proto.write_text(text.replace("float min_p = 16;", "float min_p = 99;"))  # a free number
    out = subprocess.run([str(buf), "breaking", "--against", str(ROOT / "proto")], cwd=edited,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0 and "min_p" in out.stdout, out.stdout + out.stderr
