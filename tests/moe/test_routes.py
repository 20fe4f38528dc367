"""sanitize_routes against a plain-Python reference on fresh random routes."""

import numpy as np
import pytest

from flashnext.moe import InvalidRouteCounter, sanitize_routes
from flashnext.moe.routes import RouteError


def reference(ids, weights, n):
    out_i, out_w = ids.copy(), weights.copy()
    for idx in np.ndindex(ids.shape):
        if not 0 <= int(ids[idx]) < n:
            out_i[idx], out_w[idx] = 0, 0.0
    return out_i, out_w


def test_notes_vector():
    ids, w = sanitize_routes(np.array([-1, 7, 512]), np.array([0.4, 0.5, 0.6]), 512)
    assert ids.tolist() == [0, 7, 0]
    assert w.tolist() == [0.0, 0.5, 0.0]


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("w_dtype", [np.float32, np.float16])
def test_random_routes_match_reference_and_inputs_are_untouched(id_dtype, w_dtype, rng):
    n = int(rng.integers(4, 600))
    ids = rng.integers(-3, n + 3, size=(int(rng.integers(1, 300)), 10)).astype(id_dtype)
    ids[rng.random(ids.shape[0]) < 0.2] = -1  # whole padding rows, as vLLM writes them
    w = rng.random(ids.shape).astype(w_dtype) + w_dtype(0.01)
    ids0, w0 = ids.copy(), w.copy()
    out_i, out_w = sanitize_routes(ids, w, n)
    ref_i, ref_w = reference(ids, w, n)
    assert out_i.dtype == ids.dtype and out_w.dtype == w.dtype
    np.testing.assert_array_equal(out_i, ref_i)
    np.testing.assert_array_equal(out_w, ref_w)
    assert not np.signbit(out_w).any()
    np.testing.assert_array_equal(ids, ids0)
    np.testing.assert_array_equal(w, w0)


def test_counter_counts_only_non_padding_invalid_routes():
    counter = InvalidRouteCounter()
    ids = np.array([[-1, -1], [3, 9], [-5, 2]])
    sanitize_routes(ids, np.ones(ids.shape, np.float32), 8, counter=counter)
    sanitize_routes(ids, np.ones(ids.shape, np.float32), 8, counter=counter)
    assert counter.value() == 4  # 9 and -5, twice
    counter.reset()
    assert counter.value() == 0


@pytest.mark.parametrize(
    ("ids", "weights", "n", "message"),
    [
        (np.zeros((2, 3), np.int64), np.zeros((3, 2)), 8, r"shape \(2, 3\) != weights shape"),
        (np.zeros(3, np.float32), np.zeros(3), 8, "must be integers"),
        (np.zeros(3, np.int64), np.zeros(3), 0, "num_experts must be >= 1"),
    ],
)
def test_bad_routes_are_named(ids, weights, n, message):
    with pytest.raises(RouteError, match=message):
        sanitize_routes(ids, weights, n)


def test_torch_routes_match_numpy_without_host_sync(rng):
    torch = pytest.importorskip("torch", reason="torch not installed: pip install 'flashnext[gpu]'")
    ids = rng.integers(-2, 70, size=(33, 8))
    w = rng.random(ids.shape).astype(np.float32)
    counter = InvalidRouteCounter()
    t_ids, t_w = torch.from_numpy(ids), torch.from_numpy(w)
    out_i, out_w = sanitize_routes(t_ids, t_w, 64, counter=counter)
    ref_i, ref_w = sanitize_routes(ids, w, 64)
    np.testing.assert_array_equal(out_i.numpy(), ref_i)
    np.testing.assert_array_equal(out_w.numpy(), ref_w)
    assert torch.equal(t_ids, torch.from_numpy(ids))  # not mutated
    expected = int(((ids < -1) | (ids >= 64)).sum())
    assert counter.value() == expected
