"""Train while extracting (hsx.follow, --max-pending-gb): a trainer reads units as they are committed and releases
them; the extractor waits for it and counts released units as done.

The bar: a 4-unit window on a 40+-unit job never holds more than 4 unconsumed units on disk, and the trainer sees
every row of the uninterrupted run (`hsx.load`) exactly once, state bytes included, across 10 random SIGKILLs of
either side.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hsx
from helpers import Child, child_env, committed_units, hsx_child, hsx_main, manifest_records
from hsx import ledgers
from hsx.config import HsxError, config_from


def digest(hidden, final) -> str:
    """sha256 of a row's state bits: `hsx.load`'s int16 lists and torch rows' bfloat16 tensors alike."""
    h = hashlib.sha256()
    for x in (hidden, final):
        if isinstance(x, torch.Tensor):
            h.update(x.contiguous().view(torch.int16).numpy().tobytes())
        else:
            h.update(np.asarray(x, dtype=np.int16).tobytes())
    return h.hexdigest()


def reference_rows(out: Path) -> dict[int, str]:
    ds = hsx.load(out)
    return {r["sample_id"]: digest(r["hidden_states"], r["final_hidden_state"]) for r in ds}


# ---- the parts, on the finished reference ----------------------------------------------------------------------

def test_max_pending_gb_is_a_checked_number(small_chat_path):
    base = {"model": "m", "dataset": str(small_chat_path), "output_dir": "o", "layers": [1]}
    assert config_from({**base, "max_pending_gb": 4}).max_pending_gb == 4.0
    assert config_from({**base, "max_pending_gb": 0.5}).max_pending_gb == 0.5
    for bad, why in (("4", "must be a number"), (True, "must be a number"), (0, "at least"), (-1.0, "at least"),
                     (float("nan"), "must be a number")):
        with pytest.raises(HsxError, match=why):
            config_from({**base, "max_pending_gb": bad})
    with pytest.raises(HsxError, match="max_pending_gb"):
        hsx.stream(model="m", dataset=str(small_chat_path), layers=[1], max_pending_gb=1)


def test_follow_rows_equal_load_rows(fault_reference):
    ref = fault_reference
    want = hsx.load(ref.out)
    dict_rows = list(hsx.follow(ref.out, rows="dict", commit="manual"))
    assert sorted(r["sample_id"] for r in dict_rows) == sorted(want["sample_id"])
    by_id = {r["sample_id"]: r for r in want}
    for r in dict_rows:
        assert r == by_id[r["sample_id"]]
    view = hsx.torch_view(ref.out)
    at = {view[i]["sample_id"]: i for i in range(len(view))}
    torch_rows = list(hsx.follow(ref.out, commit="manual"))
    assert len(torch_rows) == len(view)
    for r in torch_rows:
        v = view[at[r["sample_id"]]]
        assert r.keys() == v.keys()
        for k in r:
            if isinstance(r[k], torch.Tensor):
                assert r[k].dtype == v[k].dtype and torch.equal(r[k].view(torch.int16) if r[k].dtype ==
                                                                torch.bfloat16 else r[k], v[k].view(torch.int16)
                                                                if v[k].dtype == torch.bfloat16 else v[k])
            else:
                assert r[k] == v[k]
    assert not list((ref.out / ".hsx").glob("consumed-*"))  # manual: nothing recorded without commit()


def test_consumed_units_are_done_and_resume_from_the_ledger(tmp_path, fault_reference):
    from hsx.sink import OutputDir

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    f = hsx.follow(out, delete_consumed=True, rows="dict", commit="manual", rank=0, world_size=1)
    it = iter(f)
    first = [next(it)]
    while not any(n == f.records[u]["rows"] for u, n in f.state_dict()["position"].items()):
        first.append(next(it))  # until one unit is read whole (units hold several length buckets' rows)
    first += [next(it) for _ in range(2)]  # and a little of the next
    state = f.state_dict()
    f.commit(state)
    whole = [u for u, n in state["position"].items() if n == f.records[u]["rows"]]
    assert whole and all(not (out / "data" / f"train-{u}.arrow").exists() for u in whole)
    o = OutputDir(out)
    assert set(ledgers.done_units(o.state, o.data)) == {r["unit"] for r in manifest_records(out)}  # deleted, still done
    assert o.file_problem({"file": f"train-{whole[0]}.arrow", "bytes": f.records[whole[0]]["bytes"],
                           "crc32": f.records[whole[0]]["crc32"]}) == "consumed"
    assert o.check_units(all_crc=True) == []
    with pytest.warns(UserWarning, match="deleted once a trainer consumed"):
        assert len(hsx.load(out)) == len(fault_reference.sample_ids) - sum(f.records[u]["rows"] for u in whole)
    # a new reader resumes where the ledger says; an older checkpoint than what was deleted is refused
    rest = list(hsx.follow(out, rows="dict", commit="manual"))
    assert sorted(r["sample_id"] for r in first + rest) == sorted(fault_reference.sample_ids)
    g = hsx.follow(out, rows="dict", commit="manual")
    with pytest.raises(HsxError, match="older than what consumer 'trainer' committed and deleted"):
        g.load_state_dict({**state, "position": {}})


