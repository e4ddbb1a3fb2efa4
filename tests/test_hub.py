"""hsx.hub against a stubbed HfApi (no network): what a push uploads, failures and resumption, stream mode's
batching, deletion only of what the Hub confirmed, done_units() over deleted units, and the token never written. A
push uploads the bytes it checked: no link, no damaged or swapped unit, no FIFO, no file outside data/; a hostile
remote hsx.json is not this job's."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import importlib

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub import errors as hub_errors
from huggingface_hub.errors import HfHubHTTPError

from hsx import ledgers
from hsx.config import HsxError, load_config
from hsx.hub import StreamUploader, is_transient, push_output
from hsx.info import recorded_info

TOP_FILES = ["README.md", "token_frequencies.npy", "hsx.json"]  # what the last commit adds, in order
from hsx.run import extract
from hsx.sink import Committer, OutputDir

# huggingface_hub's own HTTP client (httpx2 in hub 2.x), for real error objects
http = importlib.import_module(hub_errors.Response.__module__.split(".")[0])
REPO = "someone/states"
ENV_TOKEN = "hf_EnvSecretTokenAAAAAAAAAAAAAAAAAAAA"
ARG_TOKEN = "hf_ArgSecretTokenBBBBBBBBBBBBBBBBBBBB"


def http_error(status: int, message: str = "", retry_after: str | None = None) -> HfHubHTTPError:
    headers = {"Retry-After": retry_after} if retry_after else {}
    response = http.Response(status, headers=headers,
                               request=http.Request("POST", f"https://huggingface.co/api/datasets/{REPO}/commit"))
    return HfHubHTTPError(f"{status} Error: {message}", response=response)


class FakeHfApi:
    """Records create_repo / create_branch / create_commit / upload_folder / list_repo_tree / repo_exists /
    revision_exists calls (each checked
    against the real HfApi signature) and keeps each branch's files in a dict. `fail(method, *errors)` makes the
    next calls of `method` raise those errors in turn (None: that call succeeds)."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.calls: list[tuple[str, dict]] = []
        self.commits: list[dict] = []
        self.failures: dict[str, list] = {}
        self.lock = threading.Lock()

    def fail(self, method: str, *errors) -> None:
        self.failures.setdefault(method, []).extend(errors)

    def _call(self, method: str, *args, **kwargs) -> None:
        inspect.signature(getattr(HfApi, method)).bind(None, *args, **kwargs)  # a call the real API accepts
        self.calls.append((method, kwargs))
        queue = self.failures.get(method)
        if queue:
            error = queue.pop(0)
            if error is not None:
                raise error

    def files(self, revision: str = "main") -> dict[str, bytes]:
        return self.repos[REPO]["branches"][revision]

    # -- the API --

    def create_repo(self, repo_id, **kw):
        self._call("create_repo", repo_id, **kw)
        assert kw["repo_type"] == "dataset"
        if repo_id in self.repos and not kw.get("exist_ok"):
            raise http_error(409, "exists")
        self.repos.setdefault(repo_id, {"private": kw.get("private"), "branches": {"main": {}}})

    def create_branch(self, repo_id, **kw):
        self._call("create_branch", repo_id, **kw)
        branches = self.repos[repo_id]["branches"]
        branches.setdefault(kw["branch"], dict(branches["main"]))

    def repo_exists(self, repo_id, **kw):
        self._call("repo_exists", repo_id, **kw)
        return repo_id in self.repos

    def revision_exists(self, repo_id, revision, **kw):
        self._call("revision_exists", repo_id, revision, **kw)
        return repo_id in self.repos and revision in self.repos[repo_id]["branches"]

    def list_repo_tree(self, repo_id, path_in_repo=None, **kw):
        self._call("list_repo_tree", repo_id, path_in_repo, **kw)
        for path, data in sorted(self.repos[repo_id]["branches"][kw.get("revision") or "main"].items()):
            lfs = SimpleNamespace(sha256=hashlib.sha256(data).hexdigest()) if path.endswith(".arrow") else None
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            yield SimpleNamespace(path=path, size=len(data), blob_id=blob, lfs=lfs)

    def create_commit(self, repo_id, operations, **kw):
        operations = list(operations)
        self._call("create_commit", repo_id, operations, **kw)
        with self.lock:
            files = self.repos[repo_id]["branches"][kw.get("revision") or "main"]
            for op in operations:
                if isinstance(op, CommitOperationAdd):
                    f = op.path_or_fileobj
                    files[op.path_in_repo] = f.read() if hasattr(f, "read") else Path(f).read_bytes()
                else:
                    assert isinstance(op, CommitOperationDelete)
                    files.pop(op.path_in_repo)
            oid = f"{len(self.commits) + 1:040x}"
            self.commits.append({"oid": oid, "time": time.monotonic(), "revision": kw.get("revision"),
                                 "message": kw["commit_message"],
                                 "added": [op.path_in_repo for op in operations if isinstance(op, CommitOperationAdd)],
                                 "deleted": [op.path_in_repo for op in operations
                                             if isinstance(op, CommitOperationDelete)]})
        return SimpleNamespace(oid=oid)

    def hf_hub_download(self, repo_id, filename, **kw):
        self._call("hf_hub_download", repo_id, filename, **kw)
        data = self.repos[repo_id]["branches"][kw.get("revision") or "main"][filename]  # (KeyError: a 404)
        path = Path(kw["local_dir"]) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return str(path)

    def upload_folder(self, **kw):  # not used by hsx.hub (create_commit batches); kept for a complete stub
        self._call("upload_folder", **kw)
        raise AssertionError("hsx.hub commits explicit batches; upload_folder should not be called")


