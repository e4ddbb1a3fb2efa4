"""Trust between an output and its readers: consumers are declared and a unit is deleted only once each of them
consumed it (one live deleting reader per consumer rank; over Flight, commits only from the claimer and for its
rank's share; a consumer that stopped for good retired by a command that says what it releases); no damaged byte
reaches a step (CRC-32 before any row of a unit, locally and over Flight); every Flight verb answers one line."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import shutil
import threading

import pytest

import hsx
from helpers import assert_one_error_line, hsx_main
from hsx import ledgers
from hsx.config import HsxError
from hsx.errors import UsageError

TOKEN = "s3cret-token-0123456789"


def copy_out(tmp_path, ref):
    out = tmp_path / "out"
    shutil.copytree(ref.out, out)
    return out


def manifest_records(out) -> dict[str, dict]:
    return ledgers.manifest_records(out / ".hsx")


def files(out) -> set[str]:
    return {p.name for p in (out / "data").glob("train-*.arrow")}


@pytest.fixture
def server_of():
    """server_of(out, consumers=None) -> grpc:// url of an in-process `hsx serve out` (shut down after the test)."""
    from hsx.serve import make_server

    servers = []

    def start(out, consumers=None):
        server = make_server(out, "127.0.0.1", 0, TOKEN, log=lambda *a, **k: None, consumers=consumers)
        threading.Thread(target=server.serve, daemon=True).start()
        servers.append(server)
        return server.location

    yield start
    for s in servers:
        s.shutdown()


def flight_client(url):
    import pyarrow.flight as flight

    from hsx.flight import bearer

    return (flight.FlightClient(url.replace("grpc://", "grpc+tcp://")),
            flight.FlightCallOptions(headers=bearer(TOKEN)))


def act(url, kind, body):
    import pyarrow.flight as flight

    client, opts = flight_client(url)
    return [json.loads(r.body.to_pybytes()) for r in
            client.do_action(flight.Action(kind, json.dumps(body).encode()), options=opts)]


# ---- declared consumers ---------------------------------------------------------------------------------------

def test_a_unit_is_deleted_only_once_every_declared_consumer_consumed_it(tmp_path, fault_reference):
    """Without the rule, consumer "s" committing a whole unit deleted it though consumer "t" never read it."""
    from hsx.follow import pending_bytes
    from hsx.sink import OutputDir

    out = copy_out(tmp_path, fault_reference)
    o, records = OutputDir(out), manifest_records(out)
    total = sum(r["bytes"] for r in records.values())
    t = hsx.follow(out, consumer="t", delete_consumed=True, rows="dict", commit="manual")  # declared, reads later
    s = hsx.follow(out, consumer="s", delete_consumed=True, rows="dict", commit="manual")
    assert sorted(r["sample_id"] for r in s) == sorted(fault_reference.sample_ids)
    s.commit()
    assert len(files(out)) == len(records)  # s consumed every unit; t none: nothing deleted
    assert pending_bytes(o) == total  # and the window still waits for t: pending until every consumer consumed
    got = sorted(r["sample_id"] for r in t)
    assert got == sorted(fault_reference.sample_ids)  # t reads every row: none was deleted under it
    state = t.state_dict()
    some = dict(sorted(state["position"].items())[:5])
    t.commit({**state, "position": some})
    gone = {records[u]["file"] for u in some}
    assert files(out) == {r["file"] for r in records.values()} - gone  # exactly those both consumed
    assert pending_bytes(o) == total - sum(records[u]["bytes"] for u in some)
    assert set(ledgers.done_units(o.state, o.data)) == set(records)  # deleted units are still done
    t.commit()
    assert files(out) == set() and pending_bytes(o) == 0