def test_follow_reads_no_unit_swapped_for_a_link_or_cut_short(tmp_path, fault_reference):
    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    unit = sorted((out / "data").glob("train-*.arrow"))[0]
    outside = tmp_path / "secret.arrow"
    shutil.copyfile(unit, outside)  # the same bytes, outside the output: only the link gives it away
    unit.unlink()
    unit.symlink_to(outside)
    with pytest.raises(HsxError, match="symbolic link"):
        list(hsx.follow(out, rows="dict", commit="manual"))
    unit.unlink()
    unit.write_bytes(outside.read_bytes()[:-8])
    with pytest.raises(HsxError, match="bytes, not|its manifest line says"):
        list(hsx.follow(out, rows="dict", commit="manual"))


def test_the_window_counts_committed_and_in_flight_units_not_a_killed_commits_leftover(tmp_path, fault_reference):
    """A kill between a unit's rename into data/ and its manifest line leaves a file no trainer can read (follow
    reads committed units) and the redo replaces: counting it made a resumed job wait for ever on a trainer that had
    consumed everything (seen once in CI as a 120 s stall of the window test below)."""
    from hsx.follow import ConsumerWindow, pending_bytes
    from hsx.sink import OutputDir

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    o = OutputDir(out)
    records = ledgers.manifest_records(o.state)
    biggest = max(records.values(), key=lambda r: r["bytes"])
    assert pending_bytes(o) == sum(r["bytes"] for r in records.values())  # nothing consumed: every unit
    f = hsx.follow(out, rows="dict", commit="manual", delete_consumed=True)
    f.commit({**f.state_dict(), "position": {u: r["rows"] for u, r in records.items() if u != biggest["unit"]}})
    assert pending_bytes(o) == biggest["bytes"]  # the one unit not consumed
    manifest = out / ".hsx" / "manifest-00000.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(ln for ln in lines if json.loads(ln)["unit"] != biggest["unit"]))
    assert (out / "data" / biggest["file"]).exists()  # now a leftover: in data/, no manifest line
    assert pending_bytes(o) == 0
    said = []
    ConsumerWindow(o, biggest["bytes"] / 1e9, said.append, poll_seconds=0.01).wait(_Never())
    assert said == []  # it did not wait
    # this process's own unit between its rename and its manifest line is counted, once (also while in .hsx/tmp/)
    assert pending_bytes(o, [biggest["unit"]]) == biggest["bytes"]
    o.tmp.mkdir(parents=True)
    shutil.copyfile(out / "data" / biggest["file"], o.unit_tmp_path(biggest["unit"]))
    assert pending_bytes(o, [biggest["unit"]]) == pending_bytes(o) == biggest["bytes"]


def test_a_resume_removes_a_killed_commits_leftover_and_does_not_wait_for_it(tmp_path, fault_reference):
    """The same kill, then `hsx extract --max-pending-gb` resumed with the trainer done with every other unit: the
    leftover goes (it is redone, never read), so the window is empty and the job finishes instead of waiting."""
    from hsx.sink import OutputDir

    ref = fault_reference
    out = tmp_path / "out"
    shutil.copytree(ref.out, out)
    records = ledgers.manifest_records(OutputDir(out).state)
    biggest = max(records.values(), key=lambda r: r["bytes"])
    f = hsx.follow(out, rows="dict", commit="manual", delete_consumed=True)
    f.commit({**f.state_dict(), "position": {u: r["rows"] for u, r in records.items() if u != biggest["unit"]}})
    manifest = out / ".hsx" / "manifest-00000.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(ln for ln in lines if json.loads(ln)["unit"] != biggest["unit"]))
    child = hsx_child([*ref.argv(out), "--max-pending-gb", f"{biggest['bytes'] / 1e9:.12f}"], tmp_path / "run")
    try:
        assert child.wait(timeout=180) == 0, child.stderr
    finally:
        child.kill_tree(signal.SIGKILL)
    said = child.stdout + child.stderr
    assert f"never recorded ({biggest['file']}) removed; they are redone" in said, said
    assert "waiting:" not in said
    redone = ledgers.manifest_records(OutputDir(out).state)[biggest["unit"]]
    assert (redone["bytes"], redone["crc32"]) == (biggest["bytes"], biggest["crc32"])  # the same bytes, redone
    assert json.loads((out / "hsx.json").read_text())["complete"]