# ---- outputs ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def complete(tmp_path_factory, model4, chat_data) -> Path:
    """A finished output with several units (and a tokenized cache under .hsx/)."""
    root = tmp_path_factory.mktemp("hub") / "out"
    cfg = load_config(None, {"output_dir": str(root), "compile": "off", "model": str(model4.path),
                             "dataset": str(chat_data.path), "layers": ["1", "3"], "final_hidden": True,
                             "max_length": 160, "token_budget": 640, "unit_tokens": 300})
    extract(cfg, log=lambda *a: None)
    return root


@pytest.fixture
def out(complete, tmp_path) -> Path:
    root = tmp_path / "out"
    shutil.copytree(complete, root)
    (root / ".hsx" / "lock").unlink(missing_ok=True)
    return root


def data_files(root: Path) -> dict[str, bytes]:
    return {f"data/{p.name}": p.read_bytes() for p in sorted((root / "data").glob("train-*.arrow"))}


def expected_repo(root: Path) -> dict[str, bytes]:
    return {**data_files(root), **{name: (root / name).read_bytes() for name in TOP_FILES}}


def quiet(*a, **k):
    pass


def units(root: Path) -> list[str]:
    return sorted(p.name[len("train-"):-len(".arrow")] for p in (root / "data").glob("train-*.arrow"))


# ---- push_output ------------------------------------------------------------------------------------------------

