"""Units claimed as processes go (`--elastic HOST:PORT`): through a TCPStore every node reaches (torchrun's c10d
rendezvous store, at its --rdzv-endpoint), with leases, so nodes may come and go while a job runs.

Every process of the job, on any node, joined by any launcher (or none), takes the next unit it can claim; a
faster node writes more units, a later one fewer. A unit's key holds who has it:

    hsx/claims/<job>/u/<unit>   absent or ""   free
                                claim:<owner>  being written by <owner>
                                done:<owner>   committed by <owner> (its manifest line is on <owner>'s disk)
    hsx/claims/<job>/hb/<owner> a counter <owner>'s heartbeat thread adds to every HEARTBEAT seconds
    hsx/claims/<job>/fin/<owner> set when <owner> ended with its output dir intact (any exit hsx itself reaches):
                                the count of processes started (`starts`) then
    hsx/claims/<job>/starts     a counter each process adds to when it starts (its start number)
    hsx/claims/<job>/who/<owner> the launch <owner> ran in: torchrun's run id and its agent (host, pid)
    hsx/claims/<job>/agent/<launch> the latest owner that launch's agent started
    hsx/claims/<job>/idle/<owner> set while <owner> has nothing to claim and waits for the others
    hsx/claims/<job>/pulse      a counter every heartbeat of the job adds to
    hsx/claims/job              the job the store serves (its fingerprint): another job's process is refused while
                                that job's pulse moves

Every change of a unit's key is a compare-and-set, so two processes never both claim one unit. An owner is lost
when its counter has not moved for `lease` seconds of the watcher's own clock (no clock is compared between
machines). A lost owner's claims return to the pool, and so do the units it committed: its node's dir may be
gone with it (a survivor with its own dir redoes them; in a shared dir they are there, and the dir's own units
are never claimed). A unit committed by a live owner, or by one that finished while this process ran, is never
claimed again: a done mark counts only while a dir that holds the unit answers for it. An owner that finished before
this process started (a rerun into new or emptied dirs while the store lives; workers restarted) answers for
nothing: its units are redone unless a live process's dir holds them, and such a dir gets a lease to say so. A
process whose own dir holds a unit never claims it; it marks it done for the others (`adopt`), in place of a mark
of an owner that has ended. A process ends when every unit is
committed by an owner that finished or waits idle at its end: until then a node lost mid-job is noticed (by its
heartbeat) by every process still running, and its units are redone.

The store outlives any one group of workers (it lives in the agent that hosts the rendezvous, as long as that
agent lives), so the agent restarting its workers, or a node that joins with its own launcher, finds the claims
there. A process that was judged lost but was only slow writes the same bytes as its taker (units are a function
of the data only): one unit in two dirs, never a wrong one.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from datetime import timedelta

from hsx.config import HsxError, UsageError

CONNECT_SECONDS = 60.0  # how long to try reaching the store
LEASE_SECONDS = 30.0  # an owner whose heartbeat has not moved this long is lost (HSX_LEASE_SECONDS changes it)
POLL_SECONDS = 1.0  # how often a process with nothing to claim looks again while others hold the rest


def lease_seconds(environ=os.environ) -> float:
    raw = environ.get("HSX_LEASE_SECONDS", "").strip()
    if not raw:
        return LEASE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 1.0 <= value <= 86400.0:
        raise HsxError(f"environment variable HSX_LEASE_SECONDS={raw[:40]!r} is not a number of seconds in [1, 86400]")
    return value


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (torchrun's --rdzv-endpoint form; [v6]:PORT too) or UsageError."""
    host, sep, port = endpoint.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdecimal() or not 0 < int(port) < 65536:
        raise UsageError(f"--elastic {endpoint[:80]!r}: give HOST:PORT, the address of torchrun's --rdzv-endpoint "
                         "(the c10d rendezvous store)")
    return host, int(port)


