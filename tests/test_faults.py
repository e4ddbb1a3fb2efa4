"""Faults injected into real jobs: SIGKILL at random points, SIGTERM/SIGINT, a fake CUDA OOM, a full disk, NaN rows,
unparseable input, corrupted outputs for `hsx verify`, and a Hub token in the environment.

Every job here is the one of `fault_reference` (conftest.py): model4, the demo chat, ~55 units of ~400 tokens. After
each fault the job is run again to completion and must equal the uninterrupted reference: the same sample_ids in the
same order, the same tokens and masks, bit-identical states (CPU, one thread: every batch runs at the shapes it had in
the reference), the same counts in hsx.json, every unit recorded once with the CRC-32 of its file, and `hsx verify`
passing. An OOM-split batch's rows run at other shapes: their states are checked within bf16 rounding.
"""

from __future__ import annotations

import errno
import json
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import (
    assert_equals_reference,
    assert_one_error_line,
    assert_same_output,
    assert_units_intact,
    committed_units,
    hsx_child,
    hsx_main,
    is_complete,
    manifest_records,
    message_lines,
    output_table,
    torn_manifest_copy,
)

from hsx.buckets import padded_length


def unit_crcs(out: Path) -> dict[str, str]:
    return {r["unit"]: r["crc32"] for r in manifest_records(out)}


# ---- SIGKILL at random points ----------------------------------------------------------------------------------

def kill_plan(seed: int, units: int) -> list[tuple[str, float, float]]:
    """Where each run of a seed is killed: (phase, parameter, extra delay in seconds). Phases: `startup` (a random
    delay: imports, claiming, tokenizing, loading the model), `claimed` (right after .hsx/job.json appears:
    tokenization and model loading), `units` (right after the k-th manifest line: mid-extraction, often mid-write
    of the next unit), `final` (right after the last unit's manifest line: finalization), `finalizing` (as soon as
    the card appears: between the card and hsx.json). Mid-extraction kills leave >= 5 units to go, so they land
    before the end whatever the machine's speed."""
    rng = random.Random(seed)
    if seed == 0:
        return [("startup", rng.uniform(0.3, 2.5), 0.0), ("claimed", 0, rng.uniform(0.0, 0.4))]
    if seed == 1:
        return [("units", rng.randint(1, units - 5), rng.uniform(0.0, 0.03))]
    if seed == 2:  # killed twice: the second kill hits a resumed run
        k1 = rng.randint(1, units // 2)
        return [("units", k1, rng.uniform(0.0, 0.03)), ("units", rng.randint(k1 + 3, units - 5),
                                                          rng.uniform(0.0, 0.03))]
    # right after the last unit is recorded, then (on the resume, which only finalizes) as the card appears
    return [("final", units, rng.uniform(0.0, 0.01)), ("finalizing", 0, 0.0)]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sigkill_at_random_points_then_resume(tmp_path, fault_reference, seed):
    ref = fault_reference
    out = tmp_path / "out"
    argv = ref.argv(out)
    outcomes = []
    for i, (phase, param, extra) in enumerate(kill_plan(seed, ref.units)):
        child = hsx_child(argv, tmp_path / f"run{i}")
        if phase == "startup":
            hit = child.poll_until(lambda t=child.t0 + param: time.monotonic() >= t)
        elif phase == "claimed":
            hit = child.poll_until(lambda: (out / ".hsx" / "job.json").exists())
        elif phase == "finalizing":
            hit = child.poll_until(lambda: (out / "README.md").exists() or (out / ".README.md.tmp").exists(),
                                   every=0.001)
        else:
            hit = child.poll_until(lambda k=int(param): committed_units(out) >= k)
        if hit:
            time.sleep(extra)
            child.kill_tree(signal.SIGKILL)
        rc = child.wait()
        done = len(assert_units_intact(out)) if (out / ".hsx").exists() else 0
        outcomes.append((phase, param, rc, done, is_complete(out)))
        assert rc in (0, -signal.SIGKILL), child.stderr
        if phase == "units":  # these must land mid-extraction, or the test proves nothing
            assert rc == -signal.SIGKILL and int(param) <= done < ref.units and not is_complete(out), outcomes
    print(f"seed {seed}: (phase, param, rc, units committed, complete) = {outcomes}")
    # run the same command until it ends (one run, from wherever the kills left the dir)
    rc, stdout, stderr = hsx_main(argv)
    assert rc == 0, stderr
    if outcomes[-1][-1]:
        assert "already complete" in stdout
    assert_equals_reference(out, ref)


# ---- SIGTERM / SIGINT ------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_after_the_current_unit_and_resumes(tmp_path, fault_reference, sig, code):
    ref = fault_reference
    out = tmp_path / "out"
    child = hsx_child(ref.argv(out), tmp_path / "run")
    assert child.poll_until(lambda: committed_units(out) >= 3), child.stderr
    child.signal(sig)
    rc = child.wait()
    err = child.stderr
    assert rc == code, err
    assert "Traceback" not in err
    lines = message_lines(err)
    assert len(lines) == 1, lines
    done = len(assert_units_intact(out))
    assert 3 <= done < ref.units
    assert lines[0] == f"hsx: stopped cleanly after {done} of {ref.units} units; run the same command to continue"
    assert f"{signal.Signals(sig).name}: stopping after the current unit" in child.stdout
    assert not is_complete(out)
    assert not list((out / ".hsx" / "tmp").rglob("*.arrow"))  # it stopped after a unit, not inside one
    rc, stdout, stderr = hsx_main(ref.argv(out))
    assert rc == 0, stderr
    assert "continuing the job" in stdout
    assert_equals_reference(out, ref, verify=False)


# ---- CUDA out of memory (faked) --------------------------------------------------------------------------------

def padded(n: int) -> int:
    """The length a row of n tokens runs at alone (hsx.engine pads a batch to `padded_length`)."""
    return padded_length(np.array([n]))


def hook_loaded_models(monkeypatch, install) -> None:
    """`install(base)` on each model a job loads (hsx.target.model.load_model, which hsx.target.ready calls): a fault
    enters where a real one does, in the model's own forward."""
    import hsx.target.model

    real_load_model = hsx.target.model.load_model

    def load_model(*args, **kwargs):
        loaded = real_load_model(*args, **kwargs)
        install(loaded.base)
        return loaded

    monkeypatch.setattr(hsx.target.model, "load_model", load_model)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["batches_over_a_size", "one_row_never_fits", "longest_rows_never_fit"])