class _Never:
    """A stop flag that is never set (hsx.job's Stop, as ConsumerWindow.wait reads it)."""

    def __init__(self):
        self.event = threading.Event()

    def is_set(self):
        return False


def test_follow_refuses_dataloader_workers(fault_reference):
    loader = torch.utils.data.DataLoader(hsx.follow(fault_reference.out, commit="manual"), num_workers=1,
                                         collate_fn=hsx.collate)
    with pytest.raises(Exception, match="num_workers=0"):
        next(iter(loader))


def test_follow_pickles_and_a_spawn_worker_refuses_with_the_same_error(fault_reference):
    """The reader pickles with its position (a spawn DataLoader worker gets it so), and the worker's copy refuses
    to read with the error a fork worker gives, not a pickling error."""
    import pickle

    f = hsx.follow(fault_reference.out, commit="manual")
    it = iter(f)
    next(it)
    copy = pickle.loads(pickle.dumps(f))  # (while f hands out rows: the copy is not iterating)
    assert copy.state_dict() == f.state_dict() and sum(f.state_dict()["position"].values()) == 1
    copy.load_state_dict(f.state_dict())
    assert torch.equal(next(iter(copy))["hidden_states"], next(it)["hidden_states"])  # the copy reads on from there
    assert copy.state_dict() == f.state_dict()  # (2 rows handed out by each)
    loader = torch.utils.data.DataLoader(hsx.follow(fault_reference.out, commit="manual"), num_workers=1,
                                         collate_fn=hsx.collate, multiprocessing_context="spawn")
    with pytest.raises(HsxError, match="hsx.follow reads in the training process: use DataLoader.num_workers=0"):
        next(iter(loader))


def test_follow_splits_units_between_ranks(fault_reference):
    seen = [r["sample_id"] for k in range(3)
            for r in hsx.follow(fault_reference.out, rows="dict", commit="manual", rank=k, world_size=3)]
    assert sorted(seen) == sorted(fault_reference.sample_ids)


@pytest.mark.slow
def test_a_job_waiting_for_its_trainer_stops_cleanly_on_sigterm(tmp_path, fault_reference):
    sig, code = signal.SIGTERM, 143  # (SIGINT takes the same handler: test_faults)
    out = tmp_path / "out"
    child = hsx_child([*fault_reference.argv(out), "--max-pending-gb", "0.000001"], tmp_path / "run")
    assert child.poll_until(lambda: "waiting:" in child.stdout, timeout=240), child.stderr
    assert child.poll_until(lambda: committed_units(out) == 1)  # one unit (committed in the background)
    time.sleep(1.0)
    assert committed_units(out) == 1  # then the wait: nobody consumes
    child.signal(sig)
    assert child.wait(timeout=60) == code, child.stderr
    assert "stopped cleanly after 1 of" in child.stderr, child.stderr
    assert committed_units(out) == 1


# ---- the bar: a 4-unit window, 10 random kills of either side ---------------------------------------------------

CONSUMER = r'''
import hashlib, json, os, sys, time
import torch
import hsx
import hsx.errors


def digest(hidden, final):  # as test_follow.digest, for torch rows
    h = hashlib.sha256()
    for x in (hidden, final):
        h.update(x.contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def run(url, ckpt):
    saved = json.load(open(ckpt)) if os.path.exists(ckpt) else {"seen": [], "data": None}
    rows = hsx.follow(url, delete_consumed=True, commit="manual", poll_seconds=0.05)
    if saved["data"] is not None:
        rows.load_state_dict(saved["data"])
    seen = saved["seen"]
    for row in rows:
        seen.append([row["sample_id"], digest(row["hidden_states"], row["final_hidden_state"])])
        state = rows.state_dict()
        tmp = ckpt + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"seen": seen, "data": state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ckpt)
        rows.commit(state)  # after the checkpoint is durable
    return len(seen)


while True:  # (over hsx serve) the server restarted: start again from the checkpoint, as a scheduler would
    try:
        print("consumer: done", run(sys.argv[1], sys.argv[2]))
        break
    except hsx.errors.HsxError as e:
        if "unreachable" not in str(e):
            raise
        print("consumer: restart after", e, file=sys.stderr, flush=True)
        time.sleep(0.2)
'''


