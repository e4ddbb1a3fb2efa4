"""`hsx serve OUT`: the committed units of an output dir, served over Arrow Flight to trainers on other machines
(`hsx.follow("grpc://HOST:PORT")`; the protocol: hsx.flight).

The server reads OUT as a local hsx.follow does (hsx.follow.LocalSource: the manifests, the plan, the units
checked against their manifest lines, through no link but hsx merge's) and records each client's consumption in
OUT's own ledgers, so `hsx extract --max-pending-gb` and `delete_consumed` bound the extractor's disk exactly as
for a local reader. What a client sends is data, never a path: a unit is named by its manifest name and must be
committed; a consumer name, rank and rows are checked (hsx.follow.check_consumer, LocalSource.record), a commit
is recorded only from the client that claimed that consumer rank last and only for units of that rank's share; a
bad request gets one error line and changes nothing; every verb hsx.follow does not use answers "not supported";
no error carries the server's traceback. A unit is sent only once its file matched its manifest line's CRC-32, each
record batch with its own CRC-32 for the client to check. A bind other than loopback needs a token
(`--token-file`, printable ASCII, or $HSX_SERVE_TOKEN), compared in constant time with every call's
`authorization: Bearer` header.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from hsx.errors import HsxError, Stopped, UsageError, one_line
from hsx.flight import CHECK_RULES, MAX_REQUEST_BYTES, TOKEN_ENV, batch_check

SESSION = re.compile(r"[A-Za-z0-9]{1,64}")
ACTIONS = {"state": "plan, manifests, complete, consumers", "ledger": "a consumer's ledger",
           "claim": "a deleting reader's consumer rank", "commit": "record a consumer's rows",
           "hold": "units a waiting step holds"}  # (the protocol: hsx.flight)

MAX_TOKEN_BYTES = 4096
LISTENING_AT = ' at {0} (hsx.follow("{0}", ...))'  # what `hsx serve` prints after OUT once it listens
LISTENING = re.compile(r' at (grpc://\S+) \(hsx\.follow\("')  # that line's location, whatever OUT's name
# A unit's record batches go out in slices of about this many bytes (one row at least): the writer's batches are a
# GPU batch each (~100 MB at 8B), and one gRPC message of that size is built, sent and taken apart whole, each side
# waiting on the other; smaller messages overlap them (docs/benchmarks.md, session 25). A slice is a view, and its
# CRC-32 by the "buffers" rule is read in place (hsx.flight.batch_check).
SENT_BATCH_BYTES = 8 << 20


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token_file: str | None) -> str | None:
    """The bearer token: the first line of `token_file`, else $HSX_SERVE_TOKEN, else None. The file is read as
    bytes and its line taken as it is: printable ASCII only (a header value carries nothing else intact), never
    decoded with replacements (the bearer expected must be the file's bytes)."""
    if token_file is None:
        token = os.environ.get(TOKEN_ENV) or None
    else:
        try:
            with open(token_file, "rb") as f:
                raw = f.read(MAX_TOKEN_BYTES + 1)
        except OSError as e:
            raise UsageError(f"--token-file {token_file}: {e.strerror or e}") from None
        if len(raw) > MAX_TOKEN_BYTES or not raw.strip():
            raise UsageError(f"--token-file {token_file}: one line of at most {MAX_TOKEN_BYTES} bytes, not empty")
        line = raw.strip().splitlines()[0].strip()
        if not all(0x21 <= b <= 0x7E for b in line):
            raise UsageError(f"--token-file {token_file}: its first line is not printable ASCII (a token is letters, "
                             "digits and punctuation, e.g. `openssl rand -hex 32`)")
        token = line.decode("ascii")
    if token is not None and (len(token) < 16 or not token.isascii() or not token.isprintable() or " " in token):
        raise UsageError("the token must be at least 16 printable ASCII characters, without spaces")
    return token


def make_server(out_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                log=print, consumers: list[str] | None = None):
    """A started Flight server for OUT (`.port`, `.location`; `.shutdown()`), listening on host:port (0: a free
    port). UsageError for a bind other than loopback without a token. `consumers`: names declared in OUT as
    consumers it serves (units are deleted only once each of them consumed them)."""
    import pyarrow.flight as flight

    from hsx.follow import LocalSource, check_consumer

    if not is_loopback(host) and not token:
        raise UsageError(f"--host {host} is reachable from other machines: give a token (--token-file PATH or "
                         f"${TOKEN_ENV}); only a loopback bind (127.0.0.1) may go without one")
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise HsxError(f"{root} is not a folder (hsx serve serves an hsx output dir, being written or finished)")
    if not root.exists():  # started beside `hsx extract` (in either order): served as it is created, as follow reads
        log(f"hsx serve: {root} does not exist yet; its units are served as `hsx extract --output-dir {root}` "
            "creates and commits them", flush=True)
    src = LocalSource(root, write=True)
    if consumers:
        from hsx.ledgers import declare_consumers

        declare_consumers(src.out.state, list(consumers), "hsx serve")
    expected = f"Bearer {token}".encode() if token else None
    supported = {flight.FlightMethod.DO_GET, flight.FlightMethod.DO_ACTION, flight.FlightMethod.LIST_ACTIONS}

    class Auth(flight.ServerMiddlewareFactory):
        def start_call(self, info, headers):
            if expected is not None:
                given = next(iter(headers.get("authorization", [])), "")
                given = given.encode() if isinstance(given, str) else bytes(given)
                if not hmac.compare_digest(given, expected):
                    raise flight.FlightUnauthenticatedError("no valid bearer token")
            if info.method not in supported:  # (refused here: pyarrow answers some verbs' errors with tracebacks)
                raise flight.FlightServerError(f"{info.method.name.lower()}: not supported by hsx serve (it answers "
                                               "do_get, do_action and list_actions: hsx.follow's protocol)")
            return None

    def body_of(raw: bytes, what: str) -> dict[str, Any]:
        if len(raw) > MAX_REQUEST_BYTES:
            raise flight.FlightServerError(f"{what}: a request over {MAX_REQUEST_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            body = None
        if not isinstance(body, dict):
            raise flight.FlightServerError(f"{what}: the request is not a JSON object")
        return body

    def one_line_errors(verb: str, fn, *args):
        """fn(*args), its errors as one FlightServerError line: what a client sent wrong, said; anything else, named
        by its type only (logged here in one line), never the server's traceback."""
        try:
            return fn(*args)
        except flight.FlightError:
            raise
        except (HsxError, ValueError, TypeError, KeyError, FileNotFoundError, RecursionError) as e:
            raise flight.FlightServerError(f"{verb}: {one_line(e)}") from None
        except Exception as e:  # (not KeyboardInterrupt: Ctrl-C still stops the server)
            log(f"hsx serve: {verb} failed: {type(e).__name__}: {one_line(e)}", flush=True)
            raise flight.FlightServerError(f"{verb}: the server failed ({type(e).__name__}); its log says more") \
                from None

    def batches(table, verb: str, rule: str):
        """The unit's record batches in slices of about SENT_BATCH_BYTES, each with its CRC-32 by `rule` as
        app_metadata (hsx.flight.batch_check)."""
        try:
            for batch in table.to_batches():
                for piece in slices(batch, SENT_BATCH_BYTES):
                    yield piece, batch_check(piece, rule)
        except Exception as e:  # (inside the stream too: one line)
            log(f"hsx serve: {verb} failed: {type(e).__name__}: {one_line(e)}", flush=True)
            raise flight.FlightServerError(f"{verb}: the server failed ({type(e).__name__})") from None

    def get(ticket):
        body = body_of(ticket.ticket, "get")
        unit = body.get("unit")
        rec = src.records().get(unit) if isinstance(unit, str) else None
        if rec is None:
            raise HsxError(f"{str(unit)[:80]!r} is not a committed unit of this output")
        rule = body.get("check", "serialized")  # (a client from before the "buffers" rule asks for none)
        if rule not in CHECK_RULES:
            raise HsxError(f"check: one of {', '.join(CHECK_RULES)}")
        table = src.table(rec)  # (its file's CRC-32 checked against the manifest line first)
        return flight.GeneratorStream(table.schema, batches(table, "get", rule))

    def act(kind: str, raw: bytes) -> Any:
        body = body_of(raw, kind)
        if kind == "state":
            summary, records = src.summary(), src.records()
            return {"summary": None if summary is None else summary.to_dict(), "records": records,
                    "complete": src.complete(), "gone": [u for u, r in records.items() if src.gone(r)],
                    "consumers": src.declared()}
        consumer = body.get("consumer")
        if kind == "ledger":
            check_consumer(consumer, 0, 1)
            return src.ledger(consumer)
        if kind in ("claim", "commit", "hold"):
            session = body.get("session")
            if not (session is None or (isinstance(session, str) and SESSION.fullmatch(session))):
                raise HsxError("session: 1 to 64 letters or digits (what the reader names its claim by)")
            if session is None and kind == "claim":
                raise HsxError("a claim names its session")
            session = f"client-{session}"  # (never a local reader's claim: hsx.follow.LOCAL)
            rank, world_size = body.get("rank"), body.get("world_size")
            if kind == "claim":
                src.take_consumer(consumer, rank, world_size, session=session, by="hsx serve")
            elif kind == "commit":
                src.record(consumer, rank, world_size, body.get("rows"), session=session)
            else:
                src.hold(consumer, rank, world_size, body.get("units"), session=session)
            return {}
        raise HsxError(f"unknown action {kind!r}")

    class Server(flight.FlightServerBase):
        def do_get(self, context, ticket):
            return one_line_errors("get", get, ticket)

        def do_action(self, context, action):
            kind = action.type if action.type in ACTIONS else None
            if kind is None:
                shown = action.type if re.fullmatch(r"[\w-]{1,40}", action.type, re.ASCII) else "of that name"
                raise flight.FlightServerError(f"unknown action {shown} (hsx serve answers "
                                               f"{', '.join(ACTIONS)})")
            answer = one_line_errors(kind, act, kind, action.body.to_pybytes())
            return [json.dumps(answer).encode()]

        def list_actions(self, context):
            return list(ACTIONS.items())

    try:
        server = Server(f"grpc+tcp://{host}:{port}", middleware={"auth": Auth()})
    except Exception as e:  # a port in use, an address not of this machine
        raise HsxError(f"cannot listen on {host}:{port}: {one_line(e)}") from None
    server.location = f"grpc://{host if ':' not in host else f'[{host}]'}:{server.port}"
    return server


def slices(batch, nbytes: int):
    """`batch` in consecutive slices of about `nbytes` each by its mean row size, one row at least (views: no copy)."""
    rows, size = batch.num_rows, batch.nbytes
    if rows <= 1 or size <= nbytes:
        yield batch
        return
    step = max(1, rows * nbytes // size)
    for start in range(0, rows, step):
        yield batch.slice(start, step)


def serve(out_dir: str, host: str, port: int, token_file: str | None, log=print,
          consumers: list[str] | None = None) -> None:
    """`hsx serve OUT`: serve until SIGINT/SIGTERM."""
    server = make_server(out_dir, host, port, read_token(token_file), log, consumers)
    log(f"hsx serve: {out_dir}{LISTENING_AT.format(server.location)}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (hsx.cli raises it carrying the signal): how a server ends
        import signal

        signum = e.args[0] if e.args and type(e.args[0]) is int else int(signal.SIGINT)
        raise Stopped(f"serve: stopped by {signal.Signals(signum).name}; nothing in {out_dir} is lost: its "
                      "readers end with 'is unreachable' until it serves again", 128 + signum) from None
    finally:
        server.shutdown()


def bench_serve(out_dir: str, seconds: float = 10.0, clients: int = 1, log=print,
                units_ahead: int | None = None) -> dict[str, Any]:
    """GB/s an `hsx serve` hands out on loopback, as a deployment runs it: the server in a process of its own
    (`hsx serve OUT --port 0`), each of `clients` clients in another (trainer ranks are processes: threads of one
    process would share its GIL with each other and with the server, and measure that instead). Each client reads
    every committed unit of OUT over and over for `seconds`, as hsx.follow's Flight reader reads them (DoGet, each
    record batch checked against the CRC-32 the server sent: hsx.flight.read_checked); bytes are the tables'. With
    `units_ahead`, each client is an `hsx.follow` reader taking every row (`rows="torch"`, that many units read
    ahead), pass after pass: bytes are those of the rows it handed out (unit files' bytes, pro rata of rows), and
    "unit_reads" the units it handed out whole."""
    import multiprocessing
    import queue as queues
    import threading

    from hsx.follow import LocalSource

    units = LocalSource(Path(out_dir), write=False).records()
    if not units:
        raise HsxError(f"{out_dir}: no committed unit to serve")
    server, location = _bench_server(out_dir)
    ctx = multiprocessing.get_context("spawn")  # (no fork of a process that may hold threads and CUDA)
    start, results = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [ctx.Process(target=_bench_client, args=(k, location, units, seconds, units_ahead, start, results),
                         name=f"hsx-serve-bench-{k}", daemon=True) for k in range(clients)]
    done: dict[int, tuple[int, int]] = {}  # client -> (bytes, unit reads)
    failed: list[str] = []
    try:
        for p in procs:
            p.start()
        try:
            start.wait(timeout=SERVE_BENCH_START_SECONDS)
        except threading.BrokenBarrierError:
            pass  # (a client that failed to start broke it: its error is in `results`)
        t0 = time.perf_counter()
        while len(done) + len(failed) < clients:  # (the clock stops at the last answer, not at processes' exits)
            try:
                k, nbytes, reads, error = results.get(timeout=1.0)
            except queues.Empty:
                if not any(p.is_alive() for p in procs):
                    failed.append("a client process ended without an answer")
                    break
                continue
            if error is None:
                done[k] = (nbytes, reads)
            else:
                failed.append(error)
                start.abort()
                break  # (the others are ended below: one failure fails the bench)
        elapsed = time.perf_counter() - t0
    finally:  # (answered clients exit on their own; after a failure or an interrupt, every one is ended now)
        ended = len(done) == clients
        for p in procs:
            p.join(timeout=10 if ended else 0)
            if p.is_alive():
                p.kill()
                p.join()
        server.kill()
        server.wait()
    if failed:
        raise HsxError(f"hsx serve --bench: a client failed: {failed[0]}")
    nbytes, reads = sum(b for b, _ in done.values()), sum(r for _, r in done.values())
    result = {"units": len(units), "clients": clients, "units_ahead": units_ahead, "unit_reads": reads, "bytes": nbytes,
              "seconds": round(elapsed, 3), "gb_per_s": round(nbytes / elapsed / 1e9, 3),
              "bytes_per_client": [done[k][0] for k in sorted(done)],
              "gb_per_s_per_client": [round(done[k][0] / elapsed / 1e9, 3) for k in sorted(done)]}
    plural = "s" if clients > 1 else ""
    who = f"client{plural}" if units_ahead is None else f"hsx.follow reader{plural} (units_ahead={units_ahead})"
    what = f"in {reads} unit reads" if units_ahead is None else f"of rows handed out ({reads} units whole)"
    log(f"hsx serve --bench: {nbytes / 1e9:.2f} GB {what} by {clients} {who} over {elapsed:.1f} s: "
        f"{result['gb_per_s']:.2f} GB/s served on loopback by a server in its own process"
        + (f" ({', '.join(f'{g:.2f}' for g in result['gb_per_s_per_client'])} each)" if clients > 1 else ""))
    return result


SERVE_BENCH_START_SECONDS = 120.0  # for the server and each client process to start (imports: torch, pyarrow)


def _bench_server(out_dir: str):
    """`hsx serve OUT --port 0` on loopback in a process of its own, without a token: (its Popen, its location)
    once it listens; HsxError with its last line if it ends first."""
    import subprocess
    import sys
    import tempfile
    import threading

    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}  # (loopback: no token, so no client needs one)
    said = tempfile.TemporaryFile("w+")  # (its stderr: a pipe nobody drains could fill and stop it)
    server = subprocess.Popen([sys.executable, "-m", "hsx", "serve", str(out_dir), "--port", "0"], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=said, text=True)
    found: list[str] = []

    def first_line() -> None:
        for line in server.stdout:  # (read to the end: a server whose pipe fills would block)
            listening = None if found else LISTENING.search(line)
            if listening:
                found.append(listening.group(1))

    threading.Thread(target=first_line, daemon=True).start()
    deadline = time.monotonic() + SERVE_BENCH_START_SECONDS
    while not found and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not found:
        server.kill()
        server.wait()
        said.seek(0)
        last = said.read().strip().splitlines()[-1:] or ["no line"]
        said.close()
        raise HsxError(f"hsx serve --bench: the server did not start: {one_line(last[0])}")
    said.close()  # (the child keeps its own descriptor)
    return server, found[0]


def _bench_client(k: int, location: str, units: dict[str, dict[str, Any]], seconds: float, units_ahead: int | None,
                  start, results) -> None:
    """One client of `bench_serve`, in its own process: reads for `seconds` once every client is ready, then puts
    (k, bytes, unit reads, None), or (k, 0, 0, its error in one line)."""
    try:
        import pyarrow.flight as flight

        from hsx.flight import parse_location, read_checked, unit_ticket

        tickets = [(u, unit_ticket(u)) for u in sorted(units)]
        client, at = flight.FlightClient("grpc+tcp://{}:{}".format(*parse_location(location))), [k]

        def raw_read(deadline: float) -> tuple[int, int]:
            """One unit read with DoGet a call, each client starting at another unit (not all on one file at once)."""
            unit, ticket = tickets[at[0] % len(tickets)]
            at[0] += 1
            return read_checked(client, ticket, f"unit {unit}").nbytes, 1

        def follow_pass(deadline: float) -> tuple[int, int]:
            """One pass of an hsx.follow reader over every unit, up to the deadline: the bytes of the rows it handed
            out (each unit's file bytes pro rata of its rows handed out) and the units it handed out whole. Units
            read ahead and not yet handed out do not count."""
            from hsx.follow import follow

            reader = follow(location, rows="torch", commit="manual", rank=0, world_size=1, units_ahead=units_ahead,
                            timeout=1.0, poll_seconds=0.1)
            try:
                for _ in reader:
                    if time.perf_counter() >= deadline:
                        break
            except HsxError:  # (a job still running: no new unit for a second ends the pass)
                if any(reader.position.get(u, 0) < rec["rows"] for u, rec in units.items()):
                    raise
            handed = {u: min(row, units[u]["rows"]) for u, row in reader.position.items() if u in units}
            return (round(sum(units[u]["bytes"] * row / units[u]["rows"] for u, row in handed.items())),
                    sum(row == units[u]["rows"] for u, row in handed.items()))

        once = raw_read if units_ahead is None else follow_pass
        if units_ahead is not None:  # (imported before the clock starts: they take seconds)
            import importlib

            for module in ("torch", "datasets", "hsx.follow", "hsx.torch_data"):
                importlib.import_module(module)
        start.wait(timeout=SERVE_BENCH_START_SECONDS)
        # The clock is read after each call: an output of a few large units ends near `seconds`, not a whole pass
        # over them later.
        nbytes = reads = 0
        deadline = time.perf_counter() + seconds
        while True:  # (one call at least, however short `seconds`)
            b, r = once(deadline)
            nbytes, reads = nbytes + b, reads + r
            if time.perf_counter() >= deadline:
                break
        results.put((k, nbytes, reads, None))
    except BaseException as e:  # noqa: BLE001 (told by the parent, in one line)
        results.put((k, 0, 0, one_line(e) if isinstance(e, HsxError) else f"{type(e).__name__}: {one_line(e)}"))
