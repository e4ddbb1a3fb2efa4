"""`hsx merge OUT DIR...`: one job's node dirs joined into one output by metadata only.

Nodes without a shared filesystem each write their own dir (hsx.run); a merge links their unit files into OUT
(relative symlinks, checked by `OutputDir.unit_source` on every read and push), writes a manifest, hsx.json and
the card, and copies no hidden-state byte. It believes no dir: every dir's plan and every unit it links are checked
before it writes anything (`_summary`, `_check_units`). `--partial` joins the dirs that survive a lost node into an
unfinished OUT that the job's `hsx extract` then completes. Its own module so that the output dir (hsx.sink)
imports neither the card nor the vocabulary: they sit above it.
"""

from __future__ import annotations

import os
import stat
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hsx.config import HsxError
from hsx.errors import UsageError, file_system_error, file_system_line, one_line
from hsx.schema import ManifestRecord, Summary, merged_values
from hsx.checksums import file_crc32
from hsx.files import open_regular
from hsx import ledgers
from hsx.info import complete_info, info_features, recorded_info, read_summary, write_info, write_summary
from hsx.fingerprint import JOB_FILE, check_recorded_job, recorded_job, same_job, write_job
from hsx.sink import OutputDir


def merge(out_dir: str, dirs: list[str], log=print, partial: bool = False) -> dict[str, Any]:
    """`hsx merge OUT DIR...`: join the dirs that the nodes of one job wrote (each its own, when there is no
    shared filesystem) into OUT. Only metadata is written: OUT/data/ gets relative symlinks to the other dirs'
    unit files (OUT may be one of the dirs), a manifest, hsx.json and the card. No hidden-state byte is copied.

    `partial` (`--partial`): some units are in none of the dirs (a node's dir was lost). OUT gets the units
    there are and stays unfinished (no complete hsx.json, the unfinished card): the job's `hsx extract` command
    with `--output-dir OUT` then writes only the missing units and finishes it.

    Like extract, it holds every dir whole while it works (refused while a job runs in any of them), refuses an
    OUT that hsx did not write or that holds another job, and never deletes or replaces a file in OUT/data/
    (only links an earlier merge made): OUT's own unit of a name is the one kept."""
    seen: dict[str, str] = {}
    for d in dirs:  # one dir named twice (or by two spellings) is one node's share, not two
        key = os.path.realpath(d)
        if key in seen:
            raise UsageError(f"hsx merge: {d} names the same dir as {seen[key]}; give each node's dir once")
        seen[key] = d
    out = OutputDir(out_dir, given_as="OUTPUT_DIR of `hsx merge` (a new dir, or one of the job's)")
    sources = [OutputDir(d, given_as="DIR of `hsx merge` (a dir the job's `hsx extract` wrote)") for d in dirs]
    # What a refused merge must not leave behind: the dirs, .hsx/ and data/ it creates (an empty OUT, or a
    # mistyped source dir made just to be locked).
    made = [p for d in [out, *sources] for p in (d.root, d.state, d.data, d.state / "lock", d.state / "busy")
            if not os.path.lexists(p)]
    try:
        with ExitStack() as stack:
            seen = set()
            for d in [out, *sources]:
                if d.root.resolve() not in seen:  # (one lock per dir: OUT may be one of the sources)
                    seen.add(d.root.resolve())
                    stack.enter_context(d.locked_whole())
            return _merge(out, sources, dirs, log, partial, made)
    except BaseException as e:
        _remove_made(made)
        fault = file_system_error(e) if isinstance(e, Exception) and not isinstance(e, HsxError) else None
        if fault is not None:  # (hsx.json is written last: OUT is not taken for a finished output)
            raise HsxError(file_system_line(fault, str(out.root), "no unit file was changed and OUT is not "
                                            "finished")) from None
        raise


