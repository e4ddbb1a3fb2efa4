"""Length buckets and units: the order rows are computed and written in.

Rows are grouped into narrow length buckets (upper bounds grow by 1/16 and are multiples of 8), so a right-padded
batch carries little padding where batches in dataset order are mostly padding. Within a bucket rows keep
`sample_id` order, so the output order — bucket, then sample_id — does not depend on the budget, the device or the
number of processes. That order is cut into units of at most `unit_tokens` tokens: a unit is one output file
(`data/train-<bucket>-<chunk>.arrow`, named by its first row's bucket), the grain of commit and resume, and the
grain work is shared across ranks.

A unit runs on from one bucket into the next ones while their upper bounds stay within `UNIT_SPAN` of its first
bucket's. Why: cut at every bucket, a small job's long tail is dozens of nearly empty units, each at least one
forward, and a forward costs a fixed host time however few its tokens, so small forwards run far below the rate of
full ones. Spanning buckets trades a little more padding (right-padded targets only) for far fewer small forwards;
a large job hardly changes. The units depend on the lengths, sample ids, `max_length` and `unit_tokens` only, never
on the budget, the device or the number of processes.

A unit's rows go in the fewest batches the token budget allows, padding counted (at most `budget // upper_bound`
rows each), spread evenly over them: filled in turn, most units of a large job ended in a small last batch. A
unit's batches depend on the unit and the budget only, never on which rank runs it or what ran before it, so a
row's states are the same bits whatever the number of processes (batches joined across units were faster on small
jobs but broke that). The measurements behind each choice: docs/benchmarks.md, sessions 17 and 18 and "Figures
moved from the code".
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

PAD_MULTIPLE = 8  # batch lengths are padded to this, so kernels see aligned shapes and few distinct shapes
BUCKET_GROWTH = 1.0625
UNIT_SPAN = 1.5  # a unit's last bucket bound is at most this times its first's
# How rows are cut into units, in the job's fingerprint: an output dir planned another way is another job's (its
# unit names would not hold the same rows), refused on resume instead of skipping rows its units never held.
UNIT_PLAN = f"buckets-{BUCKET_GROWTH}-span-{UNIT_SPAN}"


@dataclass(frozen=True)
class Unit:
    name: str  # "<bucket>-<chunk>": its first row's bucket, zero-padded so names sort in output order
    bucket: int  # its first row's bucket
    upper_bound: int  # longest row its last bucket may hold, in tokens
    start: int  # rows [start, stop) of the ordered dataset
    stop: int
    tokens: int

    def batch_size(self, token_budget: int) -> int:
        """Rows per batch (`datasets.map`'s batch_size): the unit's rows over the fewest batches of at most
        `token_budget // upper_bound` rows, as evenly as one batch size allows (the last batch is at most
        batches - 1 rows short)."""
        most = max(1, token_budget // self.upper_bound)
        rows = self.stop - self.start
        batches = -(-rows // most)  # the fewest that hold the unit's rows
        return -(-rows // batches)


def bucket_bounds(max_length: int) -> np.ndarray:
    """Ascending bucket upper bounds, the last one exactly `max_length`."""
    bounds, b = [], PAD_MULTIPLE
    while b < max_length:
        bounds.append(b)
        b = max(b + PAD_MULTIPLE, -(-int(b * BUCKET_GROWTH) // PAD_MULTIPLE) * PAD_MULTIPLE)
    bounds.append(max_length)
    return np.asarray(bounds, dtype=np.int64)


def plan_units(sample_ids: np.ndarray, num_tokens: np.ndarray, max_length: int,
               unit_tokens: int) -> tuple[np.ndarray, list[Unit]]:
    """Order usable rows by (bucket, sample_id) and cut that order into units: each as many rows as fit in
    `unit_tokens` (at least one row, which may be larger), from buckets within `UNIT_SPAN` of its first row's.

    Returns the permutation (positions into the input arrays) and the units over the permuted rows."""
    bounds = bucket_bounds(max_length)
    bucket = np.searchsorted(bounds, num_tokens, side="left")
    order = np.lexsort((sample_ids, bucket))
    bucket_sorted = bucket[order]
    tokens_sorted = np.asarray(num_tokens, dtype=np.int64)[order]
    cum = np.r_[0, np.cumsum(tokens_sorted)].tolist()  # cum[i]: tokens in rows [0, i)
    # span_end[b]: the first row past the buckets a unit starting in bucket b may take
    last_bucket = np.searchsorted(bounds, bounds * UNIT_SPAN, side="right") - 1
    span_end = np.searchsorted(bucket_sorted, last_bucket, side="right").tolist()
    units: list[Unit] = []
    a, n, chunks = 0, len(order), {}
    # One binary search per unit over the cumulative totals, no Python per row.
    while a < n:
        b = int(bucket_sorted[a])
        z = max(a + 1, bisect_right(cum, cum[a] + unit_tokens, a + 1, span_end[b] + 1) - 1)
        chunk = chunks[b] = chunks.get(b, -1) + 1
        units.append(Unit(name=f"{b:03d}-{chunk:05d}", bucket=b, upper_bound=int(bounds[bucket_sorted[z - 1]]),
                          start=a, stop=z, tokens=cum[z] - cum[a]))
        a = z
    return order, units


def padded_length(lengths: np.ndarray) -> int:
    """The length a right-padded batch of rows of these lengths runs at: the longest, up to a multiple of
    PAD_MULTIPLE (hsx.engine pads each batch to it)."""
    return int(-(-int(lengths.max()) // PAD_MULTIPLE) * PAD_MULTIPLE)
