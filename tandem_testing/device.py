"""Where the model-equivalence tests run Tandem's model, and how closely it must agree.

CPU and float32 unless ``TANDEM_TEST_DEVICE`` and ``TANDEM_TEST_DTYPE`` say otherwise
(``bench/gpu_check.sh`` sets ``cuda`` and ``bfloat16``). References stay what each test
makes them (transformers in float32 on CPU, or the test's own uncached forward of the same
model), so in bfloat16 a comparison measures Tandem's rounding, not only summation order.

Rules (``assert_greedy_close``): in float32 the greedy ids are equal and every logits row is
within the test's own ``atol``. In a reduced dtype the ids are equal up to the first one
that differs, and there the reference must be at a near-tie: its logits of the token it
chose and of the one Tandem chose differ by at most twice the bf16 tolerance (each side
within the tolerance of the other). Logits rows are compared up to that position only
(later rows follow different prefixes). The bf16 tolerance is ``BF16_LOGITS_REL`` of the
reference's largest logit magnitude, measured in ``docs/benchmarks.md`` (GPU check).
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("TANDEM_TEST_DEVICE", "cpu"))
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_dtype_name = os.environ.get("TANDEM_TEST_DTYPE", "float32")
if _dtype_name not in _DTYPES:
    raise ValueError(f"TANDEM_TEST_DTYPE {_dtype_name!r} is not one of {', '.join(_DTYPES)}")
DTYPE = _DTYPES[_dtype_name]
REDUCED = _dtype_name != "float32"
# A fraction of the reference's largest |logit|: bf16 keeps 8 significant bits (relative
# step 2^-8 ~ 0.004) and every layer rounds its inputs, weights and outputs again. Measured
# in bf16 on CPU against float32 references: at most 0.012 (tests/test_hf_model.py and
# tests/test_model_equivalence.py, every logits row); 0.03 leaves room for CUDA's kernels.
BF16_LOGITS_REL = 0.03


def tolerance(fp32_atol: float, reference: torch.Tensor, dtype: torch.dtype = DTYPE) -> float:
    """The test's float32 ``atol``, or in a reduced dtype ``BF16_LOGITS_REL`` of the
    reference's largest magnitude (logits, or the vision tower's embeddings)."""
    if dtype == torch.float32:
        return fp32_atol
    return BF16_LOGITS_REL * float(reference.abs().max())


def assert_greedy_close(ids: list[int], ref_ids: list[int], ref_logits: torch.Tensor,
                        fp32_atol: float, logits: torch.Tensor | None = None,
                        dtype: torch.dtype = DTYPE) -> None:
    """Tandem's greedy ``ids`` (and the ``logits`` rows that chose them, when the test has
    them) against a reference's, by the rules in the module docstring for ``dtype``."""
    ref_logits = ref_logits.float().cpu()
    atol = tolerance(fp32_atol, ref_logits, dtype)
    if dtype == torch.float32:
        assert ids == ref_ids
        upto = len(ref_ids)
    else:
        assert len(ids) == len(ref_ids), (ids, ref_ids)
        upto = next((i for i, (a, b) in enumerate(zip(ids, ref_ids, strict=True)) if a != b),
                    len(ref_ids))
        if upto < len(ref_ids):
            row = ref_logits[upto]
            gap = float(row[ref_ids[upto]] - row[ids[upto]])
            assert gap <= 2 * atol, (
                f"token {upto}: Tandem chose {ids[upto]}, the reference {ref_ids[upto]} "
                f"with a lead of {gap:.4f} > 2 x {atol:.4f}: no near-tie ({ids} vs {ref_ids})")
            upto += 1
    if logits is not None:
        torch.testing.assert_close(logits.float().cpu()[:upto], ref_logits[:upto], atol=atol,
                                   rtol=0)