def test_fake_oom_splits_and_drops_only_rows_that_cannot_fit(tmp_path, monkeypatch, fault_reference, case):
    from hsx.engine import Extractor

    ref = fault_reference
    table = output_table(ref.out)
    rows = dict(zip(table.column("sample_id").to_pylist(), table.column("input_ids").to_pylist()))
    longest = max(padded(len(v)) for v in rows.values())
    limit, multi_row_limit, victim, drop = 1 << 30, 1 << 30, None, set()
    if case == "batches_over_a_size":  # every row fits alone; no batch of several rows over 160 tokens does
        multi_row_limit = 160
    elif case == "one_row_never_fits":  # a row in the middle of a unit of several rows, whatever its batch
        recs = sorted(manifest_records(ref.out), key=lambda r: r["file"])
        starts = np.cumsum([0] + [r["rows"] for r in recs])
        u = max(range(len(recs)), key=lambda j: (recs[j]["rows"], -abs(j - len(recs) // 2)))
        assert recs[u]["rows"] >= 3
        sid = ref.sample_ids[int(starts[u]) + 1]
        victim = torch.tensor(rows[sid])
        assert sum(v[:len(rows[sid])] == rows[sid] for v in rows.values()) == 1  # only it starts with its ids
        drop = {sid}
    else:  # the longest rows: larger than the fake memory even alone
        limit = longest - 8
        drop = {s for s, v in rows.items() if padded(len(v)) > limit}
        assert 1 <= len(drop) < 5
    calls = {"oom": 0, "forward": 0}

    def forward(module, args, kwargs):  # (before the model's forward: where a CUDA OOM is raised)
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        has_victim = victim is not None and ids.shape[1] >= len(victim) and bool(
            (ids[:, :len(victim)] == victim).all(1).any())
        if ids.numel() > limit or (ids.shape[0] > 1 and ids.numel() > multi_row_limit) or has_victim:
            calls["oom"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (fake)")
        calls["forward"] += 1

    real_run_batch = Extractor.run_batch
    whole = set()  # sample_ids of the map batches that ran as one forward, at the reference's shapes

    def run_batch(self, table, slot):
        before = dict(calls)
        result = real_run_batch(self, table, slot)
        if calls["oom"] == before["oom"] and calls["forward"] == before["forward"] + 1:
            whole.update(table.column("sample_id").to_pylist())
        return result

    hook_loaded_models(monkeypatch, lambda base: base.register_forward_pre_hook(forward, with_kwargs=True))
    monkeypatch.setattr(Extractor, "run_batch", run_batch)
    out = tmp_path / "out"
    rc, stdout, stderr = hsx_main(ref.argv(out))
    assert rc == 0, stderr
    assert "Traceback" not in stderr
    assert calls["oom"] >= max(1, len(drop)) and calls["forward"] > 0
    info = json.loads((out / "hsx.json").read_text())
    c, rc_ = info["counts"], ref.info["counts"]
    assert c["rows_written"] == rc_["rows_written"] - len(drop)
    assert c["tokens_written"] == rc_["tokens_written"] - sum(len(rows[s]) for s in drop)
    expected_skipped = dict(rc_["skipped"], **({"oom": len(drop)} if drop else {}))
    assert c["skipped"] == dict(sorted(expected_skipped.items()))
    assert c["truncated"] == rc_["truncated"] and info["units"] == ref.units
    recs = assert_units_intact(out)
    assert len(recs) == ref.units  # every unit was finished: an OOM costs at most the rows that cannot fit
    assert sum(r["skipped_oom"] for r in recs) == len(drop)
    # Every row but the dropped ones, once, in order, with its tokens and masks. A split batch runs its rows at other
    # shapes (fewer rows, a shorter padded length), and CPU and GPU matmul kernels choose their blocking, so the order
    # of a sum, by shape: those rows' states equal the unsplit run's within bf16 rounding, not bit for bit (a fresh
    # 2-core CI machine: 1,298 of 2,009,344 values differ). Rows whose batch ran whole are the reference's bytes.
    split = set(rows) - whole - drop
    assert whole and (split or case == "longest_rows_never_fit"), (len(split), len(whole))  # (those run alone)
    assert_same_output(out, ref.out, drop=drop, ignore_states=split)
    assert_same_output(out, ref.out, drop=drop, exact=False)


# ---- disk full -------------------------------------------------------------------------------------------------

def _enospc():
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["unit_write", "commit", "finalize", "tokenize"])
def test_disk_full_is_one_line_keeps_committed_units_and_resumes(tmp_path, monkeypatch, fault_reference, where):
    """ENOSPC while `datasets` writes a unit's Arrow file, while committing it (fsync), while writing hsx.json, and
    while writing the tokenized cache. One line, non-zero, committed units intact; once space is freed, the same
    command finishes the job."""
    import hsx.info
    import hsx.sink
    from datasets.arrow_writer import ArrowWriter

    ref = fault_reference
    state = {"on": True, "n": 0, "fired": 0}
    nth = 12

    def fire_on_nth() -> None:
        state["n"] += 1
        if state["on"] and state["n"] == nth:
            state["fired"] += 1
            _enospc()

    real_write_table = ArrowWriter.write_table

    def write_table(self, pa_table, writer_batch_size=None):
        path = str(self._path)
        if where == "unit_write" and "/.hsx/tmp/rank-" in path:
            fire_on_nth()
        if where == "tokenize" and "/.hsx/tokenized/" in path and state["on"]:
            state["fired"] += 1
            _enospc()
        return real_write_table(self, pa_table, writer_batch_size)

    monkeypatch.setattr(ArrowWriter, "write_table", write_table)
    real_fsync_file, real_atomic_write = hsx.sink.fsync_file, hsx.info.atomic_write

    def fsync_file(path):
        if where == "commit":
            fire_on_nth()
        return real_fsync_file(path)

    def atomic_write(path, text):
        if where == "finalize" and path.name == "hsx.json" and state["on"]:
            state["fired"] += 1
            _enospc()
        return real_atomic_write(path, text)

    monkeypatch.setattr(hsx.sink, "fsync_file", fsync_file)
    monkeypatch.setattr(hsx.info, "atomic_write", atomic_write)  # (hsx.json: hsx.info.write_info)

    out = tmp_path / "out"
    rc, stdout, stderr = hsx_main(ref.argv(out))
    assert state["fired"] == 1
    line = assert_one_error_line(rc, stderr, "disk full", str(out), "run the same command to continue")
    recs = assert_units_intact(out)
    assert f": {len(recs)} unit(s) are complete and intact" in line
    expected = {"unit_write": (1, ref.units - 1), "commit": (nth - 1, nth - 1), "finalize": (ref.units, ref.units),
                "tokenize": (0, 0)}[where]
    assert expected[0] <= len(recs) <= expected[1], len(recs)
    assert not is_complete(out)
    kept = {r["unit"]: r["crc32"] for r in recs}
    ref_crc = unit_crcs(ref.out)
    assert all(ref_crc[u] == crc for u, crc in kept.items())  # what was committed is right, not just intact

    state["on"] = False  # space freed
    rc, stdout, stderr = hsx_main(ref.argv(out))
    assert rc == 0, stderr
    assert_equals_reference(out, ref, verify=False)
    assert all(unit_crcs(out)[u] == crc for u, crc in kept.items())  # units committed before were kept


@pytest.mark.slow
def test_resume_with_another_token_budget(tmp_path, monkeypatch, fault_reference):
    """The token budget does not decide the output's rows, so a resume may change it: stopped after 20 units by a
    full disk, then finished with --token-budget 333 instead of 1024: the reference's rows, units and counts; the
    units kept byte for byte; the redone ones ran at other batch shapes, so their states are the reference's within
    bf16 rounding (matmul blocking follows the shape). Its last line says what this run wrote, and what OUT holds."""
    import hsx.sink

    ref = fault_reference
    state = {"n": 0, "on": True}
    real_fsync_file = hsx.sink.fsync_file

    def fsync_file(path):
        state["n"] += 1
        if state["on"] and state["n"] == 21:
            _enospc()
        return real_fsync_file(path)

    monkeypatch.setattr(hsx.sink, "fsync_file", fsync_file)
    out = tmp_path / "out"
    argv = ref.argv(out)
    rc, stdout, stderr = hsx_main(argv)
    assert rc == 1 and len(assert_units_intact(out)) == 20, stderr
    kept = {r["unit"]: r for r in manifest_records(out)}
    state["on"] = False
    argv[argv.index("--token-budget") + 1] = "333"
    rc, stdout, stderr = hsx_main(argv)
    assert rc == 0, stderr
    assert "continuing the job" in stdout
    assert_equals_reference(out, ref, verify=False, exact=False)
    assert all(unit_crcs(out)[u] == r["crc32"] for u, r in kept.items())
    c = ref.info["counts"]
    rows, tokens = c["rows_written"] - sum(r["rows"] for r in kept.values()), \
        c["tokens_written"] - sum(r["tokens"] for r in kept.values())
    assert (f"hsx: this run wrote {rows:,} rows, {tokens:,} tokens ({ref.units - 20} of the {ref.units} files; the "
            f"others were committed before); the output holds {c['rows_written']:,} rows, {c['tokens_written']:,} "
            f"tokens in {out} ({ref.units} files)") in stdout, stdout


# ---- NaN / Inf rows --------------------------------------------------------------------------------------------

def marker_token(table) -> tuple[int, set[int]]:
    """A token id that occurs in only a few rows (2 to 4), and those rows' sample_ids."""
    where: dict[int, set[int]] = {}
    for sid, ids in zip(table.column("sample_id").to_pylist(), table.column("input_ids").to_pylist()):
        for t in set(ids):
            where.setdefault(t, set()).add(sid)
    token = min((t for t, s in where.items() if 2 <= len(s) <= 4 and t > 2), key=lambda t: (abs(len(where[t]) - 3), t))
    return token, where[token]


def poison(base, token: int) -> None:
    """Make `base` produce NaN for every sequence that holds `token`: decoder layer 0's output becomes NaN in those
    rows of the batch, so every captured layer and the final norm are NaN there (and nowhere else)."""
    import hsx.target.model

    seen = {}

    def remember_ids(module, args, kwargs):
        seen["ids"] = kwargs["input_ids"] if "input_ids" in kwargs else args[0]

    def poison_layer(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        rows = (seen["ids"] == token).any(dim=1)
        if bool(rows.any()):
            h[rows] = float("nan")
        return output

    base.register_forward_pre_hook(remember_ids, with_kwargs=True)
    hsx.target.model.decoder_layers(base)[0].register_forward_hook(poison_layer)


def poison_rows_with(monkeypatch, token: int) -> None:
    """Every model the job loads poisoned (`poison`)."""
    hook_loaded_models(monkeypatch, lambda base: poison(base, token))


@pytest.fixture(scope="module")
def nan_marker(fault_reference):
    return marker_token(output_table(fault_reference.out))


def extract_poisoned(monkeypatch, ref, nan_marker, out, *flags):
    """Run the reference job with NaN states injected into the marked rows; returns (stdout, marked rows)."""
    token, marked = nan_marker
    poison_rows_with(monkeypatch, token)
    rc, stdout, stderr = hsx_main(ref.argv(out, *flags))
    assert rc == 0, stderr
    return stdout, marked


@pytest.mark.slow
def test_nan_rows_skipped_by_default(tmp_path, monkeypatch, fault_reference, nan_marker):
    ref = fault_reference
    out = tmp_path / "out"
    stdout, marked = extract_poisoned(monkeypatch, ref, nan_marker, out)
    info = json.loads((out / "hsx.json").read_text())
    c, rc_ = info["counts"], ref.info["counts"]
    k = len(marked)
    assert c["skipped"] == dict(sorted({**rc_["skipped"], "nonfinite": k}.items()))
    assert c["nonfinite"] == {"mode": "skip", "rows": k}
    assert c["rows_written"] == rc_["rows_written"] - k
    assert f"rows with NaN/Inf states: {k} (skipped)" in stdout
    recs = assert_units_intact(out)
    assert sum(r["skipped_nonfinite"] for r in recs) == k
    assert "has_nonfinite" not in output_table(out).column_names
    assert_same_output(out, ref.out, drop=marked)


@pytest.mark.slow
def test_nan_rows_kept_and_flagged(tmp_path, monkeypatch, fault_reference, nan_marker):
    ref = fault_reference
    out = tmp_path / "out"
    stdout, marked = extract_poisoned(monkeypatch, ref, nan_marker, out, "--nonfinite", "keep")
    info = json.loads((out / "hsx.json").read_text())
    c, rc_ = info["counts"], ref.info["counts"]
    assert c["skipped"] == rc_["skipped"] and "nonfinite" not in c["skipped"]
    assert c["nonfinite"] == {"mode": "keep", "rows": len(marked)}
    assert c["rows_written"] == rc_["rows_written"]
    assert f"rows with NaN/Inf states: {len(marked)} (kept, flagged)" in stdout
    table = output_table(out)
    flagged = {s for s, f in zip(table.column("sample_id").to_pylist(), table.column("has_nonfinite").to_pylist())
               if f}
    assert flagged == marked
    assert sum(r["nonfinite_kept"] for r in assert_units_intact(out)) == len(marked)
    for row in table.select(["sample_id", "hidden_states", "final_hidden_state"]).to_pylist():
        states = torch.tensor(np.concatenate([np.ravel(row["hidden_states"]), np.ravel(row["final_hidden_state"])]),
                              dtype=torch.int16).view(torch.bfloat16)
        assert bool(torch.isnan(states).any()) == (row["sample_id"] in marked), row["sample_id"]
    assert_same_output(out, ref.out, ignore_states=marked)  # every row, in order; the others bit-identical
    rc, stdout, stderr = hsx_main(["verify", str(out), "--samples", "0"])  # the flag column is in the schema
    assert rc == 0, stderr


@pytest.mark.slow
def test_verify_accepts_flagged_rows_the_model_really_produces(tmp_path, monkeypatch, fault_reference, nan_marker):
    import transformers

    ref = fault_reference
    out = tmp_path / "out"
    token = nan_marker[0]
    stdout, marked = extract_poisoned(monkeypatch, ref, nan_marker, out, "--nonfinite", "keep")
    real = transformers.AutoModel.from_pretrained

    def from_pretrained(*a, **k):  # the reference forward of verify produces the same NaN for the same rows
        model = real(*a, **k)
        poison(model, token)
        return model

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", from_pretrained)
    rc, stdout, stderr = hsx_main(["verify", str(out), "--samples", str(ref.info["counts"]["rows_written"])])
    assert rc == 0, stderr


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_unparseable_line_in_the_middle_then_fixed(tmp_path, fault_reference):
    """A line 41 of 81 that is not JSON: one `hsx: error:` line naming the file, nothing written; after the file is
    fixed, the same command runs (the dir holds no output of the failed job, so it is re-claimed)."""
    ref = fault_reference
    good = ref.dataset.read_text().splitlines()[:80]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(good[:40] + ['{"messages": [{"role": "us'] + good[40:]) + "\n")
    out = tmp_path / "out"
    argv = argv_on(ref, path, out)
    assert_cannot_read(hsx_main(argv), path, out)
    path.write_text("\n".join(good) + "\n")
    rc, stdout, stderr = hsx_main(argv)
    assert rc == 0, stderr
    assert json.loads((out / "hsx.json").read_text())["counts"]["rows_in"] == 80


@pytest.mark.slow
def test_unparseable_file_is_exactly_one_line_without_progress_bars(tmp_path, fault_reference):
    ref = fault_reference
    path = tmp_path / "chat.jsonl"
    good = ref.dataset.read_text().splitlines()[:10]
    path.write_text("\n".join(good[:5] + ['{"messages": [{"role": "us'] + good[5:]) + "\n")
    # child_env() sets HF_DATASETS_DISABLE_PROGRESS_BARS=1
    child = hsx_child(argv_on(ref, path, tmp_path / "out"), tmp_path / "run")
    rc = child.wait()
    assert_one_error_line(rc, child.stderr, "cannot read dataset", str(path))


def argv_on(ref, path, out) -> list[str]:
    """The reference job's command with another input file."""
    argv = ref.argv(out)
    argv[argv.index("--dataset") + 1] = str(path)
    return argv


def assert_cannot_read(result, path, out) -> None:
    """One `hsx: error: cannot read dataset ...` line naming the file, no traceback, nothing written."""
    rc, stdout, stderr = result
    assert rc != 0 and "Traceback" not in stderr
    hsx_lines = [line for line in message_lines(stderr) if line.startswith("hsx:")]
    assert len(hsx_lines) == 1 and hsx_lines[0].startswith("hsx: error: cannot read dataset"), hsx_lines
    assert str(path) in hsx_lines[0]
    assert not (out / "hsx.json").exists() and not list(out.glob("data/*"))


@pytest.mark.parametrize("case", ["truncated_parquet", "invalid_utf8_jsonl"])
def test_unreadable_input_file(tmp_path, fault_reference, case):
    import pyarrow as pa
    import pyarrow.parquet as pq

    ref = fault_reference
    rows = [json.loads(line) for line in ref.dataset.read_text().splitlines()[:20]]
    if case == "truncated_parquet":
        path = tmp_path / "chat.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])  # a copy that stopped half-way
    else:
        path = tmp_path / "chat.jsonl"
        path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows[:10]) + b"\xff\xfe{}\n")
    out = tmp_path / "out"
    assert_cannot_read(hsx_main(argv_on(ref, path, out)), path, out)


# ---- hsx verify ------------------------------------------------------------------------------------------------

@pytest.fixture
def ref_copy(tmp_path, fault_reference) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(fault_reference.out, out)
    return out


def _verify(out: Path, samples: int = 0) -> tuple[int, str, str]:
    return hsx_main(["verify", str(out), "--samples", str(samples)])


def _flip(path: Path, at: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, at + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _a_unit(out: Path, index: int = 10) -> Path:
    return sorted((out / "data").glob("train-*.arrow"))[index]


def test_verify_passes_on_a_clean_output(ref_copy):
    rc, stdout, stderr = _verify(ref_copy, samples=3)
    assert rc == 0, stderr
    assert "is consistent" in stdout and "3 rows recomputed" in stdout


def test_verify_detects_flipped_bytes_in_a_unit(ref_copy):
    f = _a_unit(ref_copy)
    size = f.stat().st_size
    _flip(f, size // 2)  # inside the states buffer: the file still parses
    assert f.stat().st_size == size
    rc, stdout, stderr = _verify(ref_copy)
    line = assert_one_error_line(rc, stderr, f.name, "CRC-32", prefix="hsx: verify failed: ")
    assert rc == 1, line


def test_verify_detects_a_damaged_header_in_one_line(ref_copy):
    f = _a_unit(ref_copy)
    _flip(f, 8)
    rc, stdout, stderr = _verify(ref_copy)
    assert rc == 1
    assert_one_error_line(rc, stderr, f.name, prefix="hsx: verify failed: ")


def test_verify_detects_a_deleted_unit(ref_copy):
    f = _a_unit(ref_copy)
    f.unlink()
    rc, stdout, stderr = _verify(ref_copy)
    assert rc == 1
    assert_one_error_line(rc, stderr, prefix="hsx: verify failed: ")


def test_verify_names_a_deleted_unit(ref_copy):
    f = _a_unit(ref_copy)
    f.unlink()
    rc, stdout, stderr = _verify(ref_copy)
    assert_one_error_line(rc, stderr, f.name, "missing", prefix="hsx: verify failed: ")


def test_verify_detects_a_unit_missing_from_the_manifest(ref_copy):
    f = _a_unit(ref_copy)
    manifest = ref_copy / ".hsx" / "manifest-00000.jsonl"
    lines = [line for line in manifest.read_text().splitlines() if json.loads(line)["file"] != f.name]
    manifest.write_text("\n".join(lines) + "\n")
    rc, stdout, stderr = _verify(ref_copy)
    assert rc == 1
    assert_one_error_line(rc, stderr, f.name, "is listed in hsx.json but in no manifest", prefix="hsx: verify failed: ")


def test_verify_detects_a_duplicated_unit(ref_copy):
    """A unit's file present twice (under another unit name, recorded in the manifest): rows repeat."""
    from hsx.checksums import file_crc32

    f = _a_unit(ref_copy)
    dup = ref_copy / "data" / "train-999-00000.arrow"
    shutil.copyfile(f, dup)
    rec = next(r for r in manifest_records(ref_copy) if r["file"] == f.name)
    rec = {**rec, "unit": "999-00000", "file": dup.name, "crc32": file_crc32(dup)}
    with open(ref_copy / ".hsx" / "manifest-00000.jsonl", "a") as m:
        m.write(json.dumps(rec, sort_keys=True) + "\n")
    rc, stdout, stderr = _verify(ref_copy)
    assert rc == 1  # refused before any row is read: hsx.json does not list the unit its manifest added
    assert_one_error_line(rc, stderr, dup.name, "is in the manifests but not listed in hsx.json",
                          prefix="hsx: verify failed: ")


# ---- a torn manifest line (a kill or a full disk in the middle of appending it) ---------------------------------

def test_resume_after_a_torn_manifest_line_finishes_in_one_run(tmp_path, fault_reference):
    ref = fault_reference
    out = tmp_path / "out"
    torn_manifest_copy(ref, out)
    rc, stdout, stderr = hsx_main(ref.argv(out))
    assert rc == 0, stderr
    assert_equals_reference(out, ref, verify=False)


# ---- secrets ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_hub_token_is_never_printed_or_written(tmp_path, fault_reference):
    secret = "hf_secretvalue123"
    ref = fault_reference
    out = tmp_path / "out"
    child = hsx_child(ref.argv(out, "--limit", "24"), tmp_path / "run", HF_TOKEN=secret,
                      HUGGING_FACE_HUB_TOKEN=secret)
    rc = child.wait()
    assert rc == 0, child.stderr
    assert is_complete(out)
    assert secret not in child.stdout and secret not in child.stderr
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {"hsx.json", "README.md"} <= {p.name for p in written}
    for p in written:
        assert secret.encode() not in p.read_bytes(), p
