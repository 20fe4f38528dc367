"""Per-row record packing (pure numpy, runs in CI without a GPU)."""

import numpy as np
import pytest

from flashnext.errors import FormatError
from flashnext.kernels.records import pack_records, record_layout, unpack_records
from flashnext.ple.formats import get_codec

from ..ple.reference import card_tensors, dequant64

FORMATS = ["bf16", "fp8", "int4", "nvfp4"]


@pytest.mark.parametrize(
    ("fmt", "nbytes", "offsets"),
    [("bf16", 320, [0]), ("fp8", 164, [0, 160]), ("int4", 100, [0, 80]), ("nvfp4", 90, [0, 80])],
)
def test_layout_at_width_160(fmt, nbytes, offsets):
    layout = record_layout(get_codec(fmt), 160)
    assert layout.record_bytes == nbytes == get_codec(fmt).bytes_per_row(160)
    assert [f.offset for f in layout.fields] == offsets


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_unpack_round_trip_dequantizes_like_the_card(fmt, rng):
    tensors = card_tensors(fmt, 37, rng)
    layout = record_layout(get_codec(fmt), 160)
    recs = pack_records(layout, tensors)
    assert recs.shape == (37, layout.record_bytes) and recs.dtype == np.uint8
    back = unpack_records(layout, recs)
    for name, arr in back.items():
        np.testing.assert_array_equal(arr.view(np.uint8), np.asarray(tensors[name]).view(np.uint8))
    if fmt == "nvfp4":
        back["weight_scale_2"] = np.full(37, tensors["weight_scale_2"], np.float32)
    np.testing.assert_array_equal(
        get_codec(fmt).dequantize(back), dequant64(fmt, back).astype(np.float32)
    )


def test_pack_into_a_buffer_writes_only_the_first_rows(rng):
    layout = record_layout(get_codec("int4"), 160)
    buf = np.full((10, 100), 7, np.uint8)
    tensors = card_tensors("int4", 4, rng)
    pack_records(layout, tensors, out=buf)
    assert np.all(buf[4:] == 7)
    np.testing.assert_array_equal(buf[:4, :80], tensors["weight_i4"])


def test_wrong_tensor_is_named(rng):
    layout = record_layout(get_codec("fp8"), 160)
    tensors = card_tensors("fp8", 3, rng)
    tensors["weight_scale"] = tensors["weight_scale"].astype(np.float64)
    with pytest.raises(
        FormatError, match="tensor weight_scale is float64 \\[3\\], expected float32"
    ):
        pack_records(layout, tensors)
    with pytest.raises(FormatError, match="record buffer is uint8 \\[2, 164\\]"):
        pack_records(layout, card_tensors("fp8", 3, rng), out=np.zeros((2, 164), np.uint8))
