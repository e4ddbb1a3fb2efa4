"""hsx serve: an output dir's committed units over Arrow Flight, read by hsx.follow("grpc://...") with the same rows
and position contract as a local reader, consumption recorded in OUT's ledgers; a hostile client changes nothing."""

from __future__ import annotations

import json
import shutil

import pytest

import hsx
from hsx.config import HsxError
from hsx.errors import UsageError


@pytest.fixture
def served(tmp_path, fault_reference):
    from hsx.serve import make_server

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    server = make_server(out, "127.0.0.1", 0, "s3cret-token-0123456789")
    import threading

    threading.Thread(target=server.serve, daemon=True).start()
    yield out, server.location, "s3cret-token-0123456789"
    server.shutdown()


def listing(out):
    return sorted((p.relative_to(out), p.stat().st_size) for p in out.rglob("*") if p.is_file())


def test_rows_over_flight_equal_the_local_readers_and_consumption_lands_in_out(served, fault_reference):
    out, url, token = served
    local = list(hsx.follow(fault_reference.out, rows="dict", commit="manual"))
    remote = hsx.follow(url, rows="dict", commit="manual", token=token, delete_consumed=True)
    got = list(remote)
    assert got == local  # the same rows in the same order
    t_local = next(iter(hsx.follow(fault_reference.out, commit="manual")))
    t_remote = next(iter(hsx.follow(url, commit="manual", token=token)))
    assert t_local.keys() == t_remote.keys() and all(
        (t_local[k] == t_remote[k]).all() if hasattr(t_local[k], "shape") else t_local[k] == t_remote[k]
        for k in t_local)
    assert not list((out / ".hsx").glob("consumed-*"))  # manual: nothing until commit()
    split = [r["sample_id"] for k in range(3)  # ranks split the units as a local reader's do
             for r in hsx.follow(url, rows="dict", commit="manual", rank=k, world_size=3, token=token)]
    assert sorted(split) == sorted(r["sample_id"] for r in local)
    other = list(hsx.follow(url, consumer="eval", rows="dict", token=token))
    assert other == local  # another job reads OUT by its own name (not deleting: writing nothing)
    state = remote.state_dict()
    remote.commit(state)
    assert not list((out / "data").glob("train-*.arrow"))  # the server deleted them, after its ledger line
    ledger = (out / ".hsx" / "consumed-trainer-00000.jsonl").read_text().splitlines()
    assert not (out / ".hsx" / "consumed-eval-00000.jsonl").exists()
    assert len(ledger) == len(state["position"])
    # a new reader resumes where the ledger says (nothing left)
    assert list(hsx.follow(url, rows="dict", token=token, timeout=5)) == []


def test_a_pickled_remote_reader_reconnects_with_its_token(served, monkeypatch):
    """A spawn DataLoader worker gets hsx.follow's reader by pickle: a grpc:// one connects again, with its token."""
    import pickle

    monkeypatch.delenv("HSX_SERVE_TOKEN", raising=False)
    out, url, token = served
    f = hsx.follow(url, rows="dict", commit="manual", token=token)
    it = iter(f)
    next(it)
    copy = pickle.loads(pickle.dumps(f))
    assert copy.state_dict() == f.state_dict()
    assert next(iter(copy)) == next(it)  # read over its own connection, from the position it was pickled at


def test_a_client_without_the_token_is_refused_and_a_public_bind_needs_one(served, tmp_path):
    from hsx.serve import make_server

    out, url, token = served
    before = listing(out)
    for bad in (None, "wrong-token-0123456789", token + "x"):
        with pytest.raises(HsxError, match="refused the request.*bearer token"):
            hsx.follow(url, rows="dict", token=bad or "", delete_consumed=True)
    assert listing(out) == before
    with pytest.raises(UsageError, match="give a token"):
        make_server(out, "0.0.0.0", 0, None)


