"""Length buckets and units: bounds, ordering, partition, token caps."""

from __future__ import annotations

import numpy as np
import pytest

from hsx.buckets import PAD_MULTIPLE, Unit, bucket_bounds, padded_length, plan_units


@pytest.mark.parametrize("max_length", [1, 5, 8, 9, 16, 17, 100, 512, 4096, 32768, 131072])
def test_bucket_bounds(max_length):
    b = bucket_bounds(max_length)
    assert b[-1] == max_length
    assert np.all(np.diff(b) > 0), "strictly ascending"
    assert np.all(b[:-1] % PAD_MULTIPLE == 0), "multiples of 8 except maybe the last"
    assert b[0] >= 1
    # narrow: consecutive bounds grow by at most max(8, ~1/16) (+ rounding to 8), so padding waste stays small
    for lo, hi in zip(b[:-1], b[1:]):
        assert hi - lo <= max(PAD_MULTIPLE, int(np.ceil(lo * 0.0625 / PAD_MULTIPLE)) * PAD_MULTIPLE)


def test_bucket_bounds_small_values():
    assert bucket_bounds(8).tolist() == [8]
    assert bucket_bounds(9).tolist() == [8, 9]
    assert bucket_bounds(24).tolist() == [8, 16, 24]


def test_padded_length():
    assert padded_length(np.array([1])) == 8
    assert padded_length(np.array([3, 8])) == 8
    assert padded_length(np.array([9, 2])) == 16


def check_plan(sample_ids, num_tokens, max_length, unit_tokens):
    order, units = plan_units(sample_ids, num_tokens, max_length, unit_tokens)
    n = len(sample_ids)
    bounds = bucket_bounds(max_length)
    # a permutation of the rows
    assert sorted(order.tolist()) == list(range(n))
    sid, tok = sample_ids[order], num_tokens[order]
    bucket = np.searchsorted(bounds, tok, side="left")
    # ordered by bucket, then sample_id
    keys = list(zip(bucket.tolist(), sid.tolist()))
    assert keys == sorted(keys)
    # units partition [0, n) contiguously, in order, each row in exactly one unit
    covered = np.zeros(n, dtype=int)
    at = 0
    for u in units:
        assert isinstance(u, Unit)
        assert u.start == at and u.stop > u.start
        covered[u.start:u.stop] += 1
        at = u.stop
        # one bucket per unit, and every row fits under its upper bound and above the previous one
        assert set(bucket[u.start:u.stop].tolist()) == {u.bucket}
        assert u.upper_bound == bounds[u.bucket]
        assert tok[u.start:u.stop].max() <= u.upper_bound
        if u.bucket > 0:
            assert tok[u.start:u.stop].min() > bounds[u.bucket - 1]
        assert u.tokens == int(tok[u.start:u.stop].sum())
    assert at == n
    assert np.all(covered == 1)
    # names are unique and sort in output order (files are read back sorted by name)
    names = [u.name for u in units]
    assert len(set(names)) == len(names)
    assert names == sorted(names)
    return order, units


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("unit_tokens", [1, 50, 1000, 1 << 20])
def test_plan_units_properties(seed, unit_tokens):
    rng = np.random.default_rng(seed)
    n, max_length = 300, 512
    sample_ids = rng.permutation(np.arange(1000, 1000 + n)).astype(np.int64)  # not in order, not from 0
    num_tokens = rng.integers(1, max_length + 1, size=n).astype(np.int64)
    check_plan(sample_ids, num_tokens, max_length, unit_tokens)


def test_plan_units_order_does_not_depend_on_input_order():
    rng = np.random.default_rng(0)
    sid = np.arange(200, dtype=np.int64)
    tok = rng.integers(1, 300, size=200).astype(np.int64)
    perm = rng.permutation(200)
    o1, u1 = plan_units(sid, tok, 300, 500)
    o2, u2 = plan_units(sid[perm], tok[perm], 300, 500)
    assert sid[o1].tolist() == sid[perm][o2].tolist()
    assert [(u.name, u.start, u.stop) for u in u1] == [(u.name, u.start, u.stop) for u in u2]


def test_plan_units_empty():
    order, units = plan_units(np.zeros(0, np.int64), np.zeros(0, np.int64), 128, 100)
    assert len(order) == 0 and units == []


def test_plan_units_batch_size_counts_padding():
    sid = np.arange(4, dtype=np.int64)
    tok = np.array([100, 101, 3, 97], dtype=np.int64)
    _, units = plan_units(sid, tok, 4096, 1 << 20)
    big = [u for u in units if u.tokens > 10][0]
    assert big.batch_size(1000) == 1000 // big.upper_bound
    assert big.batch_size(1) == 1  # never zero


UNIT_CAP_BUG = ("BUG: plan_units cuts a bucket only when the running token total crosses a multiple of unit_tokens, "
                "so a unit of several rows can hold up to ~2x unit_tokens (rows of 60 tokens with unit_tokens=100 "
                "give a unit of 2 rows / 120 tokens)")


@pytest.mark.xfail(strict=True, reason=UNIT_CAP_BUG)
def test_unit_token_cap():
    """A unit holds at most `unit_tokens` tokens, unless it is a single row."""
    over = []
    for seed in range(3):
        for unit_tokens in (50, 1000):
            rng = np.random.default_rng(seed)
            sid = np.arange(300, dtype=np.int64)
            tok = rng.integers(1, 513, size=300).astype(np.int64)
            _, units = plan_units(sid, tok, 512, unit_tokens)
            over += [(unit_tokens, u.name, u.tokens, u.stop - u.start) for u in units
                     if u.tokens > unit_tokens and u.stop - u.start > 1]
    assert over == []


@pytest.mark.xfail(strict=True, reason=UNIT_CAP_BUG)
def test_unit_token_cap_minimal():
    _, units = plan_units(np.arange(4, dtype=np.int64), np.full(4, 60, dtype=np.int64), 64, 100)
    assert all(u.tokens <= 100 for u in units), [(u.name, u.tokens) for u in units]
