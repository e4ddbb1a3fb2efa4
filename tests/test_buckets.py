"""Length buckets and units: bounds, ordering, partition, token caps."""

from __future__ import annotations

import numpy as np
import pytest

from hsx.buckets import PAD_MULTIPLE, UNIT_SPAN, Unit, bucket_bounds, padded_length, plan_units


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
        # named by its first row's bucket; its rows' buckets within UNIT_SPAN of that one, its upper bound its
        # last row's bucket's (so every row fits under it)
        assert bucket[u.start] == u.bucket
        assert u.upper_bound == bounds[bucket[u.stop - 1]] <= UNIT_SPAN * bounds[u.bucket]
        assert tok[u.start:u.stop].max() <= u.upper_bound
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
    assert big.stop - big.start == 3 and big.upper_bound > 101
    assert big.batch_size(1000) == 3  # all three rows, padded to the bucket's bound, fit the budget
    assert big.batch_size(2 * big.upper_bound) == 2  # two fit: batches of 2 and 1
    assert big.batch_size(1) == 1  # never zero


@pytest.mark.parametrize("rows", [1, 2, 7, 63, 64, 65, 100, 127, 1000])
@pytest.mark.parametrize("most", [1, 2, 3, 8, 64, 999])
def test_batches_of_a_unit_are_the_fewest_and_even(rows, most):
    """A unit runs in the fewest batches the budget allows (`most` rows each at its upper bound), none over the
    budget, and its last batch is not a small remainder: at most batches - 1 rows shorter than the others (65 rows
    at 64 a batch run as 33 + 32, not 64 + 1)."""
    upper = 16
    unit = Unit(name="000-00000", bucket=0, upper_bound=upper, start=5, stop=5 + rows, tokens=rows * upper)
    size = unit.batch_size(most * upper + upper // 2)
    batches = [len(range(rows)[a:a + size]) for a in range(0, rows, size)]
    assert sum(batches) == rows and size <= most
    assert len(batches) == -(-rows // most)
    assert batches[-1] >= size - (len(batches) - 1)


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


def test_unit_token_cap_minimal():
    _, units = plan_units(np.arange(4, dtype=np.int64), np.full(4, 60, dtype=np.int64), 64, 100)
    assert [(u.name, u.start, u.stop, u.tokens) for u in units] == [
        ("007-00000", 0, 1, 60), ("007-00001", 1, 2, 60), ("007-00002", 2, 3, 60), ("007-00003", 3, 4, 60)]


def test_units_are_greedy():
    """Each unit is as full as the cap and the span allow: the next row would not have fitted, or its bucket is
    past the span (so units are not cut needlessly small), and an exact fit stays one unit."""
    rng = np.random.default_rng(11)
    sid = np.arange(2000, dtype=np.int64)
    tok = rng.integers(1, 1025, size=2000).astype(np.int64)
    for unit_tokens in (1, 100, 700, 5000, 1 << 30):
        order, units = check_plan(sid, tok, 1024, unit_tokens)
        t = tok[order]
        bounds = bucket_bounds(1024)
        for u, nxt in zip(units, units[1:]):
            assert u.tokens <= unit_tokens or u.stop - u.start == 1
            next_bound = bounds[np.searchsorted(bounds, t[nxt.start])]
            if next_bound <= UNIT_SPAN * bounds[u.bucket]:
                assert u.tokens + t[nxt.start] > unit_tokens, (unit_tokens, u, nxt)
    _, units = plan_units(np.arange(6, dtype=np.int64), np.full(6, 50, dtype=np.int64), 64, 100)
    assert [(u.start, u.stop, u.tokens) for u in units] == [(0, 2, 100), (2, 4, 100), (4, 6, 100)]


def test_small_buckets_share_a_unit_within_the_span():
    """A few rows in each of many buckets (a small job's long tail) make a few units, not one per bucket: a unit
    takes in the next buckets while their bounds stay within UNIT_SPAN of its first's, so 1,000 rows over 200-4,000
    tokens run in a handful of forwards, and no unit holds lengths further apart than the span."""
    rng = np.random.default_rng(3)
    tok = np.sort(rng.integers(200, 4001, size=1000)).astype(np.int64)
    order, units = check_plan(np.arange(1000, dtype=np.int64), tok, 4096, 1 << 30)
    bounds = bucket_bounds(4096)
    buckets = np.unique(np.searchsorted(bounds, tok))
    assert len(buckets) > 40
    assert len(units) <= 8  # log(4000 / 200) / log(1.5) = 7.4 spans
    for u in units:
        t = tok[order][u.start:u.stop]
        assert t.max() <= UNIT_SPAN * bounds[u.bucket]
    # each unit except the last stops where the next row's bucket leaves the span
    for u, nxt in zip(units, units[1:]):
        assert bounds[np.searchsorted(bounds, tok[order][nxt.start])] > UNIT_SPAN * bounds[u.bucket]


def test_spans_are_measured_from_a_units_first_bucket():
    """Lengths 100, 140, 190 (bounds 104, 144, 192 apart by more than 1.5x end to end): the first unit takes 100 and
    140 (144 <= 1.5 x 104), the second starts at 190's bucket."""
    tok = np.array([190, 100, 140, 100, 190], dtype=np.int64)
    order, units = check_plan(np.arange(5, dtype=np.int64), tok, 4096, 1 << 20)
    assert [tok[order][u.start:u.stop].tolist() for u in units] == [[100, 100, 140], [190, 190]]
    assert [u.upper_bound for u in units] == [144, 192]
    assert units[0].batch_size(3 * 144) == 3 and units[0].batch_size(3 * 144 - 1) == 2  # sized for its longest


def test_rows_larger_than_a_unit_get_one_unit_each():
    tok = np.array([300, 20, 20, 300, 300, 20], dtype=np.int64)  # two buckets; in order: 20 20 20 | 300 300 300
    _, units = plan_units(np.arange(6, dtype=np.int64), tok, 512, 100)
    assert [(u.stop - u.start, u.tokens) for u in units] == [(3, 60), (1, 300), (1, 300), (1, 300)]


def test_plan_a_million_rows_quickly():
    import time

    rng = np.random.default_rng(0)
    n = 1_000_000
    sid = rng.permutation(n).astype(np.int64)
    tok = rng.integers(1, 4097, size=n).astype(np.int64)
    t0 = time.perf_counter()
    order, units = plan_units(sid, tok, 4096, 1 << 20)
    elapsed = time.perf_counter() - t0
    assert len(order) == n and units[-1].stop == n
    assert sum(u.tokens for u in units) == int(tok.sum())
    assert max(u.tokens for u in units) <= 1 << 20
    assert elapsed < 3.0, f"planning 1M rows took {elapsed:.2f} s"