def test_push_uploads_exactly_the_output(out):
    (out / "notes.txt").write_text("not part of the output")
    api = FakeHfApi()
    want = expected_repo(out)
    assert len(want) > 5
    summary = push_output(out, REPO, api=api, log=quiet, max_files_per_commit=3)
    assert api.files() == want  # data/*.arrow and TOP_FILES; no .hsx/, nothing else
    assert not any(p.startswith(".hsx") for c in api.commits for p in c["added"])
    assert api.calls[0] == ("create_repo", {"repo_type": "dataset", "exist_ok": True, "private": True})
    assert not [c for c in api.calls if c[0] == "create_branch"]
    # batches of at most 3 data files, README.md and hsx.json last, in one commit
    assert all(len(c["added"]) <= 3 for c in api.commits)
    assert api.commits[-1]["added"] == TOP_FILES
    assert all(p.startswith("data/") for c in api.commits[:-1] for p in c["added"])
    assert summary["commits"] == len(api.commits) == -(-len(data_files(out)) // 3) + 1
    # every file is recorded, and a second push only checks
    recorded = [json.loads(line) for line in (out / ".hsx" / "uploaded-push.jsonl").read_text().splitlines()]
    assert {r["file"] for r in recorded} == set(want)
    assert all(r["repo"] == REPO and r["revision"] == "main" and r["commit"] for r in recorded)
    n = len(api.commits)
    again = push_output(out, REPO, api=api, log=quiet)
    assert len(api.commits) == n and again["commits"] == 0 and len(again["skipped"]) == len(data_files(out))


def test_push_to_a_branch_public(out):
    api = FakeHfApi()
    push_output(out, REPO, api=api, log=quiet, revision="v2", private=False)
    assert ("create_branch", {"branch": "v2", "repo_type": "dataset", "exist_ok": True}) in api.calls
    assert api.repos[REPO]["private"] is False
    assert api.files("v2") == expected_repo(out) and api.files("main") == {}
    assert all(c["revision"] == "v2" for c in api.commits)


def test_push_refuses_an_incomplete_dir(out):
    info = json.loads((out / "hsx.json").read_text())
    (out / "hsx.json").write_text(json.dumps({**info, "complete": False}))
    api = FakeHfApi()
    with pytest.raises(HsxError, match="not a complete hsx output"):
        push_output(out, REPO, api=api, log=quiet)
    assert api.calls == []


def test_failure_in_the_middle_then_resume_uploads_only_what_is_missing(out):
    api = FakeHfApi()
    api.fail("create_commit", None, http_error(403, "forbidden"))  # the 2nd commit fails for good (no retry)
    with pytest.raises(HsxError, match=r"push to someone/states: commit of 2 file\(s\) failed: .*HTTP 403"):
        push_output(out, REPO, api=api, log=quiet, max_files_per_commit=2)
    first = api.commits[0]["added"]
    assert set(api.files()) == set(first) and len(first) == 2  # only the first batch landed
    assert "hsx.json" not in api.files()  # the repo is not marked complete
    n_calls = len([c for c in api.calls if c[0] == "create_commit"])
    assert n_calls == 2
    summary = push_output(out, REPO, api=api, log=quiet, max_files_per_commit=2)
    added_after = [p for c in api.commits[1:] for p in c["added"]]
    assert sorted(added_after) == sorted(set(expected_repo(out)) - set(first))  # nothing twice
    assert api.files() == expected_repo(out)
    assert sorted(summary["skipped"]) == sorted(first)


def test_transient_errors_are_retried(out):
    api = FakeHfApi()
    api.fail("create_repo", http_error(503, "busy"))
    api.fail("list_repo_tree", http.ConnectError("connection reset"))
    api.fail("create_commit", http_error(429, "slow down", retry_after="0"), http_error(502, "bad gateway"))
    log: list[str] = []
    push_output(out, REPO, api=api, log=log.append, backoff=0)
    assert api.files() == expected_repo(out)
    retries = [line for line in log if "attempt 2 of" in line or "attempt 3 of" in line]
    assert len(retries) == 4 and any("HTTP 429" in line for line in retries)
    assert any("ConnectError" in line for line in retries)


def test_retries_give_up_and_permanent_errors_fail_at_once(out):
    api = FakeHfApi()
    api.fail("create_commit", *[http_error(500, "down")] * 3)
    with pytest.raises(HsxError, match="failed after 3 attempts: .*HTTP 500"):
        push_output(out, REPO, api=api, log=quiet, backoff=0, retries=3)
    api = FakeHfApi()
    api.fail("create_repo", http_error(401, "invalid credentials"))
    with pytest.raises(HsxError, match="create_repo failed: .*HTTP 401"):
        push_output(out, REPO, api=api, log=quiet, backoff=0)
    assert [c[0] for c in api.calls] == ["create_repo"]
    assert is_transient(http_error(503)) and is_transient(http_error(429)) and is_transient(TimeoutError())
    assert not is_transient(http_error(404)) and not is_transient(ValueError("bad name"))
    from huggingface_hub.errors import OfflineModeIsEnabled

    assert not is_transient(OfflineModeIsEnabled("HF_HUB_OFFLINE=1"))


def test_a_commit_that_landed_but_was_not_recorded_is_not_uploaded_again(out):
    """A kill between the Hub's commit and the upload record: the next push finds the files identical (sha256)."""
    api = FakeHfApi()
    push_output(out, REPO, api=api, log=quiet)
    (out / ".hsx" / "uploaded-push.jsonl").unlink()
    n = len(api.commits)
    push_output(out, REPO, api=api, log=quiet)
    assert len(api.commits) == n
    assert {json.loads(x)["file"] for x in (out / ".hsx" / "uploaded-push.jsonl").read_text().splitlines()} \
        == set(data_files(out))
    # a remote file with the same name and size but other bytes is replaced
    name = sorted(data_files(out))[0]
    api.files()[name] = bytes(len(api.files()[name]))
    (out / ".hsx" / "uploaded-push.jsonl").unlink()
    push_output(out, REPO, api=api, log=quiet)
    assert api.commits[-1]["added"] == [name] and api.files() == expected_repo(out)


def another_job(api: FakeHfApi, out: Path, revision: str = "main") -> dict[str, bytes]:
    """The repo as another job's finished push left it: its hsx.json (another fingerprint), units, card."""
    api.create_repo(REPO, repo_type="dataset", exist_ok=True)
    if revision != "main":
        api.create_branch(REPO, branch=revision, repo_type="dataset", exist_ok=True)
    info = json.loads((out / "hsx.json").read_text())
    clash = sorted(data_files(out))[0]  # a unit name both jobs have
    files = {"data/train-099-00000.arrow": b"old job", clash: b"old job's unit",
             "README.md": b"# old job", "hsx.json": json.dumps({**info, "fingerprint": "f" * 32}).encode(),
             "data/notes.md": b"kept", "other.txt": b"kept"}
    api.files(revision).update(files)
    return dict(files)


def test_push_refuses_a_repo_holding_another_jobs_output(out):
    """Its hsx.json records another job fingerprint: nothing is uploaded or deleted, one line names the repo and
    both jobs; --hub-overwrite (overwrite=True) replaces that output and prunes its units."""
    api = FakeHfApi()
    before = another_job(api, out)
    n = len(api.commits)
    with pytest.raises(HsxError, match=r"someone/states holds the output of another job \(job ffffffffffff; "
                                       r"this is job [0-9a-f]{12}\).*--hub-overwrite"):
        push_output(out, REPO, api=api, log=quiet)
    assert api.files() == before and len(api.commits) == n
    assert not (out / ".hsx" / "uploaded-push.jsonl").exists()
    log: list[str] = []
    summary = push_output(out, REPO, api=api, log=log.append, overwrite=True)
    assert summary["deleted"] == ["data/train-099-00000.arrow"]
    assert api.files() == {**expected_repo(out), "data/notes.md": b"kept", "other.txt": b"kept"}
    assert any("replacing it (--hub-overwrite)" in line for line in log)
    # now it is this job's repo: a re-push without the flag only checks
    n = len(api.commits)
    assert push_output(out, REPO, api=api, log=quiet)["commits"] == 0 and len(api.commits) == n


@pytest.mark.parametrize("remote", [
    {"data/train-000-00000.arrow": b"a unit of a push that never finished"},  # no hsx.json
    {"data/train-000-00000.arrow": b"x", "hsx.json": b"{not json"},  # an unreadable hsx.json
    {"hsx.json": b'{"complete": true}'},  # an hsx.json without a job fingerprint
    {"hsx.json": b'{"fingerprint": "a", "fingerprint": "b"}'},  # says two things
    {"weights.safetensors": b"someone's model"},  # not hsx's at all
])
def test_push_refuses_a_repo_of_files_it_did_not_push(out, remote):
    api = FakeHfApi()
    api.create_repo(REPO, repo_type="dataset", exist_ok=True)
    api.files().update(remote)
    with pytest.raises(HsxError, match=r"^someone/states holds .*(did not push|not this job's).*--hub-overwrite"):
        push_output(out, REPO, api=api, log=quiet)
    assert api.files() == remote and api.commits == []


def test_a_remote_hsx_json_that_cannot_be_downloaded_is_not_this_jobs(out):
    api = FakeHfApi()
    before = another_job(api, out)
    api.fail("hf_hub_download", http_error(403, "gated"))
    with pytest.raises(HsxError, match=r"holds an hsx.json that is not this job's: its hsx.json cannot be "
                                       r"downloaded \(.*HTTP 403"):
        push_output(out, REPO, api=api, log=quiet)
    assert api.files() == before and api.commits == []


def test_push_into_a_new_repo_with_only_a_card_is_fine(out):
    api = FakeHfApi()
    api.create_repo(REPO, repo_type="dataset", exist_ok=True)
    api.files().update({"README.md": b"# made on the site", ".gitattributes": b"*.arrow filter=lfs"})
    push_output(out, REPO, api=api, log=quiet)
    assert api.files() == {**expected_repo(out), ".gitattributes": b"*.arrow filter=lfs"}


def test_a_huge_remote_hsx_json_is_not_downloaded(out, monkeypatch):
    import hsx.hub

    api = FakeHfApi()
    another_job(api, out)
    monkeypatch.setattr(hsx.hub, "MAX_INFO_BYTES", 100)
    with pytest.raises(HsxError, match=r"holds an hsx.json that is not this job's: its hsx.json is [\d,]+ bytes"):
        push_output(out, REPO, api=api, log=quiet)
    assert not [c for c in api.calls if c[0] == "hf_hub_download"]


def test_the_same_job_pushed_again_or_resumed_is_not_refused(out, tmp_path):
    """A killed push (units there, no hsx.json), with its records or without them (killed before recording), and
    a copy of the same output pushed from another dir (no records: the bytes match)."""
    api = FakeHfApi()
    api.fail("create_commit", None, http_error(403, "forbidden"))
    with pytest.raises(HsxError, match="HTTP 403"):
        push_output(out, REPO, api=api, log=quiet, max_files_per_commit=2)
    assert "hsx.json" not in api.files() and len(api.files()) == 2
    (out / ".hsx" / "uploaded-push.jsonl").unlink()  # killed between the commit and its record
    push_output(out, REPO, api=api, log=quiet, max_files_per_commit=2)
    assert api.files() == expected_repo(out)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / ".hsx")
    (copy / ".hsx").mkdir()
    n = len(api.commits)
    push_output(copy, REPO, api=api, log=quiet)
    assert len(api.commits) == n
    # a re-push of the very output reads no remote file (its hsx.json is compared by blob id); the same job's
    # hsx.json with other bytes (a resume rewrote it) is read for its fingerprint, and replaced
    assert not [c for c in api.calls if c[0] == "hf_hub_download"]
    info = json.loads(api.files()["hsx.json"])
    api.files()["hsx.json"] = json.dumps({**info, "run": {"seconds": 1}}).encode()
    push_output(copy, REPO, api=api, log=quiet)
    assert [c[0] for c in api.calls].count("hf_hub_download") == 1
    assert api.files() == expected_repo(out)
    # a unit of the same name and size but other bytes is not this job's
    shutil.rmtree(copy / ".hsx")
    (copy / ".hsx").mkdir()
    api2 = FakeHfApi()
    api2.create_repo(REPO, repo_type="dataset", exist_ok=True)
    name = sorted(data_files(out))[0]
    api2.files()[name] = bytes(len(data_files(out)[name]))
    with pytest.raises(HsxError, match=f"1 file\\(s\\) and no hsx.json \\({name}\\)"):
        push_output(copy, REPO, api=api2, log=quiet)


