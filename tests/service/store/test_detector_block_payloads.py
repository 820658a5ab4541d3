"""A stored block's payload (store/detector_blocks.py encode/decode) gives back every array as it
was: dtype, shape and values (NaN, strings, empty arrays), read-only, whether stored as it is or
packed (mostly-NaN floats, integers of a narrow range); and payloads stored before this format (the
first unpacked layout, an .npz before it) still load."""

from __future__ import annotations

import io
import json

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
        # Packed: a tensor block's step column (spans 1,000 steps) and its expensive-step columns.
        "tensor_steps": np.tile(np.arange(19_000, 20_000, dtype=np.int64), 3),
        "sat_frac": np.where(np.arange(3_000) % 200 == 0, rng.random(3_000), np.nan),
        "sat_frac_f32": np.where(np.arange(64) == 5, np.float32(-0.0), np.float32(np.nan)).astype(np.float32),
        "all_nan": np.full((4, 16), np.nan),
        "negative": np.arange(-40, -8, dtype=np.int64),
        "wide_ints": np.array([-(2**63)] + [2**63 - 1] * 20, dtype=np.int64),
        "huge_unsigned": np.full(20, 2**64 - 1, dtype=np.uint64),
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
    for name in ("step_seconds", "sat_frac", "tensor_steps"):  # raw, sparse, narrow
        with pytest.raises(ValueError, match="read-only"):
            got[name][0] = 0
    assert detector_blocks.decode(detector_blocks.encode({})) == {}


def test_mostly_nan_floats_and_narrow_integers_are_packed() -> None:
    """What a restart loads is the payload: a tensor block's step and expensive-step columns take a
    fraction of their raw bytes, and its dense columns stay views into the payload (no copy)."""
    n = 384 * 1_000
    steps = np.tile(np.arange(19_000, 20_000, dtype=np.int64), 384)
    expensive = np.where(steps % 200 == 0, 0.001, np.nan)
    block = {"c0": steps, "c1": np.linspace(1, 4, n), "c4": expensive, "c5": expensive, "c6": expensive}
    payload = detector_blocks.encode(block)
    assert len(payload) < 8 * n * 1.3  # raw: 5 x 8 bytes a row; packed: ~8 (c1) + 2 (c0) + ~0.06 x 3
    got = detector_blocks.decode(payload)
    _assert_equal(got, block)
    assert got["c1"].base is not None and not got["c1"].flags.owndata


def _v1_payload(arrays: dict[str, np.ndarray]) -> bytes:
    """A payload as the first unpacked layout wrote it (magic TVB1; header [dtype, shape, offset])."""
    header, body = {}, b""
    for name, a in arrays.items():
        header[name] = (a.dtype.str, list(a.shape), len(body))
        data = np.ascontiguousarray(a).tobytes()
        body += data + bytes(-len(data) % 64)
    head = json.dumps(header).encode()
    front = b"TVB1" + len(head).to_bytes(4, "little") + head
    return front + bytes(-len(front) % 64) + body


def test_a_payload_of_the_first_layout_still_loads() -> None:
    _assert_equal(detector_blocks.decode(_v1_payload(_arrays())), _arrays())


def test_a_payload_stored_as_npz_still_loads() -> None:
    buf = io.BytesIO()
    np.savez(buf, **_arrays())  # type: ignore[arg-type]
    _assert_equal(detector_blocks.decode(buf.getvalue()), _arrays())


def test_object_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="'names' holds Python objects"):
        detector_blocks.encode({"names": np.array(["a", None], dtype=object)})