def _remove_made(made: list[Path]) -> None:
    """Remove what a failed merge created, deepest first: the links it made under a name that was free (a rerun
    makes them again), its lock files (empty, held by no one once the merge let them go) and the dirs, only if
    empty (rmdir, never a recursive delete). So an OUT the merge created is not left as a data/ without .hsx/,
    which a rerun would refuse as a dir hsx did not write."""
    for path in sorted(made, key=lambda p: len(p.parts), reverse=True):
        try:
            if path.parent.name == "data" and path.suffix == ".arrow":
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    path.unlink()  # (the link only)
            elif path.name in ("lock", "busy"):
                if stat.S_ISREG(os.lstat(path).st_mode) and os.lstat(path).st_size == 0:
                    path.unlink()
            else:
                path.rmdir()
        except OSError:  # not empty (it holds something else), or not there
            pass


# What a node's summary.json says of where it ran, not of what the job is: its command line and config (its own
# --output-dir) and the local paths of the model and tokenizer (the fingerprint holds their content).
PER_NODE_KEYS = ("command", "config", "model", "model_path", "tokenizer")


def _plan(summary: Summary) -> dict[str, Any]:
    return {k: v for k, v in summary.to_dict().items() if k not in PER_NODE_KEYS}


def _summary(dirs: list[OutputDir], fingerprint: str) -> Summary:
    """The job's planning summary, the same in every dir that has one (PER_NODE_KEYS aside), of this job."""
    found = [(d, s) for d, s in ((d, read_summary(d.state)) for d in dirs) if s is not None]
    if not found:
        raise HsxError("no dir has a planning summary (.hsx/summary.json): did the job get past tokenization?")
    first, summary = found[0]
    for d, s in found:
        if s.fingerprint is not None and s.fingerprint != fingerprint:  # (an older hsx wrote none)
            raise HsxError(f"{d.state / 'summary.json'} is of another job than its .hsx/job.json (their fingerprints "
                           "differ): the dir is damaged or not the job's; merge without it")
        if _plan(s) != _plan(summary):
            what = sorted(k for k in set(_plan(s)) | set(_plan(summary)) if _plan(s).get(k) != _plan(summary).get(k))
            raise HsxError(f"{d.state / 'summary.json'} and {first.state / 'summary.json'} plan the job differently "
                           f"({', '.join(what[:3])} differ): one of the dirs is damaged or not the job's; merge "
                           "without it")
    return summary


