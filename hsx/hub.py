"""Publishing an output dir to the Hugging Face Hub: a complete dir at the end (`push_output`, `hsx push`), or
unit by unit while the job runs (`StreamUploader`, --push-mode stream), optionally deleting each unit locally once
the Hub has it (--delete-after-upload), so a job can produce more than the local disk holds (SpecForge reports 1.2 TB
for ShareGPT-68k on Llama-3.1-8B, and 35 TB projected for 30k samples of GPT-OSS-120B at 64K context).

What goes up: data/train-*.arrow, README.md, token_frequencies.npy and hsx.json, as they are; never .hsx/ (run
state, the tokenized cache).
The Arrow units are already Hub-ready shards: the card's `configs` make `load_dataset(REPO)` read them. datasets'
own `push_to_hub` would rewrite everything as Parquet, which for nested int16 writes far slower than Arrow IPC and
saves little space (docs/benchmarks.md, "Figures moved from the code"), and it needs the whole dataset present.

How:
- huggingface_hub's own API: `create_repo(repo_type="dataset", exist_ok=True, private=...)`, `create_branch` for a
  revision, then `create_commit` with explicit `CommitOperationAdd` batches. With hf_xet (a huggingface_hub 2.x
  dependency) a commit's files are chunked, deduplicated and uploaded in a single read pass, and a retried commit
  re-sends ~0 bytes of the chunks the server already holds. `create_commit` rather than `upload_folder`: every
  commit then holds exactly the files listed, so once the Hub confirms it we know which units it holds (the upload
  records and --delete-after-upload depend on that), and no scan or pattern match over thousands of unit files
  runs per commit (`upload_folder`'s allow_patterns match every file against every pattern). Nor
  `upload_large_folder` (gone from huggingface_hub 2.x, where `upload_folder` does its resumable multi-commit xet
  upload): it picks its own batches and order, so hsx.json could land before the units it lists (it must be the
  last commit: its `complete` is the commit point), no commit is tied to the files it holds (the upload records,
  --delete-after-upload and a resumed job's done units need that), and it neither checks a file against hsx.json's
  CRC-32 before sending it nor prunes another job's units in the last commit.
- Batches: at most 50 files (the Hub recommends < 100 files per commit) and 64 GiB per commit. A stream starts at
  most one commit per `min_seconds_between_commits` (60 s by default: the Hub rate-limits commits; at full GPU speed
  a default unit (hsx.job.UNIT_BYTES) is committed every second or so, so a minute's units go in one commit);
  `close()` flushes the rest.
- Retries: HTTP 408/409/412/423/425/429 and 5xx, connection errors and timeouts are retried with exponential
  backoff (2 s doubling, capped at 5 min, jittered x0.5-1, at least the server's Retry-After), 10 attempts
  (7-14 min of waiting) in all; any other error (401/403/404, a bad name, offline mode) fails at once. A failure
  names the repo and the step, never the token.
- Upload records: after the Hub confirms a commit, one line per file goes to .hsx/uploaded-<rank>.jsonl (fsynced;
  `hsx push` writes uploaded-push.jsonl): path, bytes, CRC-32 (from the manifest), repo, revision, commit. Only then
  is a unit deleted with delete_after_upload, and `hsx.ledgers.done_units` counts recorded units as done, so a
  resumed job does not redo them. A restarted push skips the files it recorded that the Hub still has with the
  same size; a file the Hub has without a record (a kill between the commit and the record) is compared by sha256
  (LFS) or git blob id before it is skipped.
- `push_output` sends README.md and hsx.json in its last commit (hsx.json's `complete` is the commit point, on the
  Hub as locally) and deletes, in that commit, data/train-*.arrow files of the repo that are not part of this
  output, so the repo is exactly this output.
- Another job's repo is never replaced unless asked (`overwrite`, --hub-overwrite): before anything is uploaded
  (or, with --delete-after-upload, deleted), and with --push-mode end also when the job starts (`check_end_push`:
  not after hours of extraction), `check_remote` reads the repo's hsx.json (at most MAX_INFO_BYTES)
  and refuses a job fingerprint other than this one's, an hsx.json that cannot be read, and, in a repo without
  hsx.json (a push that has not finished), any file but README.md, .gitattributes and this job's units (recorded
  as uploaded there, identical to the local file, or committed by another node's dir of the job with that size).
- Token: HfApi() reads HF_TOKEN / `hf auth login` unless a token is given; it is never printed or written (error
  messages are scrubbed of it).
"""

from __future__ import annotations

import hashlib
import os
import queue
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.errors import HsxError
from hsx.schema import MAX_INFO_BYTES, Info, ManifestRecord, human_bytes
from hsx.checksums import file_crc32
from hsx.files import fsync_dir, open_regular, read_json, read_jsonl
from hsx.fingerprint import recorded_job
from hsx import ledgers
from hsx.info import listed_files, recorded_info
from hsx.sink import OutputDir