def test_a_newer_deleting_reader_in_one_process_takes_over_and_the_older_records_nothing(tmp_path, fault_reference):
    """In one process (a notebook cell run again, a trainer restarted in-process while its old loader is still
    referenced) the newest reader of a consumer rank holds the claim: the older one's commit is refused in one
    line, so two readers of one name never both delete. Across processes the flock refuses the second reader
    (test_a_second_deleting_reader_in_another_process_is_refused_until_the_first_ends). Without the take-over a re-run cell is
    refused until the old reader is garbage-collected."""
    out = copy_out(tmp_path, fault_reference)
    first = hsx.follow(out, consumer="t", delete_consumed=True, rows="dict", commit="manual")
    next(iter(first))
    newer = hsx.follow(out, consumer="t", delete_consumed=True, rows="dict", commit="manual")
    with pytest.raises(HsxError, match="a newer hsx.follow of consumer 't' rank 0 in this process took over") as e:
        first.commit()
    assert "\n" not in str(e.value)
    assert len(files(out)) == len(manifest_records(out))  # nothing recorded or deleted by the older one
    hsx.follow(out, consumer="t", rows="dict")  # a reader that does not delete records nothing: not refused
    other_rank = hsx.follow(out, consumer="t", delete_consumed=True, rank=1, world_size=2, rows="dict")
    assert other_rank.consumer == "t"
    list(newer)
    newer.commit()  # the newer one records and deletes its share
    assert len(files(out)) < len(manifest_records(out))


def test_retiring_a_consumer_says_what_it_releases_and_deletes_nothing_else(tmp_path, fault_reference):
    out = copy_out(tmp_path, fault_reference)
    records = manifest_records(out)
    rc, stdout, err = hsx_main(["consumers", str(out), "--declare", "t,s"])
    assert rc == 0, err
    s = hsx.follow(out, consumer="s", delete_consumed=True, rows="dict", commit="manual")
    list(s)
    position = s.state_dict()["position"]
    whole = sorted(position)[:6]
    partial = sorted(position)[6]
    s.commit({**s.state_dict(), "position": {**{u: position[u] for u in whole}, partial: 1}})
    assert len(files(out)) == len(records)  # t was declared before s read: nothing deleted
    rc, stdout, err = hsx_main(["consumers", str(out)])
    assert rc == 0, err
    assert "t: declared by hsx consumers --declare" in stdout and "holds back 6 unit(s)" in stdout
    reader = hsx.follow(out, consumer="t", delete_consumed=True, rows="dict")  # alive: not retired under it
    rc, _, err = hsx_main(["consumers", str(out), "--retire", "t"])
    assert_one_error_line(rc, err, "live reader")
    assert len(files(out)) == len(records)
    del reader
    gc.collect()
    rc, stdout, err = hsx_main(["consumers", str(out), "--retire", "t"])
    assert rc == 0, err
    assert "6 unit(s) that 's' had consumed whole are released and deleted" in stdout
    assert files(out) == {r["file"] for u, r in records.items() if u not in whole}  # the partial one stays
    for argv, why in ((["--retire", "t"], "retired already"), (["--retire", "nobody"], "not a consumer"),
                      (["--retire", "s", "--declare", "x"], "one at a time"), (["--declare", "a/b"], "letters")):
        rc, _, err = hsx_main(["consumers", str(out), *argv])
        assert_one_error_line(rc, err, why)
    with pytest.raises(HsxError, match="was retired"):
        hsx.follow(out, consumer="t", delete_consumed=True, rows="dict")
    del s
    gc.collect()
    rc, stdout, err = hsx_main(["consumers", str(out), "--retire", "s"])  # the last one: nothing is released
    assert rc == 0 and "no consumer is left" in stdout and "nothing is deleted" in stdout
    assert files(out) == {r["file"] for u, r in records.items() if u not in whole}


