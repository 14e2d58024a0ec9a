"""What can be checked of the GPU check (bench/gpu_check.sh) without a GPU: the script parses,
its requirements cover what `tandem serve` needs, and the bf16 comparison rules the
model-equivalence tests use there (tandem_testing/device.py) pass a near-tie and refuse
a real disagreement."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tandem_testing.device import BF16_LOGITS_REL, assert_greedy_close

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(REPO / "bench" / "gpu_check.sh")], check=True)


def test_requirements_cover_every_runtime_dependency_but_the_operators() -> None:
    """A runtime dependency added to the project and not to the GPU check's list would be
    missing there, where nothing can be downloaded."""
    chosen = subprocess.run(  # as bench/gpu_check.py prepare runs it
        [sys.executable, str(REPO / "docker" / "requirements.py"), "--gpu-check",
         str(REPO / "pyproject.toml")], capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    names = {canonicalize_name(Requirement(r).name) for r in chosen}
    runtime = {canonicalize_name(Requirement(r).name)
               for r in PYPROJECT["project"]["dependencies"]}
    assert runtime - names == {"kopf", "kubernetes"}  # the operator's: tandem serve needs neither
    assert {"pytest", "transformers"} <= names
    assert set(chosen) <= {*PYPROJECT["project"]["dependencies"],
                           *PYPROJECT["project"]["optional-dependencies"]["dev"]}


def test_bf16_rules_allow_a_near_tie_only() -> None:
    # The reference chose token 1 at step 1 by 0.01 (scale 4: bf16 tolerance 0.12).
    ref_ids, ref = [0, 1, 2], torch.tensor([[4.0, 1.0, 0.0], [0.0, 2.01, 2.0],
                                         [0.0, 0.0, 3.0]])
    ours = ref + 0.05
    assert_greedy_close([0, 2, 1], ref_ids, ref, 1e-4, ours, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):  # float32: the same ids, always
        assert_greedy_close([0, 2, 1], ref_ids, ref, 1e-4, ours, dtype=torch.float32)
    far = ref.clone()
    far[1, 1] = 3.0  # the reference's lead is 1.0: no near-tie
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_greedy_close([0, 2, 1], ref_ids, far, 1e-4, dtype=torch.bfloat16)
    off = ours.clone()
    off[0, 0] += 2 * BF16_LOGITS_REL * 4.0  # logits off by twice the tolerance
    with pytest.raises(AssertionError):
        assert_greedy_close(ref_ids, ref_ids, ref, 1e-4, off, dtype=torch.bfloat16)