def test_hsx_push_command_refuses_then_overwrites(out, monkeypatch, capsys):
    import huggingface_hub

    from hsx.cli import main

    api = FakeHfApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: api)
    before = another_job(api, out, revision="v2")
    assert main(["push", str(out), REPO, "--hub-revision", "v2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hsx: error: someone/states@v2 holds the output of another job")
    assert "Traceback" not in err[0] and api.files("v2") == before
    assert main(["push", str(out), REPO, "--hub-revision", "v2", "--hub-overwrite"]) == 0
    assert api.files("v2")["hsx.json"] == (out / "hsx.json").read_bytes()


# ---- stream mode ------------------------------------------------------------------------------------------------

def test_stream_batches_units_into_few_commits_and_deletes_after_upload(out):
    api = FakeHfApi()
    want = data_files(out)
    names = units(out)
    assert len(names) >= 6
    up = StreamUploader(out, REPO, api=api, delete_after_upload=True, max_units_per_commit=4,
                        min_seconds_between_commits=0.4, log=quiet, resubmit=False)
    for u in names:
        up.submit(u)
    up.close()
    assert api.files() == want  # every unit once, bytes intact
    commits = api.commits
    assert len(commits) <= 1 + -(-(len(names) - 1) // 4) and len(commits) < len(names)
    assert all(len(c["added"]) <= 4 for c in commits)
    starts = [c["time"] for c in commits]
    assert all(b - a >= 0.35 for a, b in zip(starts, starts[1:]))  # at most one commit per interval
    assert sorted(p for c in commits for p in c["added"]) == sorted(want)
    assert not list((out / "data").glob("*.arrow"))  # deleted locally, each after its commit
    recorded = [json.loads(x) for x in (out / ".hsx" / "uploaded-00000.jsonl").read_text().splitlines()]
    assert sorted(r["file"] for r in recorded) == sorted(want)
    manifest = ledgers.manifest_records(OutputDir(out).state)
    crc = {f"data/{r['file']}": r["crc32"] for r in manifest.values()}
    assert all(r["crc32"] == crc[r["file"]] and r["unit"] for r in recorded)
    # resume knows they are done although their files are gone
    assert set(ledgers.done_units(out / ".hsx", out / "data")) == set(manifest) == set(names)
    assert up.stats == {"units": len(names), "bytes": sum(map(len, want.values())), "commits": len(commits),
                        "deleted": len(names)}


def test_stream_failure_deletes_only_what_was_uploaded_then_resumes(out):
    api = FakeHfApi()
    names = units(out)
    api.fail("create_commit", None, http_error(403, "no"))  # the 1st commit lands, the 2nd fails for good
    up = StreamUploader(out, REPO, api=api, delete_after_upload=True, max_units_per_commit=2,
                        min_seconds_between_commits=0, log=quiet, resubmit=False)
    for u in names[:2]:
        up.submit(u)
    deadline = time.monotonic() + 10
    while len(api.commits) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    for u in names[2:]:
        try:
            up.submit(u)
        except HsxError:
            break  # the failure surfaces at the next submit
    with pytest.raises(HsxError, match="HTTP 403"):
        up.close()
    uploaded = set(api.commits[0]["added"])
    on_disk = {f"data/{p.name}" for p in (out / "data").glob("*.arrow")}
    assert uploaded and not uploaded & on_disk  # uploaded: deleted
    assert on_disk == {f"data/train-{u}.arrow" for u in names} - uploaded  # the rest stays, failed commit included
    assert set(ledgers.done_units(out / ".hsx", out / "data")) == set(names)  # deleted-and-uploaded plus on-disk
    # a new uploader (the resumed job) re-submits this rank's units that were never recorded as uploaded
    up2 = StreamUploader(out, REPO, api=api, delete_after_upload=True, min_seconds_between_commits=0, log=quiet)
    up2.close()
    assert not list((out / "data").glob("*.arrow"))
    assert set(api.files()) == {f"data/train-{u}.arrow" for u in names}
    # the end: README.md and hsx.json, the repo is complete
    summary = StreamUploader(out, REPO, api=api, log=quiet).finish()
    assert summary["uploaded"] == TOP_FILES
    assert set(api.files()) == {f"data/train-{u}.arrow" for u in names} | set(TOP_FILES)


def test_stream_to_another_repo_after_deleting_is_refused(out):
    api = FakeHfApi()
    up = StreamUploader(out, REPO, api=api, delete_after_upload=True, min_seconds_between_commits=0, log=quiet)
    up.close()  # (resubmits every committed unit: all uploaded and deleted)
    assert not list((out / "data").glob("*.arrow"))
    with pytest.raises(HsxError, match="deleted locally after its upload to someone/states@main"):
        StreamUploader(out, "someone/other", api=api, log=quiet)
    with pytest.raises(HsxError, match="does not have it"):
        push_output(out, "someone/other", api=api, log=quiet)
    assert push_output(out, REPO, api=api, log=quiet)["uploaded"] == TOP_FILES


def test_stream_into_another_jobs_repo_is_refused_before_uploading_or_deleting(out):
    api = FakeHfApi()
    before = another_job(api, out)
    on_disk = data_files(out)
    with pytest.raises(HsxError, match=r"someone/states holds the output of another job .*--hub-overwrite"):
        StreamUploader(out, REPO, api=api, delete_after_upload=True, min_seconds_between_commits=0, log=quiet)
    assert api.files() == before and api.commits == []
    assert data_files(out) == on_disk  # the leftovers it would have re-submitted (and deleted) are all here
    up = StreamUploader(out, REPO, api=api, delete_after_upload=True, min_seconds_between_commits=0, log=quiet,
                        overwrite=True)
    summary = up.finish()  # the last commit replaces hsx.json and prunes the other job's unit
    assert summary["deleted"] == ["data/train-099-00000.arrow"]
    assert {p for p in api.files() if p.startswith("data/train")} == set(on_disk)


def test_stream_resumed_on_another_node_knows_the_jobs_units(out, tmp_path):
    """One dir per node: node 0's units are on the Hub (no hsx.json yet); node 1's uploader is told of them by
    `known` (run.py gathers each dir's job_files) and is not refused; without it they are foreign."""
    from hsx.hub import job_files

    api = FakeHfApi()
    StreamUploader(out, REPO, api=api, min_seconds_between_commits=0, log=quiet).close()
    node1 = tmp_path / "node1"
    shutil.copytree(out, node1)
    for f in (node1 / ".hsx").glob("*.jsonl"):
        f.unlink()  # a dir that committed none of these units
    for f in (node1 / "data").glob("*.arrow"):
        f.unlink()
    with pytest.raises(HsxError, match="that this job did not push"):
        StreamUploader(node1, REPO, api=api, log=quiet)
    known = job_files(OutputDir(out), REPO, None)
    assert set(known) == set(data_files(out))
    StreamUploader(node1, REPO, api=api, log=quiet, known=known).close()
    with pytest.raises(HsxError, match="that this job did not push"):  # other sizes: not the job's units
        StreamUploader(node1, REPO, api=api, log=quiet, known={k: v + 1 for k, v in known.items()})


def test_committer_hands_committed_units_to_the_uploader(tmp_path):
    out = OutputDir(tmp_path / "out")
    out.state.mkdir(parents=True)
    seen = []
    committer = Committer(out, on_commit=lambda unit, path: seen.append((unit, path, path.exists(),
                                                                         unit in ledgers.manifest_records(out.state))))
    for unit in ("000-00000", "001-00000"):
        out.unit_tmp(unit).write_bytes(b"x" * 10)
        committer.submit(unit, {"rows": 1, "tokens": 1})
    committer.join()
    committer.close()
    assert seen == [(u, out.data / f"train-{u}.arrow", True, True) for u in ("000-00000", "001-00000")]


def test_finalize_writes_no_empty_file_when_every_unit_was_uploaded_and_deleted(out):
    api = FakeHfApi()
    StreamUploader(out, REPO, api=api, delete_after_upload=True, min_seconds_between_commits=0, log=quiet).close()
    o = OutputDir(out)
    info = recorded_info(o.root).to_dict()
    o.finalize(info, (out / "README.md").read_text())
    assert not list((out / "data").glob("*.arrow"))  # no 0-row train-000-00000.arrow over an uploaded unit


def test_a_resumed_job_does_not_redo_uploaded_and_deleted_units(out, model4, chat_data):
    """The end-to-end resume: every unit uploaded and deleted, the job not finalized -> the same command
    finalizes from the manifests and the upload records without extracting anything again."""
    api = FakeHfApi()
    StreamUploader(out, REPO, api=api, delete_after_upload=True, min_seconds_between_commits=0, log=quiet).close()
    before = json.loads((out / "hsx.json").read_text())
    (out / "hsx.json").unlink()
    (out / "README.md").unlink()
    cfg = load_config(None, {"output_dir": str(out), "compile": "off", "model": str(model4.path),
                             "dataset": str(chat_data.path), "layers": ["1", "3"], "final_hidden": True,
                             "max_length": 160, "token_budget": 640, "unit_tokens": 300})
    info = extract(cfg, log=quiet)
    assert info["complete"] and info["counts"] == before["counts"]
    assert info["run"]["tokens"] == 0  # nothing extracted again
    assert not list((out / "data").glob("*.arrow"))


# ---- the token ----------------------------------------------------------------------------------------------

def test_token_is_never_written_or_printed(out, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    api = FakeHfApi()
    log: list[str] = []
    # a server error that echoes the token back must not carry it into a message, a log line or a file
    api.fail("create_commit", http_error(503, f"bad auth {ARG_TOKEN} / {ENV_TOKEN}"),
             http_error(400, f"rejected {ARG_TOKEN}"))
    with pytest.raises(HsxError) as err:
        push_output(out, REPO, api=api, token=ARG_TOKEN, log=log.append, backoff=0)
    up = StreamUploader(out, REPO, api=api, token=ARG_TOKEN, delete_after_upload=True,
                        min_seconds_between_commits=0, log=log.append)
    up.finish()
    assert api.files() == {**{k: v for k, v in api.files().items() if k.startswith("data/")},
                           **{name: (out / name).read_bytes() for name in TOP_FILES}}
    texts = [str(err.value), *log]
    texts += [p.read_bytes().decode("utf-8", "replace") for p in out.rglob("*") if p.is_file()]
    texts += [v.decode("utf-8", "replace") for v in api.files().values()]
    for secret in (ARG_TOKEN, ENV_TOKEN):
        assert not any(secret in t for t in texts)
    assert "hf_***" in str(err.value) or "***" in str(err.value)


def test_loading_a_dir_with_deleted_units_warns(out):
    import hsx

    names = units(out)
    api = FakeHfApi()
    up = StreamUploader(out, REPO, api=api, delete_after_upload=True, min_seconds_between_commits=0, log=quiet,
                        resubmit=False)
    up.submit(names[0])
    up.close()
    with pytest.warns(UserWarning, match=r"1 unit\(s\) were deleted after their upload to someone/states"):
        assert len(hsx.load(str(out))) < recorded_info(OutputDir(out).root).counts.rows_written


def test_abort_leaves_pending_units_on_disk_for_the_next_run(out):
    api = FakeHfApi()
    names = units(out)
    up = StreamUploader(out, REPO, api=api, delete_after_upload=True, max_units_per_commit=2,
                        min_seconds_between_commits=30, log=quiet, resubmit=False)
    for u in names:
        up.submit(u)
    t = time.monotonic()
    up.abort()  # a stop signal: the first commit (allowed at once, 2 units at most) may land; no 30 s wait
    assert time.monotonic() - t < 10
    landed = {p for c in api.commits for p in c["added"]}
    assert len(landed) <= 2
    assert {f"data/{p.name}" for p in (out / "data").glob("*.arrow")} == \
        {f"data/train-{u}.arrow" for u in names} - landed
    StreamUploader(out, REPO, api=api, delete_after_upload=True, min_seconds_between_commits=0, log=quiet).close()
    assert set(api.files()) == {f"data/train-{u}.arrow" for u in names}


# ---- wired into `hsx extract` (--push-to-hub) ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["stream", "end"])
def test_extract_pushes(tmp_path, model4, chat_data, monkeypatch, mode):
    import huggingface_hub

    import hsx.hub

    api = FakeHfApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: api)
    monkeypatch.setattr(hsx.hub, "MIN_SECONDS_BETWEEN_COMMITS", 0.0)
    root = tmp_path / "out"
    values = {"output_dir": str(root), "compile": "off", "model": str(model4.path), "dataset": str(chat_data.path),
              "layers": ["1", "3"], "final_hidden": True, "max_length": 160, "token_budget": 640,
              "unit_tokens": 300, "push_to_hub": REPO, "push_mode": mode, "delete_after_upload": mode == "stream"}
    info = extract(load_config(None, values), log=quiet)
    names = info["unit_names"] if "unit_names" in info else ledgers.manifest_records(OutputDir(root).state)
    want = {f"data/train-{u}.arrow" for u in names} | set(TOP_FILES)
    assert set(api.files()) == want
    assert api.files()["hsx.json"] == (root / "hsx.json").read_bytes()
    assert api.commits[-1]["added"] == TOP_FILES
    assert api.repos[REPO]["private"] is True
    if mode == "stream":
        assert not list((root / "data").glob("*.arrow"))  # all uploaded, then deleted
        added = [p for c in api.commits for p in c["added"] if p.startswith("data/")]
        assert sorted(added) == sorted(set(added))  # each unit uploaded once
    n = len(api.commits)
    again = extract(load_config(None, values), log=quiet)  # complete: the push only checks
    assert again["complete"] and len(api.commits) == n


def test_extract_streaming_into_another_jobs_repo_is_refused(tmp_path, model4, chat_data, monkeypatch, complete):
    import huggingface_hub

    import hsx.hub

    api = FakeHfApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: api)
    monkeypatch.setattr(hsx.hub, "MIN_SECONDS_BETWEEN_COMMITS", 0.0)
    before = another_job(api, complete)
    root = tmp_path / "out"
    values = {"output_dir": str(root), "compile": "off", "model": str(model4.path), "dataset": str(chat_data.path),
              "layers": ["1", "3"], "final_hidden": True, "max_length": 160, "token_budget": 640,
              "unit_tokens": 300, "push_to_hub": REPO, "push_mode": "stream", "delete_after_upload": True}
    with pytest.raises(HsxError, match="holds the output of another job"):
        extract(load_config(None, values), log=quiet)
    assert api.files() == before and api.commits == []
    info = extract(load_config(None, {**values, "hub_overwrite": True}), log=quiet)
    assert api.files()["hsx.json"] == (root / "hsx.json").read_bytes() and info["complete"]
    assert "data/train-099-00000.arrow" not in api.files()
    with pytest.raises(HsxError, match="--hub-overwrite needs --push-to-hub"):
        load_config(None, {**values, "push_to_hub": None, "push_mode": "end", "delete_after_upload": False,
                           "hub_overwrite": True})


def test_extract_pushing_at_the_end_into_another_jobs_repo_is_refused_before_extracting(tmp_path, model4, chat_data,
                                                                                        monkeypatch, complete):
    """--push-mode end found a repo (or --hub-revision) holding another job's output only at push time, after the
    whole extraction. Now at the start too, before any unit is written, creating nothing on the Hub (a repo or
    branch that does not exist yet is not checked further); --hub-overwrite goes on and replaces it at the end."""
    import huggingface_hub

    api = FakeHfApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: api)
    root = tmp_path / "out"
    values = {"output_dir": str(root), "compile": "off", "model": str(model4.path), "dataset": str(chat_data.path),
              "layers": ["1", "3"], "final_hidden": True, "max_length": 160, "token_budget": 640,
              "unit_tokens": 300, "push_to_hub": REPO, "push_mode": "end", "hub_revision": "v1"}
    api.create_repo(REPO, repo_type="dataset")  # the repo exists, the branch does not: nothing to check there
    before = another_job(api, complete)  # ... and main holds another job's output
    api.calls.clear()
    with pytest.raises(HsxError, match="no usable rows"):  # (stopped later, for another reason: it got past)
        extract(load_config(None, {**values, "max_length": 1}), log=quiet)
    assert [c[0] for c in api.calls] == ["repo_exists", "revision_exists"]
    values.pop("hub_revision")
    with pytest.raises(HsxError, match="someone/states holds the output of another job"):
        extract(load_config(None, values), log=quiet)
    assert not ledgers.manifest_records(OutputDir(root).state) and api.files() == before and api.commits == []
    assert not [c for c in api.calls if c[0] in ("create_repo", "create_branch")]
    log: list[str] = []
    info = extract(load_config(None, {**values, "hub_overwrite": True}), log=log.append)
    assert info["complete"] and api.files()["hsx.json"] == (root / "hsx.json").read_bytes()
    assert sum("replacing it (--hub-overwrite)" in line for line in log) == 2  # at the start, and at the push