def unconsumed_on_disk(out: Path) -> int:
    """Units on disk no trainer has consumed: committed ones in data/, and ones being written under .hsx/tmp/.
    Listed in this order, then the ledgers read, so a unit moving or released meanwhile is never counted twice."""
    from hsx.sink import OutputDir

    data = [p.name for p in (out / "data").glob("train-*.arrow")] if (out / "data").is_dir() else []
    writing = list((out / ".hsx").glob("tmp/*/train-*.arrow"))
    consumed = ledgers.consumed(OutputDir(out).state) if (out / ".hsx").is_dir() else {}
    return len([n for n in data if n not in consumed]) + len(writing)


@contextlib.contextmanager
def watching_the_window(out: Path):
    """A thread listing `out` every 2 ms while the block runs; yields [the most unconsumed units it saw]."""
    most, stop_watch = [0], threading.Event()

    def watch():
        while not stop_watch.is_set():
            try:
                most[0] = max(most[0], unconsumed_on_disk(out))
            except (OSError, HsxError):
                pass
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield most
    finally:
        stop_watch.set()
        watcher.join()


def seen_count(ckpt: Path) -> int:
    try:
        return len(json.loads(ckpt.read_text())["seen"])
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
def test_window_of_4_units_and_10_random_kills_see_every_row_once(tmp_path, fault_reference):
    ref = fault_reference
    want = reference_rows(ref.out)
    sizes = [r["bytes"] for r in manifest_records(ref.out)]
    assert len(sizes) >= 40
    window = 4 * min(sizes)  # bytes: fewer than 4 of the smallest units pending before a unit starts
    out, ckpt = tmp_path / "out", tmp_path / "ckpt.json"
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    argv = [*ref.argv(out), "--max-pending-gb", f"{window / 1e9:.12f}"]
    runs = {"extractor": 0, "consumer": 0}

    def start(side: str):
        runs[side] += 1
        logs = tmp_path / f"{side}{runs[side]}"
        if side == "extractor":
            return hsx_child(argv, logs)
        return Child([sys.executable, str(script), str(out), str(ckpt)], logs, env=child_env())

    with watching_the_window(out) as most:
        t0 = time.monotonic()
        procs = {"extractor": start("extractor"), "consumer": start("consumer")}
        rng = random.Random(26)
        kills = []
        try:
            while len(kills) < 10:
                side = rng.choice(sorted(s for s, p in procs.items() if p.proc.poll() is None) or ["none"])
                assert side != "none", f"the job ended after {len(kills)} kills"
                p = procs[side]
                progress = (lambda: committed_units(out)) if side == "extractor" else (lambda: seen_count(ckpt))
                start_at = progress()
                if p.poll_until(lambda: progress() > start_at, timeout=120):  # mid-job: it did something since
                    time.sleep(rng.uniform(0.0, 0.3))
                    if p.proc.poll() is None:
                        p.kill_tree(signal.SIGKILL)
                        kills.append((side, progress(), round(time.monotonic() - t0, 1)))
                p.wait()
                if not (side == "extractor" and p.proc.returncode == 0):
                    procs[side] = start(side)
            for side in ("extractor", "consumer"):
                assert procs[side].wait(timeout=300) == 0, procs[side].stderr
        finally:
            for p in procs.values():
                p.kill_tree(signal.SIGKILL)
    print(f"kills (side, progress, s): {kills}; ended at {time.monotonic() - t0:.1f} s; most unconsumed units "
          f"on disk: {most[0]}")
    assert len(kills) == 10 and {k[0] for k in kills} == {"extractor", "consumer"}
    assert "consumer: done" in procs["consumer"].stdout

    seen = json.loads(ckpt.read_text())["seen"]
    ids = [s for s, _ in seen]
    assert len(ids) == len(set(ids)), "a row was seen twice"
    assert {s: d for s, d in seen} == want  # every row, state bits equal to hsx.load's of the uninterrupted run
    assert 1 <= most[0] <= 4, most[0]
    assert any("waiting:" in (tmp_path / f"extractor{k}" / "stderr.txt").read_text() + (
        tmp_path / f"extractor{k}" / "stdout.txt").read_text() for k in range(1, runs["extractor"] + 1))
    # the extractor's view: complete, every unit listed, nothing left on disk, a rerun checks and does nothing
    info = json.loads((out / "hsx.json").read_text())
    assert info["complete"] and info["counts"] == ref.info["counts"]
    assert sorted(e["file"] for e in info["files"]) == sorted(p.name for p in (ref.out / "data").iterdir())
    assert not list((out / "data").glob("train-*.arrow"))
    rc, stdout, stderr = hsx_main([*argv, "--check-crc"])
    assert rc == 0 and "already complete" in stdout, stderr


# ---- the default commit loses no row; what a reader writes; dirs hsx merge made ---------------------------------

