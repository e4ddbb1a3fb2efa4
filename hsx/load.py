"""Consumer side: read an hsx output, local or on the Hub, as torch tensors without copying; batch it for a
drafter's training (exports to trainers' own layouts: hsx.export).

- `load(path_or_repo, split="train", layers=None, streaming=False, revision=None)`: one type per call form
  (`load(p)` a `datasets.Dataset`, `streaming=True` a `datasets.IterableDataset`, `layers=[...]` a `torch_view`,
  both a `torch_stream`), local dir or Hub repo alike.
  * a local output dir: memory-mapped from data/<split>-*.arrow in place (`Dataset.from_file`, 0.008 s for
    472 MB). `datasets.load_dataset(DIR)` would first copy everything into the HF cache (472 MB -> a 472 MB
    cache file, so a second terabyte for a terabyte output), and datasets
    5.2 keys that cache by the folder's name and the card's configs, not by the files (hsx puts the job
    fingerprint in the card's config to keep two jobs apart).
  * a Hub repo id: `load_dataset(repo, split=...)`, downloaded into the HF cache first, as `load_dataset` does;
    with `streaming=True` it downloads as it goes and caches nothing (the way to read a terabyte output).
  * `layers=[...]` (model layer indices as in hsx.json; negatives count from the model's end): torch rows
    holding only those of the stored layers. Cost: locally, evenly spaced layers are a
    strided view of the memory-mapped file and others are gathered by `index_select` (a copy of the selected
    layers only); pages of the other layers are not read unless they share a 4 KiB page (a layer row is
    hidden x 2 bytes: 8 KiB at hidden 4096). Streaming, every row arrives whole: the download and the Arrow
    parsing cost all stored layers, and `layers=` only saves memory downstream.
- `torch_view` / `torch_stream`: rows with every stored column as torch tensors (top-k logits and ids,
  has_nonfinite included); bf16 / float16 / float32 states as stored, views of the Arrow buffers, no copy;
  fp8 states dequantized to bfloat16 (`dequantize=False`: raw `torch.float8_e4m3fn` with the `*_scale`
  columns). Arrow has no bfloat16: bf16 is stored bit-exact as int16, and datasets' torch/numpy formatters would
  widen it to int64 unless told `dtype=None`.
- `collate(rows, pad_token_id=0, pad_to_multiple_of=None)`: right-padded batches for a DataLoader.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hsx.schema import DTYPES, Damaged, Info, StoredLayout, bits_dtype, decode, dequantize, storage_dtype_of

IGNORE_INDEX = -100  # `labels` outside the loss (transformers' and torch's CrossEntropyLoss default)


# ---- opening ----------------------------------------------------------------------------------------------------

def load(path_or_repo: str | os.PathLike, split: str = "train", layers: list[int] | None = None,
         streaming: bool = False, revision: str | None = None, dequantize: bool = True, verify: bool = False,
         allow_incomplete: bool = False):
    """An hsx output, local dir or Hub repo alike; the type depends only on the call form:

    - `load(p)`: a `datasets.Dataset` (a local dir memory-mapped in place, no copy; a Hub repo downloaded into
      the HF cache first, as `load_dataset` does)
    - `load(p, streaming=True)`: a `datasets.IterableDataset` (a Hub repo downloads as it goes, caches nothing)
    - `load(p, layers=[...])`: a `torch_view` (map-style torch rows of only those stored layers)
    - `load(p, layers=[...], streaming=True)`: a `torch_stream` (iterable torch rows)

    `dequantize` (fp8 outputs, torch rows): see `torch_view`.

    A local dir is checked against the files its hsx.json lists (names and sizes; with `verify`, CRC-32 too,
    which reads every byte): an incomplete dir (a job running or interrupted) or a damaged one is refused with
    one line (HsxError); `allow_incomplete=True` reads the committed, intact units instead (with a warning).

    What it does not check without `verify`: the bytes. A unit of the right size with a flipped bit is valid Arrow
    and is read as it is (hsx.follow checks each unit's CRC-32 before handing out its rows; `hsx verify OUT` checks
    them and recomputes rows). A Hub repo is read as `load_dataset` reads it (the Hub's own checks, not hsx's
    CRC-32s)."""
    local = _local_dir(path_or_repo)
    if local is not None:
        if revision is not None:
            raise ValueError("revision= is for Hub repos; a local dir is read as it is")
        out, files, whole = _local_files(local, split, verify, allow_incomplete)
        recorded = _recorded(out)
        if not streaming:
            ds = note_layout(open_checked_files(out, files), recorded)
            if whole:
                _check_rows(local, split, ds)
            return ds if layers is None else torch_view(ds, layers=layers, meta=read_info(local),
                                                        dequantize=dequantize)
    from datasets import load_dataset

    if local is not None:
        ds = note_layout(load_dataset("arrow", data_files={split: [str(f) for f in files]}, split=split,
                                      streaming=True), recorded)
    else:
        ds = load_dataset(str(path_or_repo), split=split, streaming=streaming, revision=revision)
    if layers is None:
        return ds
    meta = read_info(local) if local is not None else hub_info(str(path_or_repo), revision)
    if streaming:
        return torch_stream(ds, layers=layers, meta=meta, dequantize=dequantize)
    return torch_view(ds, layers=layers, meta=meta, dequantize=dequantize)


def _recorded(out):
    """What the output dir `out` (an hsx.sink.OutputDir) records of its job: hsx.json, else (a job running or
    interrupted) its plan, else None (a dir of data files only)."""
    from hsx.info import recorded_info, read_summary

    return recorded_info(out.root) or (read_summary(out.state) if out.state.is_dir() else None)


def _check_rows(root: Path, split: str, ds) -> None:
    """A whole finished output has the rows its hsx.json counts (a dir whose list was cut, or an older hsx's
    without a list, would otherwise read as fewer rows, silently)."""
    from hsx.config import HsxError
    from hsx.info import recorded_info

    meta = recorded_info(Path(root))
    if meta is None or not meta.complete or split != "train":
        return
    if len(ds) != meta.counts.rows_written:
        raise HsxError(f"{root}: its data files hold {len(ds):,} rows, its hsx.json counts "
                       f"{meta.counts.rows_written:,}; the dir was changed after the job wrote it")


def _local_dir(path_or_repo: str | os.PathLike) -> Path | None:
    """The output dir, or None for a Hub repo id ("name" or "owner/name")."""
    p = Path(path_or_repo).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise NotADirectoryError(f"{path_or_repo}: an hsx output is a folder")
    s = str(path_or_repo)
    if isinstance(path_or_repo, Path) or s.startswith((".", "/", "~")) or s.count("/") > 1:
        raise FileNotFoundError(f"{path_or_repo}: no such output dir")
    return None


def open_arrow_files(files: list[Path]):
    """One `datasets.Dataset` over these Arrow files, memory-mapped in place (no copy, no HF cache).

    datasets writes a cache-writing op's result (sort, map, filter, shuffle + flatten_indices, train_test_split)
    as cache-<fingerprint>.arrow in the folder of the dataset's first mapped file. So the files are mapped
    through links in a folder of datasets' cache (`cache_view`), never from the output's data/: caches land in
    HF_DATASETS_CACHE as for any dataset, and an output dir holds only what hsx wrote."""
    from datasets import Dataset, concatenate_datasets

    return concatenate_datasets([Dataset.from_file(str(f)) for f in cache_view(files)])


def open_checked_files(out, files: list[Path]):
    """`open_arrow_files` of units `out.unit_source` approved, checked to be those very files: each is opened
    without following a link and compared with what was approved (`OutputDir.open_unit`) before it is mapped, and
    its name checked to still lead to that file after, so a unit swapped for a link out of the output (or another
    file) between the check and the mapping is refused (HsxError), not read."""
    from hsx.files import still_the_file

    fds = [out.open_unit(f) for f in files]
    try:
        ds = open_arrow_files(files)
        for f, fd in zip(files, fds):
            still_the_file(f, fd)
        return ds
    finally:
        for fd in fds:
            os.close(fd)


def cache_view(files: list[Path]) -> list[Path]:
    """Links to `files` in HF_DATASETS_CACHE/hsx/outputs/<key>/, made once per set of files as they are: the key
    hashes each file's path, device, inode, size and modification time, so a rewritten unit gets a new folder
    (and datasets' caches from the old one are not reused for it). Without a writable datasets cache, the files
    themselves."""
    import hashlib
    import json
    import uuid

    import datasets.config

    paths = [Path(os.path.abspath(f)) for f in files]
    ids = []
    for p in paths:
        st = p.stat()
        ids.append([str(p), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns])
    key = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:32]
    folder = Path(datasets.config.HF_DATASETS_CACHE) / "hsx" / "outputs" / key
    names = [f"{i:06d}-{p.name}" for i, p in enumerate(paths)]  # (merged units may share a name across dirs)

    def holds_the_links(d: Path) -> bool:
        try:
            return all(os.readlink(d / n) == str(p) for n, p in zip(names, paths))
        except OSError:
            return False

    if not holds_the_links(folder):
        tmp = folder.with_name(f"{key}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir(parents=True)
            for n, p in zip(names, paths):
                os.symlink(p, tmp / n)
            try:
                os.rename(tmp, folder)
            except OSError:  # made meanwhile by another process (or damaged): use this one
                folder = tmp if not holds_the_links(folder) else folder
        except OSError:
            return paths
    return [folder / n for n in names]


def _local_files(root: Path, split: str, verify: bool, allow_incomplete: bool):
    """The files of `split` to read: those the finished output's hsx.json lists (their list, the manifests, the
    counts and data/ checked to agree: `OutputDir.check_finished`), each checked (sizes; CRC-32 with `verify`);
    of an unfinished one (allow_incomplete), its committed units; of a dir with neither hsx.json nor .hsx/
    (written by hand, or an older hsx), data/<split>-*.arrow. A link is read only if it is one `hsx merge` made
    (`OutputDir.unit_source`): the paths returned are the checked files, not links. Also returns whether they
    are the whole output (not a part read with allow_incomplete, or of units deleted after their upload), after the
    OutputDir that approved them (its `open_unit` opens them as approved)."""
    from hsx.config import HsxError
    from hsx import ledgers
    from hsx.info import listed_files, recorded_info, read_summary
    from hsx.sink import OutputDir

    out = OutputDir(root)
    meta = recorded_info(out.root)
    complete = meta is not None and meta.complete
    listed = None
    if complete:
        out.check_finished(meta)
        listed = listed_files(meta)
        if listed is None and out.state.is_dir():  # an older hsx's hsx.json: its manifests list the files
            listed = list(ledgers.manifest_records(out.state).values()) or None
    if listed is not None:
        entries = [e for e in listed if e["file"].startswith(f"{split}-")]
        what = "listed in its hsx.json"
    elif out.state.is_dir() and not complete:
        entries = [r for r in ledgers.manifest_records(out.state).values() if r["file"].startswith(f"{split}-")]
        summary = read_summary(out.state)
        total = len(summary.unit_names if summary else []) or "?"
        share = ledgers.finished_share(out.state, out.data)
        if share and not allow_incomplete:
            raise HsxError(f"{root} is one node's finished share of a job ({share[0]} of its {share[1]} units; the "
                           "other nodes' dirs hold the rest): join them with `hsx merge OUT NODE_DIR...` "
                           "(docs/scale-out.md), or load(..., allow_incomplete=True) to read this share")
        if not allow_incomplete:
            committed = ledgers.done_units(out.state, out.data)
            raise HsxError(f"{root} is not a finished hsx output ({len(committed)} of {total} units "
                           "committed: a job is running or was interrupted); run the same `hsx extract` command "
                           "to finish it, or load(..., allow_incomplete=True) to read the committed units")
        what = "committed"
    else:  # no list to check against
        entries = [{"file": n} for n in out.data_file_names() if n.startswith(f"{split}-")]
        what = None
    if not entries:
        have = sorted({n.split("-")[0] for n in out.data_file_names() if "-" in n})
        raise FileNotFoundError(f"{root}: no data/{split}-*.arrow files" +
                                (f" (splits here: {', '.join(have)})" if have else " (not an hsx output dir?)"))
    sources: dict = {}
    paths = {e["file"]: out.unit_source(e["file"], meta, sources) for e in entries
             if os.path.lexists(out.data / e["file"])}  # (a link that is not hsx merge's: HsxError)
    problems = {e["file"]: out.file_problem(e, verify) if what else None for e in entries}
    uploaded = [n for n, p in problems.items() if p == "uploaded"]
    consumed = [n for n, p in problems.items() if p == "consumed"]  # deleted by a trainer (hsx.follow)
    exported = [n for n, p in problems.items() if p == "exported"]  # deleted by an export (--delete-source)
    bad = {n: p for n, p in problems.items() if p and p not in ("uploaded", "consumed", "exported")}
    left = len(entries) - len(bad) - len(uploaded) - len(consumed) - len(exported)
    if exported and (not allow_incomplete or not left):
        raise HsxError(ledgers.used_up(out.root, entries)
                       + (f" (load(..., allow_incomplete=True) reads the {left} files left)"
                                               if left else "; no file of it is left here to load"))
    if bad and not allow_incomplete:
        name, why = next(iter(bad.items()))
        raise HsxError(f"{root} is damaged: {len(bad)} of the {len(entries)} files {what} are missing or differ "
                       f"(data/{name}: {why}); run the same `hsx extract` command with --check-crc to redo them "
                       "(it checks every unit's CRC-32), or load(..., allow_incomplete=True) to read the intact ones")
    if uploaded:
        repos = sorted({f"{u.get('repo')}" for u in ledgers.uploaded(out.state).values() if u.get("repo")})
        warnings.warn(f"{root}: {len(uploaded)} unit(s) were deleted after their upload to "
                      f"{', '.join(repos) or 'the Hub'}; this dir holds only part of the output: load the repo "
                      "instead", stacklevel=3)
    if consumed:
        warnings.warn(f"{root}: {len(consumed)} unit(s) were deleted once a trainer consumed them (hsx.follow "
                      "with delete_consumed); this dir holds only part of the output", stacklevel=3)
    if bad or exported or what == "committed":
        why = (["the job is not finished"] if what == "committed" else []) + (
            [f"{len(bad)} are missing or damaged"] if bad else []) + (
            [f"{len(exported)} were deleted by an export"] if exported else [])
        warnings.warn(f"{root}: reading {left} of the {len(entries)} files {what} ({'; '.join(why)})", stacklevel=3)
    files = [paths[n] for n, p in problems.items() if p is None]
    if not files:
        raise HsxError(f"{root}: no intact data/{split}-*.arrow file to read")
    return out, files, len(files) == len(entries) and what != "committed"


def info(path: str | os.PathLike) -> dict[str, Any]:
    """hsx.json of a local output dir as a dict, checked (HsxError, one line, when it is missing or damaged);
    `read_info` gives it as a typed record."""
    return read_info(path).to_dict()


def read_info(path: str | os.PathLike) -> Info:
    """hsx.json of a local output dir as an `hsx.schema.Info` (HsxError, one line, when missing or damaged)."""
    from hsx.files import read_json

    return read_json(Path(path) / "hsx.json", Info)


def hub_info(repo_id: str, revision: str | None = None) -> Info:
    """hsx.json of a Hub repo (one small download, cached by huggingface_hub). Its size is asked first: one bigger
    than hsx writes (hsx.schema.MAX_INFO_BYTES) is refused, not downloaded into the cache."""
    from huggingface_hub import HfApi, constants, hf_hub_download

    from hsx.config import HsxError
    from hsx.schema import MAX_INFO_BYTES
    from hsx.files import read_json

    if not constants.HF_HUB_OFFLINE:  # (offline: only a copy already in the cache is read, as read_json bounds it)
        listed = HfApi().get_paths_info(repo_id, ["hsx.json"], repo_type="dataset", revision=revision)
        size = next((getattr(f, "size", None) for f in listed), None)
        if isinstance(size, int) and size > MAX_INFO_BYTES:
            raise HsxError(f"{repo_id}: its hsx.json is {size:,} bytes, more than hsx writes ({MAX_INFO_BYTES:,} at "
                           "most); not downloaded")
    return read_json(Path(hf_hub_download(repo_id, "hsx.json", repo_type="dataset", revision=revision)), Info)


def _as_info(meta: Info | dict[str, Any] | None) -> Info | None:
    """`meta=` as given to torch_view / torch_stream: an Info, or hsx.json as a dict (checked)."""
    if meta is None or isinstance(meta, Info):
        return meta
    try:
        return Info.from_dict(meta)
    except Damaged as e:
        raise ValueError(f"meta= is not an hsx.json: {e}") from None


# ---- decoding rows ----------------------------------------------------------------------------------------------

@dataclass
class _Layout:
    """How one row's states are laid out, and which of the stored layers to hand out."""

    hidden: int
    num_layers: int  # stored in hidden_states
    dtype: str  # storage dtype
    positions: list[int] | None  # indices into the stored layers, or None for all
    dequantize: bool = True  # fp8: hand out bfloat16 x = q * scale (no *_scale columns); False: q and scales

    def row(self, t) -> dict[str, Any]:
        """One row (a one-row pyarrow Table sliced from the mapped file) as torch tensors: every stored column,
        states decoded (see torch_view)."""
        ids = _tensor(_values(t, "input_ids"))
        n = ids.shape[0]
        row: dict[str, Any] = {}
        for name in t.column_names:
            if name == "input_ids":
                row[name] = ids
            elif name == "hidden_states":
                row[name] = _select(self._states(t, name).view(n, self.num_layers, self.hidden), self.positions)
            elif name == "final_hidden_state":
                row[name] = self._states(t, name).view(n, -1)
            elif name == "hidden_states_scale":
                row[name] = _select(_tensor(_values(t, name, nested=True)).view(n, self.num_layers), self.positions)
            elif name == "final_hidden_state_scale":
                row[name] = _tensor(_values(t, name, nested=True)).view(n, 1)
            elif name == "topk_logits":  # bf16 bits as int16, like bf16 states, whatever the storage dtype
                row[name] = decode(_tensor(_values(t, name, nested=True)), "bfloat16").view(n, -1)
            elif name in ("topk_ids", "policy_ids", "policy_logprobs", "policy_tail"):  # (T, K); the tail (T, 1)
                row[name] = _tensor(_values(t, name, nested=True)).view(n, -1)
            elif isinstance(t.schema.field(name).type, pa_list_types()):
                row[name] = _tensor(_values(t, name))  # a per-token column (loss_mask, ...)
            else:
                row[name] = t.column(name)[0].as_py()  # sample_id, num_tokens, has_nonfinite, ...
        if self.dtype == "float8_e4m3" and self.dequantize:
            for name in ("hidden_states", "final_hidden_state"):
                if name in row:
                    row[name] = dequantize(row[name], row.pop(f"{name}_scale"))
        return row

    def _states(self, t, name: str):
        a = _values(t, name, nested=True)
        bits = DTYPES[self.dtype].bits
        if a.dtype != np.dtype(bits):
            raise TypeError(f"{name} holds {a.dtype} values, not the {bits} bits of "
                            f"{self.dtype} an hsx output stores (rows re-encoded by a Python-level map?)")
        return decode(_tensor(a), self.dtype)