def test_push_replans_when_a_unit_vanishes_after_another_rank_uploaded_it(out):
    """The finalizer's push races another rank's stream uploader, which uploads, records and deletes a unit."""
    api = FakeHfApi()
    first = sorted((out / "data").glob("train-*.arrow"))[-1]
    calls = {"n": 0}
    real = api.create_commit

    def racing_commit(repo_id, operations, **kw):
        calls["n"] += 1
        if calls["n"] == 1:  # the other rank: commit, record, delete that unit
            other = StreamUploader(out, REPO, api=api, rank=1, delete_after_upload=True,
                                   min_seconds_between_commits=0, log=quiet, resubmit=False)
            other.submit(first.name[len("train-"):-len(".arrow")], first)
            other.close()
            raise ValueError(f"Provided path: '{first}' is not a file")
        return real(repo_id, operations, **kw)

    api.create_commit = racing_commit
    log: list[str] = []
    push_output(out, REPO, api=api, log=log.append)
    assert any("vanished" in line for line in log)
    assert set(api.files()) == set(expected_repo(out)) | {f"data/{first.name}"}
    assert not first.exists()


import os  # noqa: E402
import re  # noqa: E402

from helpers import call_with_deadline, copy_of, flip_unit_bytes, planted_secret, swap_for_link  # noqa: E402
from test_merge import split_like_two_nodes  # noqa: E402
import hsx  # noqa: E402
from hsx.merge import merge  # noqa: E402