def test_a_hostile_client_gets_one_error_and_changes_nothing(served):
    import pyarrow.flight as flight

    from hsx.flight import bearer

    out, url, token = served
    client = flight.FlightClient(url.replace("grpc://", "grpc+tcp://"))
    opts = flight.FlightCallOptions(headers=bearer(token))
    records = {json.loads(ln)["unit"]: json.loads(ln) for ln in (out / ".hsx" / "manifest-00000.jsonl").open()}
    unit, rec = sorted(records.items())[0]
    claim = {"consumer": "t", "rank": 0, "world_size": 1, "session": "s1"}  # (commits need the claim: test_consumers)
    list(client.do_action(flight.Action("claim", json.dumps(claim).encode()), options=opts))
    before = listing(out)
    tickets = [b"not json", b"[1]", json.dumps({"unit": "../../etc/passwd"}).encode(),
               json.dumps({"unit": "/etc/passwd"}).encode(), json.dumps({"unit": 7}).encode(), b"x" * (5 << 20)]
    for t in tickets:
        with pytest.raises(flight.FlightError):
            client.do_get(flight.Ticket(t), options=opts).read_all()
    actions = [("commit", {"consumer": "../x", "rank": 0, "world_size": 1, "rows": {unit: 1}}),
               ("commit", {"consumer": "t", "rank": 3, "world_size": 2, "rows": {unit: 1}}),
               ("commit", {"consumer": "t", "rank": 0, "world_size": 1, "rows": {"nope": 1}}),
               ("commit", {"consumer": "t", "rank": 0, "world_size": 1, "rows": {unit: rec["rows"] + 1}}),
               ("commit", {"consumer": "t", "rank": 0, "world_size": 1, "rows": {unit: -1}}),
               ("commit", {"consumer": "t", "rank": 0, "world_size": 1, "rows": [unit]}),
               ("hold", {"consumer": "t", "rank": 0, "world_size": 1, "units": ["../../x"]}),
               ("rm", {}), ("ledger", {"consumer": "a/b"})]
    for kind, body in actions:
        with pytest.raises(flight.FlightError) as e:
            list(client.do_action(flight.Action(kind, json.dumps({**body, "session": "s1"}).encode()),
                                  options=opts))
        assert "Traceback" not in str(e.value)
    assert listing(out) == before
    # a position recorded once, then replayed or rewound: one error, the ledger as it was
    ok = ("commit", {"consumer": "t", "rank": 0, "world_size": 1, "rows": {unit: rec["rows"]}, "session": "s1"})
    list(client.do_action(flight.Action(ok[0], json.dumps(ok[1]).encode()), options=opts))
    assert not (out / "data" / rec["file"]).exists()
    after = listing(out)
    for row in (rec["rows"], 1):
        body = {**ok[1], "rows": {unit: row}}
        with pytest.raises(flight.FlightError, match="recorded only forward"):
            list(client.do_action(flight.Action("commit", json.dumps(body).encode()), options=opts))
    assert listing(out) == after


def test_serve_command_line_errors_are_one_line(tmp_path):
    from helpers import assert_one_error_line, hsx_main

    rc, _, err = hsx_main(["serve", str(tmp_path), "--host", "0.0.0.0", "--port", "0"])
    assert_one_error_line(rc, err, "give a token")
    assert rc == 2
    (tmp_path / "a-file").write_text("")
    rc, _, err = hsx_main(["serve", str(tmp_path / "a-file"), "--port", "0"])
    assert_one_error_line(rc, err, "is not a folder")
    (tmp_path / "tok").write_text("short\n")
    rc, _, err = hsx_main(["serve", str(tmp_path), "--token-file", str(tmp_path / "tok")])
    assert_one_error_line(rc, err, "at least 16")