def pa_list_types():
    import pyarrow as pa

    return (pa.ListType, pa.LargeListType, pa.FixedSizeListType)


def _layout(meta: Info | StoredLayout | dict | None, features, hidden_size: int | None,
            layers: list[int] | None, dequantize: bool = True) -> _Layout:
    """The row layout of a Dataset of an output: from `meta` (its hsx.json, or the StoredLayout hsx.load notes in
    the Dataset's info), `hidden_size`, or its features where they tell (the final-norm state's width is the
    hidden size; fp8's scales count the layers). Where none tells how the width of `hidden_states` splits into
    layers x hidden, ValueError: a guess would hand out states of the wrong shape."""
    meta = meta if isinstance(meta, StoredLayout) else _as_info(meta)
    width = _feature_length(features, "hidden_states")
    hidden = hidden_size or (meta.hidden_size if meta else None)
    if hidden is None:
        hidden = _feature_length(features, "final_hidden_state")
    if hidden is None and width is not None and _feature_length(features, "hidden_states_scale"):
        hidden = width // _feature_length(features, "hidden_states_scale")
    if width is None and meta:
        width = len(meta.layers) * meta.hidden_size
    how = "pass the output dir, meta=hsx.read_info(OUT) (its hsx.json) or hidden_size="
    if width is None:
        raise ValueError(f"cannot tell the row layout (no hidden_states feature): {how}")
    if hidden is None:
        raise ValueError(f"cannot tell how the {width} values a token of hidden_states split into layers x hidden "
                         f"(a Dataset without hsx.load's layout note, and no final_hidden_state): {how}")
    if meta and width != len(meta.layers) * meta.hidden_size:
        raise ValueError(f"hidden_states holds {width} values a token, not the {len(meta.layers)} layers x "
                         f"{meta.hidden_size} its hsx.json records: the Dataset is of another output")
    if not (type(hidden) is int and hidden >= 1 and width % hidden == 0):
        raise ValueError(f"hidden_size={hidden!r} does not divide the {width} values a token of hidden_states")
    positions = None
    if layers is not None:
        if not meta:
            raise ValueError("layers= selects by model layer index: pass the output dir, or meta=<its hsx.json as "
                             "a dict>")
        positions = layer_positions(meta.layers, list(layers), meta.num_model_layers)
    return _Layout(hidden=hidden, num_layers=width // hidden,
                   dtype=meta.storage_dtype if meta else storage_dtype_of(features),
                   positions=positions, dequantize=dequantize)