# ---- push uploads the bytes it checked: no link, no damaged unit, no FIFO, no file out of data/ --------------------

def pushed(api) -> dict[str, bytes]:
    """What a FakeHfApi holds on someone/states' main branch (nothing when no repo was made)."""
    return api.repos.get("someone/states", {}).get("branches", {}).get("main", {})


def test_push_uploads_no_link_and_no_damaged_unit(finished, tmp_path):
    secret = planted_secret(tmp_path)
    out = copy_of(finished, tmp_path, "out")
    (out / "data" / "train-999-00000.arrow").symlink_to(secret)
    api = FakeHfApi()
    with pytest.raises(HsxError, match="data/ holds 1 data file.* does not list"):
        push_output(out, "someone/states", api=api, log=lambda *a: None)
    assert not pushed(api)

    swapped = copy_of(finished, tmp_path, "swapped")  # a unit replaced by a link to the secret
    name = sorted((swapped / "data").glob("train-0*.arrow"))[0].name
    (swapped / "data" / name).unlink()
    (swapped / "data" / name).symlink_to(secret)
    flipped = copy_of(finished, tmp_path, "flipped")
    flip_unit_bytes(flipped / "data" / name)
    for bad, why in ((swapped, "is a symbolic link, and not one `hsx merge` made"),
                     (flipped, "does not match hsx.json")):
        api = FakeHfApi()
        with pytest.raises(HsxError, match=f"{name} {re.escape(why)}"):
            push_output(bad, "someone/states", api=api, log=lambda *a: None)
        assert f"data/{name}" not in api.repos.get("someone/states", {}).get("branches", {}).get("main", {})
        assert not any(b"TopSecret" in v for v in pushed(api).values())
    linked = copy_of(finished, tmp_path, "linked-card")
    (linked / "README.md").unlink()
    (linked / "README.md").symlink_to(secret)
    with pytest.raises(HsxError, match="symbolic link"):
        push_output(linked, "someone/states", api=FakeHfApi(), log=lambda *a: None)