def test_serve_started_before_the_output_exists_serves_it_once_created(tmp_path, fault_reference):
    """docs/follow.md starts `hsx serve OUT` beside a new `hsx extract --output-dir OUT`: OUT may not exist yet when
    the server starts. It must serve OUT once created (not exit, leaving the extractor waiting for a reader)."""
    import threading

    from hsx.serve import make_server

    out, said = tmp_path / "out", []
    server = make_server(out, "127.0.0.1", 0, None, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    threading.Thread(target=server.serve, daemon=True).start()
    try:
        assert any("does not exist yet" in line for line in said), said
        reader = hsx.follow(server.location, rows="dict", commit="manual", poll_seconds=0.05, timeout=60)
        got, started = [], threading.Event()

        def read():
            started.set()
            got.extend(reader)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        started.wait()
        shutil.copytree(fault_reference.out, tmp_path / "staged")
        (tmp_path / "staged").rename(out)  # the extractor creates OUT and commits (here: all at once)
        t.join(timeout=120)
        assert not t.is_alive()
    finally:
        server.shutdown()
    assert got == list(hsx.follow(fault_reference.out, rows="dict", commit="manual"))


# ---- the bar: extractor, server and a consumer that sees only grpc://, SIGKILLs of each ------------------------

@pytest.mark.slow
def test_a_consumer_reading_only_over_flight_sees_every_row_once_across_kills_of_all_three(tmp_path,
                                                                                         fault_reference):
    import random
    import signal
    import sys
    import time

    from helpers import Child, child_env, committed_units, free_port, hsx_child, manifest_records
    from test_follow import CONSUMER, reference_rows, seen_count, watching_the_window

    ref = fault_reference
    want = reference_rows(ref.out)
    window = 4 * min(r["bytes"] for r in manifest_records(ref.out))
    out, ckpt = tmp_path / "out", tmp_path / "elsewhere" / "ckpt.json"
    ckpt.parent.mkdir()
    script = ckpt.parent / "consumer.py"
    script.write_text(CONSUMER)  # (given the URL where a local one is given OUT)
    port = free_port()
    url = f"grpc://127.0.0.1:{port}"
    argv = {"extractor": [*ref.argv(out), "--max-pending-gb", f"{window / 1e9:.12f}"],
            "server": ["serve", str(out), "--port", str(port)]}
    runs = {"extractor": 0, "server": 0, "consumer": 0}

    def start(side: str):
        runs[side] += 1
        logs = tmp_path / f"{side}{runs[side]}"
        if side == "consumer":  # its only way to OUT is the URL (it runs in another folder, given no path)
            return Child([sys.executable, str(script), url, str(ckpt)], logs, env=child_env(), cwd=ckpt.parent)
        if side == "server":
            out.mkdir(exist_ok=True)
        return hsx_child(argv[side], logs)

    with watching_the_window(out) as most:
        procs = {side: start(side) for side in ("server", "extractor", "consumer")}
        rng = random.Random(42)
        kills = []
        progress = {"extractor": lambda: committed_units(out), "consumer": lambda: seen_count(ckpt),
                    "server": lambda: seen_count(ckpt)}
        try:
            while len(kills) < 6:
                for side in ("server", "consumer"):  # a consumer the server's death ended: its scheduler restarts it
                    if procs[side].proc.poll() not in (None, 0):
                        procs[side].wait()
                        procs[side] = start(side)
                side = ["server", "extractor", "consumer"][len(kills) % 3]
                p = procs[side]
                if p.proc.poll() is not None:
                    if side == "extractor":
                        break
                    continue
                start_at = progress[side]()
                if p.poll_until(lambda: progress[side]() > start_at, timeout=180):
                    time.sleep(rng.uniform(0.0, 0.3))
                    if p.proc.poll() is None:
                        p.kill_tree(signal.SIGKILL)
                        kills.append((side, progress[side]()))
                p.wait()
                if not (side == "extractor" and p.proc.returncode == 0):
                    procs[side] = start(side)
            end = time.monotonic() + 400
            while procs["consumer"].proc.poll() != 0 and time.monotonic() < end:
                if procs["consumer"].proc.poll() is not None:  # ended by the server's restart: start it again
                    procs["consumer"].wait()
                    procs["consumer"] = start("consumer")
                time.sleep(0.2)
            assert procs["consumer"].wait(timeout=60) == 0, procs["consumer"].stderr
            assert procs["extractor"].wait(timeout=120) == 0, procs["extractor"].stderr
        finally:
            for p in procs.values():
                p.kill_tree(signal.SIGKILL)
    print(f"kills: {kills}; runs: {runs}; most unconsumed units on disk: {most[0]}")
    assert {k[0] for k in kills} == {"extractor", "server", "consumer"}, kills
    seen = json.loads(ckpt.read_text())["seen"]
    ids = [s for s, _ in seen]
    assert len(ids) == len(set(ids)), "a row was seen twice"
    assert {s: d for s, d in seen} == want  # every row, state bits equal to the uninterrupted run's
    assert 1 <= most[0] <= 4, most[0]
    assert not list((out / "data").glob("train-*.arrow"))


def test_a_damaged_answer_from_a_server_is_one_error(served, monkeypatch):
    from hsx.flight import FlightSource

    out, url, token = served
    src = FlightSource(url, token)
    real = src._action
    for kind, bad in (("state", lambda a: {**a, "records": {"x": {"unit": "x", "file": "/etc/passwd"}}}),
                      ("state", lambda a: {**a, "summary": {"unit_names": 7}}),
                      ("ledger", lambda a: {"u": {"unit": "u", "row": "all"}})):
        monkeypatch.setattr(src, "_action", lambda k, body, kind=kind, bad=bad: bad(real(k, body)) if k == kind
                            else real(k, body))
        with pytest.raises(HsxError, match=f"a damaged `{kind}` answer"):
            src.records() if kind == "state" else src.ledger("trainer")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stopped_server_says_so_in_one_line_not_as_an_interrupted_job(tmp_path, sig):
    import signal

    from helpers import hsx_child, message_lines

    server = hsx_child(["serve", str(tmp_path), "--port", "0"], tmp_path / "logs")
    try:
        assert server.poll_until(lambda: "hsx serve:" in server.stdout, timeout=60, every=0.05), server.stderr
        server.proc.send_signal(getattr(signal, sig))
        rc = server.wait(60)
    finally:
        server.kill_tree(signal.SIGKILL)
    assert rc == 128 + getattr(signal, sig)
    lines = message_lines(server.stderr)
    assert lines == [lines[0]] and lines[0].startswith(f"hsx: serve: stopped by {sig}"), lines
    assert "run the same command" not in lines[0]  # (an extract's line: a server has no work to continue)


def test_serve_bench_counts_what_several_checking_clients_read(fault_reference, tmp_path):
    from hsx.serve import bench_serve

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    before = listing(out)
    lines = []
    got = bench_serve(str(out), seconds=0.3, clients=3, log=lines.append)
    units = hsx.follow(out, commit="manual").src.records()
    assert got["clients"] == 3 and len(got["gb_per_s_per_client"]) == 3 and min(got["bytes_per_client"]) > 0
    assert got["unit_reads"] >= 3 and len(units) > 1  # each client read at least a unit
    assert got["bytes"] > 0 and got["gb_per_s"] > 0
    assert "by 3 clients" in lines[-1]
    assert listing(out) == before  # a bench reads; it records and deletes nothing
    from helpers import assert_one_error_line, hsx_main

    rc, _, err = hsx_main(["serve", str(out), "--clients", "2"])
    assert_one_error_line(rc, err, "--clients is --bench's")
    rc, _, err = hsx_main(["serve", str(out), "--bench", "1", "--clients", "0"])
    assert_one_error_line(rc, err, "--clients")
    rc, _, err = hsx_main(["serve", str(out), "--units-ahead", "1"])
    assert_one_error_line(rc, err, "--units-ahead is --bench's")
    # the server, a process of its own, is found by the line it prints, whatever OUT's name; one that cannot start
    # is one error line naming its own
    from hsx.serve import _bench_server

    odd = tmp_path / "runs at night (hsx.follow(" / "out"
    shutil.copytree(out, odd)
    assert bench_serve(str(odd), seconds=0.05, log=lines.append)["unit_reads"] >= 1
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(HsxError, match="the server did not start: .*is not a folder"):
        _bench_server(str(tmp_path / "a-file"))
    # a client that fails (here: a unit damaged on disk, which the server refuses to send) fails the bench at once,
    # in one line, its other clients ended
    import time

    bad = tmp_path / "damaged"
    shutil.copytree(out, bad)
    victim = sorted((bad / "data").glob("train-*.arrow"))[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    began = time.monotonic()
    with pytest.raises(HsxError, match="a client failed: .*CRC-32"):
        bench_serve(str(bad), seconds=60, clients=2, log=lines.append)
    assert time.monotonic() - began < 45  # (not the 60 s window)
    # each client an hsx.follow reader: the rows it handed out, counted by their units' file bytes pro rata
    got = bench_serve(str(out), seconds=0.3, clients=2, units_ahead=1, log=lines.append)
    assert got["units_ahead"] == 1 and got["unit_reads"] >= 2 and min(got["bytes_per_client"]) > 0
    assert got["bytes"] >= 2 * min(r["bytes"] for r in units.values())
    assert "by 2 hsx.follow readers (units_ahead=1)" in lines[-1] and listing(out) == before
    # a deadline passed inside the first unit: the row handed out counts, its unit's rest and what was read ahead
    # do not
    got = bench_serve(str(out), seconds=1e-6, units_ahead=2, log=lines.append)
    first = units[sorted(units)[0]]
    assert first["rows"] > 1 and got["unit_reads"] == 0
    assert got["bytes"] == round(first["bytes"] / first["rows"]), (got, first)


def test_units_read_ahead_come_on_their_own_connections_and_change_no_row(served, fault_reference):
    """units_ahead=N: while a unit's rows are handed out the next N of this reader's units are read, each on its own
    connection; the rows and their order are a local reader's, with 0 (nothing read ahead) and with 2."""
    out, url, token = served
    local = list(hsx.follow(fault_reference.out, rows="dict", commit="manual"))
    for ahead in (0, 2):
        remote = hsx.follow(url, rows="dict", commit="manual", token=token, units_ahead=ahead)
        it = iter(remote)
        got = [next(it)]
        units = sorted(remote.src.records())
        assert len(units) > 3
        assert sorted(remote.src.ahead) == units[1:1 + ahead]  # the next ones, in the order they are opened
        got += list(it)
        assert got == local
        assert not remote.src.ahead  # each was taken by its open
    with pytest.raises(ValueError, match="units_ahead"):
        hsx.follow(url, token=token, units_ahead=-1)


def test_a_unit_read_ahead_that_failed_fails_at_its_open_with_no_row_of_it_handed_out(served, fault_reference,
                                                                                         monkeypatch):
    from hsx.flight import FlightSource

    out, url, token = served
    units = sorted(hsx.follow(fault_reference.out, commit="manual").src.records())
    bad = units[2]
    read = FlightSource._read

    def damaged(self, rec, client=None):
        if rec["unit"] == bad:
            raise HsxError(f"{self.where}: unit {bad} came damaged (record batch 0: its CRC-32 is not the one the "
                           "server sent); no row of it was handed out")
        return read(self, rec, client)

    monkeypatch.setattr(FlightSource, "_read", damaged)
    remote = hsx.follow(url, rows="dict", commit="manual", token=token, units_ahead=2)
    got = []
    with pytest.raises(HsxError, match=f"unit {bad} came damaged"):
        for row in remote:
            got.append(row)
    before = [r for r in hsx.follow(fault_reference.out, rows="dict", commit="manual")][:len(got)]
    assert got == before and remote.position.get(bad, 0) == 0  # every row before it, none of it


def test_a_read_ahead_of_a_unit_since_redone_is_not_taken(served, monkeypatch):
    from hsx.flight import FlightSource, _ReadAhead

    out, url, token = served
    src = FlightSource(url, token, units_ahead=1)
    rec = sorted(src.records().items())[0][1]
    taken, result = [], _ReadAhead.result
    monkeypatch.setattr(_ReadAhead, "result", lambda self: taken.append(1) or result(self))
    src.open_ahead([rec])
    assert len(src.open(rec)) == rec["rows"] and taken == [1]  # its own record: taken from the read ahead
    src.open_ahead([rec])
    other = {**rec, "crc32": "00000000"}  # the same name, other bytes: a unit redone since the read began
    assert len(src.open(other)) == rec["rows"] and taken == [1]  # read again, not taken from the read ahead
    assert not src.ahead


def _ipc_round_trip(batch):
    """The batch as a Flight client receives it: written as an IPC stream and read back."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return pa.ipc.open_stream(sink.getvalue()).read_next_batch()


def _check_batch():
    import pyarrow as pa

    return pa.RecordBatch.from_pydict({
        "ids": pa.array([[1, 2, 3], [], None, [7]], pa.list_(pa.int32())),
        "mask": pa.array([1, 0, None, 1], pa.int8()),
        "states": pa.array([[[1, 2], [3, 4]], [[5, 6]], [], [[7, None]]], pa.list_(pa.list_(pa.int16(), 2))),
        "big": pa.array([[1.5], None, [2.5, 3.5], []], pa.large_list(pa.float32())),
        "text": pa.array(["ab", None, "", "héllo"], pa.string()),
        "flags": pa.array([True, False, None, True]),
        "nothing": pa.nulls(4),
    })


def test_a_batch_check_by_buffers_is_the_same_after_ipc_and_changes_with_any_value_byte():
    import pyarrow as pa

    from hsx.flight import batch_check

    batch = _check_batch()
    sent = batch_check(batch)
    assert sent.startswith(b"buffers:")  # every type here is walked (no copy)
    assert batch_check(_ipc_round_trip(batch)) == sent
    assert batch_check(batch, "serialized") == batch_check(_ipc_round_trip(batch), "serialized")
    # a value in any column, a row's length, a null, a nested value: each changes the check
    changed = {
        "ids": pa.array([[1, 2, 4], [], None, [7]], pa.list_(pa.int32())),
        "mask": pa.array([1, 0, 0, 1], pa.int8()),
        "states": pa.array([[[1, 2], [3, 5]], [[5, 6]], [], [[7, None]]], pa.list_(pa.list_(pa.int16(), 2))),
        "big": pa.array([[1.5], None, [2.5], [3.5]], pa.large_list(pa.float32())),
        "text": pa.array(["ab", None, "", "hello"], pa.string()),
        "flags": pa.array([True, True, None, True]),
    }
    for name, column in changed.items():
        other = batch.set_column(batch.schema.get_field_index(name), name, column)
        assert batch_check(_ipc_round_trip(other)) != sent, name
    # a byte flipped in the serialized message's values (as on the wire): the received batch's check differs
    wire = bytearray(batch.serialize())
    at = bytes(wire).index(b"h\xc3\xa9llo")
    wire[at] ^= 0x01
    flipped = pa.ipc.read_record_batch(pa.py_buffer(bytes(wire)), batch.schema)
    assert batch_check(flipped) != sent


def test_a_batch_of_a_type_or_layout_not_walked_is_checked_serialized_on_both_sides():
    import pyarrow as pa

    from hsx.flight import batch_check

    nested = pa.RecordBatch.from_pydict({"s": pa.array([{"a": 1}, {"a": 2}])})
    assert batch_check(nested) == batch_check(nested, "serialized")  # (8 hex digits: the rule a client reads)
    assert batch_check(_ipc_round_trip(nested)) == batch_check(nested)
    sliced = _check_batch().slice(1, 2)  # an offset Arrow's writer removes
    assert b":" not in batch_check(sliced)
    assert batch_check(_ipc_round_trip(sliced), "serialized") == batch_check(sliced)


def test_slices_of_a_batch_without_nulls_are_checked_by_buffers_and_equal_what_the_client_receives():
    """`hsx serve` sends a large record batch as slices: each keeps the "buffers" rule (no copy on either side) where
    its arrays have no nulls, whatever its offset, with the CRC-32 of the batch the client receives (truncated,
    offsets rebased by Arrow's writer); a value inside the slice changes it, bytes outside it do not."""
    import numpy as np
    import pyarrow as pa

    from hsx.flight import batch_check

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, 37)
    ends = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = int(ends[-1])
    states = pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(-9, 9, tokens * 6), pa.int16()), 6)
    batch = pa.RecordBatch.from_pydict({  # (hsx's columns, and strings and large lists)
        "sample_id": pa.array(np.arange(37), pa.int64()),
        "input_ids": pa.ListArray.from_arrays(pa.array(ends), pa.array(rng.integers(0, 99, tokens), pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(pa.array(ends), pa.array(rng.integers(0, 2, tokens), pa.int8())),
        "num_tokens": pa.array(lengths, pa.int32()),
        "hidden_states": pa.ListArray.from_arrays(pa.array(ends), states),
        "text": pa.array([f"row {i}" * int(k) for i, k in enumerate(lengths)], pa.string()),
        "big": pa.LargeListArray.from_arrays(pa.array(ends.astype(np.int64)), pa.array(rng.random(tokens),
                                                                                       pa.float32())),
    })
    for start, rows in ((0, 37), (0, 5), (5, 7), (13, 1), (30, 7), (36, 1), (9, 0)):
        piece = batch.slice(start, rows)
        sent = batch_check(piece)
        assert sent.startswith(b"buffers:"), (start, rows)
        assert batch_check(_ipc_round_trip(piece)) == sent, (start, rows)
        assert batch_check(piece, "serialized") == batch_check(_ipc_round_trip(piece), "serialized")
    assert batch_check(batch.slice(5, 7)) != batch_check(batch.slice(6, 7))
    inside, outside = (next(i for i in span if lengths[i]) for span in (range(5, 12), range(12, 30)))
    for row in (inside, outside):  # a value changed inside rows 5-11, then one outside them
        ids = batch.column(1).to_pylist()
        ids[row][0] += 1
        other = batch.set_column(1, "input_ids", pa.array(ids, pa.list_(pa.int32())))
        assert (batch_check(other.slice(5, 7)) != batch_check(batch.slice(5, 7))) == (row == inside)
    flags = pa.RecordBatch.from_pydict({"flags": pa.array([True, False] * 12)})
    assert b":" not in batch_check(flags.slice(8, 5))  # booleans sliced: serialized
    assert batch_check(_ipc_round_trip(flags.slice(8, 5)), "serialized") == batch_check(flags.slice(8, 5))


def test_a_large_batch_goes_out_in_slices_each_checked_and_the_rows_are_the_local_readers(served, fault_reference,
                                                                                            monkeypatch):
    """With batches larger than SENT_BATCH_BYTES the server sends each in slices of about that size (a row at least),
    every slice with a "buffers" CRC-32 the client checks: the rows hsx.follow hands out are the local reader's."""
    import pyarrow as pa
    import pyarrow.flight as flight

    import hsx.serve
    from hsx.flight import batch_check, unit_ticket

    out, url, token = served
    rec = json.loads(next((out / ".hsx").glob("manifest-*.jsonl")).read_text().splitlines()[0])
    table = pa.ipc.open_stream(pa.memory_map(str(out / "data" / rec["file"]))).read_all()
    assert rec["rows"] >= 3 and table.num_rows == rec["rows"]
    monkeypatch.setattr(hsx.serve, "SENT_BATCH_BYTES", table.nbytes // rec["rows"] * 2)  # ~2 rows a slice
    client = flight.connect(url)
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])
    reader = client.do_get(unit_ticket(rec["unit"]), options=options)
    chunks = []
    while True:
        try:
            chunks.append(reader.read_chunk())
        except StopIteration:
            break
    assert len(chunks) > len(table.to_batches()) and all(1 <= c.data.num_rows <= 3 for c in chunks)
    assert all(c.app_metadata.to_pybytes() == batch_check(c.data) and c.app_metadata.to_pybytes().startswith(
        b"buffers:") for c in chunks)
    assert pa.Table.from_batches([c.data for c in chunks]).equals(table)
    local = list(hsx.follow(fault_reference.out, rows="dict", commit="manual"))
    assert list(hsx.follow(url, rows="dict", commit="manual", token=token)) == local


def test_slices_cover_a_batch_in_order_by_its_mean_row_size():
    import pyarrow as pa

    from hsx.serve import slices

    batch = pa.RecordBatch.from_pydict({"x": pa.array(range(10), pa.int64())})  # 80 bytes, 8 a row
    assert [(p.num_rows, p.column(0)[0].as_py()) for p in slices(batch, 24)] == [(3, 0), (3, 3), (3, 6), (1, 9)]
    assert [p.num_rows for p in slices(batch, 80)] == [10] and [p.num_rows for p in slices(batch, 1)] == [1] * 10
    assert [p.num_rows for p in slices(batch.slice(0, 0), 1)] == [0]


def test_clients_and_servers_from_before_the_buffers_check_still_agree(served):
    """A ticket without "check" (an older client) gets the serialized form's CRC-32s; an older server (one that
    ignores "check") is read by this client by the rule each batch's metadata names."""
    import pyarrow.flight as flight

    from hsx.flight import batch_check, read_checked, unit_ticket

    out, url, token = served
    client = flight.connect(url)
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])
    unit = json.loads(next((out / ".hsx").glob("manifest-*.jsonl")).read_text().splitlines()[0])["unit"]
    old = client.do_get(flight.Ticket(json.dumps({"unit": unit}).encode()), options=options)
    chunk = old.read_chunk()
    assert chunk.app_metadata.to_pybytes() == batch_check(chunk.data, "serialized")
    assert b":" not in chunk.app_metadata.to_pybytes()
    table = read_checked(client, flight.Ticket(json.dumps({"unit": unit}).encode()), "old server", options=options)
    assert table.equals(read_checked(client, unit_ticket(unit), "new server", options=options))
    with pytest.raises(flight.FlightServerError, match="check: one of buffers, serialized"):
        client.do_get(flight.Ticket(json.dumps({"unit": unit, "check": "md5"}).encode()), options=options).read_all()