def _feature_length(features, name: str) -> int | None:
    """The per-token width of a state column's feature (List(List(Value, length=N))), None where there is none."""
    try:
        n = features[name].feature.length
    except (KeyError, TypeError, AttributeError):
        return None
    return n if type(n) is int and n >= 1 else None


def note_layout(ds, meta):
    """`ds` with the row layout of `meta` (an Info or Summary) noted in `ds.info.description` (StoredLayout), so `torch_view(ds)` and
    `torch_stream(ds)` give the rows `torch_view(OUT)` gives; the description is left as it is without `meta`."""
    if meta is not None:
        ds.info.description = StoredLayout.of(meta).note()
    return ds


def _noted_layout(source) -> StoredLayout | None:
    """The layout note hsx.load left in a Dataset's info (None without one); ValueError for a damaged one."""
    try:
        return StoredLayout.of_note(getattr(getattr(source, "info", None), "description", None))
    except Damaged as e:
        raise ValueError(f"the Dataset's info.description is not hsx.load's layout note ({e}): pass meta=") from None


def layer_positions(stored: list[int], wanted: list[int], num_model_layers: int | None = None) -> list[int]:
    """Where each wanted model layer (negatives count from the model's end) sits among the stored layers."""
    out = []
    for w in wanted:
        j = w + num_model_layers if (w < 0 and num_model_layers) else w
        if j not in stored:
            raise ValueError(f"layer {w} is not in this output; its layers are {stored}")
        out.append(stored.index(j))
    if not out:
        raise ValueError("layers= is empty")
    return out


