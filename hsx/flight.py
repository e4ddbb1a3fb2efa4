"""hsx.follow over the network: the client side of `hsx serve OUT` (Arrow Flight, `pyarrow.flight`).

A `FlightSource` is what `hsx.follow("grpc://HOST:PORT")` reads instead of a local dir (hsx.follow.LocalSource):
the same plan, manifests, ledger and units, asked of the server, which reads OUT with a LocalSource and records the
consumption in OUT's own ledgers, so `--max-pending-gb` and `delete_consumed` act as for a local reader. The
protocol, all of it (hsx.serve answers it):

- every call carries `authorization: Bearer <token>` when the server was given a token;
- DoGet, ticket `{"unit": NAME, "check": "buffers"}`: the committed unit NAME's rows as Arrow record batches (its
  schema metadata carries `datasets`' features, so the rows decode as `hsx.load`'s), once the server checked the
  unit's file against its manifest line's CRC-32; each batch's app_metadata is its own CRC-32 (`batch_check`: by
  its buffers, as the ticket asks; a ticket without "check" gets the serialized form's, as servers and clients
  before that rule do), which the client checks (a bit flipped after the server's check, in its memory or on the
  wire, is caught too);
- DoAction `state` `{}`: `{"summary", "records", "complete", "gone", "consumers"}`: the job's plan
  (.hsx/summary.json), the manifest records, whether hsx.json says complete, the committed units no longer in
  data/, and the consumers units wait for;
- DoAction `ledger` `{"consumer"}`: the consumer's ledger (the furthest record of each unit);
- DoAction `claim` `{"consumer", "rank", "world_size", "session"}`: a deleting reader declares its consumer
  (OUT/.hsx/consumers.json) and becomes the session whose commits the server records for that consumer rank;
  it renews the claim every few seconds (the same action): another session's claim is refused while the holder's
  lease runs, and takes over once it lapsed (a trainer restarted after a kill);
- DoAction `commit` `{"consumer", "rank", "world_size", "rows": {UNIT: ROW}, "session"}`: record these positions,
  of units of that rank's share only (the server builds the ledger lines from its manifest records, and deletes
  the units every declared consumer has consumed);
- DoAction `hold` `{"consumer", "rank", "world_size", "units": [UNIT], "session"}`: the units a waiting step holds.
Bodies are JSON objects of at most MAX_REQUEST_BYTES. Every other Flight verb answers "not supported"; every
error is one line (FlightServerError), never the server's traceback.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
import weakref
from typing import Any
from urllib.parse import urlsplit

from hsx.errors import HsxError, UsageError, one_line

MAX_REQUEST_BYTES = 4 << 20  # a request body or ticket (gRPC's own default message bound)
CLAIM_RENEW_SECONDS = 2.0  # a deleting reader renews its claim this often (FlightSource.take_consumer)
CLAIM_LEASE_SECONDS = 10.0  # a claim not renewed for this long is a dead reader's: another may take it over
TOKEN_ENV = "HSX_SERVE_TOKEN"  # the bearer token, for `hsx serve` and hsx.follow("grpc://...") alike


def parse_location(url: str) -> tuple[str, int]:
    """(host, port) of `grpc://HOST:PORT` (or grpc+tcp://); UsageError for anything else."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("grpc", "grpc+tcp") or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise UsageError(f"{url!r}: give the server as grpc://HOST:PORT (what `hsx serve` prints)")
    return parts.hostname, port


def bearer(token: str | None) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {token}".encode())] if token else []


class FlightSource:
    """An `hsx serve` server, as hsx.follow reads it (the methods of hsx.follow.LocalSource, asked over Flight)."""

    def __init__(self, url: str, token: str | None = None, units_ahead: int = 1):
        import pyarrow.flight as flight

        host, port = parse_location(url)
        self.where = f"grpc://{host}:{port}"
        self.location = f"grpc+tcp://{host}:{port}"
        self.client = flight.FlightClient(self.location)
        self.units_ahead = units_ahead  # units read ahead (`open_ahead`), each on its own connection
        self.ahead: dict[str, tuple[dict, _ReadAhead]] = {}  # unit -> (the manifest record it read, its read)
        self.options = flight.FlightCallOptions(headers=bearer(token if token is not None else
                                                               os.environ.get(TOKEN_ENV)), timeout=600)
        self.last: dict[str, Any] | None = None  # the last `state` answer
        self.token = token
        self.session = uuid.uuid4().hex  # names this reader's claim (`take_consumer`)
        self.taken: dict[str, Any] | None = None  # the claim this reader holds and renews
        self.renewer: threading.Thread | None = None
        self.superseded = False  # a newer reader of its consumer rank in this process took its claim over

    def __reduce__(self):  # (a pickled hsx.follow, for a spawn DataLoader worker: a new connection)
        return FlightSource, (self.where, self.token, self.units_ahead)

    def _call(self, fn, *args):
        import pyarrow.flight as flight

        try:
            return fn(*args, options=self.options)
        except flight.FlightUnauthenticatedError as e:
            raise HsxError(f"{self.where} refused the request: {one_line(_message(e))} (give its token: token= or "
                           f"${TOKEN_ENV})") from None
        except flight.FlightUnavailableError as e:
            raise HsxError(f"{self.where} is unreachable ({one_line(_message(e))}): is `hsx serve` running?") from None
        except flight.FlightError as e:
            raise HsxError(f"{self.where}: {one_line(_message(e))}") from None

    def _action(self, kind: str, body: dict[str, Any]) -> Any:
        import pyarrow.flight as flight

        results = self._call(lambda **kw: list(self.client.do_action(flight.Action(kind, json.dumps(body).encode()),
                                                                     **kw)))
        if len(results) != 1:
            raise HsxError(f"{self.where}: {len(results)} answers to `{kind}`, not 1 (not an hsx serve?)")
        try:
            return json.loads(results[0].body.to_pybytes())
        except ValueError:
            raise HsxError(f"{self.where}: an answer to `{kind}` that is not JSON (not an hsx serve?)") from None

    def _state(self) -> dict[str, Any]:
        from hsx.schema import Summary

        from hsx.schema import Damaged, ManifestRecord

        s = self._action("state", {})
        if not (isinstance(s, dict) and isinstance(s.get("records"), dict) and isinstance(s.get("gone"), list)):
            raise HsxError(f"{self.where}: a `state` answer without its records (not an hsx serve?)")
        try:  # what a server says is checked as the files it read are (hsx.schema's records)
            _check_records(s["records"], ManifestRecord)
            s["summary"] = None if s.get("summary") is None else Summary.from_dict(s["summary"])
        except (Damaged, HsxError) as e:
            raise HsxError(f"{self.where}: a damaged `state` answer: {one_line(e)}") from None
        self.last = s
        return s

    def summary(self):
        if self.last is None or self.last["summary"] is None:
            self._state()
        return self.last["summary"]

    def records(self) -> dict[str, dict[str, Any]]:
        return self._state()["records"]

    def complete(self) -> bool:
        return bool((self.last or self._state()).get("complete"))

    def declared(self) -> list[str]:
        found = self._state().get("consumers")
        return found if isinstance(found, list) else []

    def ledger(self, consumer: str) -> dict[str, dict[str, Any]]:
        from hsx.schema import ConsumedRecord, Damaged

        found = self._action("ledger", {"consumer": consumer})
        try:
            _check_records(found, ConsumedRecord)
        except Damaged as e:
            raise HsxError(f"{self.where}: a damaged `ledger` answer: {one_line(e)}") from None
        return found

    def gone(self, rec: dict[str, Any]) -> bool:
        return rec["unit"] in (self.last or self._state())["gone"]

    def readable(self, rec: dict[str, Any], consumer: str) -> bool:
        return True  # (the server checks the unit as it reads it)

    def open(self, rec: dict[str, Any]):
        """The unit's rows as a `datasets.Dataset` (its features from the schema metadata the server sends), each
        record batch checked against the CRC-32 the server sent with it (`batch_check`: the server checked the
        unit's file against its manifest line before sending; this checks what came over the wire). A unit read
        ahead (`open_ahead`) of this very record is taken from there (its errors raised here, as a read's)."""
        from datasets import Dataset
        from datasets.table import InMemoryTable

        entry = self.ahead.pop(rec["unit"], None)  # (taken only for the same record: not a unit redone since)
        table = entry[1].result() if entry is not None and entry[0] == rec else self._read(rec)
        if table.num_rows != rec["rows"]:
            raise HsxError(f"{self.where}: unit {rec['unit']} came with {table.num_rows} rows, its manifest line "
                           f"says {rec['rows']}")
        return Dataset(InMemoryTable(table))

    def open_ahead(self, recs: list[dict[str, Any]]) -> None:
        """Begin reading the first `units_ahead` of these units (the ones this reader opens next, in order), each
        on its own connection and thread, so that their transfer overlaps the rows handed out before them and
        several streams add up (one gRPC stream is slower than a GPU writes: docs/benchmarks.md, 2026-12-07).
        Reads no longer wanted are dropped (their threads end on their own); memory: up to `units_ahead` units."""
        wanted = {rec["unit"]: rec for rec in recs[:self.units_ahead]}
        for unit in [u for u in self.ahead if u not in wanted]:
            del self.ahead[unit]
        for unit, rec in wanted.items():
            if unit not in self.ahead or self.ahead[unit][0] != rec:
                self.ahead[unit] = (rec, _ReadAhead(self, rec))

    def _read(self, rec: dict[str, Any], client=None):
        """Unit `rec` as a pyarrow Table read over `client` (default: this reader's connection), every batch
        checked (`read_checked`)."""
        ticket = unit_ticket(rec["unit"])
        return self._call(lambda **kw: read_checked(client or self.client, ticket,
                                                    f"{self.where}: unit {rec['unit']}", **kw))

    def take_consumer(self, consumer: str, rank: int, world_size: int) -> None:
        """Take the consumer rank at the server for this reader (hsx.follow.LocalSource.take_consumer, there): it
        declares the consumer in OUT and records only this reader's commits for it while this reader renews the
        claim (a daemon thread, every CLAIM_RENEW_SECONDS, for as long as this source lives). A claim another live
        reader holds is asked again until that one's lease would have lapsed (a trainer restarted after a kill
        waits out its dead self's), then refused (HsxError, one line); one an older reader of this process holds is
        taken over at once (`_IN_PROCESS`)."""
        key = (self.where, consumer, rank)
        with _IN_PROCESS_LOCK:  # (an older reader of this process holding it: its session goes on in this one)
            ref = _IN_PROCESS.get(key)
            older = ref() if ref is not None else None
            if older is not None and older is not self and older.taken is not None:
                self.session, older.taken, older.superseded = older.session, None, True
            _IN_PROCESS[key] = weakref.ref(self)
        body = {"consumer": consumer, "rank": rank, "world_size": world_size, "session": self.session}
        deadline = time.monotonic() + CLAIM_LEASE_SECONDS + CLAIM_RENEW_SECONDS
        while True:
            try:
                self._action("claim", body)
                break
            except HsxError as e:
                if "already has a live reader" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(CLAIM_RENEW_SECONDS / 2)
        self.taken = body
        if self.renewer is None:
            self.renewer = threading.Thread(target=_renew, args=(weakref.ref(self), CLAIM_RENEW_SECONDS),
                                            name="hsx-follow-claim", daemon=True)
            self.renewer.start()

    def _as_consumer(self, kind: str, body: dict[str, Any]) -> None:
        """`kind` of this reader's claimed consumer rank; once more after claiming again if the server does not
        know the claim (it was restarted since)."""
        if self.superseded:
            raise HsxError(f"{kind}: a newer hsx.follow of consumer {body['consumer']!r} rank {body['rank']} in this "
                           "process took over; this older reader records nothing more (iterate the newer one)")
        try:
            self._action(kind, {**body, "session": self.session})
        except HsxError as e:
            if self.taken is None or "claims its consumer first" not in str(e):
                raise
            self._action("claim", self.taken)
            self._action(kind, {**body, "session": self.session})

    def record(self, consumer: str, rank: int, world_size: int, rows: dict[str, int]) -> None:
        if rows:
            self._as_consumer("commit", {"consumer": consumer, "rank": rank, "world_size": world_size, "rows": rows})

    def hold(self, consumer: str, rank: int, world_size: int, units: list[str]) -> None:
        self._as_consumer("hold", {"consumer": consumer, "rank": rank, "world_size": world_size, "units": units})


class _ReadAhead:
    """One unit read by FlightSource.open_ahead: on a connection and daemon thread of its own (a reader that stops
    never waits for it); `result()` waits for the table, or raises what the read raised."""

    def __init__(self, source: FlightSource, rec: dict[str, Any]):
        self.done = threading.Event()
        self.table, self.error = None, None
        threading.Thread(target=self._run, args=(source, rec), name="hsx-read-ahead", daemon=True).start()

    def _run(self, source: FlightSource, rec: dict[str, Any]) -> None:
        import pyarrow.flight as flight

        client = None
        try:
            client = flight.FlightClient(source.location)
            self.table = source._read(rec, client)
        except BaseException as e:  # (raised in the reader's thread, by `result`)
            self.error = e
        finally:
            if client is not None:
                client.close()
            self.done.set()

    def result(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.table


# (server, consumer, rank) → the reader of this process that holds that claim. A newer reader of it in this process
# (a notebook cell run again, a trainer restarted in-process while its old loader is still referenced, as by the
# traceback of what stopped it) goes on under the older one's session, which the server already knows: it is not
# kept waiting for a lease that the older one, still alive, would keep renewing. The older one records nothing more,
# as a local reader superseded in its process (hsx.follow._take_over_in_process).
_IN_PROCESS: dict[tuple[str, str, int], "weakref.ref[FlightSource]"] = {}
_IN_PROCESS_LOCK = threading.Lock()


def _renew(source_ref, every: float) -> None:
    """The claim renewer's loop: renew the source's claim every `every` seconds while the source lives (a failed
    renewal is tried again next time: the commit that follows says what is wrong, in one line)."""
    while True:
        time.sleep(every)
        source = source_ref()
        if source is None or source.superseded:
            return
        try:
            source._action("claim", source.taken)
        except Exception:  # noqa: BLE001 (unreachable server, lapsed claim: the next commit reports it)
            pass
        del source


def unit_ticket(unit: str):
    """The DoGet ticket for committed unit `unit`, asking for each batch's check by its buffers (`batch_check`);
    a server from before that rule ignores the ask and sends the serialized form's, which `read_checked` checks."""
    import pyarrow.flight as flight

    return flight.Ticket(json.dumps({"unit": unit, "check": "buffers"}).encode())


def read_checked(client, ticket, what: str, **call_options):
    """The pyarrow Table a DoGet of `ticket` streams, each record batch checked against the CRC-32 the server sent
    as its app_metadata (`batch_check`, by the rule the metadata names); HsxError naming `what` and the batch when
    one differs or comes without."""
    import pyarrow as pa

    reader = client.do_get(ticket, **call_options)
    batches = []
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            return pa.Table.from_batches(batches, schema=reader.schema)
        sent = chunk.app_metadata.to_pybytes() if chunk.app_metadata is not None else b""
        rule = sent.split(b":", 1)[0].decode("ascii", "replace") if b":" in sent else "serialized"
        if chunk.data is None or rule not in CHECK_RULES or sent != batch_check(chunk.data, rule):
            raise HsxError(f"{what} came damaged (record batch {len(batches)}: its CRC-32 is not the one the server "
                           f"sent{'' if sent else ', or none'}); no row of it was handed out")
        batches.append(chunk.data)


CHECK_RULES = ("buffers", "serialized")


def batch_check(batch, rule: str = "buffers") -> bytes:
    """A record batch's app_metadata in a DoGet: the CRC-32 (8 hex digits) of the batch, the same for the batch the
    server sends and the one the client receives unless a byte the rows are made of changed between.
    - "buffers" (`b"buffers:" + hex`): over the batch's layout and the bytes its values occupy in its buffers, read
      where they lie (`_buffers_crc32`): no copy. Where a column's type or layout is one it does not walk, that
      batch goes by "serialized" (its metadata says so).
    - "serialized" (8 hex digits alone, what servers before the "buffers" rule send and what they are asked for
      by clients before it): over the batch as Arrow IPC serializes it, each side serializing the batch it holds
      (a copy of the batch on each side: a third of one stream's rate with 100 MB batches)."""
    if rule == "buffers":
        crc = _buffers_crc32(batch)
        if crc is not None:
            return b"buffers:%08x" % crc
    from hsx.checksums import crc32

    return b"%08x" % crc32(batch.serialize())


def _buffers_crc32(batch) -> int | None:
    """CRC-32 over a record batch's row and column counts and, per column, depth first, each array's length, null
    count and the bytes its values occupy (validity bits where it has nulls, fixed-width values, offsets from zero,
    list children, string bytes), read in place; padding and bytes past or before the values are not in it. So a
    slice of a batch (what `hsx serve` sends of a large one) and the batch the client receives of it, which Arrow's
    IPC writer truncates and whose offsets it rebases to zero, have one CRC. None where an array's type or layout is
    not walked here (a slice of an array with nulls or of booleans, a type with other children): "serialized" checks
    that batch."""
    import struct

    from hsx.checksums import crc32

    crc = crc32(struct.pack("<qq", batch.num_rows, batch.num_columns))
    for column in batch.columns:
        crc = _array_crc32(column, crc)
        if crc is None:
            return None
    return crc


def _array_crc32(arr, crc: int) -> int | None:
    import struct

    import numpy as np
    import pyarrow as pa

    from hsx.checksums import crc32

    t, n, first = arr.type, len(arr), arr.offset
    if isinstance(t, pa.ExtensionType) or pa.types.is_dictionary(t) or (first and arr.null_count):
        return None
    buffers = arr.buffers()

    def take(i: int, start: int, nbytes: int) -> int | None:
        buf = buffers[i] if i < len(buffers) else None
        if nbytes == 0:
            return crc
        if buf is None or buf.size < start + nbytes:
            return None
        return crc32(memoryview(buf)[start:start + nbytes], crc)

    crc = crc32(struct.pack("<qq", n, arr.null_count), crc)
    if pa.types.is_null(t):  # (no buffer: every value null)
        return crc
    if arr.null_count:
        crc = take(0, 0, (n + 7) // 8)
        if crc is None:
            return None
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_string(t) or pa.types.is_binary(t) \
            or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        large = pa.types.is_large_list(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        width = 8 if large else 4
        buf = buffers[1]
        if buf is None or buf.size < (first + n + 1) * width:
            return None
        ends = np.frombuffer(buf, dtype="<i8" if large else "<i4", count=n + 1, offset=first * width)
        start, stop = int(ends[0]), int(ends[-1])
        if start < 0 or stop < start:
            return None
        # (the offsets as the receiver holds them: from zero)
        crc = crc32(memoryview(ends - start if start else ends).cast("B"), crc)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return _array_crc32(arr.values.slice(start, stop - start), crc) if len(arr.values) >= stop else None
        return take(2, start, stop - start)
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        if len(arr.values) < (first + n) * size:
            return None
        return _array_crc32(arr.values.slice(first * size, n * size), crc)
    if t.num_fields or t.num_buffers != 2:
        return None
    try:
        bits = t.bit_width
    except ValueError:  # (not fixed width)
        return None
    if first and bits % 8:  # (bits of a slice: Arrow's writer copies them to a new bitmap, its last byte other bits)
        return None
    return take(1, first * bits // 8, (n * bits + 7) // 8)


def _check_records(records, kind) -> None:
    """schema.Damaged unless `records` maps each unit name to a valid `kind` record (hsx.schema) of that unit."""
    from hsx.schema import Damaged

    if not isinstance(records, dict):
        raise Damaged("not an object")
    for unit, rec in records.items():
        kind.from_dict(rec)
        if rec["unit"] != unit:
            raise Damaged(f"the record of {unit!r} names unit {rec['unit']!r}")


def _message(e: Exception) -> str:
    """A Flight error's message without gRPC's detail suffix (". Detail: ...", "gRPC client debug context")."""
    text = str(e)
    for cut in (". Detail:", ". gRPC client debug context", "\ngRPC"):
        text = text.split(cut)[0]
    return text
