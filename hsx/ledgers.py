"""The record files under an output dir's .hsx/ (which ones, and when each is there: hsx.sink's drawing of the
dir): the manifests of committed units, the runs, uploads, consumers, exports, merges and ranks. For each, how a
record is appended (fsynced, a torn last line ended first: hsx.files.append_synced) and how it is read back and
checked (each line through its typed record in hsx.schema; a torn line from a kill is passed over, a whole line
that is not a valid record is one HsxError line naming file and line).

Every function takes the dir's .hsx/ folder (`state`; `data`: its data/), so hsx.sink.OutputDir, hsx.merge and
the readers share one reading of each file."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from hsx.errors import HsxError
from hsx.files import append_synced, atomic_write, file_size, open_no_follow, read_bounded, read_json, read_jsonl
from hsx.info import recorded_run_values
from hsx.schema import (CONSUMER_NAME, RECORD_REST_BYTES, RUN_VARIANT_KEYS, ConsumedRecord, ConsumersRecord,
                        ManifestRecord, RunRecord, UploadRecord, merged_values, values_used)

MANIFESTS = "manifest-*.jsonl"  # one per rank: every process appends only to its own
UPLOADED = "uploaded-*.jsonl"  # Hub upload records (hsx.hub): one per rank, and uploaded-push.jsonl
CONSUMED = "consumed-*.jsonl"  # what trainers following the job consumed (hsx.follow): one per consumer rank
CONSUMERS = "consumers.json"  # the consumers the output serves, declared and retired (hsx.schema.ConsumersRecord)
MAX_CONSUMERS = 1000  # declared at once: each holds every unit back until it consumed it (and bounds the file)
RUNS = "runs-*.jsonl"  # what each run of a rank computed the states with (hsx.schema.RunRecord): one per rank
EXPORTED = "exported.jsonl"  # units an export with --delete-source deleted (hsx.export), and where to


def uploaded_matches(uploaded: dict[str, Any] | None, rec: dict[str, Any]) -> bool:
    """Whether an upload record is of this manifest record's file: same size, and same CRC-32 where both say."""
    return (uploaded is not None and uploaded.get("bytes") == rec["bytes"]
            and (uploaded.get("crc32") is None or rec.get("crc32") is None or uploaded["crc32"] == rec["crc32"]))


# ---- manifests: the committed units -----------------------------------------------------------------------------

def append_manifest(state: Path, rank: int, record: dict[str, Any]) -> None:
    """Append a committed unit's record to .hsx/manifest-<rank>.jsonl, fsynced (after a kill mid-append the last
    line is torn: append_synced ends it, this record starts a line)."""
    append_synced(state / f"manifest-{rank:05d}.jsonl", json.dumps(record, sort_keys=True) + "\n")


def manifest_records(state: Path) -> dict[str, dict[str, Any]]:
    """Every committed unit's manifest record (every rank's), by unit name; whether its file is still here or not."""
    records = {}
    for manifest in sorted(state.glob(MANIFESTS)):
        for rec in read_jsonl(manifest, ManifestRecord):  # a torn line from a kill: that unit is redone
            records[rec["unit"]] = rec
    return records


def last_session_units(state: Path) -> set[str]:
    """The units the last run of each rank committed (the last manifest line's session, per manifest)."""
    units = set()
    for manifest in sorted(state.glob(MANIFESTS)):
        recs = list(read_jsonl(manifest, ManifestRecord))
        last = recs[-1].get("session") if recs else None
        units |= {r["unit"] for r in recs if last is not None and r.get("session") == last}
    return units


def done_units(state: Path, data: Path) -> dict[str, dict[str, Any]]:
    """Committed units from the manifests (every rank's) whose files exist in `data` with the recorded size, or that
    a Hub push recorded as uploaded (in .hsx/uploaded-*.jsonl, with the same size and CRC-32), or a trainer as
    wholly consumed: with --delete-after-upload those are gone from disk and must not be redone."""
    up, used = uploaded(state), consumed(state)
    done = {}
    for unit, rec in manifest_records(state).items():
        f = data / rec["file"]
        if file_size(f) == rec["bytes"]:
            done[unit] = rec
        elif (uploaded_matches(up.get(f"data/{rec['file']}"), rec)
              or uploaded_matches(used.get(rec["file"]), rec)) and not (
                state / "damaged" / rec["file"]).exists():  # (gone after its upload, not moved aside)
            done[unit] = rec
    return done


# ---- runs: what computed each unit ------------------------------------------------------------------------------