def test_a_merged_output_pushes_its_linked_units(finished, tmp_path):
    nodes = split_like_two_nodes(finished, tmp_path)
    merge(str(nodes[0]), [str(n) for n in nodes], log=lambda *a: None)
    api = FakeHfApi()
    push_output(nodes[0], "someone/states", api=api, log=lambda *a: None)
    pushed = {k for k in api.files() if k.startswith("data/")}
    assert pushed == {f"data/{p.name}" for p in (finished / "data").iterdir()}
    for p in (finished / "data").iterdir():
        assert api.files()[f"data/{p.name}"] == p.read_bytes()


def test_a_files_list_that_points_out_of_data_is_refused(finished, tmp_path):
    secret = planted_secret(tmp_path)
    out = copy_of(finished, tmp_path, "out")
    info = json.loads((out / "hsx.json").read_text())
    info["files"].append({"file": "../../secret.txt", "bytes": secret.stat().st_size, "crc32": None, "rows": 0})
    (out / "hsx.json").write_text(json.dumps(info))
    with pytest.raises(HsxError, match="`files` is damaged"):
        push_output(out, "someone/states", api=FakeHfApi(), log=lambda *a: None)
    with pytest.raises(HsxError, match="`files` is damaged"):
        hsx.load(str(out))


def test_a_unit_swapped_for_a_link_after_its_check_is_not_pushed(finished_copy, tmp_path):
    """The bytes checked against hsx.json are the bytes uploaded: the file is opened once, checked on that fd,
    and uploaded from it; a name swapped for a link to a secret after the check uploads no secret."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET" * 1000)
    api = FakeHfApi()
    real = api.create_commit
    swapped = []

    def swap_then_commit(repo_id, operations, **kw):  # after check_before_upload, before the file is read
        for unit in sorted((finished_copy / "data").glob("train-*.arrow")):
            if not unit.is_symlink():
                swapped.append(unit.name)
                swap_for_link(unit, secret)
        return real(repo_id, operations, **kw)

    api.create_commit = swap_then_commit
    try:
        push_output(finished_copy, REPO, api=api, log=quiet)
    except HsxError:
        pass  # a later commit may refuse the swapped names; what matters is what went up
    assert swapped
    uploaded = api.files()
    assert all(b"SECRET" not in data for data in uploaded.values())
    assert uploaded, "the first commit's units went up from the files as checked"


def test_push_refuses_a_fifo_named_like_its_card_before_uploading(finished_copy):
    """README.md, hsx.json and token_frequencies.npy go up as regular files only: a FIFO there was read (and
    waited on forever) by the upload; now it is refused before anything is uploaded."""
    (finished_copy / "README.md").unlink()
    os.mkfifo(finished_copy / "README.md")
    api = FakeHfApi()
    done, result = call_with_deadline(lambda: push_output(finished_copy, REPO, api=api, log=quiet), 30,
                                      finished_copy / "README.md")
    assert done, "push waited on a FIFO"
    assert isinstance(result, HsxError) and "not a regular file" in str(result)
    assert REPO not in api.repos or not any(api.files())


@pytest.mark.parametrize("remote", [
    b"[1, 2, 3]",  # JSON, not an object
    b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's depth
    b'{"fingerprint": ' + b"1" * 5000 + b"}",  # a number int() refuses
    b'{"fingerprint": {"a": "b"}}',  # not a string
    b'{"fingerprint": ""}',
    b"\xff\xfe{}",  # not UTF-8
])
def test_push_reads_a_hostile_remote_hsx_json_as_not_this_jobs(finished, tmp_path, remote):
    out = Path(shutil.copytree(finished, tmp_path / "out"))
    api = FakeHfApi()
    api.create_repo(REPO, repo_type="dataset", exist_ok=True)
    api.files().update({"hsx.json": remote})
    with pytest.raises(HsxError, match=r"holds an hsx.json that is not this job's.*--hub-overwrite"):
        push_output(out, REPO, api=api, log=lambda *a: None)
    assert api.files() == {"hsx.json": remote} and api.commits == []