def unit_of_rows(out: Path) -> dict[int, str]:
    """sample_id -> the unit file holding it."""
    from datasets import Dataset

    return {s: f.name for f in sorted((out / "data").glob("train-*.arrow"))
            for s in Dataset.from_file(str(f))["sample_id"]}


@pytest.mark.parametrize("over", ["dir", "grpc"])
def test_a_unit_is_deleted_only_once_the_step_over_its_last_row_returned(tmp_path, fault_reference, over):
    """The DataLoader asks for the rows of the batch it builds while the previous batch's step has returned, and
    not the current one's: a unit whose last row is in the batch being trained stays on disk (the old commit
    deleted it while the DataLoader built that batch: a kill in its step lost the rows). The same over
    `hsx serve` (the server deletes)."""
    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    where = unit_of_rows(out)
    if over == "grpc":
        from hsx.serve import make_server

        server = make_server(out, "127.0.0.1", 0, None)
        threading.Thread(target=server.serve, daemon=True).start()
    rows = hsx.follow(out if over == "dir" else server.location, delete_consumed=True, rows="dict",
                      poll_seconds=0.01)
    trained: list[int] = []
    for batch in torch.utils.data.DataLoader(rows, batch_size=7, collate_fn=list):  # 13 batches of 7, then 5
        ids = [r["sample_id"] for r in batch]
        assert all((out / "data" / where[s]).exists() for s in ids)  # this step's rows: all still on disk
        gone = {where[s] for s in trained} - {where[s] for s in ids}
        assert all(not (out / "data" / f).exists() for f in gone)  # rows of steps that returned: released
        trained += ids
    assert sorted(trained) == sorted(fault_reference.sample_ids)
    left = {p.name for p in (out / "data").glob("train-*.arrow")}
    assert left and left <= {where[s] for s in trained[-5:]}  # the last step's units: kept until commit()
    rows.commit()
    assert not list((out / "data").glob("train-*.arrow"))
    if over == "grpc":
        server.shutdown()
        return
    # without a DataLoader, rows one by one (each its own step), or a batch size given
    for batch_size, got in ((None, 1), (5, 5)):
        out2 = tmp_path / f"out{batch_size}"
        shutil.copytree(fault_reference.out, out2)
        it = iter(hsx.follow(out2, delete_consumed=True, rows="dict", batch_size=batch_size))
        ids = [next(it)["sample_id"] for _ in range(40)]
        kept = {p.name for p in (out2 / "data").glob("train-*.arrow")}
        start = 40 - (40 % got or got) if got > 1 else 39  # the rows of the step not yet returned
        assert {where[s] for s in ids[start:]} <= kept
        assert not {where[s] for s in ids[:start]} - {where[s] for s in ids[start:]} & kept


def test_a_position_past_a_units_rows_is_an_error(fault_reference):
    f = hsx.follow(fault_reference.out, rows="dict", commit="manual")
    unit, rec = next(iter(f.records.items()))
    for bad in ({unit: rec["rows"] + 1}, {unit: 10**9}):
        with pytest.raises(HsxError, match=f"{rec['rows'] + 1 if bad[unit] < 10**9 else 10**9} rows of unit "
                                           f"{unit} were read, it holds {rec['rows']}"):
            f.load_state_dict({**f.state_dict(), "position": bad})
        with pytest.raises(HsxError, match="were read, it holds"):
            f.commit({**f.state_dict(), "position": bad})
    f.load_state_dict({**f.state_dict(), "position": {unit: rec["rows"]}})  # the whole unit: fine
    assert len(list(f)) == len(fault_reference.sample_ids) - rec["rows"]