REPO_TYPE = "dataset"
MAX_FILES_PER_COMMIT = 50  # the Hub recommends fewer than 100 files per commit
MAX_BYTES_PER_COMMIT = 64 << 30  # a failed commit is retried whole (hf_xet dedup re-sends ~0 bytes, but re-reads)
MIN_SECONDS_BETWEEN_COMMITS = 60.0  # stream mode: the Hub rate-limits commits
RETRIES = 10  # attempts per Hub call: 2+4+...+256+300 s of backoff (jittered x0.5-1): 7-14 min
BACKOFF_SECONDS = 2.0
BACKOFF_CAP_SECONDS = 300.0
RETRY_STATUS = {408, 409, 412, 423, 425, 429}  # and every 5xx
DATA_GLOB = "train-*.arrow"
TOP_FILES = ("README.md", "token_frequencies.npy", "hsx.json")  # last: hsx.json's `complete` is the commit point
PUSH_LEDGER = "push"  # .hsx/uploaded-push.jsonl
NEW_REPO_FILES = ("README.md", ".gitattributes")  # what a repo made on the Hub's site holds: no job's output


# ---- errors, retries, secrets -----------------------------------------------------------------------------------

def is_transient(e: BaseException) -> bool:
    """Worth retrying: HTTP 408/409/412/423/425/429/5xx, connection errors, timeouts. Not: offline mode, 4xx."""
    names = {c.__name__ for c in type(e).__mro__}
    if "OfflineModeIsEnabled" in names:  # HF_HUB_OFFLINE=1: a ConnectionError that no retry fixes
        return False
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(status, int):
        return status in RETRY_STATUS or status >= 500
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    # httpx-style transport errors (huggingface_hub 2.x's HTTP client), without importing a particular client
    return bool(names & {"TransportError", "TimeoutException", "NetworkError", "ConnectError", "ReadError",
                         "WriteError", "RemoteProtocolError", "ProtocolError"})


def _retry_after(e: BaseException) -> float:
    headers = getattr(getattr(e, "response", None), "headers", None) or {}
    try:
        return float(headers.get("Retry-After") or headers.get("retry-after") or 0)
    except (TypeError, ValueError):
        return 0.0