def _select(x, positions: list[int] | None):
    """The chosen layers (dim 1): a strided view when they are evenly spaced and increasing, else a copy of just
    those layers."""
    if positions is None:
        return x
    step = positions[1] - positions[0] if len(positions) > 1 else 1
    if step > 0 and positions == list(range(positions[0], positions[0] + step * len(positions), step)):
        return x[:, positions[0]:positions[-1] + 1:step]
    import torch

    bits = bits_dtype(x.dtype)  # (index_select through the integer bits: bit-exact, any CPU)
    index = torch.tensor(positions)
    return x.view(bits).index_select(1, index).view(x.dtype) if bits is not None else x.index_select(1, index)


class torch_view:  # noqa: N801  (reads like a function: torch_view(OUT)[i])
    """Rows of an hsx output as torch tensors, every stored column: `sample_id`, `num_tokens` (ints),
    `input_ids`, `loss_mask` (T,), `hidden_states` (T, layers, hidden), `final_hidden_state` (T, hidden),
    `topk_logits` (T, K) bfloat16 and `topk_ids` (T, K) int32 with --topk-logits K, `policy_ids` (T, K) int32,
    `policy_logprobs` (T, K) float16 and `policy_tail` (T, 1) float32 with --teacher-policy K (hsx.policy: row t is the
    distribution of token t+1), `has_nonfinite` (bool) with --nonfinite keep. States keep their storage dtype as views
    of the mapped file, no copy (torch.bfloat16 for bf16 outputs); fp8 outputs are dequantized to bfloat16 (x = q *
    scale, a copy of the selected layers), or with `dequantize=False` come raw as torch.float8_e4m3fn with their
    `*_scale` columns. A map-style dataset: `len(view)`, `view[i]`; give it to a `torch.utils.data.DataLoader` with
    `collate_fn=hsx.collate`.

    `source`: an output dir, or a `datasets.Dataset` of one: from `load` (which notes the layout in its
    `info.description`), else with `meta` (its hsx.json) or `hidden_size` (ValueError where nothing tells how its
    states split into layers x hidden). `layers`: only these of the stored layers, by model layer index (needs the dir or `meta`)."""

    def __init__(self, source, hidden_size: int | None = None, layers: list[int] | None = None,
                 meta: dict[str, Any] | None = None, dequantize: bool = True):
        if isinstance(source, (str, Path)):
            meta = meta or read_info(source)
            source = load(str(source))
        if meta is None:
            meta = _noted_layout(source)
        self.layout = _layout(meta, source.features, hidden_size, layers, dequantize)
        self.ds = source.with_format("arrow")
        self.hidden = self.layout.hidden
        self.width = self.layout.num_layers * self.layout.hidden

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.layout.row(self.ds[int(i)])  # a one-row pyarrow Table sliced from the mapped file