def test_a_reader_that_does_not_delete_writes_nothing_and_reads_a_read_only_output(tmp_path, fault_reference):
    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*"))
    for p in [out, *out.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)  # chmod -R a-w
    try:
        for commit in ("unit", "manual"):
            rows = hsx.follow(out, rows="dict", commit=commit)
            assert sorted(r["sample_id"] for r in rows) == sorted(fault_reference.sample_ids)
            rows.commit()
        loader = torch.utils.data.DataLoader(hsx.follow(out), batch_size=8, collate_fn=hsx.collate)
        assert sum(len(b["sample_id"]) for b in loader) == 96
    finally:
        for p in [out, *out.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_a_dir_hsx_merge_joined_is_followable_finished_or_partial(tmp_path, fault_reference):
    from test_merge import split_like_two_nodes

    from hsx.merge import merge

    node0, node1 = split_like_two_nodes(fault_reference.out, tmp_path)
    merge(str(tmp_path / "joined"), [str(node0), str(node1)], log=lambda *a: None)
    want = {r["sample_id"]: r for r in hsx.load(fault_reference.out)}
    got = list(hsx.follow(tmp_path / "joined", rows="dict"))
    assert len(got) == len(want) and all(r == want[r["sample_id"]] for r in got)
    merge(str(tmp_path / "partial"), [str(node0)], log=lambda *a: None, partial=True)  # node 1 lost
    rows = hsx.follow(tmp_path / "partial", rows="dict", timeout=0.5, poll_seconds=0.05, delete_consumed=True)
    got = []
    with pytest.raises(HsxError, match="no new unit for 0.5 s"):
        for r in rows:
            got.append(r["sample_id"])
    assert sorted(got) == sorted(unit_of_rows(node0))  # node 0's rows, read through the links
    rows.commit()  # the links go, never their targets
    assert not list((tmp_path / "partial" / "data").iterdir()) and len(list((node0 / "data").iterdir())) > 0


NEW_USER = r'''
import json, os, sys, time
import hsx
from torch.utils.data import DataLoader

out, log = sys.argv[1], sys.argv[2]
for batch in DataLoader(hsx.follow(out, delete_consumed=True, poll_seconds=0.05), batch_size=8,
                        collate_fn=hsx.collate):
    time.sleep(1.0)  # the training step
    with open(log, "a") as f:  # what the step trained on, once it returned
        f.write(json.dumps(batch["sample_id"].tolist()) + "\n")
        f.flush()
        os.fsync(f.fileno())
'''


@pytest.mark.slow
@pytest.mark.parametrize("over", ["dir", "grpc"])
def test_the_readmes_two_terminals_with_a_kill_inside_batch_5_see_every_row(tmp_path, over):
    """The README's demo (`--unit-tokens 800 --max-pending-gb 0.002`, a DataLoader of batch 8 over
    `hsx.follow(OUT, delete_consumed=True)`), the trainer killed -9 in its 5th step and started again: every row is
    trained on (the old default committed and deleted a unit while the DataLoader built the batch holding its last
    rows: 94 of 96)."""
    from helpers import REPO

    out, log = tmp_path / "out", tmp_path / "trained.jsonl"
    script = tmp_path / "trainer.py"
    script.write_text(NEW_USER)
    extractor = hsx_child(["extract", "--config", str(REPO / "recipes" / "demo.yaml"), "--output-dir", str(out),
                           "--unit-tokens", "800", "--max-pending-gb", "0.002"], tmp_path / "extractor")
    batches = lambda: len(log.read_text().splitlines()) if log.exists() else 0  # noqa: E731
    source, server = str(out), None
    if over == "grpc":  # the trainer is given only the server's address
        from helpers import free_port

        out.mkdir()
        port = free_port()
        source, server = f"grpc://127.0.0.1:{port}", hsx_child(["serve", str(out), "--port", str(port)],
                                                              tmp_path / "server")
    try:
        trainer = Child([sys.executable, str(script), source, str(log)], tmp_path / "trainer1", env=child_env())
        assert trainer.poll_until(lambda: batches() == 4, timeout=240), trainer.stderr
        time.sleep(0.5)  # inside the 5th step
        trainer.kill_tree(signal.SIGKILL)
        trainer.wait()
        assert batches() == 4
        trainer = Child([sys.executable, str(script), source, str(log)], tmp_path / "trainer2", env=child_env())
        assert trainer.wait(timeout=300) == 0, trainer.stderr
        assert extractor.wait(timeout=120) == 0, extractor.stderr
    finally:
        for p in (extractor, trainer, server):
            if p is not None:
                p.kill_tree(signal.SIGKILL)
    seen = [s for line in log.read_text().splitlines() for s in json.loads(line)]
    assert len(set(seen)) == 96, sorted(set(range(100)) - set(seen))
    biggest = max(e["rows"] for e in json.loads((out / "hsx.json").read_text())["files"])
    assert len(seen) - 96 <= 8 + biggest  # the duplicates: the killed step's rows, and those of a unit it began


def test_a_dataloader_whose_batches_follow_cannot_see_is_an_error_not_a_guess(tmp_path, fault_reference, monkeypatch):
    """commit="unit" learns where a batch starts from torch's fetcher; a fetcher built otherwise (another torch)
    must not be taken for rows one by one (that committed units a step had not seen): one error naming batch_size=,
    and with batch_size= given the same DataLoader reads every row."""
    from torch.utils.data._utils import fetch

    def fetch_as_a_tuple(self, possibly_batched_index):  # a batch built without a `data` list to look at
        rows = tuple(row for _, row in zip(possibly_batched_index, self.dataset_iter))
        if not rows:
            raise StopIteration
        return self.collate_fn(list(rows))

    monkeypatch.setattr(fetch._IterableDatasetFetcher, "fetch", fetch_as_a_tuple)
    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    with pytest.raises(HsxError, match="batch_size=B"):
        next(iter(torch.utils.data.DataLoader(hsx.follow(out, rows="dict"), batch_size=4, collate_fn=list)))
    seen = [r["sample_id"] for batch in torch.utils.data.DataLoader(
        hsx.follow(out, rows="dict", batch_size=4), batch_size=4, collate_fn=list) for r in batch]
    assert sorted(seen) == sorted(fault_reference.sample_ids)


import os  # noqa: E402

from helpers import LONG_DIGITS, call_with_deadline, drop_manifest_line  # noqa: E402
from hsx.sink import OutputDir  # noqa: E402


# ---- consumed ledgers: forged, torn, linked or FIFO ledgers never lose or hang a unit ------------------------------

def test_follow_and_the_window_read_a_ledger_line_with_a_number_too_long_as_torn(finished_copy):
    from hsx.follow import pending_bytes

    before = pending_bytes(OutputDir(finished_copy))
    (finished_copy / ".hsx" / "consumed-trainer-00000.jsonl").write_text(f'{{"unit": "x", "n": {LONG_DIGITS}}}\n')
    assert pending_bytes(OutputDir(finished_copy)) == before  # (read as a torn line: nothing consumed)
    assert len(list(hsx.follow(finished_copy, rows="dict", commit="manual"))) == len(hsx.load(str(finished_copy)))


def test_follow_deletes_no_unit_a_ledger_of_other_bytes_says_was_consumed(finished_copy):
    """A ledger line for a unit with other bytes or CRC-32 than the manifest's (another job's ledger left in the
    dir, a forged one) made follow(delete_consumed=True) skip that unit and delete it unread."""
    records = ledgers.manifest_records(OutputDir(finished_copy).state)
    victim = sorted(records.values(), key=lambda r: r["unit"])[0]
    forged = {**victim, "row": victim["rows"], "crc32": "00000000"}
    forged = {k: forged[k] for k in ("unit", "file", "bytes", "rows", "row", "crc32")}
    (finished_copy / ".hsx" / "consumed-trainer-00000.jsonl").write_text(json.dumps(forged) + "\n")
    rows = list(hsx.follow(finished_copy, rows="dict", delete_consumed=True))
    assert sum(r["rows"] for r in records.values()) == len(rows)  # the victim's rows were handed out too
    assert ledgers.done_units(finished_copy / ".hsx", finished_copy / "data").keys() == records.keys()


def test_the_window_counts_a_unit_whose_ledger_line_is_of_other_bytes(finished_copy):
    """A consumed line with another CRC-32 than the unit's manifest line is no consumption of that unit (as
    done_units and hsx.follow read it): the window still counts the unit as pending."""
    from hsx.follow import pending_bytes

    before = pending_bytes(OutputDir(finished_copy))
    rec = sorted(ledgers.manifest_records(OutputDir(finished_copy).state).values(), key=lambda r: r["unit"])[0]
    line = {"unit": rec["unit"], "file": rec["file"], "bytes": rec["bytes"], "rows": rec["rows"],
            "row": rec["rows"], "crc32": "00000000"}
    (finished_copy / ".hsx" / "consumed-trainer-00000.jsonl").write_text(json.dumps(line) + "\n")
    assert pending_bytes(OutputDir(finished_copy)) == before
    line["crc32"] = rec["crc32"]
    (finished_copy / ".hsx" / "consumed-trainer-00000.jsonl").write_text(json.dumps(line) + "\n")
    assert pending_bytes(OutputDir(finished_copy)) == before - rec["bytes"]


def test_follow_refuses_a_ledger_that_is_a_link_or_a_fifo_before_appending(finished_copy, tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text("")
    ledger = finished_copy / ".hsx" / "consumed-trainer-00000.jsonl"
    ledger.symlink_to(outside)
    with pytest.raises(HsxError, match="symbolic link"):
        list(hsx.follow(finished_copy, rows="dict"))
    assert outside.read_text() == ""
    ledger.unlink()
    os.mkfifo(ledger)
    with pytest.raises(HsxError, match="not a regular file"):
        hsx.follow(finished_copy, rows="dict")


def test_the_window_of_a_job_is_not_hung_by_a_fifo_ledger(finished_copy):
    from hsx.follow import pending_bytes

    os.mkfifo(finished_copy / ".hsx" / "consumed-trainer-00000.jsonl")
    with pytest.raises(HsxError, match="not a regular file"):
        pending_bytes(OutputDir(finished_copy))


def test_a_fifo_planted_at_the_ledger_after_follow_started_is_refused_not_waited_on(finished_copy):
    # (no ledger yet: nothing to check; it appends to one)
    f = hsx.follow(finished_copy, rows="dict", delete_consumed=True)
    ledger = finished_copy / ".hsx" / "consumed-trainer-00000.jsonl"
    os.mkfifo(ledger)
    done, error = call_with_deadline(lambda: list(f), 60, ledger)
    assert done and isinstance(error, HsxError) and "not a regular file" in str(error), error
    # a reader that deletes nothing reads the ledger (its resume point) and writes none: not held by the FIFO either
    done, error = call_with_deadline(lambda: list(hsx.follow(finished_copy, rows="dict")), 60, ledger)
    assert done and isinstance(error, HsxError) and "not a regular file" in str(error), error


def test_follow_deletes_nothing_through_a_data_dir_swapped_for_a_link(finished_copy, tmp_path):
    """The links are checked when the reader starts; data/ moved elsewhere and linked while the trainer runs
    (days) made each deletion of a consumed unit go through the link."""
    f = hsx.follow(finished_copy, rows="dict", delete_consumed=True)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(finished_copy / "data", elsewhere)
    (finished_copy / "data").symlink_to(elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    with pytest.raises(HsxError, match="symbolic link"):
        list(f)
    assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_follow_of_a_complete_job_that_will_never_commit_a_unit_says_so(finished_copy, tmp_path):
    """hsx.json complete, but a planned unit without a manifest line (or no plan at all: a dir copied without
    .hsx/): nothing will ever commit it, and the reader waited for ever (or until its timeout)."""
    copy = Path(shutil.copytree(finished_copy, tmp_path / "copy"))
    unit = sorted(ledgers.manifest_records(OutputDir(finished_copy).state))[-1]
    drop_manifest_line(finished_copy, unit)
    with pytest.raises(HsxError, match=f"complete, but 1 unit\\(s\\) of its plan have no manifest line "
                                       f"\\(train-{unit}.arrow\\)"):
        list(hsx.follow(finished_copy, rows="dict", commit="manual", timeout=30))
    shutil.rmtree(copy / ".hsx")
    with pytest.raises(HsxError, match="without its job's plan"):
        list(hsx.follow(copy, rows="dict", commit="manual", timeout=30))


@pytest.mark.parametrize("rank,world_size", [(0.5, 2), ("0", 1), (True, 2), (0, 2.0)])
def test_follow_takes_only_integer_ranks(finished_copy, rank, world_size):
    """A float rank passed the range check and failed later formatting the ledger's name; True read as rank 1."""
    with pytest.raises(ValueError, match="integers"):
        hsx.follow(finished_copy, rank=rank, world_size=world_size)


def test_both_sources_are_the_written_source_protocol(tmp_path):
    """hsx.follow.Source is the seam between the reader and its transports: both sources satisfy it, and its members
    are exactly what the reader calls on its source (Follow's `self.src.X`, follow()'s `source.X`), so a new call is
    a deliberate change to the Protocol, not a method one transport happens to have."""
    import ast
    import importlib
    import inspect
    import pickle
    import re

    import hsx.torch_data
    from hsx.flight import FlightSource
    from hsx.follow import LocalSource, Source

    local = LocalSource(tmp_path / "out", write=False)
    remote = FlightSource("grpc://127.0.0.1:1")  # (no call is made: a Flight client connects lazily)
    assert isinstance(local, Source) and isinstance(remote, Source)
    for copy in (pickle.loads(pickle.dumps(local)), pickle.loads(pickle.dumps(remote))):  # the pickling rule
        assert isinstance(copy, Source) and copy.where in (local.where, remote.where)
    assert pickle.loads(pickle.dumps(remote)).taken is None  # a copy has taken no consumer rank
    assert pickle.loads(pickle.dumps(local)).holders == {}

    called = set(re.findall(r"self\.src\.([a-z_]+)", inspect.getsource(hsx.torch_data.Follow)))
    called |= set(re.findall(r"\bsource\.([a-z_]+)", inspect.getsource(importlib.import_module("hsx.follow").follow)))
    tree = ast.parse(inspect.getsource(Source))
    members = {n.name for n in tree.body[0].body if isinstance(n, ast.FunctionDef)}
    members |= {n.target.id for n in tree.body[0].body if isinstance(n, ast.AnnAssign)}
    assert members == called, (members - called, called - members)
    for name in members - {"where"}:  # each with its line of what it guarantees, present on both sources
        assert inspect.getdoc(getattr(Source, name)), name
        assert callable(getattr(local, name)) and callable(getattr(remote, name)), name