def connect(endpoint: str, timeout: float = 6 * 3600):
    """A client of the TCPStore at `endpoint` (torchrun's c10d rendezvous store: the agent at --rdzv-endpoint hosts
    it, multi-tenant, so any number of clients may join). `timeout`: how long a `wait` on it may last."""
    import torch.distributed as dist

    host, port = parse_endpoint(endpoint)
    try:  # Refused: no agent listens there (the job's agents have ended, or another address), and TCPStore would
        # retry that for minutes, logging C++ stack traces (measured: 2.5 min per try; torchrun restarts it each time)
        socket.create_connection((host, port), timeout=CONNECT_SECONDS).close()
    except OSError as e:
        reason = "connection refused" if isinstance(e, ConnectionRefusedError) else _first_line(e)
        raise HsxError(f"--elastic {endpoint}: cannot reach the rendezvous store there ({reason}): no torchrun agent "
                       "of the job listens there (ended, or not started with --rdzv-backend c10d --rdzv-endpoint "
                       "HOST:PORT)") from None
    try:  # (a store that is not there is one error line after CONNECT_SECONDS, not hours of retries)
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_SECONDS),
                              wait_for_workers=False)
        store.set_timeout(timedelta(seconds=timeout))
        return store
    except (RuntimeError, ValueError, TimeoutError, OSError) as e:
        raise HsxError(f"--elastic {endpoint}: cannot reach the rendezvous store there "
                       f"({_first_line(e)}); start the "
                       "torchrun agent with --rdzv-backend c10d --rdzv-endpoint HOST:PORT first") from None


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:120] if str(e).strip() else type(e).__name__


def lost_store(e: Exception) -> HsxError:
    return HsxError(f"lost the claims store of --elastic ({_first_line(e)}): the node hosting the rendezvous is "
                    "gone; the units committed are kept: relaunch the job on the dirs left (docs/scale-out.md)")