def test_over_flight_only_the_claimer_commits_and_only_its_ranks_share(tmp_path, fault_reference, server_of,
                                                                       monkeypatch):
    """Without the checks, a commit as rank 1 of 2 for a unit of rank 0's share was accepted and the unit deleted."""
    import pyarrow.flight as flight

    import hsx.flight

    out = copy_out(tmp_path, fault_reference)
    url = server_of(out, consumers=["t"])
    plan = json.loads((out / ".hsx" / "summary.json").read_text())["unit_names"]
    records = manifest_records(out)
    before = files(out)
    act(url, "claim", {"consumer": "u", "rank": 1, "world_size": 2, "session": "a"})
    for body, why in (({"rank": 1, "world_size": 2, "session": "a", "rows": {plan[0]: records[plan[0]]["rows"]}},
                       "rank 0's of 2, not rank 1's"),
                      ({"rank": 1, "world_size": 2, "session": "zz", "rows": {plan[1]: 1}}, "not this reader's"),
                      ({"rank": 0, "world_size": 2, "session": "a", "rows": {plan[0]: 1}}, "claims its consumer")):
        with pytest.raises(flight.FlightServerError, match=why) as e:
            act(url, "commit", {"consumer": "u", **body})
        assert "Traceback" not in str(e.value)
    with pytest.raises(flight.FlightServerError, match="rank 0's of 2, not rank 1's"):  # (a client of no session)
        act(url, "commit", {"consumer": "t", "rank": 1, "world_size": 2, "rows": {plan[0]: records[plan[0]]["rows"]}})
    assert not list((out / ".hsx").glob("consumed-*"))
    # its own share, whole: recorded, not deleted (t, declared by `hsx serve --consumers t`, has not read it)
    act(url, "commit", {"consumer": "u", "rank": 1, "world_size": 2, "session": "a",
                        "rows": {plan[1]: records[plan[1]]["rows"]}})
    assert files(out) == before and ledgers.wholly_consumed(out / ".hsx", "u", records) == {plan[1]}
    # another session's claim is refused while the holder's lease runs; once it lapsed (the holder was killed),
    # the new one takes over and the old session records nothing more
    with pytest.raises(flight.FlightServerError, match="already has a live reader that deletes"):
        act(url, "claim", {"consumer": "u", "rank": 1, "world_size": 2, "session": "b"})
    monkeypatch.setattr(hsx.flight, "CLAIM_LEASE_SECONDS", 0.0)
    act(url, "claim", {"consumer": "u", "rank": 1, "world_size": 2, "session": "b"})
    with pytest.raises(flight.FlightServerError, match="after this one's claim lapsed"):
        act(url, "commit", {"consumer": "u", "rank": 1, "world_size": 2, "session": "a", "rows": {plan[3]: 1}})
    monkeypatch.undo()
    t = hsx.follow(url, consumer="t", delete_consumed=True, rows="dict", commit="manual", token=TOKEN)
    assert sorted(r["sample_id"] for r in t) == sorted(fault_reference.sample_ids)
    t.commit()
    assert files(out) == before - {records[plan[1]]["file"]}  # only the unit both consumed


# ---- no damaged byte reaches a step ---------------------------------------------------------------------------

def flip_a_byte(out, unit_file):
    """One byte inside the unit's values flipped: the same size, still valid Arrow."""
    path = out / "data" / unit_file
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_damaged_unit_is_one_error_naming_it_and_nothing_is_deleted(tmp_path, fault_reference, server_of):
    out = copy_out(tmp_path, fault_reference)
    records = manifest_records(out)
    unit = sorted(records)[2]
    flip_a_byte(out, records[unit]["file"])
    handed = []
    with pytest.raises(HsxError, match=f"unit {unit}'s bytes do not match the CRC-32") as e:
        for row in hsx.follow(out, rows="dict", delete_consumed=True):
            handed.append(row["sample_id"])
    assert "\n" not in str(e.value)
    assert len(handed) == sum(records[u]["rows"] for u in sorted(records)[:2])  # none of the damaged unit's rows
    assert (out / "data" / records[unit]["file"]).exists()
    url = server_of(out)
    with pytest.raises(HsxError, match=f"unit {unit}'s bytes do not match the CRC-32") as e:
        list(hsx.follow(url, rows="dict", token=TOKEN))
    assert "Traceback" not in str(e.value)
    # hsx.load checks sizes (what it does not check is its docstring's); verify=True checks the CRC-32 too
    with pytest.raises(HsxError, match="do not match its CRC-32"):
        hsx.load(out, verify=True)