def _secrets(token: str | None) -> list[str]:
    found = [token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")]
    return [s for s in found if isinstance(s, str) and len(s) >= 4]


def scrub(text: str, secrets: list[str]) -> str:
    """A message with every known token (and anything shaped like an HF token) blanked."""
    for s in secrets:
        text = text.replace(s, "***")
    return re.sub(r"hf_[A-Za-z0-9]{8,}", "hf_***", text)


def describe(e: BaseException, secrets: list[str] = ()) -> str:
    status = getattr(getattr(e, "response", None), "status_code", None)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = f"{type(e).__name__}{f' (HTTP {status})' if status else ''}: {first}"
    return scrub(text, list(secrets))


class _Hub:
    """One repo on the Hub, through an HfApi, with retries. `api` may be any object with HfApi's methods."""

    def __init__(self, repo_id: str, *, revision: str | None, api, token: str | None, retries: int,
                 backoff: float, log: Callable[[str], Any]):
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(token=token) if token else HfApi()  # token=None: HF_TOKEN or the stored login
        self.api, self.repo_id, self.revision = api, repo_id, revision
        self.retries, self.backoff, self.log = max(1, retries), backoff, log
        self.secrets = _secrets(token)

    @property
    def where(self) -> str:
        return f"{self.repo_id}" + (f"@{self.revision}" if self.revision else "")

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001  (classified below; re-raised as HsxError)
                if not is_transient(e) or attempt == self.retries:
                    tries = f" after {attempt} attempts" if attempt > 1 else ""
                    raise HsxError(f"push to {self.where}: {what} failed{tries}: {describe(e, self.secrets)}") from e
                delay = 0.0
                if self.backoff > 0:  # (tests pass backoff=0)
                    delay = min(BACKOFF_CAP_SECONDS, self.backoff * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
                    delay = max(delay, min(_retry_after(e), BACKOFF_CAP_SECONDS))
                self.log(f"hsx: push: {what} failed ({describe(e, self.secrets)}); attempt {attempt + 1} of "
                         f"{self.retries} in {delay:.0f} s")
                time.sleep(delay)
        raise AssertionError("unreachable")

    def ensure_repo(self, private: bool) -> None:
        self.call("create_repo", lambda: self.api.create_repo(self.repo_id, repo_type=REPO_TYPE, exist_ok=True,
                                                              private=private))
        if self.revision:
            self.call("create_branch", lambda: self.api.create_branch(self.repo_id, branch=self.revision,
                                                                      repo_type=REPO_TYPE, exist_ok=True))

    def remote_files(self) -> dict[str, RemoteFile]:
        def listing():
            files = {}
            for f in self.api.list_repo_tree(self.repo_id, recursive=True, repo_type=REPO_TYPE,
                                             revision=self.revision):
                if getattr(f, "size", None) is None:
                    continue  # a folder
                lfs = getattr(f, "lfs", None)
                files[f.path] = RemoteFile(int(f.size), getattr(lfs, "sha256", None) if lfs is not None else None,
                                           getattr(f, "blob_id", None))
            return files

        return self.call("list_repo_tree", listing)

    def commit(self, adds: list[tuple[str, Any]], deletes: list[str], message: str) -> str | None:
        """One commit of these files (path in repo, local path or a binary file object opened and checked by the
        caller: what was checked is what goes up) and deletions; returns the commit id."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        def attempt():
            for _, f in adds:
                if hasattr(f, "seek"):
                    f.seek(0)  # (a retry reads the file object again from its start)
            # fresh operations each attempt: create_commit mutates them
            ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=f if hasattr(f, "read") else str(f))
                   for p, f in adds]
            ops += [CommitOperationDelete(path_in_repo=p) for p in deletes]
            info = self.api.create_commit(self.repo_id, operations=ops, commit_message=message,
                                          repo_type=REPO_TYPE, revision=self.revision)
            return getattr(info, "oid", None)

        what = f"commit of {len(adds)} file(s)" + (f" and {len(deletes)} deletion(s)" if deletes else "")
        return self.call(what, attempt)


@dataclass
class RemoteFile:
    size: int
    sha256: str | None  # LFS / xet files
    blob_id: str | None  # git blob id (sha1 of "blob <size>\0<content>")


def sha256_file(path: Path, chunk: int = 64 << 20) -> str:
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:  # (never a link's target, never a FIFO)
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def git_blob_id(path: Path) -> str:
    with os.fdopen(open_regular(path), "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def same_content(path: Path, remote: RemoteFile | None) -> bool:
    """Whether the Hub's file is this local file (size, then sha256 for LFS files or the git blob id)."""
    if remote is None or path.stat().st_size != remote.size:
        return False
    if remote.sha256:
        return sha256_file(path) == remote.sha256
    if remote.blob_id:
        return git_blob_id(path) == remote.blob_id
    return False


def _batches(items: list, sizes: list[int], max_files: int, max_bytes: int) -> list[list]:
    out, cur, cur_bytes = [], [], 0
    for item, size in zip(items, sizes):
        if cur and (len(cur) >= max_files or cur_bytes + size > max_bytes):
            out.append(cur)
            cur, cur_bytes = [], 0
        cur.append(item)
        cur_bytes += size
    if cur:
        out.append(cur)
    return out


def _record(path_in_repo: str, size: int, manifest: dict | None, hub: _Hub, commit: str | None) -> dict:
    return {"file": path_in_repo, "unit": (manifest or {}).get("unit"), "bytes": size,
            "crc32": (manifest or {}).get("crc32"), "repo": hub.repo_id, "revision": hub.revision or "main",
            "commit": commit, "time": round(time.time(), 3)}


def _recorded_here(rec: dict | None, hub: _Hub, size: int, manifest: dict | None) -> bool:
    """An upload record says this file, as it is, went to this repo and revision."""
    if rec is None or rec.get("repo") != hub.repo_id or rec.get("revision") != (hub.revision or "main"):
        return False
    return ledgers.uploaded_matches(rec, {"bytes": size, "crc32": (manifest or {}).get("crc32")})


# ---- whose repo is it --------------------------------------------------------------------------------------------

def _remote_job(hub: _Hub, remote: RemoteFile) -> tuple[str | None, str]:
    """The job fingerprint the repo's hsx.json records, or (None, why it cannot say)."""
    if remote.size > MAX_INFO_BYTES:  # (not downloaded: a huge file is not hsx's)
        return None, f"its hsx.json is {remote.size:,} bytes, more than hsx writes"
    with tempfile.TemporaryDirectory(prefix="hsx-remote-") as tmp:
        try:
            got = hub.call("download of hsx.json", lambda: hub.api.hf_hub_download(
                hub.repo_id, "hsx.json", repo_type=REPO_TYPE, revision=hub.revision, local_dir=tmp))
        except HsxError as e:
            return None, f"its hsx.json cannot be downloaded ({str(e).split(': ', 1)[-1][:200]})"
        try:
            obj = read_json(Path(got), limit=MAX_INFO_BYTES)  # (bounded, a regular file, one key once)
        except HsxError as e:
            return None, str(e).replace(str(got), "its hsx.json")[:200]
    fp = obj.get("fingerprint")
    if not isinstance(fp, str) or not fp:
        return None, "its hsx.json records no job fingerprint"
    return fp, ""


def check_remote(hub: _Hub, remote: dict[str, RemoteFile], fingerprint: str | None,
                 ours: Callable[[str, RemoteFile], bool], *, overwrite: bool, log=print,
                 same_info: Callable[[RemoteFile], bool] = lambda r: False) -> None:
    """Refuse (HsxError naming the repo and what differs) to push job `fingerprint` into a repo that holds
    another job's output: an hsx.json of another fingerprint (or one that cannot be read, unless `same_info` finds
    it identical to this output's), or, without hsx.json, any file but NEW_REPO_FILES that `ours(path, remote)`
    does not claim. Called before anything is uploaded or deleted. With `overwrite`, logs what is replaced."""
    what = None
    if "hsx.json" in remote:
        if same_info(remote["hsx.json"]):  # this very output's (a re-push): nothing to download
            return
        theirs, why = _remote_job(hub, remote["hsx.json"])
        if theirs is None or theirs != fingerprint:
            what = (f"the output of another job (job {theirs[:12]}; this is job {(fingerprint or '?')[:12]})"
                    if theirs is not None else f"an hsx.json that is not this job's: {why}")
    else:
        foreign = sorted(p for p, r in remote.items() if p not in NEW_REPO_FILES and not ours(p, r))
        if foreign:
            what = (f"{len(foreign)} file(s) and no hsx.json ({foreign[0]}{', ...' if len(foreign) > 1 else ''}) "
                    "that this job did not push")
    if what is None:
        return
    if overwrite:
        log(f"hsx: push: {hub.where} holds {what}; replacing it (--hub-overwrite)")
        return
    raise HsxError(f"{hub.where} holds {what}; this push would replace them. Push to another repo, or pass "
                   "--hub-overwrite to replace that output")


def check_destination(out: OutputDir, hub: _Hub, *, overwrite: bool, log: Callable[[str], Any],
                      known: dict[str, int] | None = None) -> None:
    """`check_remote` for the job writing `out` (its job.json's fingerprint), before the job uploads anything: the
    repo's files this job may have put there are its units recorded as uploaded there, its units here with the
    same bytes, and `known` ({path in repo: bytes}: `job_files` of the job's dirs; default this dir's)."""
    job = recorded_job(out.state)
    fingerprint = job.fingerprint if job is not None else None
    uploaded = ledgers.uploaded(out.state)
    mine = {rec["file"]: rec for rec in ledgers.manifest_records(out.state).values()}
    known = job_files(out, hub.repo_id, hub.revision) if known is None else known

    def ours(path: str, r: RemoteFile) -> bool:
        name = path[len("data/"):] if path.startswith("data/") else None
        if name is None or "/" in name:
            return False
        if _recorded_here(uploaded.get(path), hub, r.size, mine.get(name)):
            return True
        f = out.data / name
        if name in mine and f.is_file() and not f.is_symlink():  # this dir's unit: the bytes decide
            return same_content(f, r)
        return known.get(path) == r.size  # another node's dir's unit (the Hub lists no CRC-32)

    check_remote(hub, hub.remote_files(), fingerprint, ours, overwrite=overwrite, log=log)


def check_end_push(out_dir: str | os.PathLike, repo_id: str, *, revision: str | None = None, overwrite: bool = False,
                   token: str | None = None, api=None, log: Callable[[str], Any] = print, retries: int = RETRIES,
                   backoff: float = BACKOFF_SECONDS) -> None:
    """At the start of a job that pushes once complete (--push-mode end): refuse now, not after hours of
    extraction, a repo (or --hub-revision) that holds another job's output (`check_destination`; `push_output`
    checks again before it uploads). Nothing is created: a repo or revision that does not exist yet holds nothing."""
    hub = _Hub(repo_id, revision=revision, api=api, token=token, retries=retries, backoff=backoff, log=log)
    if not hub.call("repo_exists", lambda: hub.api.repo_exists(repo_id, repo_type=REPO_TYPE)):
        return
    if revision and not hub.call("revision_exists", lambda: hub.api.revision_exists(repo_id, revision,
                                                                                    repo_type=REPO_TYPE)):
        return
    check_destination(OutputDir(out_dir), hub, overwrite=overwrite, log=log)


# ---- a complete dir ---------------------------------------------------------------------------------------------

def push_output(out_dir: str | os.PathLike, repo_id: str, *, private: bool = True, revision: str | None = None,
                token: str | None = None, api=None, log: Callable[[str], Any] = print,
                max_files_per_commit: int = MAX_FILES_PER_COMMIT, max_bytes_per_commit: int = MAX_BYTES_PER_COMMIT,
                retries: int = RETRIES, backoff: float = BACKOFF_SECONDS, prune: bool = True,
                overwrite: bool = False) -> dict[str, Any]:
    """Upload a COMPLETE output dir to the Hub dataset repo `repo_id` (created if missing, private by default;
    `revision`: a branch, created if missing): data/train-*.arrow, then README.md and hsx.json in the last commit.

    Resumable and idempotent: files the Hub already has (recorded in .hsx/uploaded-*.jsonl, or found identical)
    are skipped, so running it again after a failure uploads only what is missing, and on a pushed dir it only
    checks. Units deleted after upload (--delete-after-upload) must be on the Hub already. With `prune`, the last
    commit also deletes the repo's data/train-*.arrow files that are not part of this output. A repo that holds
    another job's output is refused before anything is uploaded (`check_remote`), unless `overwrite`.

    Returns {"uploaded": files, "skipped": files, "deleted": remote files, "commits": n, "bytes": uploaded bytes}."""
    out = OutputDir(out_dir)
    info = recorded_info(out.root)
    if info is None or not info.complete:
        raise HsxError(f"{out_dir} is not a complete hsx output (hsx.json missing or not complete): run the same "
                       "`hsx extract` command to finish it, or push units as they are written with --push-mode stream")
    for name in TOP_FILES:
        if (out.root / name).is_symlink():
            raise HsxError(f"{out.root / name} is a symbolic link; hsx pushes only the files it wrote, never a "
                           "link's target")
        if os.path.lexists(out.root / name) and not (out.root / name).is_file():  # (a FIFO would hang the upload)
            raise HsxError(f"{out.root / name} is not a regular file; hsx pushes only the files it wrote")
    out.check_finished(info)  # the list, the manifests, the counts and data/ agree
    by_file = output_records(out, info)
    local = local_units(out, info, by_file)  # (a link that is not one `hsx merge` made: HsxError)
    uploaded = ledgers.uploaded(out.state)
    used_up = ledgers.used_up(out.root, [rec for name, rec in by_file.items()
                           if not ledgers.uploaded_matches(uploaded.get(f"data/{name}"), rec)])
    if used_up:  # (before the repo is created: there is no whole output to push; units it pushed before may go)
        raise HsxError(f"{used_up}: push that export, or run `hsx extract` again into another dir")
    hub = _Hub(repo_id, revision=revision, api=api, token=token, retries=retries, backoff=backoff, log=log)
    hub.ensure_repo(private)

    def ours(path: str, r: RemoteFile) -> bool:  # a unit of this output: recorded as uploaded here, or identical
        name = path[len("data/"):] if path.startswith("data/") else None
        if name not in by_file:
            return False
        return (_recorded_here(uploaded.get(path), hub, r.size, by_file[name])
                or (name in local and local[name].exists() and same_content(local[name], r)))

    check_remote(hub, hub.remote_files(), info.fingerprint, ours, overwrite=overwrite, log=log,
                 same_info=lambda r: same_content(out.root / "hsx.json", r))
    summary = {"uploaded": [], "skipped": [], "deleted": [], "commits": 0, "bytes": 0}

    for round_ in range(3):  # a unit may vanish under us (another rank deleting it after its upload): re-plan
        remote = hub.remote_files()
        uploaded = ledgers.uploaded(out.state)
        todo, skipped, new_records = _plan_data(out, hub, remote, uploaded, by_file, local)
        ledgers.record_uploaded(out.state, PUSH_LEDGER, new_records)
        summary["skipped"] = sorted(set(skipped) - set(summary["uploaded"]))
        try:
            _push_data(out, hub, todo, by_file, summary, max_files_per_commit, max_bytes_per_commit, log)
        except HsxError:
            gone = [p.name for p in todo if not p.exists()]
            if gone and round_ < 2:
                log(f"hsx: push: {len(gone)} file(s) vanished while pushing ({gone[0]}, ...: uploaded and deleted "
                    "by another rank?); checking the Hub again")
                continue
            raise
        break

    remote = hub.remote_files()
    output_files = {f"data/{name}" for name in by_file}
    stale = sorted(p for p in remote if prune and p.startswith("data/") and Path(p).match(DATA_GLOB)
                   and p.count("/") == 1 and p not in output_files)
    tops = [(name, out.root / name) for name in TOP_FILES
            if os.path.lexists(out.root / name) and not same_content(out.root / name, remote.get(name))]
    tops = [(name, os.fdopen(open_regular(p), "rb")) for name, p in tops]  # (no link, no FIFO: a regular file)
    if tops or stale:
        if stale:
            log(f"hsx: push: deleting {len(stale)} file(s) of {hub.where} that are not part of this output "
                f"({stale[0]}, ...)")
        oid = hub.commit(tops, stale, f"hsx: {', '.join(n for n, _ in tops) or 'prune'} "
                                      f"(job {(info.fingerprint or '?')[:12]})")
        summary["commits"] += 1
        summary["uploaded"] += [n for n, _ in tops]
        summary["deleted"] = stale
        summary["bytes"] += sum(os.fstat(f.fileno()).st_size for _, f in tops)
        ledgers.record_uploaded(out.state, PUSH_LEDGER,
                        [_record(n, os.fstat(f.fileno()).st_size, None, hub, oid) for n, f in tops])
    for _, f in tops:
        f.close()
    if summary["commits"]:
        log(f"hsx: pushed {len(summary['uploaded'])} file(s), {human_bytes(summary['bytes'])}, to {hub.where} in "
            f"{summary['commits']} commit(s); {len(summary['skipped'])} already there")
    else:
        log(f"hsx: {hub.where} already holds this output ({len(summary['skipped'])} data files); nothing to push")
    return summary


def local_units(out: OutputDir, info: Info, by_file: dict[str, dict]) -> dict[str, Path]:
    """The output's files that are here, by name: the path to read each from, checked without following a link
    (`OutputDir.unit_source`: a unit `hsx merge` linked is read from its own dir; any other link is refused)."""
    sources: dict = {}
    return {name: out.unit_source(name, info, sources) for name in by_file if os.path.lexists(out.data / name)}


def _plan_data(out: OutputDir, hub: _Hub, remote: dict[str, RemoteFile], uploaded: dict[str, dict],
               by_file: dict[str, dict], local: dict[str, Path]) -> tuple[list[Path], list[str], list[dict]]:
    """Local data files to upload; files the Hub has already; records for files found identical without one."""
    todo, skipped, new_records = [], [], []
    local = {name: path for name, path in local.items() if path.exists()}
    for name, path in sorted(local.items()):
        pir, size = f"data/{name}", path.stat().st_size
        r = remote.get(pir)
        if r is not None and r.size == size and _recorded_here(uploaded.get(pir), hub, size, by_file.get(name)):
            skipped.append(pir)
        elif same_content(path, r):  # committed by an earlier push that was killed before recording it
            skipped.append(pir)
            new_records.append(_record(pir, size, by_file.get(name), hub, None))
        else:
            todo.append(path)
    for name, rec in sorted(by_file.items()):
        if name in local:
            continue
        pir = f"data/{name}"
        up = uploaded.get(pir)
        if not ledgers.uploaded_matches(up, rec):
            raise HsxError(f"{out.root}: unit {name} is in the manifest but neither on disk nor recorded as "
                           "uploaded; run the same `hsx extract` command to redo it")
        r = remote.get(pir)
        if r is None or r.size != rec["bytes"]:
            raise HsxError(f"{out.root}: unit {name} was deleted locally after its upload to "
                           f"{up.get('repo')}@{up.get('revision')}, but {hub.where} does not have it; push to "
                           f"{up.get('repo')} (revision {up.get('revision')}) instead")
        skipped.append(pir)
    return todo, skipped, new_records


def _push_data(out: OutputDir, hub: _Hub, todo: list[Path], by_file: dict[str, dict], summary: dict,
               max_files: int, max_bytes: int, log) -> None:
    if not todo:
        return
    sizes = [p.stat().st_size for p in todo]
    total, done_bytes = sum(sizes), 0
    log(f"hsx: push: {len(todo)} data file(s), {human_bytes(total)}, to {hub.where}")
    for batch in _batches(todo, sizes, max(1, max_files), max_bytes):
        opened = []
        try:
            for p in batch:
                if not p.exists():
                    raise HsxError(f"{p} vanished")
                opened.append(check_before_upload(out, p, by_file.get(p.name)))
            batch_sizes = [os.fstat(f.fileno()).st_size for f in opened]
            oid = hub.commit([(f"data/{p.name}", f) for p, f in zip(batch, opened)], [],
                             f"hsx: add {len(batch)} unit(s) ({human_bytes(sum(batch_sizes))})")
        finally:
            for f in opened:
                f.close()
        ledgers.record_uploaded(out.state, PUSH_LEDGER, [_record(f"data/{p.name}", s, by_file.get(p.name), hub, oid)
                                                 for p, s in zip(batch, batch_sizes)])
        summary["commits"] += 1
        summary["uploaded"] += [f"data/{p.name}" for p in batch]
        summary["bytes"] += sum(batch_sizes)
        done_bytes += sum(batch_sizes)
        log(f"hsx: push: {human_bytes(done_bytes)} of {human_bytes(total)} committed to {hub.where}")


# ---- while the job runs -----------------------------------------------------------------------------------------

def job_files(out: OutputDir, repo_id: str, revision: str | None) -> dict[str, int]:
    """What this dir knows of the job's files on the Hub, {path in repo: bytes}: the units it recorded as uploaded
    to `repo_id`@`revision` and the units it committed (a killed run's may be on the Hub without a record). Each
    node's dir of a multi-node job is gathered into StreamUploader's `known`."""
    files = {f"data/{rec['file']}": rec["bytes"] for rec in ledgers.manifest_records(out.state).values()}
    here = (repo_id, revision or "main")
    for path, rec in ledgers.uploaded(out.state).items():
        if (rec.get("repo"), rec.get("revision")) == here and isinstance(rec.get("bytes"), int):
            files[path] = rec["bytes"]
    return files


def output_records(out: OutputDir, info: Info) -> dict[str, dict[str, Any]]:
    """The files of the output, by name, with size and CRC-32: hsx.json's list (an older hsx's output: the
    manifests, and the empty data file of a job without rows)."""
    files = listed_files(info)
    if files is not None:
        return {e["file"]: e for e in files}
    by_file = {rec["file"]: rec for rec in ledgers.manifest_records(out.state).values()}
    if not by_file:
        by_file = {p.name: {"file": p.name, "bytes": p.stat().st_size} for p in out.data_files()
                   if not p.is_symlink()}
    return by_file


def check_before_upload(out: OutputDir, path: Path, record: dict[str, Any] | None):
    """A file goes up only as the output lists it: same size and CRC-32 (read whole, in threads). `path` is
    where `local_units` found the file: the unit itself, or the unit an `hsx merge` link points to, never a link.
    Returns the file opened (`OutputDir.open_unit`: the very file `unit_source` approved, no link followed), its
    checks made on that open file, which is what the commit uploads: a swap after the check is never uploaded."""
    if record is None or "bytes" not in record:
        raise HsxError(f"{path} is not a file of this output (not in hsx.json); hsx pushes only what it wrote")
    f = os.fdopen(out.open_unit(path), "rb")
    try:
        if os.fstat(f.fileno()).st_size != record["bytes"] or (
                record.get("crc32") and file_crc32(path, f.fileno()) != record["crc32"]):
            raise HsxError(f"{path} does not match hsx.json (size or CRC-32): the file is damaged or was replaced; "
                           "run the same `hsx extract` command with --check-crc to redo it, then push")
    except BaseException:
        f.close()
        raise
    return f


@dataclass
class _Unit:
    unit: str
    path: Path
    size: int


_CLOSE = object()


class StreamUploader:
    """Uploads units while a job runs (--push-mode stream), on a background thread, batching them into few commits.

    `submit(unit, path)` once a unit is committed locally (its manifest line on disk); the thread starts a commit
    as soon as one is allowed (at most one per `min_seconds_between_commits`), with every unit waiting then (at
    most `max_units_per_commit` / `max_bytes_per_commit`). After the Hub confirms a commit its units are recorded
    in .hsx/uploaded-<rank>.jsonl (fsynced) and, with `delete_after_upload`, deleted locally: a unit whose commit
    failed stays on disk. A failure (after retries) stops uploading; it is raised by the next `submit`, by
    `check()` and by `close()`, which also waits for the pending units to be committed (`abort()` does not: on a
    stop signal). `finish()` closes, then runs `push_output` (README.md, hsx.json, anything still missing): call
    it once the output is complete.

    On start it creates the repo (or branch) if needed, so a bad token or name fails before hours of compute,
    refuses a repo that holds another job's output (`check_remote`, unless `overwrite`; `known`: the files the
    job's other dirs recorded as uploaded there or committed, {path in repo: bytes}, `job_files` of each), and
    re-submits this rank's committed units that were never recorded as uploaded (a killed run's last ones)."""

    def __init__(self, out_dir: str | os.PathLike, repo_id: str, *, rank: int = 0, private: bool = True,
                 revision: str | None = None, delete_after_upload: bool = False, api=None, token: str | None = None,
                 max_units_per_commit: int = MAX_FILES_PER_COMMIT, max_bytes_per_commit: int = MAX_BYTES_PER_COMMIT,
                 min_seconds_between_commits: float | None = None, retries: int = RETRIES,
                 backoff: float = BACKOFF_SECONDS, log: Callable[[str], Any] = print, resubmit: bool = True,
                 overwrite: bool = False, known: dict[str, int] | None = None):
        self.out = OutputDir(out_dir, rank=rank)
        self.repo_id, self.revision, self.private, self.overwrite = repo_id, revision, private, overwrite
        self.delete_after_upload = delete_after_upload
        self.max_units, self.max_bytes = max(1, max_units_per_commit), max_bytes_per_commit
        self.interval = (MIN_SECONDS_BETWEEN_COMMITS if min_seconds_between_commits is None
                         else min_seconds_between_commits)
        self.log = log
        self.hub = _Hub(repo_id, revision=revision, api=api, token=token, retries=retries, backoff=backoff, log=log)
        self.hub.ensure_repo(private)
        self._check_records()
        self._check_remote(known)
        self.error: BaseException | None = None
        self.stats = {"units": 0, "bytes": 0, "commits": 0, "deleted": 0}
        self._next_commit_at = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._closed = self._abort = False
        self._thread = threading.Thread(target=self._work, name=f"hsx-upload-{rank}", daemon=True)
        self._thread.start()
        if resubmit:
            self.resubmit_leftovers()

    # ---- the caller's side ----

    def submit(self, unit: str, path: str | os.PathLike | None = None) -> None:
        """Queue a committed unit (default path: data/train-<unit>.arrow) for upload; raises an earlier failure."""
        self.check()
        p = Path(path) if path is not None else self.out.data / f"train-{unit}.arrow"
        self._queue.put(_Unit(unit, p, p.stat().st_size))

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Commit every unit submitted so far (respecting the commit interval), stop the thread, raise a failure."""
        if not self._closed:
            self._closed = True
            self._queue.put(_CLOSE)
            self._thread.join()
        self.check()

    def abort(self) -> None:
        """Stop after the commit in progress (a stop signal, a failed job): units not committed yet stay on disk,
        and the next run's uploader re-submits them. Never raises."""
        self._abort = True
        if not self._closed:
            self._closed = True
            self._queue.put(_CLOSE)
            self._thread.join()

    def finish(self, **kwargs) -> dict[str, Any]:
        """close(), then push_output of the complete dir (README.md, hsx.json, whatever is still missing)."""
        self.close()
        kwargs.setdefault("overwrite", self.overwrite)
        return push_output(self.out.root, self.repo_id, private=self.private, revision=self.revision,
                           api=self.hub.api, log=self.log, retries=self.hub.retries, backoff=self.hub.backoff,
                           **kwargs)

    def __enter__(self) -> StreamUploader:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the job failed: stop uploading, and let the job's error be the one raised
            self.abort()

    # ---- the thread ----

    def _work(self) -> None:
        pending: list[_Unit] = []
        closing = False
        while True:
            if closing:
                if not pending or self._abort:
                    return
                wait = self._next_commit_at - time.monotonic()
                if wait > 0 and self.error is None:
                    time.sleep(wait)
            else:
                wait = None if not pending else max(0.0, self._next_commit_at - time.monotonic())
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    item = None
                if item is _CLOSE:
                    closing = True
                    continue
                if item is not None:
                    pending.append(item)
                    while True:  # take whatever else is queued now
                        try:
                            more = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if more is _CLOSE:
                            closing = True
                            break
                        pending.append(more)
                if not pending or time.monotonic() < self._next_commit_at:
                    continue
            batch = _batches(pending, [u.size for u in pending], self.max_units, self.max_bytes)[0]
            pending = pending[len(batch):]
            self._next_commit_at = time.monotonic() + self.interval
            if self.error is None:
                try:
                    self._commit(batch)
                except BaseException as e:  # noqa: BLE001  (raised on the caller's thread)
                    self.error = e
                    self.log(f"hsx: push: stopped uploading: {e}; the units not uploaded stay on disk")

    def _commit(self, batch: list[_Unit]) -> None:
        size = sum(u.size for u in batch)
        opened = []
        try:
            for u in batch:  # (a unit this rank committed, read as the regular file it is: never through a link)
                opened.append(os.fdopen(open_regular(u.path), "rb"))
            oid = self.hub.commit([(f"data/{u.path.name}", f) for u, f in zip(batch, opened)], [],
                                  f"hsx: add {len(batch)} unit(s) ({human_bytes(size)}, rank {self.out.rank})")
        finally:
            for f in opened:
                f.close()
        manifest = {rec["file"]: rec for rec in ledgers.manifest_records(self.out.state).values()}
        ledgers.record_uploaded(self.out.state, f"{self.out.rank:05d}",  # (this rank's; fsynced before any deletion)
                        [_record(f"data/{u.path.name}", u.size, manifest.get(u.path.name), self.hub, oid)
                         for u in batch])
        self.stats["units"] += len(batch)
        self.stats["bytes"] += size
        self.stats["commits"] += 1
        if self.delete_after_upload:
            for u in batch:
                u.path.unlink(missing_ok=True)
                self.stats["deleted"] += 1
            fsync_dir(self.out.data)
        self.log(f"hsx: push: {len(batch)} unit(s), {human_bytes(size)}, committed to {self.hub.where} "
                 f"({self.stats['units']} so far{', deleted locally' if self.delete_after_upload else ''})")

    # ---- start ----

    def _check_records(self) -> None:
        """Units deleted after an upload to another repo or revision cannot be uploaded here."""
        uploaded = ledgers.uploaded(self.out.state)
        for rec in ledgers.manifest_records(self.out.state).values():
            up = uploaded.get(f"data/{rec['file']}")
            if (up is not None and not (self.out.data / rec["file"]).exists()
                    and (up.get("repo"), up.get("revision")) != (self.repo_id, self.revision or "main")):
                raise HsxError(f"{self.out.root}: unit {rec['file']} was deleted locally after its upload to "
                               f"{up.get('repo')}@{up.get('revision')}; push this job to that repo and revision")

    def _check_remote(self, known: dict[str, int] | None) -> None:
        """A repo holding another job's output is refused before this rank uploads (or deletes) anything."""
        check_destination(self.out, self.hub, overwrite=self.overwrite, log=self.log, known=known)

    def resubmit_leftovers(self) -> None:
        """This rank's committed units that are on disk but not recorded as uploaded here (a killed run's)."""
        manifest = self.out.state / f"manifest-{self.out.rank:05d}.jsonl"
        if not manifest.exists():
            return
        uploaded = ledgers.uploaded(self.out.state)
        mine = {rec["unit"]: rec for rec in read_jsonl(manifest, ManifestRecord)}
        for unit, rec in sorted(mine.items()):
            f = self.out.data / rec["file"]
            if (f.exists() and not f.is_symlink() and f.stat().st_size == rec["bytes"]
                    and not _recorded_here(uploaded.get(f"data/{rec['file']}"), self.hub, rec["bytes"], rec)):
                self._queue.put(_Unit(unit, f, rec["bytes"]))