def record_run(state: Path, rank: int, session: str, settings: dict[str, Any]) -> None:
    """Append this run's RUN_VARIANT_KEYS values to .hsx/runs-<rank>.jsonl (fsynced, before its first commit): its
    units' manifest lines name its session, so what computed each unit is known after any kill."""
    state.mkdir(parents=True, exist_ok=True)
    line = {"session": session, **{k: settings[k] for k in RUN_VARIANT_KEYS if k in settings}}
    append_synced(state / f"runs-{rank:05d}.jsonl", json.dumps(line, sort_keys=True) + "\n")  # (a torn one: ended)


def run_values_by_rank(state: Path, units: dict[str, dict[str, Any]]) -> dict[str, dict[str, list]]:
    """Every RUN_VARIANT_KEYS value the runs that committed `units` (manifest records, as done_units gives)
    computed with, by whose they are: "rank N" for the records of .hsx/runs-<N>.jsonl (every rank's ledger, each
    read bounded, as read_jsonl reads), "hsx.json" for units of an older hsx, which kept none (the values its
    hsx.json's run records: hsx.info.recorded_run_values); only those with values."""
    sessions = {rec.get("session") for rec in units.values()}
    found: set[str] = set()
    by_rank: dict[str, list[RunRecord]] = {}
    for ledger in sorted(state.glob(RUNS)) if units else ():
        runs = [RunRecord.from_dict(rec) for rec in read_jsonl(ledger, RunRecord) if rec["session"] in sessions]
        found |= {r.session for r in runs}
        rank = ledger.name[len("runs-"):-len(".jsonl")]
        by_rank.setdefault(f"rank {int(rank)}" if rank.isdigit() and len(rank) < 10 else ascii(ledger.name),
                           []).extend(runs)
    older = recorded_run_values(state.parent) if sessions - found else []
    whose = {"hsx.json": values_used(older)} if older else {}
    whose.update({k: values_used(runs) for k, runs in by_rank.items()})
    return {k: v for k, v in whose.items() if v}


def run_values(state: Path, units: dict[str, dict[str, Any]]) -> dict[str, list]:
    """`run_values_by_rank`'s values, merged: every value the runs that committed `units` computed with."""
    return merged_values(*run_values_by_rank(state, units).values())


# ---- uploads (hsx.hub) and consumers (hsx.follow) ---------------------------------------------------------------

def uploaded(state: Path) -> dict[str, dict[str, Any]]:
    """What Hub pushes recorded as committed on the Hub, by path in the repo (`data/train-....arrow`): the last
    record of each path over every .hsx/uploaded-*.jsonl (one per rank, and one for `hsx push`)."""
    records: dict[str, dict[str, Any]] = {}
    for ledger in sorted(state.glob(UPLOADED)):
        for rec in read_jsonl(ledger, UploadRecord):  # a torn line: uploaded again (a no-op on the Hub)
            records[rec["file"]] = rec
    return records


