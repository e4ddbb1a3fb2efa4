"""`hsx merge OUT DIR...`: one job's node dirs joined into one output by metadata only.

Nodes without a shared filesystem each write their own dir (hsx.run); a merge links their unit files into OUT
(relative symlinks, checked by `OutputDir.unit_source` on every read and push), writes a manifest, hsx.json and
the card, and copies no hidden-state byte. `--partial` joins the dirs that survive a lost node into an unfinished
OUT that the job's `hsx extract` then completes. Its own module so that the output dir (hsx.sink) imports neither
the card nor the vocabulary: they sit above it.
"""

from __future__ import annotations

import json
import os
import stat
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hsx.config import HsxError
from hsx.errors import UsageError
from hsx.schema import JobRecord, merged_values
from hsx.sink import OutputDir, atomic_write, complete_info, info_features, read_json


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
            return _merge(out, sources, dirs, log, partial)
    except BaseException:
        _remove_made(made)
        raise


def _remove_made(made: list[Path]) -> None:
    """Remove what a failed merge created, deepest first: its lock files (empty, held by no one once the merge
    let them go) and the dirs, only if empty (rmdir, never a recursive delete)."""
    for path in sorted(made, key=lambda p: len(p.parts), reverse=True):
        try:
            if path.name in ("lock", "busy"):
                if stat.S_ISREG(os.lstat(path).st_mode) and os.lstat(path).st_size == 0:
                    path.unlink()
            else:
                path.rmdir()
        except OSError:  # not empty (it holds something else), or not there
            pass


def _merge(out: OutputDir, sources: list[OutputDir], dirs: list[str], log, partial: bool) -> dict[str, Any]:
    jobs = []
    for src in sources:
        f = src.state / "job.json"
        if not f.exists():
            raise HsxError(f"{src.root} holds no hsx job (.hsx/job.json is missing)")
        jobs.append(read_json(f, JobRecord))
    if len({j.fingerprint for j in jobs}) != 1:
        raise HsxError("the dirs hold different jobs (their fingerprints differ); merge only one job's dirs")
    own = out.state / "job.json"
    if own.exists() and read_json(own, JobRecord).fingerprint != jobs[0].fingerprint \
            and out.has_output():
        raise HsxError(f"{out.root} holds another job's output; merge into a new dir or one of the job's dirs")
    read = next((s for s in (src.read_summary() for src in sources) if s), None)
    if read is None:
        raise HsxError("no dir has a planning summary (.hsx/summary.json): did the job get past tokenization?")
    summary = read.to_dict()
    done: dict[str, tuple[OutputDir, dict[str, Any]]] = {}
    if own.exists():
        done = {u: (out, rec) for u, rec in out.done_units().items() if (out.data / rec["file"]).exists()
                and not (out.data / rec["file"]).is_symlink()}  # OUT's own files are kept, never replaced
    for src in sources:
        for unit, rec in src.done_units().items():
            f = src.data / rec["file"]
            if f.is_file() and not f.is_symlink():  # (a link there is no unit of that dir: reads refuse it)
                done.setdefault(unit, (src, rec))
    missing = [u for u in summary["unit_names"] if u not in done]
    if missing and not partial:
        raise HsxError(f"{len(missing)} of {len(summary['unit_names'])} units are in none of the dirs "
                       f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); run the job again to "
                       "write them, then merge (or `hsx merge --partial` to join what there is, then the job's "
                       "`hsx extract` with --output-dir OUT writes only the rest)")
    for unit in (u for u in summary["unit_names"] if u in done):  # every refusal before the first write
        src, rec = done[unit]
        target, link = src.data / rec["file"], out.data / rec["file"]
        if src is not out and target.resolve() != link.resolve() and link.exists() and not link.is_symlink():
            raise HsxError(f"{link} is not a unit of this job's dirs; move it away, then merge")
    out.data.mkdir(parents=True, exist_ok=True)
    lines = []
    for unit in summary["unit_names"]:
        if unit not in done:
            continue
        src, rec = done[unit]
        target, link = src.data / rec["file"], out.data / rec["file"]
        if src is not out and target.resolve() != link.resolve():
            if link.is_symlink():
                link.unlink()  # a link of an earlier merge (the link only)
            os.symlink(os.path.relpath(target.resolve(), out.data.resolve()), link)
        lines.append(json.dumps(rec, sort_keys=True))
    atomic_write(out.state / "manifest-merged.jsonl", "\n".join(lines) + "\n")
    atomic_write(out.state / "job.json", json.dumps(jobs[0].to_dict(), indent=2, sort_keys=True))
    sources_now = out.merged_sources([str(Path(d).resolve()) for d in dirs])
    out.write_summary(summary)
    if missing:
        info = out.read_info()
        if info is not None and info.complete:  # OUT was a finished output once: no longer
            atomic_write(out.root / "hsx.json", json.dumps(info.unfinished().to_dict(), indent=2) + "\n")
        out.write_unfinished_card()
        log(f"hsx merge: {out.root}: {len(lines)} of {len(summary['unit_names'])} units from {len(dirs)} dirs "
            f"(symlinked, nothing copied); {len(missing)} missing: run the job's `hsx extract` with --output-dir "
            f"{out.root} to write them")
        return {"complete": False, "units": len(lines), "missing": len(missing)}
    dirs_used = {id(d): d for d, _ in done.values()}.values()
    used = merged_values(*(d.run_values({u: rec for u, (s, rec) in done.items() if s is d}) for d in dirs_used))
    info = complete_info(summary, {u: rec for u, (_, rec) in done.items()}, world_size=0,
                         run={"merged_from": sources_now, **({"values_used": used} if used else {})})
    from hsx.card import dataset_card
    from hsx.vocab import write_token_frequencies

    info["token_frequencies"] = write_token_frequencies(out, summary.get("vocab_size"))
    out.finalize(info, lambda i: dataset_card(i, summary["command"]), features=info_features(info))
    log(f"hsx merge: {out.root}: {info['counts']['rows_written']:,} rows in {len(lines)} units from "
        f"{len(dirs)} dirs (symlinked, nothing copied)")
    return info