def _same_unit(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("bytes", "crc32", "rows", "tokens", *ManifestRecord.COUNTS)
    return all(a.get(k) == b.get(k) for k in keys)


def _unit_problem(path: Path, rec: dict[str, Any], schema) -> tuple[str | None, Any]:
    """What is wrong with a unit file a merge would link, None if nothing, and its sample ids: a regular file
    reached through no link, of the size and CRC-32 its manifest records, a valid Arrow stream of the output's
    schema holding the recorded rows and tokens."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return "missing", None
    try:
        st = os.fstat(fd)
        if st.st_size != rec["bytes"]:
            return f"{st.st_size:,} bytes, its manifest records {rec['bytes']:,}", None
        if rec.get("crc32") is None:
            return "its manifest records no CRC-32 to check it against", None
        if file_crc32(path, fd) != rec["crc32"]:
            return "its bytes do not match the CRC-32 its manifest records", None
        try:
            with pa.memory_map(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)) as source:
                table = pa.ipc.open_stream(source).read_all()
                table.validate(full=True)
                if not table.schema.remove_metadata().equals(schema):
                    return "not a unit of this job's output (its columns differ)", None
                tokens = table.column("num_tokens")
                lengths_ok = all(pc.all(pc.equal(pc.list_value_length(table.column(c)), tokens)).as_py() is not False
                                 for c in ("input_ids", "loss_mask", "hidden_states"))
                total = pc.sum(tokens).as_py() or 0
                if table.num_rows != rec["rows"] or total != rec["tokens"] or not lengths_ok:
                    return (f"{table.num_rows} rows of {total} tokens, its manifest records {rec['rows']} of "
                            f"{rec['tokens']}"), None
                return None, table.column("sample_id").to_numpy()
        except (pa.ArrowException, OSError, ValueError, KeyError) as e:
            return f"not a valid Arrow unit ({one_line(e, 120)})", None
    finally:
        os.close(fd)


def _check_units(done: dict[str, tuple[OutputDir, dict[str, Any]]], summary: Summary) -> None:
    """HsxError in one line, before anything is written, unless every unit the merge would link is intact
    (`_unit_problem`), no input row is in two units or outside the job's, and the rows the units hold and skip
    add up to the rows the plan read (all of them when every unit is there)."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    schema = summary.format.features().arrow_schema.remove_metadata()
    units = sorted(done)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # (CRC and Arrow release the GIL)
        results = list(pool.map(lambda u: _unit_problem(done[u][0].data / done[u][1]["file"], done[u][1], schema),
                                units))
    for unit, (problem, _) in zip(units, results):
        if problem is not None:
            path = done[unit][0].data / done[unit][1]["file"]
            raise HsxError(f"{path} is damaged: {problem}; nothing was merged: run the job's `hsx extract` on "
                           f"{done[unit][0].root} to redo it (or merge without that dir), then merge")
    ids = np.concatenate([ids for _, ids in results]) if results else np.zeros(0, np.int64)
    rows_in = summary.counts.rows_in
    if len(ids) and (ids.min() < 0 or ids.max() >= rows_in or len(np.unique(ids)) != len(ids)):
        raise HsxError(f"the units hold input rows twice or rows the job never read (its plan's sample ids are 0.."
                       f"{rows_in - 1}): one of the dirs is damaged or not the job's; merge without it")
    recs = [rec for _, rec in done.values()]
    accounted = (len(ids) + sum(n for n in summary.counts.skipped.values() if type(n) is int)
                 + sum(r.get("skipped_oom", 0) + r.get("skipped_nonfinite", 0) for r in recs))
    if accounted > rows_in or (accounted != rows_in and len(done) == len(summary.unit_names)):
        raise HsxError(f"the units' manifests and .hsx/summary.json disagree: {accounted:,} rows written or skipped, "
                       f"the plan read {rows_in:,}: one of the dirs is damaged or not the job's; merge without it")


def _merge(out: OutputDir, sources: list[OutputDir], dirs: list[str], log, partial: bool,
           made: list[Path]) -> dict[str, Any]:
    jobs = []
    for src in sources:
        job = recorded_job(src.state)
        if job is None:
            raise HsxError(f"{src.root} holds no hsx job (.hsx/job.json is missing)")
        # (OUT gets the first dir's job.json: verify checks the model against its inputs, so a dir's inputs must be
        # what its fingerprint hashes)
        check_recorded_job(job, src.state / JOB_FILE)
        jobs.append(job)
    if len({j.fingerprint for j in jobs}) != 1:
        raise HsxError("the dirs hold different jobs (their fingerprints differ); merge only one job's dirs")
    own = recorded_job(out.state) if (out.state / JOB_FILE).exists() else None
    own_job = same_job(own, jobs[0].fingerprint)
    if own is not None and not own_job and out.has_output():
        raise HsxError(f"{out.root} holds another job's output; merge into a new dir or one of the job's dirs")
    # Every dir's plan, not the first one's: a dir given first with a forged summary.json must not decide the job
    holders = [*([out] if own_job else []), *(s for s in sources if s.root.resolve() != out.root.resolve())]
    read = _summary(holders, jobs[0].fingerprint)
    summary = read.to_dict()
    plan = set(summary["unit_names"])
    # Every unit any dir offers (OUT's own regular files first: those are kept, never replaced), each checked
    # against the plan and against every other dir's copy of it
    offers: dict[str, list[tuple[OutputDir, dict[str, Any]]]] = {}
    for src in holders:
        records = ledgers.manifest_records(src.state)
        stray = sorted(u for u in records if u not in plan)
        if stray:
            raise HsxError(f"{src.state}: its manifests record unit {stray[0]}, which is not in the job's plan "
                           "(.hsx/summary.json): the dir is damaged or not the job's; merge without it")
        for rec in records.values():  # (a unit of the wrong size is not done: it would pass as missing)
            f = src.data / rec["file"]
            if f.is_file() and not f.is_symlink() and f.stat().st_size != rec["bytes"]:
                raise HsxError(f"{f} is damaged: {f.stat().st_size:,} bytes, its manifest records {rec['bytes']:,}; "
                               f"nothing was merged: run the job's `hsx extract` on {src.root} to redo it (or merge "
                               "without that dir), then merge")
        for unit, rec in ledgers.done_units(src.state, src.data).items():
            f = src.data / rec["file"]
            if f.is_file() and not f.is_symlink():  # (a link there is no unit of that dir: reads refuse it)
                offers.setdefault(unit, []).append((src, rec))
    done: dict[str, tuple[OutputDir, dict[str, Any]]] = {}
    for unit, given in offers.items():
        (a, rec), *others = given
        for b, other in others:
            if not _same_unit(rec, other) and a.root.resolve() != b.root.resolve():
                raise HsxError(f"{a.data / rec['file']} and {b.data / other['file']} are two different units of one "
                               "name (their manifests record other bytes, CRC-32 or rows); delete the wrong one "
                               "(a unit whose file is gone is not counted), then merge")
        done[unit] = (a, rec)
    missing = [u for u in summary["unit_names"] if u not in done]
    if missing and not partial:
        raise HsxError(f"{len(missing)} of {len(summary['unit_names'])} units are in none of the dirs "
                       f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); run the job again to "
                       "write them, then merge (or `hsx merge --partial` to join what there is, then the job's "
                       "`hsx extract` with --output-dir OUT writes only the rest)")
    _check_units(done, read)
    for unit in (u for u in summary["unit_names"] if u in done):  # every refusal before the first write
        src, rec = done[unit]
        target, link = src.data / rec["file"], out.data / rec["file"]
        if src is not out and target.resolve() != link.resolve() and link.exists() and not link.is_symlink():
            raise HsxError(f"{link} is not a unit of this job's dirs; move it away, then merge")
    out.data.mkdir(parents=True, exist_ok=True)
    merged = []  # (the joined units' manifest records)
    for unit in summary["unit_names"]:
        if unit not in done:
            continue
        src, rec = done[unit]
        target, link = src.data / rec["file"], out.data / rec["file"]
        if src is not out and target.resolve() != link.resolve():
            if link.is_symlink():
                link.unlink()  # a link of an earlier merge (the link only)
            else:
                made.append(link)
            os.symlink(os.path.relpath(target.resolve(), out.data.resolve()), link)
        merged.append(rec)
    ledgers.write_merged_manifest(out.state, merged)
    write_job(out.state, jobs[0].to_dict())
    sources_now = ledgers.merged_sources(out.state, [str(Path(d).resolve()) for d in dirs])
    write_summary(out.state, summary)
    if missing:
        info = recorded_info(out.root)
        if info is not None and info.complete:  # OUT was a finished output once: no longer
            write_info(out.root, info.unfinished().to_dict())
        out.write_unfinished_card()
        log(f"hsx merge: {out.root}: {len(merged)} of {len(summary['unit_names'])} units from {len(dirs)} dirs "
            f"(symlinked, nothing copied); {len(missing)} missing: run the job's `hsx extract` with --output-dir "
            f"{out.root} to write them")
        return {"complete": False, "units": len(merged), "missing": len(missing)}
    dirs_used = {id(d): d for d, _ in done.values()}.values()
    used = merged_values(*(ledgers.run_values(d.state, {u: rec for u, (s, rec) in done.items() if s is d})
                           for d in dirs_used))
    info = complete_info(summary, {u: rec for u, (_, rec) in done.items()}, world_size=0,
                         run={"merged_from": sources_now, **({"values_used": used} if used else {})})
    from hsx.card import dataset_card
    from hsx.vocab import write_token_frequencies

    info["token_frequencies"] = write_token_frequencies(out, summary.get("vocab_size"))
    out.finalize(info, lambda i: dataset_card(i, summary["command"]), features=info_features(info))
    log(f"hsx merge: {out.root}: {info['counts']['rows_written']:,} rows in {len(merged)} units from "
        f"{len(dirs)} dirs (symlinked, nothing copied)")
    return info