def test_a_batch_changed_on_the_wire_is_refused_by_the_client(tmp_path, fault_reference, server_of, monkeypatch):
    import hsx.flight

    out = copy_out(tmp_path, fault_reference)
    url = server_of(out)
    assert len(list(hsx.follow(url, rows="dict", token=TOKEN))) == len(fault_reference.sample_ids)
    monkeypatch.setattr(hsx.flight, "batch_check", lambda batch, rule="buffers": b"buffers:00000000")  # (the client's side only)
    with pytest.raises(HsxError, match="came damaged"):
        list(hsx.follow(url, rows="dict", token=TOKEN))


# ---- Flight speaks one line -----------------------------------------------------------------------------------

def test_every_flight_verb_answers_one_line_and_the_server_survives(tmp_path, fault_reference, server_of):
    import pyarrow as pa
    import pyarrow.flight as flight

    out = copy_out(tmp_path, fault_reference)
    url = server_of(out)
    client, opts = flight_client(url)
    d = flight.FlightDescriptor.for_command(b"{}")
    schema = pa.schema([("a", pa.int64())])

    def put():
        writer, _ = client.do_put(d, schema, options=opts)
        writer.write_table(pa.table({"a": [1]}))
        writer.close()

    def exchange():
        writer, reader = client.do_exchange(d, options=opts)
        writer.begin(schema)
        writer.write_table(pa.table({"a": [1]}))
        writer.done_writing()
        reader.read_all()

    deep = b"[" * 100_000 + b"]" * 100_000
    calls = {"list_flights": lambda: list(client.list_flights(options=opts)),
             "get_flight_info": lambda: client.get_flight_info(d, options=opts),
             "get_schema": lambda: client.get_schema(d, options=opts),
             "do_put": put, "do_exchange": exchange,
             "deep ticket": lambda: client.do_get(flight.Ticket(deep), options=opts).read_all(),
             "deep action": lambda: list(client.do_action(flight.Action("commit", b'{"rows":' + deep + b"}"),
                                                          options=opts)),
             "huge ticket": lambda: client.do_get(flight.Ticket(b"{" * (5 << 20)), options=opts).read_all(),
             "not JSON": lambda: client.do_get(flight.Ticket(b"\xff\xfe\x00"), options=opts).read_all(),
             "unknown action": lambda: list(client.do_action(flight.Action("rm -rf", b"{}"), options=opts)),
             "two-line action": lambda: list(client.do_action(flight.Action("x\nFile \"", b"{}"), options=opts))}
    before = sorted(p.name for p in out.rglob("*"))
    for verb, call in calls.items():
        with pytest.raises((flight.FlightError, pa.ArrowException, OSError)) as e:
            call()
        text = str(e.value).split(". Detail:")[0]  # (what the server said; gRPC's own context follows)
        assert "Traceback" not in str(e.value) and "\n" not in text and "File \"" not in text, (verb, text)
        assert "not supported" in text or "not a JSON object" in text or "over" in text or "unknown" in text, text
        assert act(url, "state", {})[0]["complete"] is True  # the server still answers
    assert sorted(x.type for x in client.list_actions(options=opts)) == ["claim", "commit", "hold", "ledger",
                                                                          "state"]
    assert sorted(p.name for p in out.rglob("*")) == before


def test_a_token_file_is_read_as_bytes_and_must_be_printable_ascii(tmp_path, monkeypatch):
    from hsx.serve import read_token

    tok = tmp_path / "tok"
    for raw in (b"\xff\xfe" * 12 + b"\n", "jeton-secret-é-0123456789".encode(), b"abcdefgh\x01ijklmnopq\n"):
        tok.write_bytes(raw)
        with pytest.raises(UsageError, match="not printable ASCII"):
            read_token(str(tok))
    tok.write_bytes(b"  0123456789abcdef0123  \nsecond line\n")
    assert read_token(str(tok)) == "0123456789abcdef0123"
    monkeypatch.setenv("HSX_SERVE_TOKEN", "jeton-secret-é-0123456789")
    with pytest.raises(UsageError, match="printable ASCII"):
        read_token(None)
    rc, _, err = hsx_main(["serve", str(tmp_path), "--port", "0", "--token-file", str(tmp_path / "nothing")])
    assert_one_error_line(rc, err, "--token-file")


