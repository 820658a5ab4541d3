"""A stored block's payload (store/detector_blocks.py encode/decode) gives back every array as it
was: dtype, shape and values (NaN, strings, empty arrays), read-only; and a payload stored before
this format (an .npz) still loads."""

from __future__ import annotations

import io

import numpy as np
import pytest

from trainvitals.service.store import detector_blocks


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    timing = rng.random((5, 7))
    timing[1, 2] = np.nan
    return {
        "steps": np.arange(100, 105, dtype=np.int64),
        "step_seconds": timing,
        "every_other": timing[:, ::2],  # not contiguous
        "tensor": np.array(["layers.0.fc", "layers.10.attn.qkv"], dtype=str),
        "shadow": np.array([True, False]),
        "count": np.array([3, 0], dtype=np.int32),
        "none": np.empty(0),
        "no_rows": np.empty((0, 7)),
    }


def _assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        assert np.array_equal(got[name], a, equal_nan=a.dtype.kind == "f"), name


def test_every_array_reads_back_as_written() -> None:
    payload = detector_blocks.encode(_arrays())
    got = detector_blocks.decode(payload)
    _assert_equal(got, _arrays())
    with pytest.raises(ValueError, match="read-only"):
        got["step_seconds"][0, 0] = 0.0
    assert detector_blocks.decode(detector_blocks.encode({})) == {}


def test_a_payload_stored_as_npz_still_loads() -> None:
    buf = io.BytesIO()
    np.savez(buf, **_arrays())  # type: ignore[arg-type]
    _assert_equal(detector_blocks.decode(buf.getvalue()), _arrays())


def test_object_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="'names' holds Python objects"):
        detector_blocks.encode({"names": np.array(["a", None], dtype=object)})
