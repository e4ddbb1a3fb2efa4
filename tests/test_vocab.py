"""Draft vocabulary: token_frequencies.npy written when a job finishes equals a direct count over the output; the
d2t/t2d mapping (most frequent first, ties to the lower id, the lowest unseen ids filling in); `hsx vocab`'s files;
damaged frequency files (an entry of another shape, a header claiming a huge array) and --overwrite; --dest written
through no planted link, no foreign file replaced. (The trainers' own code reads these in test_trainers.py.)"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import hsx_main, message_lines
from hsx.config import load_config
from hsx.load import load
from hsx.run import extract
from hsx.sink import OutputDir
from hsx.vocab import FREQUENCIES_FILE, draft_vocab, read_token_frequencies, write_token_frequencies


@pytest.fixture(scope="module")
def out(tmp_path_factory, model4, chat_data) -> Path:
    root = tmp_path_factory.mktemp("vocab") / "out"
    extract(load_config(None, {"output_dir": str(root), "compile": "off", "model": str(model4.path),
                               "dataset": str(chat_data.path), "layers": ["1"], "max_length": 160,
                               "token_budget": 640, "unit_tokens": 300}), log=lambda *a: None)
    return root


def direct_count(root: Path) -> Counter:
    """Row by row, in Python, over the output as `datasets` reads it."""
    counts: Counter = Counter()
    for row in load(str(root)).select_columns(["input_ids", "loss_mask"]):
        counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m == 1)
    return counts


def test_frequencies_equal_a_direct_count_over_the_output(out):
    meta = json.loads((out / "hsx.json").read_text())
    counts = read_token_frequencies(out)
    assert counts.dtype == np.int64 and len(counts) == meta["vocab_size"] == meta["token_frequencies"]["vocab_size"]
    want = direct_count(out)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(want)
    assert meta["token_frequencies"] == {"file": FREQUENCIES_FILE, "vocab_size": len(counts),
                                         "supervised_tokens": sum(want.values()), "distinct_tokens": len(want),
                                         "counted_over": "output"}
    assert len(list((out / "data").glob("train-*.arrow"))) > 2  # summed over several units


def test_units_deleted_after_upload_are_counted_from_the_tokenized_rows(out, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    want = read_token_frequencies(out)
    next((copy / "data").glob("train-*.arrow")).unlink()  # as --delete-after-upload leaves a dir
    entry = write_token_frequencies(OutputDir(copy), len(want))
    assert entry["counted_over"] == "tokenized"
    assert np.array_equal(np.load(copy / FREQUENCIES_FILE), want)  # no row of this job was skipped late


def test_draft_vocab_order_ties_and_fill():
    counts = np.array([0, 5, 2, 5, 0, 9, 2, 0], dtype=np.int64)
    d2t, t2d = draft_vocab(counts, 3)
    assert np.flatnonzero(t2d).tolist() == [1, 3, 5] and (d2t + np.arange(3)).tolist() == [1, 3, 5]
    d2t, t2d = draft_vocab(counts, 4)  # 2 and 6 tie at 2: the lower id wins
    assert np.flatnonzero(t2d).tolist() == [1, 2, 3, 5] and d2t.dtype == np.int64
    d2t, t2d = draft_vocab(counts, 7)  # 5 tokens seen: the lowest unseen ids (0, then 4) fill in
    assert np.flatnonzero(t2d).tolist() == [0, 1, 2, 3, 4, 5, 6] and d2t.tolist() == [0] * 7
    assert t2d.dtype == bool and len(t2d) == len(counts)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="draft-vocab-size"):
            draft_vocab(counts, bad)


def test_hsx_vocab_writes_both_trainers_files(out, tmp_path):
    code, stdout, err = hsx_main(["vocab", str(out), "--draft-vocab-size", "16", "--dest", str(tmp_path)])
    assert code == 0, err
    d2t, t2d = draft_vocab(read_token_frequencies(out), 16)
    mapping = torch.load(tmp_path / "vocab_mapping-16.pt", weights_only=True)
    assert torch.equal(mapping["d2t"], torch.from_numpy(d2t)) and torch.equal(mapping["t2d"], torch.from_numpy(t2d))
    assert np.array_equal(np.load(tmp_path / "d2t-16.npy"), d2t) and np.array_equal(np.load(tmp_path / "t2d-16.npy"),
                                                                                     t2d)
    counts = read_token_frequencies(out)
    assert f"covers {counts[t2d].sum() / counts.sum():.2%}" in stdout
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_damaged_or_missing_frequencies_are_one_line(out, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    np.save(copy / FREQUENCIES_FILE, np.zeros(3, dtype=np.int64))
    code, _, err = hsx_main(["vocab", str(copy), "--draft-vocab-size", "4"])
    assert code == 1 and len(message_lines(err)) == 1 and "does not match hsx.json" in err
    (copy / FREQUENCIES_FILE).write_bytes(b"\x93NUMPY garbage")
    code, _, err = hsx_main(["vocab", str(copy), "--draft-vocab-size", "4"])
    assert code == 1 and len(message_lines(err)) == 1
    (copy / FREQUENCIES_FILE).unlink()
    code, _, err = hsx_main(["vocab", str(copy), "--draft-vocab-size", "4"])
    assert code == 1 and "no token_frequencies.npy" in err and "Traceback" not in err


def test_overwrite_removes_frequencies_and_mappings(out, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    assert hsx_main(["vocab", str(copy), "--draft-vocab-size", "8"])[0] == 0
    assert (copy / "d2t-8.npy").exists() and (copy / "vocab_mapping-8.pt").exists()
    OutputDir(copy).clear()  # what --overwrite runs: only what hsx wrote, these files included
    assert [p.name for p in copy.iterdir()] == [".hsx"]


import os  # noqa: E402

from helpers import assert_one_error_line, quiet, the_error_line  # noqa: E402


# ---- damaged frequencies and planted files -------------------------------------------------------------------------

@pytest.mark.parametrize("entry", [5, [1, 2], {"vocab_size": "8", "supervised_tokens": 1}])
def test_damaged_token_frequencies_entry_is_one_line(finished_copy, entry):
    f = finished_copy / "hsx.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "token_frequencies": entry}))
    rc, _, err = hsx_main(["vocab", str(finished_copy), "--draft-vocab-size", "4"])
    assert_one_error_line(rc, err, "token_frequencies", prefix="hsx: error: ")


def test_a_frequencies_file_whose_header_claims_a_huge_array_is_damaged_not_a_memory_error(finished_copy, tmp_path):
    """np.load allocates the shape the .npy header claims: 100 bytes claiming 10**12 int64 were a MemoryError
    traceback from `hsx vocab` and the speculators export."""
    import io

    import numpy as np

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False, "shape": (10**12,)})
    (finished_copy / "token_frequencies.npy").write_bytes(header.getvalue() + bytes(64))
    rc, _, err = hsx_main(["vocab", str(finished_copy), "--draft-vocab-size", "4", "--dest", str(tmp_path / "v")])
    line = the_error_line(err)
    assert rc != 0 and "does not match hsx.json's token_frequencies" in line, line
    (finished_copy / "token_frequencies.npy").unlink()
    (finished_copy / "token_frequencies.npy").symlink_to(tmp_path / "elsewhere.npy")
    rc, _, err = hsx_main(["vocab", str(finished_copy), "--draft-vocab-size", "4", "--dest", str(tmp_path / "v")])
    assert rc != 0, err
    the_error_line(err)


def test_vocab_writes_through_no_planted_link_and_replaces_no_foreign_file(finished, tmp_path):
    """`hsx vocab --dest D` opened D/.NAME.tmp with open(): a link planted there had its target overwritten; a
    foreign d2t-K.npy in D was replaced without a word."""
    from hsx.vocab import write_draft_vocab

    dest = tmp_path / "dest"
    dest.mkdir()
    target = tmp_path / "target"
    target.write_text("SECRET")
    os.symlink(target, dest / ".t2d-8.npy.tmp")
    write_draft_vocab(finished, 8, dest, log=quiet)
    assert target.read_text() == "SECRET" and (dest / "t2d-8.npy").is_file()
    write_draft_vocab(finished, 8, dest, log=quiet)  # the same mapping again: fine
    (dest / "d2t-16.npy").write_text("FOREIGN")
    with pytest.raises(ValueError, match="is not this mapping"):
        write_draft_vocab(finished, 16, dest, log=quiet)
    assert (dest / "d2t-16.npy").read_text() == "FOREIGN"