def test_a_deleting_reader_started_before_the_output_claims_it_once_it_exists(tmp_path, fault_reference):
    """The README's two terminals in either order: a reader started before `hsx extract` made OUT declares itself
    and takes its lock once OUT is there (waiting for a unit meanwhile, as before)."""
    out = tmp_path / "out"
    rows = hsx.follow(out, consumer="t", delete_consumed=True, rows="dict", timeout=0.3, poll_seconds=0.05)
    with pytest.raises(HsxError, match="no new unit"):
        list(rows)  # (it waits, holding nothing, for a dir that is not there)
    shutil.copytree(fault_reference.out, out)
    got = [r["sample_id"] for r in rows]
    assert sorted(got) == sorted(fault_reference.sample_ids)
    assert "t" in json.loads((out / ".hsx" / "consumers.json").read_text())["declared"]
    fd = os.open(out / ".hsx" / "consumer-t-00000.lock", os.O_RDWR)
    try:  # the lock is taken: another process's reader of "t" would be refused
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    rows.commit()
    assert files(out) == set()


def test_a_reader_of_a_declared_name_that_does_not_delete_is_warned(tmp_path, fault_reference, server_of):
    """Units wait for a declared consumer until it records them; a reader of that name without delete_consumed
    never does, so the window would wait for ever: said when it starts."""
    out = copy_out(tmp_path, fault_reference)
    rc, _, err = hsx_main(["consumers", str(out), "--declare", "t"])
    assert rc == 0, err
    with pytest.warns(UserWarning, match="consumer 't' is declared in .* delete_consumed=True"):
        hsx.follow(out, consumer="t", rows="dict")
    url = server_of(out)
    with pytest.warns(UserWarning, match="consumer 't' is declared in grpc://"):
        hsx.follow(url, consumer="t", rows="dict", token=TOKEN)


@pytest.mark.slow
def test_a_second_deleting_reader_in_another_process_is_refused_until_the_first_ends(tmp_path, fault_reference):
    """Two trainer processes started with one consumer name: the second is refused in one line while the first
    lives, and starts once it is gone (its lock dies with it, a SIGKILL included)."""
    import subprocess
    import sys

    from helpers import child_env

    out = copy_out(tmp_path, fault_reference)
    script = ("import sys, hsx, hsx.errors\n"
              "try:\n"
              "    hsx.follow(sys.argv[1], consumer='t', delete_consumed=True, rows='dict')\n"
              "except hsx.errors.HsxError as e:\n"
              "    print(e); sys.exit(1)\n")
    first = hsx.follow(out, consumer="t", delete_consumed=True, rows="dict")
    refused = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True,
                             env=child_env(), timeout=300)
    assert refused.returncode == 1 and "already has a live reader that deletes" in refused.stdout, refused
    assert len(refused.stdout.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    del first
    gc.collect()
    started = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True,
                             env=child_env(), timeout=300)
    assert started.returncode == 0, started


def test_the_consumer_flags_are_checked_in_one_line(tmp_path):
    for argv, code, why in ((["serve", str(tmp_path), "--port", "0", "--consumers", "a,,b"], 2, "--consumers"),
                            (["consumers", str(tmp_path)], 1, "no .hsx/ folder"),
                            (["consumers", str(tmp_path / "missing"), "--declare", "a"], 1, "is not a folder")):
        rc, _, err = hsx_main(argv)
        assert_one_error_line(rc, err, why)
        assert rc == code


