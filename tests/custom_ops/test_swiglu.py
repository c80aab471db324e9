"""SwiGLU (CPU): against torch's F.silu(gate) * up in the op dtype, row invariance, and the error
for an odd gate|up width."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.custom_ops.fused_reference import assert_close, swiglu, to_torch
from tests.custom_ops.ops_models import as_dtype, session, swiglu_model

DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_reference(library: Path, dtype: str) -> None:
    rng = np.random.default_rng(DTYPES.index(dtype))
    for I in (1, 8, 11, 1408):
        gate_up = as_dtype(3 * rng.standard_normal((2, 5, 2 * I)), dtype)  # silu's tails and its middle
        got = session(swiglu_model(2 * I, dtype), library).run(None, {"gate_up": gate_up})[0]
        assert got.shape == (2, 5, I)
        assert_close(to_torch(got, dtype), swiglu(to_torch(gate_up, dtype)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_number_of_rows(library: Path, dtype: str) -> None:
    rng = np.random.default_rng(8)
    sess = session(swiglu_model(2 * 96, dtype), library)
    gate_up = as_dtype(rng.standard_normal((1, 7, 2 * 96)), dtype)
    many = sess.run(None, {"gate_up": gate_up})[0]
    for i in range(7):
        assert np.array_equal(many[:, i : i + 1], sess.run(None, {"gate_up": gate_up[:, i : i + 1]})[0]), i


def test_odd_width_is_an_error(library: Path) -> None:
    with pytest.raises(
        Exception,
        match=r"SwiGLU: gate_up must be \[\.\.\., 2\*I\] \(gate \| up\) with an even last "
        r"dim, got \[1, 2, 7\]",
    ):
        session(swiglu_model("W", "float32"), library).run(None, {"gate_up": np.zeros((1, 2, 7), np.float32)})
