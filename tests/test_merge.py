"""hsx merge: the dirs that the nodes of one job wrote (no shared filesystem) join into one output, by metadata. A
merge is locked against running jobs, keeps a finished output's units, links no unit that is itself a link, refuses a
foreign dir keeping its files, and names the argument that gave a refused dir."""

import json
import os
import shutil
from pathlib import Path

import pytest

import hsx
from hsx.config import HsxError
from hsx.merge import merge

DEMO = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"
pytestmark = pytest.mark.slow  # the module fixture runs the demo job three times (~12 s on 2 loaded cores)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from hsx.cli import main

    out = tmp_path_factory.mktemp("merge") / "reference"
    assert main(["extract", "--config", str(DEMO), "--output-dir", str(out), "--unit-tokens", "1500"]) == 0
    return out


def split_like_two_nodes(reference: Path, root: Path) -> list[Path]:
    """Two node dirs, each with half the units and only its own manifest, as two nodes would leave them."""
    units = sorted((reference / "data").glob("train-*.arrow"))
    records = [json.loads(line) for f in sorted((reference / ".hsx").glob("manifest-*.jsonl"))
               for line in f.read_text().splitlines()]
    dirs = []
    for node in range(2):
        d = root / f"node{node}"
        (d / "data").mkdir(parents=True)
        (d / ".hsx").mkdir()
        for name in ("job.json", "summary.json"):
            shutil.copy(reference / ".hsx" / name, d / ".hsx" / name)
        mine = [r for k, r in enumerate(sorted(records, key=lambda r: r["unit"])) if k % 2 == node]
        for r in mine:
            shutil.copy(reference / "data" / r["file"], d / "data" / r["file"])
        (d / ".hsx" / f"manifest-{node:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mine))
        dirs.append(d)
    assert sum(len(list((d / "data").glob("*.arrow"))) for d in dirs) == len(units)
    return dirs


def test_merge_equals_the_single_dir_output(reference, tmp_path):
    node0, node1 = split_like_two_nodes(reference, tmp_path)
    info = merge(str(node0), [str(node0), str(node1)], log=lambda *a: None)
    assert info["complete"] and info["counts"] == json.loads((reference / "hsx.json").read_text())["counts"]
    links = [p for p in (node0 / "data").iterdir() if p.is_symlink()]
    assert links and all(p.resolve().parent == (node1 / "data").resolve() for p in links)  # nothing copied
    assert hsx.load(str(node0)).data.table.equals(hsx.load(str(reference)).data.table)
    from datasets import load_dataset

    streamed = load_dataset(str(node0), split="train", streaming=True)
    assert sum(1 for _ in streamed) == info["counts"]["rows_written"]


def test_a_merged_hsx_json_lists_the_values_every_nodes_runs_used(reference, tmp_path):
    """Nodes that ran with other packing (or kernels, or compile): the merged run.values_used lists both."""
    dirs = split_like_two_nodes(reference, tmp_path)
    for node, (d, packing) in enumerate(zip(dirs, ("none", "varlen"))):
        sessions = {json.loads(line)["session"] for line in (d / ".hsx" / f"manifest-{node:05d}.jsonl").open()}
        (d / ".hsx" / f"runs-{node:05d}.jsonl").write_text(
            "".join(json.dumps({"session": s, "compile": False, "packing": packing}) + "\n" for s in sessions))
    info = merge(str(dirs[0]), [str(d) for d in dirs], log=lambda *a: None)
    assert info["run"]["values_used"] == {"compile": [False], "packing": ["none", "varlen"]}


def test_merge_into_a_new_dir_and_refusals(reference, tmp_path):
    node0, node1 = split_like_two_nodes(reference, tmp_path)
    merge(str(tmp_path / "joined"), [str(node0), str(node1)], log=lambda *a: None)
    assert hsx.load(str(tmp_path / "joined")).data.table.equals(hsx.load(str(reference)).data.table)
    with pytest.raises(HsxError, match="units are in none of the dirs"):
        merge(str(tmp_path / "half"), [str(node1)], log=lambda *a: None)
    other = tmp_path / "other"
    shutil.copytree(node1, other)
    job = json.loads((other / ".hsx" / "job.json").read_text())
    from hsx.fingerprint import job_fingerprint  # (another job: other inputs, their own fingerprint)

    (other / ".hsx" / "job.json").write_text(json.dumps(job_fingerprint({**job["inputs"], "layers": [1]})))
    with pytest.raises(HsxError, match="different jobs"):
        merge(str(tmp_path / "mixed"), [str(node0), str(other)], log=lambda *a: None)
    assert not (tmp_path / "mixed").exists()  # a refused merge leaves nothing it created
    assert not (tmp_path / "half").exists()
    with pytest.raises(HsxError, match="holds no hsx job"):
        merge(str(tmp_path / "typo-out"), [str(node0), str(tmp_path / "typo")], log=lambda *a: None)
    assert not (tmp_path / "typo-out").exists() and not (tmp_path / "typo").exists()
    listing = sorted(p.name for p in (node0 / ".hsx").iterdir())
    with pytest.raises(HsxError, match="different jobs"):  # into a source: its own files stay as they were
        merge(str(node0), [str(node0), str(other)], log=lambda *a: None)
    assert sorted(p.name for p in (node0 / ".hsx").iterdir()) == listing


def test_partial_merge_of_the_dirs_that_survive_then_extract_finishes_it(reference, tmp_path):
    """Node 1's dir is lost: `hsx merge --partial` joins node 0's units into an unfinished output, and the job's
    `hsx extract` on it writes exactly node 1's units, giving the single-dir output."""
    from hsx.cli import main

    node0, node1 = split_like_two_nodes(reference, tmp_path)
    lost = {p.name for p in (node1 / "data").iterdir()}
    shutil.rmtree(node1)
    joined = tmp_path / "joined"
    assert main(["merge", "--partial", str(joined), str(node0)]) == 0
    assert not (joined / "hsx.json").exists() and "unfinished" in (joined / "README.md").read_text()
    with pytest.raises(HsxError, match="not complete|unfinished|allow_incomplete"):
        hsx.load(str(joined))
    assert main(["extract", "--config", str(DEMO), "--output-dir", str(joined), "--unit-tokens", "1500"]) == 0
    written = {p.name for p in (joined / "data").iterdir() if not p.is_symlink()}
    assert written == lost  # only the lost node's units were computed again
    assert json.loads((joined / "hsx.json").read_text())["counts"] == json.loads(
        (reference / "hsx.json").read_text())["counts"]
    assert hsx.load(str(joined)).data.table.equals(hsx.load(str(reference)).data.table)
    # the links to node 0's units are read (and pushed) as hsx merge's own: the finished hsx.json names node 0
    assert json.loads((joined / "hsx.json").read_text())["run"]["merged_from"] == [str(node0.resolve())]


def test_a_dir_named_twice_is_refused_before_anything_is_made(tmp_path):
    from helpers import assert_one_error_line, hsx_main

    node = tmp_path / "node0"
    node.mkdir()
    rc, _, err = hsx_main(["merge", str(tmp_path / "joined"), str(node), str(tmp_path / "." / "node0") + "/"])
    assert rc == 2
    assert_one_error_line(rc, err, "names the same dir as")
    assert not (tmp_path / "joined").exists() and sorted(p.name for p in node.iterdir()) == []


# ---- merge believes no input: every dir's plan, every unit it links, checked before anything is written ---------

def _records(node: Path) -> list[dict]:
    return [json.loads(line) for m in sorted((node / ".hsx").glob("manifest-*.jsonl"))
            for line in m.read_text().splitlines()]


def _rewrite_manifest(node: Path, change) -> None:
    """Every manifest of `node`, each record passed through `change` (which returns the records to write)."""
    for m in sorted((node / ".hsx").glob("manifest-*.jsonl")):
        recs = [r for line in m.read_text().splitlines() for r in change(json.loads(line))]
        m.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _refused(out: Path, dirs: list[Path], *needles: str) -> str:
    """`hsx merge OUT DIR...` refused in one line (exit 1) naming `needles`, with nothing written to OUT."""
    from helpers import assert_one_error_line, hsx_main

    rc, _, err = hsx_main(["merge", str(out), *map(str, dirs)])
    assert rc == 1, err
    line = assert_one_error_line(rc, err, *needles)
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    return line


def _forged_first(node0: Path, root: Path, summaries: bool) -> Path:
    """A dir holding the job's job.json and a summary.json whose plan lists 3 of its units, and nothing else."""
    forged = root / "forged"
    (forged / ".hsx").mkdir(parents=True)
    shutil.copy(node0 / ".hsx" / "job.json", forged / ".hsx" / "job.json")
    summary = json.loads((node0 / ".hsx" / "summary.json").read_text())
    summary["unit_names"] = summary["unit_names"][:3]
    (forged / ".hsx" / "summary.json").write_text(json.dumps(summary))
    if not summaries:
        for d in (root / "node0", root / "node1"):
            (d / ".hsx" / "summary.json").unlink()
    return forged


@pytest.mark.parametrize("summaries", [True, False], ids=["nodes-keep-their-summaries", "nodes-without-summaries"])
def test_a_forged_dir_given_first_does_not_decide_the_plan(reference, tmp_path, summaries):
    """A dir given first with the job's job.json and a summary.json listing 3 units: merge said "96 rows in 3
    units" and wrote an output that load and verify refused. Now the plans must agree (and the units the manifests
    record must be in it), or merge refuses, naming the dir."""
    node0, node1 = split_like_two_nodes(reference, tmp_path)
    forged = _forged_first(node0, tmp_path, summaries)
    line = _refused(tmp_path / "joined", [forged, node0, node1], "merge without it")
    assert ("plan the job differently" if summaries else "which is not in the job's plan") in line
    assert str(forged if summaries else node0) in line


@pytest.mark.parametrize("damage", ["flipped-byte", "hard-link-to-text", "hard-link-to-text-manifest-too",
                                    "other-rows-manifest-too", "rows-outside-the-plan", "counts"])
def test_merge_checks_every_unit_it_links_before_writing(reference, tmp_path, damage):
    """A unit that is not what the manifests it trusts say (size, CRC-32), or that is no valid Arrow unit of the
    job even where the manifest was forged to match it, or units and summary that disagree on the rows: one line
    naming the file or dir, exit 1, nothing written to OUT; the units repaired, the same merge goes through."""
    from hsx.checksums import file_crc32

    node0, node1 = split_like_two_nodes(reference, tmp_path)
    unit = sorted((node1 / "data").iterdir())[0]
    kept = tmp_path / "kept.arrow"
    shutil.copy(unit, kept)
    manifests = {m: m.read_bytes() for d in (node0, node1) for m in (d / ".hsx").glob("*.json*")}

    def forge(**values):
        _rewrite_manifest(node1, lambda r: [dict(r, **values) if r["file"] == unit.name else r])

    if damage == "flipped-byte":
        data = bytearray(unit.read_bytes())
        data[len(data) // 2] ^= 0xFF
        unit.write_bytes(bytes(data))
        needles = (str(unit), "do not match the CRC-32")
    elif damage.startswith("hard-link-to-text"):
        text = tmp_path / "notes.txt"
        text.write_text("not hidden states\n" * 40)
        unit.unlink()
        os.link(text, unit)
        if damage.endswith("manifest-too"):
            forge(bytes=text.stat().st_size, crc32=file_crc32(text))
            needles = (str(unit), "not a valid Arrow unit")
        else:
            needles = (str(unit), "bytes, its manifest records")
    elif damage == "other-rows-manifest-too":  # another unit's file under this unit's name
        other = sorted((node1 / "data").iterdir())[1]
        shutil.copy(other, unit)
        forge(bytes=other.stat().st_size, crc32=file_crc32(other))
        needles = (str(unit), "its manifest records")
    elif damage == "rows-outside-the-plan":  # ... and its manifest record forged whole: its rows are in two units
        other = sorted((node1 / "data").iterdir())[1]
        shutil.copy(other, unit)
        rec = next(r for r in _records(node1) if r["file"] == other.name)
        forge(**{k: rec[k] for k in ("bytes", "crc32", "rows", "tokens")})
        needles = ("input rows twice",)
    else:
        for d in (node0, node1):
            s = json.loads((d / ".hsx" / "summary.json").read_text())
            s["counts"]["rows_in"] += 5
            (d / ".hsx" / "summary.json").write_text(json.dumps(s))
        needles = ("manifests and .hsx/summary.json disagree",)
    _refused(tmp_path / "joined", [node0, node1], *needles)
    unit.unlink()
    shutil.copy(kept, unit)
    for m, text in manifests.items():
        m.write_bytes(text)
    info = merge(str(tmp_path / "joined"), [str(node0), str(node1)], log=lambda *a: None)
    assert info["counts"] == json.loads((reference / "hsx.json").read_text())["counts"]


def test_two_dirs_with_different_units_of_one_name_are_refused(reference, tmp_path):
    """Two dirs each offering a unit of one name with other bytes (each file matching its own manifest): merge
    does not pick one; it names both. The same bytes in two dirs (a copy) are one unit."""
    from hsx.checksums import file_crc32

    node0, node1 = split_like_two_nodes(reference, tmp_path)
    unit = sorted((node1 / "data").iterdir())[0]
    rec = next(r for r in _records(node1) if r["file"] == unit.name)
    copy = node0 / "data" / unit.name
    shutil.copy(unit, copy)
    with (node0 / ".hsx" / "manifest-00000.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")
    merge(str(tmp_path / "same"), [str(node0), str(node1)], log=lambda *a: None)  # a copy: one unit
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    _rewrite_manifest(node0, lambda r: [dict(r, crc32=file_crc32(copy)) if r["file"] == unit.name else r])
    _refused(tmp_path / "joined", [node0, node1], str(copy), str(unit), "two different units of one name")


def test_a_job_json_whose_inputs_are_not_its_fingerprints_is_refused(reference, tmp_path):
    """A dir given first holding the job's fingerprint beside other inputs (another model's files): merge copied
    its job.json into OUT, and `hsx verify` checks the model against those inputs. Each dir's job.json must hash to
    its fingerprint; `given` (names for messages, outside the hash) may differ."""
    node0, node1 = split_like_two_nodes(reference, tmp_path)
    forged = tmp_path / "forged"
    (forged / ".hsx").mkdir(parents=True)
    job = json.loads((node0 / ".hsx" / "job.json").read_text())
    job["inputs"]["layers"] = [1, 2]
    (forged / ".hsx" / "job.json").write_text(json.dumps(job))
    line = _refused(tmp_path / "joined", [forged, node0, node1], "its fingerprint is not that of the inputs it "
                    "records", "merge without it")
    assert str(forged / ".hsx" / "job.json") in line
    job = json.loads((node1 / ".hsx" / "job.json").read_text())
    job["given"]["model"] = "elsewhere/tiny-qwen3"
    (node1 / ".hsx" / "job.json").write_text(json.dumps(job))
    info = merge(str(tmp_path / "joined"), [str(node0), str(node1)], log=lambda *a: None)
    assert info["counts"] == json.loads((reference / "hsx.json").read_text())["counts"]


from helpers import copy_of, hsx_main, quiet, swap_for_link, the_error_line, tree_bytes  # noqa: E402
from hsx.sink import OutputDir  # noqa: E402


# ---- merge: locked, and careful with what it links and the dirs it is given ----------------------------------------

def test_merge_refuses_a_foreign_dir_and_keeps_its_files(finished, tmp_path):
    nodes = split_like_two_nodes(finished, tmp_path)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "README.md").write_text("my notes")
    (foreign / "hsx.json").write_text('{"mine": true}')
    with pytest.raises(HsxError, match="not written by hsx"):
        merge(str(foreign), [str(n) for n in nodes], log=lambda *a: None)
    assert tree_bytes(foreign) == {"README.md": b"my notes", "hsx.json": b'{"mine": true}'}


@pytest.mark.parametrize("rank", [0, 3])
def test_merge_refuses_a_dir_a_job_is_running_in(finished, tmp_path, rank):
    nodes = split_like_two_nodes(finished, tmp_path)
    before = {n: tree_bytes(n) for n in nodes}
    with OutputDir(nodes[1], rank=rank).locked():  # a running job's rank `rank` holds its locks
        with pytest.raises(HsxError, match="in use by a running hsx job"):
            merge(str(nodes[0]), [str(n) for n in nodes], log=lambda *a: None)
    assert {n: tree_bytes(n) for n in nodes} == before
    with pytest.raises(HsxError, match="in use by another hsx job|being merged"):
        with OutputDir(nodes[0]).locked_whole():
            with OutputDir(nodes[0], rank=5).locked():  # and no job starts while a merge runs
                pass


def test_merge_keeps_the_units_of_a_finished_output(finished, tmp_path):
    nodes = split_like_two_nodes(finished, tmp_path)
    whole = copy_of(finished, tmp_path, "whole")
    before = tree_bytes(whole / "data")
    merge(str(whole), [str(nodes[0]), str(nodes[1]), str(whole)], log=lambda *a: None)
    assert tree_bytes(whole / "data") == before and not any(p.is_symlink() for p in (whole / "data").iterdir())
    assert hsx.load(str(whole), verify=True).data.table.equals(hsx.load(str(finished)).data.table)
    other = copy_of(finished, tmp_path, "other-job")
    job = json.loads((other / ".hsx" / "job.json").read_text())
    (other / ".hsx" / "job.json").write_text(json.dumps({**job, "fingerprint": "another"}))
    with pytest.raises(HsxError, match="another job's output"):
        merge(str(other), [str(n) for n in nodes], log=lambda *a: None)


def test_merge_links_are_read_from_their_units(finished, tmp_path):
    nodes = split_like_two_nodes(finished, tmp_path)
    merge(str(tmp_path / "joined"), [str(n) for n in nodes], log=lambda *a: None)
    joined = tmp_path / "joined"
    ds = hsx.load(str(joined), verify=True)
    assert ds.data.table.equals(hsx.load(str(finished)).data.table)
    rc, _, err = hsx_main(["verify", str(joined), "--samples", "0"])
    assert rc == 0, err
    # a merged dir whose job.json is another job's is no known source
    job = json.loads((nodes[1] / ".hsx" / "job.json").read_text())
    (nodes[1] / ".hsx" / "job.json").write_text(json.dumps({**job, "fingerprint": "another"}))
    with pytest.raises(HsxError, match="is a symbolic link, and not one `hsx merge` made"):
        hsx.load(str(joined))


def test_merge_links_no_unit_that_is_itself_a_link(finished, tmp_path):
    """A node dir whose unit is a link (to a copy elsewhere, or to anything) is not that dir's unit: merge said
    "merged" and wrote an output every reader then refused; now the merge refuses, in one line, before writing."""
    node0, node1 = split_like_two_nodes(finished, tmp_path)
    unit = sorted((node1 / "data").iterdir())[0]
    shutil.copy(unit, tmp_path / "elsewhere.arrow")
    swap_for_link(unit, tmp_path / "elsewhere.arrow")
    with pytest.raises(HsxError, match="in none of the dirs"):
        merge(str(tmp_path / "m"), [str(node0), str(node1)], log=quiet)
    assert not (tmp_path / "m" / "hsx.json").exists()


def test_a_refused_merge_or_push_dir_is_named_by_its_own_argument_not_output_dir(finished_copy, tmp_path):
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    rc, _, err = hsx_main(["merge", str(tmp_path / "merged"), str(finished_copy), str(stranger)])
    line = the_error_line(err)
    assert rc != 0 and "choose another DIR of `hsx merge`" in line and "--output-dir" not in line, line
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc, _, err = hsx_main(["merge", str(afile), str(finished_copy)])
    line = the_error_line(err)
    assert rc != 0 and "is a file, not a folder; choose another OUTPUT_DIR of `hsx merge`" in line, line
    assert afile.read_text() == "x" and (stranger / "notes.txt").read_text() == "mine"
    hub_copy = tmp_path / "downloaded"  # (an output without .hsx/, as the Hub holds it)
    shutil.copytree(finished_copy, hub_copy, ignore=shutil.ignore_patterns(".hsx"))
    rc, _, err = hsx_main(["push", str(hub_copy), "someone/states"])
    line = the_error_line(err)
    assert rc != 0 and "OUTPUT_DIR of `hsx push`" in line and "--output-dir" not in line, line