def owner_id() -> str:
    """Who claims: unique per process (host, pid and a random part: a pid is reused after a restart)."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Claims:
    """This process's side of the claim protocol (module docstring) over `store`, for the job `job` (its
    fingerprint) whose units are `units` (name -> tokens). `connect_again`: makes another client of the same store
    for the heartbeat thread (a client's operations are serialized: a slow one must not hold the heartbeat up);
    None uses `store` (tests' HashStore)."""

    def __init__(self, store, job: str, units: dict[str, int], owner: str | None = None,
                 lease: float | None = None, poll: float = POLL_SECONDS, connect_again=None, plan: str = "",
                 launch: tuple[str, str] = ("", "")):
        self.store, self.owner = store, owner or owner_id()
        self.prefix = f"hsx/claims/{job}/"
        # longest first: the job's long units start early and the short ones fill in at the end (as assign_units)
        self.order = sorted(units, key=lambda n: (-units[n], n))
        self.lease = lease if lease is not None else lease_seconds()
        self.poll = poll
        self.mine: set[str] = set()  # claimed by this process and not yet committed
        self.local: set[str] = set()  # in this process's output dir: never claimed
        # owner -> (its heartbeat's value, when this process saw it change, whether it was seen to move)
        self.seen: dict[str, tuple[bytes, float, bool]] = {}
        self.lost_owners: set[str] = set()  # owners found lost (their units were taken back)
        self.idle = False  # waiting at the end with nothing to claim (the idle key says so)
        self.store_closed = False  # the store went away while this process waited at its end
        self.stopping = threading.Event()
        self._beat_store = connect_again() if connect_again is not None else store
        self.job = job
        self._one_job()
        self._check(f"{self.prefix}plan", plan, "planned other units for this job (their tokenizers or datasets "
                    "libraries differ): give every node the same environment")
        self.start = int(store.add(f"{self.prefix}starts", 1))  # this process's start number
        self.started = time.monotonic()
        self.launch = launch
        store.set(f"{self.prefix}who/{self.owner}", "|".join(launch))
        if any(launch):  # the agent's latest worker: a newer one than a lost owner says the agent lives
            store.set(f"{self.prefix}agent/{'|'.join(launch)}", self.owner)
        self._beat()
        self._thread = threading.Thread(target=self._beats, name="hsx-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, unit: str) -> str:
        return f"{self.prefix}u/{unit}"

    def _check(self, key: str, value: str, problem: str) -> None:
        got = self.store.compare_set(key, "", value)
        if got != value.encode():
            raise HsxError(f"another process claiming units through this store {problem} "
                           f"({got.decode(errors='replace')[:16]} vs {value[:16]})")

    def _one_job(self) -> None:
        """Refuse a process of another job (another fingerprint: other --layers, --unit-tokens, model or data) on a
        store that serves a job still running (its pulse moved within a lease); a store whose job has ended is
        taken over."""
        key = "hsx/claims/job"
        other = self.store.compare_set(key, "", self.job).decode(errors="replace")
        if other == self.job:
            return
        pulse = f"hsx/claims/{other}/pulse"
        before, since = self.store.add(pulse, 0), time.monotonic()
        while time.monotonic() - since < self.lease:
            time.sleep(min(self.poll, self.lease / 10))
            if self.store.add(pulse, 0) != before:
                raise HsxError(f"the claims store of --elastic serves another job, still running (fingerprint "
                               f"{other[:12]}; this one is {self.job[:12]}): a node joins a job with the very "
                               "same command (model, data, --layers, --unit-tokens, ...); another job needs a "
                               "torchrun endpoint of its own")
        if self.store.compare_set(key, other, self.job).decode(errors="replace") != self.job:
            raise HsxError("the claims store of --elastic was taken by another job meanwhile; run one job per "
                           "torchrun endpoint")

    def _beat(self) -> None:
        self._beat_store.add(f"{self.prefix}hb/{self.owner}", 1)
        self._beat_store.add(f"{self.prefix}pulse", 1)

    def _beats(self) -> None:
        interval = max(0.2, self.lease / 6)
        while not self.stopping.wait(interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001  (the store is gone: the next claim says so on the main thread)
                return

    # ---- what others hold ----

    def state(self, owner: str) -> str | None:
        """"live" once `owner`'s heartbeat was seen moving within the last lease, "lost" when it has not moved for
        a lease of this process's clock, "finished" when it ended with its dir intact after this process started,
        "gone" when it ended before (its marks answer for nothing); None while undecided (seen once, not yet for a
        lease)."""
        if owner == self.owner:
            return "live"
        fin = f"{self.prefix}fin/{owner}"
        if self.store.check([fin]):
            at = self.store.get(fin).decode(errors="replace")
            # ended after this process started (the starts it had seen include this one's): its dir answers
            return "finished" if at.isdecimal() and len(at) < 19 and int(at) >= self.start else "gone"
        key = f"{self.prefix}hb/{owner}"
        value = self.store.get(key) if self.store.check([key]) else b""
        now = time.monotonic()
        last = self.seen.get(owner)
        if last is None or value != last[0]:
            self.seen[owner] = (value, now, last is not None)
            return "live" if last is not None else None
        if now - last[1] >= self.lease:
            return "lost"
        return "live" if last[2] else None

    def lost_agents(self) -> list[str]:
        """The other agents of this process's own launch (same run id) that lost processes ran under and that are
        gone with them (a lost node): torch's agent here waits for each of them in its exit barrier (300 s),
        unless it re-forms the launch without them. An agent that started workers after the lost one (only its
        worker was killed, and it restarted its workers) lives: it is not one of them."""
        run, agent = self.launch
        agents = set()
        for owner in self.lost_owners:
            key = f"{self.prefix}who/{owner}"
            launch = self.store.get(key).decode(errors="replace") if self.store.check([key]) else ""
            their_run, _, their_agent = launch.partition("|")
            if not (run and their_run == run and their_agent != agent):
                continue
            latest = f"{self.prefix}agent/{launch}"
            if self.store.check([latest]) and self.store.get(latest).decode(errors="replace") != owner:
                continue  # its agent started a worker after it: the agent lives
            agents.add(their_agent)
        return sorted(agents)

    # ---- claiming ----

    def adopt(self, names) -> None:
        """Units this process's output dir holds: never claimed by it, and marked done for the others where free or
        marked by an owner that has ended (this live dir answers for them now)."""
        mine = f"done:{self.owner}"
        for name in names:
            self.local.add(name)
            got = self.store.compare_set(self._key(name), "", mine).decode(errors="replace")
            kind, _, owner = got.partition(":")
            if kind == "done" and owner != self.owner and self.store.check([f"{self.prefix}fin/{owner}"]):
                self.store.compare_set(self._key(name), got, mine)

    def _cas(self, name: str, old: str, new: str) -> bool:
        return self.store.compare_set(self._key(name), old, new) == new.encode()

    def take(self, stop=None, block: bool = True) -> str | None:
        try:
            return self._take(stop, block)
        except RuntimeError as e:  # (torch's DistStoreError, DistNetworkError: the store's agent is gone)
            if self.idle and not self.mine:
                # waiting at its end, holding nothing: the host of the store finished and its agent ended (a node
                # of its own launcher is not held in that agent's exit barrier)
                self.store_closed = True
                return None
            raise lost_store(e) from None

    def _take(self, stop=None, block: bool = True) -> str | None:
        """The name of the next unit this process now holds the claim of; None when there is none to claim: with
        `block`, only once every unit is committed by a live or finished owner (or `stop` is set), waiting while
        others hold claims (a lost owner's come back); without, at once."""
        mine = f"claim:{self.owner}"
        while not self.stopping.is_set() and not (stop is not None and stop.is_set()):
            i = self.store.add(f"{self.prefix}next", 1) - 1  # the first pass: each unit offered once, in order
            while i < len(self.order):
                name = self.order[i]
                if name not in self.local and self._cas(name, "", mine):
                    self.mine.add(name)
                    return name
                i = self.store.add(f"{self.prefix}next", 1) - 1
            name, waiting = self._reclaim(mine)
            if name is not None:
                self.mine.add(name)
                self._idle(False)
                return name
            if not block:
                return None
            self._idle(True)  # at its end: its committed units are final while it lives
            if not waiting:
                return None
            time.sleep(self.poll)
        return None

    def _idle(self, idle: bool) -> None:
        if idle != self.idle:
            key = f"{self.prefix}idle/{self.owner}"
            self.store.set(key, "1") if idle else self.store.delete_key(key)
            self.idle = idle

    def _reclaim(self, mine: str) -> tuple[str | None, bool]:
        """After the first pass: a free unit, or one a lost owner held or committed; else whether any unit is still
        held or undecided (worth waiting for)."""
        keys = [self._key(n) for n in self.order]
        values = self._values(keys)
        waiting = False
        for name, raw in zip(self.order, values):
            if name in self.local or name in self.mine:
                continue
            value = raw.decode(errors="replace")
            if value == "":
                if self._cas(name, "", mine):
                    return name, False
                waiting = True
                continue
            kind, _, owner = value.partition(":")
            if owner == self.owner:
                continue  # committed by this process (a claim of mine is in self.mine)
            state = self.state(owner)
            if kind == "done" and (state == "finished" or (state == "live" and self._is_idle(owner))):
                continue
            if state in (None, "live") or (state == "gone" and time.monotonic() - self.started < self.lease):
                # (an ended owner's unit: a live dir that holds it gets a lease to say so, `adopt`)
                # held, or committed by an owner still at work (or not yet seen alive): it may yet be lost
                waiting = True
                continue
            # a lost owner's claim or unit (its dir may be gone with it), or a finished owner's left claim
            if self._cas(name, value, mine):
                if state == "lost":
                    self.lost_owners.add(owner)
                return name, False
            waiting = True
        return None, waiting

    def _is_idle(self, owner: str) -> bool:
        return bool(self.store.check([f"{self.prefix}idle/{owner}"]))

    def _values(self, keys: list[str]) -> list[bytes]:
        """The keys' values ("" where absent) in one round trip once every key exists (after the first pass)."""
        if self.store.check(keys):
            return list(self.store.multi_get(keys))
        return [self.store.get(k) if self.store.check([k]) else b"" for k in keys]

    def committed(self, name: str) -> None:
        """`name` is committed (its manifest line is on disk): done for the job, while this process lives or after
        it finished."""
        try:
            self.store.set(self._key(name), f"done:{self.owner}")
        except RuntimeError as e:
            raise lost_store(e) from None
        self.mine.discard(name)
        self.local.add(name)

    def finish(self) -> None:
        """This process ends with its dir intact: its claims go back to the pool, its committed units stay done."""
        self.stopping.set()
        try:
            for name in sorted(self.mine):
                self._cas(name, f"claim:{self.owner}", "")
            self.mine.clear()
            self.store.set(f"{self.prefix}fin/{self.owner}", str(self.store.add(f"{self.prefix}starts", 0)))
        except RuntimeError:  # the store is gone: nothing to tell (an error on the way out is already said)
            pass
        self._thread.join(timeout=5)


class Claimed:
    """The units this process claims, as the run loop and the engine's producer thread see them: iterating gives
    them in claim order (the run loop maps and commits each), and `feed` gives the producer the same units in the
    same order. The next unit is claimed while the current one runs (when one is free), so the producer never
    waits for a claim at a unit's end; when none is free the loop waits for one only after committing its own.
    `close()` ends the feed (the producer stops) and is called when the loop stops early."""

    def __init__(self, claims: Claims, units: dict, stop=None):
        import queue

        self.claims, self.units, self.stop = claims, units, stop
        self.queue: queue.Queue = queue.Queue()

    def feed(self):
        while (unit := self.queue.get()) is not None:
            yield unit

    def _take(self, block: bool):
        name = self.claims.take(self.stop, block=block)
        if name is None:
            return None
        self.queue.put(self.units[name])
        return self.units[name]

    def __iter__(self):
        ahead = self._take(block=True)
        while ahead is not None:
            current, ahead = ahead, self._take(block=False)
            yield current
            if ahead is None:
                ahead = self._take(block=True)
        self.close()

    def close(self) -> None:
        self.queue.put(None)