def torch_stream(source, layers: list[int] | None = None, meta: dict[str, Any] | None = None,
                 hidden_size: int | None = None, dequantize: bool = True):
    """Rows of a streamed hsx output (`datasets.IterableDataset`) as torch tensors, like `torch_view`'s rows.

    A `torch.utils.data.IterableDataset` (hsx.torch_data.TorchStream, which pickles: fork or spawn workers): in a
    DataLoader with workers, datasets hands each worker its own files (so use at least as many files as workers). Every row is downloaded and parsed whole: `layers=` saves
    memory, not bandwidth."""
    from hsx.torch_data import TorchStream

    if meta is None:
        meta = _noted_layout(source)
    return TorchStream(source, _layout(meta, getattr(source, "features", None), hidden_size, layers, dequantize))


def table_rows(table, num_layers: int, hidden_size: int, storage_dtype: str, dequantize: bool = True):
    """Rows of a `pyarrow.Table` in an hsx output's layout (an engine batch: what `hsx.stream` hands out) as
    torch tensors, like `torch_view`'s rows: `num_layers` stored layers of `hidden_size` in `storage_dtype`. The
    tensors are views of the table's buffers."""
    layout = _Layout(hidden=hidden_size, num_layers=num_layers, dtype=storage_dtype, positions=None,
                     dequantize=dequantize)
    for i in range(table.num_rows):
        yield layout.row(table.slice(i, 1))