def record_uploaded(state: Path, name: str, records: list[dict[str, Any]]) -> None:
    """Append upload records to .hsx/uploaded-<name>.jsonl and fsync: called only after the Hub confirmed the
    commit, and before any local file is deleted."""
    if not records:
        return
    state.mkdir(parents=True, exist_ok=True)
    append_synced(state / f"uploaded-{name}.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def consumed(state: Path) -> dict[str, dict[str, Any]]:
    """The units some consumer following the job (hsx.follow) recorded as wholly consumed, by file name: the last
    record of each unit in each .hsx/consumed-*.jsonl whose `row` is its `rows`. What explains a unit no longer in
    data/ (deleted once every declared consumer had consumed it: `released`), which is then still done, as a unit
    deleted after its upload is. Whether a unit may be deleted, or still counts as pending, is `released`'s."""
    whole: dict[str, dict[str, Any]] = {}
    for ledger in sorted(state.glob(CONSUMED)):
        last: dict[str, dict[str, Any]] = {}
        for rec in read_jsonl(ledger, ConsumedRecord):  # a torn line: that progress is read again
            last[rec["file"]] = rec
        whole.update({f: r for f, r in last.items() if r["row"] == r["rows"]})
    return whole


# ---- the consumers an output serves (declared, retired) ---------------------------------------------------------

@contextlib.contextmanager
def _consumers_lock(state: Path):
    """The declaration file's read-modify-write, one process at a time (a short blocking flock: declaring and
    retiring take milliseconds)."""
    fd = open_no_follow(state / "consumers.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def consumers_record(state: Path) -> ConsumersRecord:
    """.hsx/consumers.json (an empty record where there is none)."""
    path = state / CONSUMERS
    if not os.path.lexists(path):
        return ConsumersRecord({}, {})
    return read_json(path, ConsumersRecord)


def declare_consumers(state: Path, names: list[str], by: str) -> list[str]:
    """Declare these consumers of the output (idempotent; written atomically under a lock); returns those new.
    HsxError for a name that is not one (letters, digits, _) or was retired: a retired consumer's units may be
    deleted already, so it cannot come back under its name."""
    bad = [n for n in names if not (isinstance(n, str) and CONSUMER_NAME.fullmatch(n))]
    if bad:
        raise HsxError(f"consumer {str(bad[0])[:80]!r}: letters, digits and _ only, at most 64 (it names ledger "
                       "files)")
    state.mkdir(parents=True, exist_ok=True)
    with _consumers_lock(state):
        rec = consumers_record(state)
        retired = [n for n in names if n in rec.retired]
        if retired:
            raise HsxError(f"consumer {retired[0]!r} of {state.parent} was retired ({rec.retired[retired[0]]}): "
                           "units it had not consumed may be deleted since; read under another consumer= name")
        new = [n for n in dict.fromkeys(names) if n not in rec.declared]
        if len(rec.declared) + len(new) > MAX_CONSUMERS:
            raise HsxError(f"{state.parent} declares {len(rec.declared)} consumers already (at most "
                           f"{MAX_CONSUMERS}); retire those that stopped (hsx consumers --retire NAME)")
        if new:
            atomic_write(state / CONSUMERS, json.dumps(ConsumersRecord(
                {**rec.declared, **{n: by for n in new}}, rec.retired).to_dict(), indent=2) + "\n")
    return new


def retire_consumer(state: Path, name: str) -> None:
    """Mark `name` retired (it no longer holds units back); written atomically under the declaration lock."""
    with _consumers_lock(state):
        rec = consumers_record(state)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        atomic_write(state / CONSUMERS, json.dumps(ConsumersRecord(
            rec.declared, {**rec.retired, name: stamp}).to_dict(), indent=2) + "\n")


def ledger_consumers(state: Path) -> dict[str, list[int]]:
    """The consumers with a ledger here (.hsx/consumed-<name>-<rank>.jsonl), by name, with their ranks."""
    found: dict[str, list[int]] = {}
    for ledger in sorted(state.glob(CONSUMED)):
        name, _, rank = ledger.name[len("consumed-"):-len(".jsonl")].rpartition("-")
        if CONSUMER_NAME.fullmatch(name) and rank.isdigit():
            found.setdefault(name, []).append(int(rank))
    return found


def active_consumers(state: Path) -> list[str]:
    """The consumers a unit waits for: those declared, and those with a ledger (a consumer records only once
    declared; a ledger without a declaration is an older hsx's), less those retired."""
    rec = consumers_record(state)
    return sorted((set(rec.declared) | set(ledger_consumers(state))) - set(rec.retired))


def wholly_consumed(state: Path, consumer: str, records: dict[str, dict[str, Any]]) -> set[str]:
    """The units whose ledger line of `consumer` (any rank's) says consumed whole, about the file its manifest
    record describes (same bytes, rows and CRC-32: a line about other bytes is no consumption)."""
    return {u for u, r in consumer_positions(state, consumer).items()
            if u in records and r["row"] == r["rows"] == records[u]["rows"] and uploaded_matches(r, records[u])}


def released(state: Path, records: dict[str, dict[str, Any]] | None = None) -> set[str]:
    """The committed units every active consumer (`active_consumers`) consumed whole: those that may be deleted,
    and that no longer count as pending for `--max-pending-gb`. Empty while no consumer is declared: a unit
    nobody was declared to consume is never released."""
    if not state.is_dir():
        return set()
    records = manifest_records(state) if records is None else records
    common: set[str] | None = None
    for name in active_consumers(state):
        whole = wholly_consumed(state, name, records)
        common = whole if common is None else common & whole
    return common or set()


def consumer_positions(state: Path, consumer: str) -> dict[str, dict[str, Any]]:
    """One consumer's ledger records (every rank's .hsx/consumed-<consumer>-<rank>.jsonl: a resume with another
    world size finds a unit in progress where its previous owner left it), the furthest of each unit."""
    found: dict[str, dict[str, Any]] = {}
    for ledger in sorted(state.glob(f"consumed-{consumer}-*.jsonl")):
        last: dict[str, dict[str, Any]] = {}
        for rec in read_jsonl(ledger, ConsumedRecord):
            last[rec["unit"]] = rec
        for u, rec in last.items():
            if u not in found or rec["row"] > found[u]["row"]:
                found[u] = rec
    return found


def record_consumed(state: Path, consumer: str, rank: int, records: list[dict[str, Any]]) -> None:
    """Append a consumer rank's ledger lines (hsx.schema.ConsumedRecord), fsynced before any unit is deleted."""
    state.mkdir(parents=True, exist_ok=True)
    append_synced(state / f"consumed-{consumer}-{rank:05d}.jsonl",
                  "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def write_holding(state: Path, consumer: str, rank: int, files: list[str]) -> None:
    """Say which unit files a consumer rank holds in training steps not yet returned (`held_files`)."""
    state.mkdir(parents=True, exist_ok=True)
    atomic_write(state / f"holding-{consumer}-{rank:05d}.json", json.dumps({"files": sorted(files)}) + "\n")


def held_files(state: Path) -> set[str]:
    """The unit files trainers hold in training steps that have not returned, while they wait for a unit to
    complete a batch (.hsx/holding-<consumer>-<rank>.json, hsx.follow's LocalSource.hold): the job's window does
    not wait for them, or a batch holding more than the window would wait for a unit the job waits to write."""
    names: set[str] = set()
    for f in state.glob("holding-*.json"):
        files = read_json(f, limit=RECORD_REST_BYTES).get("files") if f.is_file() else None
        if not (isinstance(files, list) and all(isinstance(n, str) for n in files)):
            raise HsxError(f"{f} is damaged (its `files` is not a list of names); remove it")
        names.update(files)
    return names

# ---- merges (hsx.merge) -----------------------------------------------------------------------------------------

def merged_sources(state: Path, add: list[str] | None = None) -> list[str]:
    """The dirs `hsx merge` linked units from into this one (.hsx/merged-from.json), with `add` recorded too: a
    partial merge's links stay readable once the job's `hsx extract` finishes the dir (its hsx.json's
    `run.merged_from` is this list)."""
    path = state / "merged-from.json"
    known = read_json(path, limit=RECORD_REST_BYTES).get("dirs") if path.exists() else []  # (a path per dir)
    if not isinstance(known, list) or not all(isinstance(d, str) for d in known):
        raise HsxError(f"{path} is damaged (its `dirs` is not a list of paths); remove it and merge again")
    if add:
        known = [*known, *(d for d in add if d not in known)]
        atomic_write(path, json.dumps({"dirs": known}, indent=2) + "\n")
    return known


def write_merged_manifest(state: Path, records: list[dict[str, Any]]) -> None:
    """.hsx/manifest-merged.jsonl: the manifest records of the units a merge joined, written whole (a manifest
    like every rank's: `manifest_records` reads it with theirs)."""
    atomic_write(state / "manifest-merged.jsonl", "\n".join(json.dumps(r, sort_keys=True) for r in records) + "\n")


# ---- exports that deleted their source (hsx.export) -------------------------------------------------------------

def record_exported(state: Path, entry: dict[str, Any], dest: str, command: str) -> None:
    """Append to .hsx/exported.jsonl that `entry`'s unit is about to be deleted by `hsx <command> --delete-source`
    into `dest` (fsynced before the deletion), so a reader of this dir is told where its rows went."""
    append_synced(state / EXPORTED, json.dumps({"file": entry["file"], "bytes": entry["bytes"],
                                                "crc32": entry.get("crc32"), "dest": dest,
                                                "command": command}, sort_keys=True) + "\n")


def exported(state: Path) -> dict[str, dict[str, Any]]:
    """What .hsx/exported.jsonl says exports deleted, by file name (well-formed lines only: it only explains a
    missing unit, it never makes one count as present)."""
    path = state / EXPORTED
    if not path.is_file() or path.is_symlink():
        return {}
    records = {}
    for rec in read_jsonl(path):
        if isinstance(rec.get("file"), str) and isinstance(rec.get("dest"), str) \
                and isinstance(rec.get("command"), str):
            records[rec["file"]] = rec
    return records


def used_up(root: Path, entries: list[dict[str, Any]]) -> str | None:
    """The line for a dir an export with --delete-source used up: of `entries` (hsx.json's or the manifests'
    records), those missing from its data/ that .hsx/exported.jsonl records with their size and CRC-32, and where
    their rows went. None when there are none (a missing unit is then just missing)."""
    records = exported(root / ".hsx")
    gone = [e["file"] for e in entries
            if not os.path.lexists(root / "data" / e["file"]) and uploaded_matches(records.get(e["file"]), e)]
    if not gone:
        return None
    rec = records[gone[0]]
    # (what the ledger says is shown as a quoted string: a forged one prints no second line)
    dest = rec["dest"] if rec["dest"].isprintable() else repr(rec["dest"])
    command = rec["command"] if rec["command"].isprintable() else repr(rec["command"])
    return (f"{root}: {len(gone)} of its {len(entries)} files were exported and then deleted "
            f"(`hsx {command[:40]} --delete-source` into {dest[:300]}); its rows are there now, in that "
            "trainer's layout, not here")


def gone_file(state: Path, entry: dict[str, Any]) -> str:
    """Why a file hsx.json (or a manifest) lists is not in data/: 'uploaded' for a unit deleted after its upload
    (--delete-after-upload), 'consumed' for one a trainer consumed and deleted (hsx.follow), 'exported' for one an
    export deleted, else 'missing'."""
    if uploaded_matches(uploaded(state).get(f"data/{entry['file']}"), entry):
        return "uploaded"
    if uploaded_matches(consumed(state).get(entry["file"]), entry):
        return "consumed"
    return "exported" if uploaded_matches(exported(state).get(entry["file"]), entry) else "missing"


# ---- the ranks of a run (hsx.run, hsx.job) ----------------------------------------------------------------------

def announce(state: Path, run_id: str, rank: int) -> None:
    """Leave a file saying `rank` of run `run_id` writes here (hsx.run.share_dir: which ranks share a dir)."""
    folder = state / "ranks" / run_id
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / f"{rank:05d}.here", run_id + "\n")


def announced(state: Path, run_id: str) -> list[int]:
    """The ranks of run `run_id` that announced themselves here."""
    folder = state / "ranks" / run_id
    return sorted(int(f.name[:-5]) for f in folder.glob("*.here") if f.name[:-5].isdigit())


def mark_rank_done(state: Path, run_id: str, rank: int, world_size: int,
                   stats: dict[str, Any] | None = None) -> bool:
    """Record that `rank` finished its share of run `run_id` (with its throughput numbers); True once all
    `world_size` ranks of the run that write into this dir have."""
    folder = state / "ranks" / run_id
    folder.mkdir(parents=True, exist_ok=True)
    record = {k: v for k, v in (stats or {}).items() if isinstance(v, (int, float, str, bool))}
    atomic_write(folder / f"{rank:05d}.done", json.dumps({"rank": rank, **record}) + "\n")
    return len(list(folder.glob("*.done"))) >= world_size


def rank_stats(state: Path, run_id: str) -> list[dict[str, Any]]:
    """What each rank of run `run_id` recorded when it finished, in rank order."""
    stats = []
    for f in sorted((state / "ranks" / run_id).glob("*.done")):
        try:  # (a rank's numbers: a few hundred bytes, well within the rest of a record)
            record = json.loads(read_bounded(f, RECORD_REST_BYTES) or b"{}")
        except (OSError, ValueError, RecursionError, HsxError):
            continue
        if isinstance(record, dict):
            stats.append(record)
    return stats


def mark_share_done(state: Path, units: int, of: int, rank: int) -> None:
    """This dir holds a finished node's share of a job whose nodes each write their own dir: `units` of its `of`
    units. Readers then name `hsx merge` as the next step, not the same `hsx extract` (nothing is left to run).
    Every rank of the node that finds the share done writes it (the same record), at once: each through a
    temporary name of its own (`rank`)."""
    atomic_write(state / "share-done.json", json.dumps({"units": units, "of": of}) + "\n", writer=f"rank-{rank:05d}")


def finished_share(state: Path, data: Path) -> tuple[int, int] | None:
    """(units, of) when this dir is a node's finished share (`mark_share_done`) and no unit was committed or lost
    since (`done_units`); None otherwise, or when the record is damaged (it only chooses which next step a message
    names)."""
    try:
        record = json.loads(read_bounded(state / "share-done.json", 256))
        units, of = record["units"], record["of"]
    except (OSError, ValueError, TypeError, KeyError, HsxError):
        return None
    if type(units) is not int or type(of) is not int or not 0 < units < of or units != len(done_units(state, data)):
        return None
    return units, of