def test_a_second_live_deleting_reader_over_flight_is_refused_and_a_restarted_one_takes_over(
        tmp_path, fault_reference, server_of, monkeypatch):
    """A reader over hsx serve renews its claim while it lives: a second one of the same name and rank in another
    process is refused (after waiting out a lease, as a trainer restarted after a kill waits out its dead self's);
    once the first is gone (here: its renewals stop), the next one takes over."""
    import hsx.flight

    monkeypatch.setattr(hsx.flight, "CLAIM_RENEW_SECONDS", 0.1)
    monkeypatch.setattr(hsx.flight, "CLAIM_LEASE_SECONDS", 1.0)
    out = copy_out(tmp_path, fault_reference)
    url = server_of(out)
    first = hsx.follow(url, consumer="t", delete_consumed=True, rows="dict", commit="manual", token=TOKEN)
    with monkeypatch.context() as elsewhere:  # (another process: it knows of no reader of this one)
        elsewhere.setattr(hsx.flight, "_IN_PROCESS", {})
        with pytest.raises(HsxError, match="consumer 't' rank 0 already has a live reader that deletes") as e:
            hsx.follow(url, consumer="t", delete_consumed=True, rows="dict", token=TOKEN)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
    it = iter(first)
    next(it)
    first.commit()  # still its claim: renewed all along
    del it, first
    gc.collect()  # (its renewer ends with it, as a killed trainer's does)
    again = hsx.follow(url, consumer="t", delete_consumed=True, rows="dict", commit="manual", token=TOKEN)
    assert len(list(again)) == len(fault_reference.sample_ids) - 1  # from where the first one's ledger left off
    again.commit()
    assert files(out) == set()


def test_a_newer_deleting_reader_over_flight_in_one_process_takes_over_at_once_and_the_older_records_nothing(
        tmp_path, fault_reference, server_of, monkeypatch):
    """Over hsx serve as on a local dir: a newer reader of a consumer rank in the same process (a notebook cell run
    again, a trainer restarted in-process while its old loader is still referenced) takes the claim over at once,
    under the older one's session, instead of waiting for a lease the older one keeps renewing; the older one's
    commit is refused in one line and it renews nothing more; every row is read once between them."""
    import time

    import hsx.flight

    monkeypatch.setattr(hsx.flight, "CLAIM_RENEW_SECONDS", 0.1)
    out = copy_out(tmp_path, fault_reference)
    url = server_of(out)
    first = hsx.follow(url, consumer="t", delete_consumed=True, rows="dict", commit="manual", token=TOKEN)
    it = iter(first)
    got = [next(it)["sample_id"] for _ in range(3)]
    first.commit()
    began = time.monotonic()
    newer = hsx.follow(url, consumer="t", delete_consumed=True, rows="dict", commit="manual", token=TOKEN)
    assert time.monotonic() - began < hsx.flight.CLAIM_LEASE_SECONDS  # not kept waiting for a lease
    next(it)
    with pytest.raises(HsxError, match="a newer hsx.follow of consumer 't' rank 0 in this process took over") as e:
        first.commit()
    assert "\n" not in str(e.value)
    got += [row["sample_id"] for row in newer]
    newer.commit()
    assert sorted(got) == sorted(fault_reference.sample_ids) and files(out) == set()


def test_declarations_are_bounded_and_a_damaged_declaration_file_is_one_line(tmp_path, fault_reference, monkeypatch):
    out = copy_out(tmp_path, fault_reference)
    monkeypatch.setattr(ledgers, "MAX_CONSUMERS", 3)
    ledgers.declare_consumers(out / ".hsx", ["a", "b", "c"], "test")
    ledgers.declare_consumers(out / ".hsx", ["a"], "test")  # (again: nothing new)
    with pytest.raises(HsxError, match="declares 3 consumers already"):
        ledgers.declare_consumers(out / ".hsx", ["d"], "test")
    (out / ".hsx" / "consumers.json").write_text('{"declared": {"a/b": "x"}, "retired": {}}')
    rc, _, err = hsx_main(["consumers", str(out)])
    assert_one_error_line(rc, err, "consumers.json is damaged")
    with pytest.raises(HsxError, match="consumers.json is damaged"):
        hsx.follow(out, consumer="t", delete_consumed=True, rows="dict")