def _tensor(a: np.ndarray):
    """`torch.from_numpy` of a read-only view. The views are read-only on purpose (they are the mapped file);
    torch warns about that, so the warning is silenced here, and only here."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def _values(t, name: str, nested: bool = False) -> np.ndarray:
    """The row's values as a read-only numpy view of the Arrow buffer (zero copy)."""
    arr = t.column(name).chunk(0) if t.column(name).num_chunks == 1 else t.column(name).combine_chunks()
    inner = arr.flatten()
    if nested:
        inner = inner.flatten()
    return inner.to_numpy(zero_copy_only=True)


# ---- batching ---------------------------------------------------------------------------------------------------

BATCH_SCALARS = ("sample_id", "num_tokens", "has_nonfinite")


def collate(rows: list[dict[str, Any]], pad_token_id: int = 0, pad_to_multiple_of: int | None = None
            ) -> dict[str, Any]:
    """Right-pad `torch_view` / `torch_stream` rows into one batch (B = len(rows), N = the longest row, rounded up
    to `pad_to_multiple_of`):

    - `input_ids` (B, N) long, padded with `pad_token_id`; `attention_mask` (B, N) long, 1 on real tokens
    - `loss_mask` (B, N) long, as stored: 1 on each assistant token (including its end-of-turn token), UNSHIFTED:
      `loss_mask[t]` says whether token t is a target. A next-token loss on position t's output (which predicts
      token t+1) uses `loss_mask[:, 1:]` against `logits[:, :-1]`.
    - `labels` (B, N) long: `input_ids` where loss_mask is 1, else -100; unshifted, the convention of
      transformers' causal-LM loss (it shifts internally).
    - every other per-token column of the rows, (B, N, ...) in its dtype, zero on padding: `hidden_states`
      (B, N, layers, hidden) and `final_hidden_state` (B, N, hidden) bfloat16 (as the rows give them: fp8 ones
      dequantized, or raw with their `*_scale` columns), `topk_logits` / `topk_ids` / `policy_*` (B, N, K)
    - `sample_id` (B,) and `num_tokens` (B,) long; `has_nonfinite` (B,) bool where stored

    The states are copied into the batch (one copy, the padded tensor the model takes)."""
    import torch

    if not rows:
        raise ValueError("collate: no rows")
    lengths = [int(r["input_ids"].shape[0]) for r in rows]
    n = max(lengths)
    if pad_to_multiple_of:
        n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
    b = len(rows)
    batch: dict[str, Any] = {
        "input_ids": torch.full((b, n), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, n), dtype=torch.long),
        "loss_mask": torch.zeros((b, n), dtype=torch.long),
        "labels": torch.full((b, n), IGNORE_INDEX, dtype=torch.long),
        "sample_id": torch.tensor([int(r["sample_id"]) for r in rows], dtype=torch.long),
        "num_tokens": torch.tensor(lengths, dtype=torch.long),
    }
    keys = [k for k, v in rows[0].items() if k not in batch and k not in BATCH_SCALARS
            and isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == lengths[0]]
    for key in keys:
        batch[key] = _zeros((b, n, *rows[0][key].shape[1:]), rows[0][key].dtype)
    for j, (r, t) in enumerate(zip(rows, lengths)):
        batch["input_ids"][j, :t] = r["input_ids"]
        batch["attention_mask"][j, :t] = 1
        batch["loss_mask"][j, :t] = r["loss_mask"]
        for key in keys:
            _copy_into(batch[key][j, :t], r[key])
    batch["labels"] = torch.where(batch["loss_mask"].bool(), batch["input_ids"], batch["labels"])
    if "has_nonfinite" in rows[0]:
        batch["has_nonfinite"] = torch.tensor([bool(r["has_nonfinite"]) for r in rows])
    return batch


def _zeros(shape, dtype):
    import torch

    bits = bits_dtype(dtype)
    return torch.zeros(shape, dtype=bits).view(dtype) if bits is not None else torch.zeros(shape, dtype=dtype)


def _copy_into(dst, src) -> None:
    """Bit-exact copy (through the integer bits for bf16 / fp8, which CPU kernels may not copy natively)."""
    bits = bits_dtype(src.dtype)
    if bits is not None:
        dst.view(bits).copy_(src.view(bits))
    else:
        dst.copy_(src)
