"""The job's input rows, read once: a Hub dataset (any configuration and split `datasets` reads) or a local file or
folder (jsonl, json, parquet, arrow, csv; a folder's splits as `datasets` names them), checked before `datasets`
parses it (JSON nested deeper than pyarrow's reader survives is refused, naming the line), with one line for each
way it cannot be read; and what identifies it in the job's fingerprint (`input_fingerprint`: a local input by its
files' content, a Hub one by datasets' fingerprint). What rows may hold: docs/inputs.md; hsx.data tokenizes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hsx.config import ExtractConfig, HsxError
from hsx.errors import file_system_error, file_system_line

LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def load_input(cfg: ExtractConfig):
    """The input split as a `datasets.Dataset`: a Hub id, a local file, a folder of files, or a saved dataset."""
    import datasets

    path = Path(cfg.dataset)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own "Failed to load JSON" line doubles ours
    try:
        if path.is_dir() and (path / "state.json").exists():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[cfg.split]
        elif path.exists():
            if cfg.dataset_config is not None and not path.is_dir():
                raise HsxError(f"--dataset-config {cfg.dataset_config!r}: {path} is a file; a configuration is one "
                               "of a Hub dataset, or of a local folder whose README.md lists `configs`")
            splits = local_splits(path)
            files = [f for fs in splits.values() for f in fs]
            builder = LOCAL_BUILDERS[files[0].suffix]
            if builder == "json":
                for f in files:
                    check_json_nesting(f)
            empty = _empty_files(files, builder)
            if cfg.dataset_config is not None:  # the files its README.md's `configs` give that name, as on the Hub
                ds = datasets.load_dataset(str(path), cfg.dataset_config, split=cfg.split)
            elif empty is not None:  # (datasets' readers raise StopIteration or ArrowInvalid on 0 rows)
                ds = empty
            else:
                ds = datasets.load_dataset(builder, data_files={k: [str(f) for f in fs] for k, fs in splits.items()},
                                           split=cfg.split)
        else:
            ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split)
    except HsxError:
        raise
    except Exception as e:  # datasets wraps parse errors; the innermost message names the problem
        fault = file_system_error(e)
        if fault is not None:  # (mostly datasets writing its cache of the input: named, not the input blamed)
            raise HsxError(file_system_line(fault, f"datasets' cache ({datasets.config.HF_DATASETS_CACHE})",
                                            f"the dataset {cfg.dataset} was not read")) from None
        raise HsxError(f"cannot read dataset {cfg.dataset}: {_not_found(cfg, e) or _innermost(e)}"
                       f"{_json_line(path, e)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if len(ds) == 0 and not cfg.allow_empty:
        raise HsxError(f"dataset {cfg.dataset} (split {cfg.split}) has no rows; pass --allow-empty if an empty "
                       "output is expected")
    if cfg.limit is not None:
        ds = ds.select(range(min(cfg.limit, len(ds))))
    return ds


def _empty_files(files: list[Path], builder: str):
    """An empty `datasets.Dataset` when no file holds a row (JSON of only whitespace: 0 `text` rows, having no
    columns to tell its format by; Parquet of 0 rows: its columns kept), else None. Other files are left to
    datasets."""
    import datasets

    if builder == "json":
        if any(_has_text(f) for f in files):
            return None
        return datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")}))
    if builder == "parquet":
        import pyarrow.parquet as pq

        metas = [pq.ParquetFile(f) for f in files]
        if any(m.metadata.num_rows for m in metas):
            return None
        return datasets.Dataset(metas[0].schema_arrow.empty_table())
    return None


JSON_DEPTH_CHECKED = 512  # lines whose brackets may nest deeper are parsed by Python's json first (see below)
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1
SCAN_CHUNK = 4 << 20  # (numpy temporaries: ~30 bytes per byte scanned)


def check_json_nesting(path: Path) -> None:
    """HsxError naming the line, for a JSON (Lines) file nested too deeply to parse: pyarrow's JSON reader, which
    datasets uses, recurses per level and crashes the process (a segmentation fault, measured at 20,000 levels
    on an 8 MiB stack) instead of raising. Bracket depth is counted with numpy, brackets inside strings counted
    too (an over-count): a chunk whose running depth varies by at most JSON_DEPTH_CHECKED holds no deeper line
    (each line starts and ends at its own level). Only the lines of other chunks are measured one by one, and
    only a line past JSON_DEPTH_CHECKED is parsed by Python's json, which raises RecursionError past its
    recursion limit (1,000 levels by default) instead of crashing. Cost: one read of the file (docs/benchmarks.md,
    "Figures moved from the code")."""
    carry = 0  # the depth of the line that runs into the next chunk, relative to its start
    line_start = 0  # byte offset where that line starts
    flagged: set[int] = set()  # offsets of lines that may nest too deeply
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(SCAN_CHUNK):
            b = np.frombuffer(chunk, dtype=np.uint8)
            depth = np.cumsum(_BRACKET_STEP[b], dtype=np.int32)  # (a chunk's depth fits: 4 MiB < 2**31)
            last_nl = chunk.rfind(b"\n")
            if int(depth.max(initial=0)) - int(depth.min(initial=0)) + abs(carry) > JSON_DEPTH_CHECKED:
                newlines = np.flatnonzero(b == 10)
                starts = np.concatenate(([0], newlines + 1))
                ends = np.concatenate((newlines + 1, [len(b)]))
                for k, (a, z) in enumerate(zip(starts, ends)):
                    if a == z:
                        continue
                    before = int(depth[a - 1]) if a else 0
                    peak = int(depth[a:z].max()) - before + (carry if k == 0 else 0)
                    if peak > JSON_DEPTH_CHECKED:
                        flagged.add(line_start if k == 0 else offset + int(a))
            if last_nl >= 0:
                line_start = offset + last_nl + 1
                carry = int(depth[-1]) - int(depth[last_nl])
            else:
                carry += int(depth[-1])
            offset += len(b)
    for start in sorted(flagged):
        with open(path, "rb") as f:
            f.seek(start)
            line = f.readline()
        try:
            json.loads(line)
        except RecursionError:
            raise HsxError(f"dataset {path}: line {_line_number(path, start)} nests JSON too deeply to be read "
                           f"(over {JSON_DEPTH_CHECKED} levels of [ and {{); fix or remove that line") from None
        except ValueError:
            pass  # not JSON: datasets' reader says so, in one line


def _line_number(path: Path, offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def _has_text(path: Path) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return True
    return False


def _not_found(cfg: ExtractConfig, e: BaseException) -> str:
    """For a dataset that is neither a local path nor found on the Hub (or, offline, in datasets' cache): what was
    looked for, and where (datasets' own message says 'not cached in None')."""
    import datasets

    inner = e
    while inner.__cause__ is not None or inner.__context__ is not None:
        inner = inner.__cause__ or inner.__context__
    cache = str(datasets.config.HF_DATASETS_CACHE)
    where = str(getattr(inner, "filename", None) or "")
    if isinstance(inner, OSError) and where and (cache.startswith(where) or where.startswith(cache)):
        # datasets' cache (HF_HOME, HF_DATASETS_CACHE) is not a folder it can write: not the dataset's fault
        return (f"datasets' cache {cache} cannot be used ({type(inner).__name__}: {inner.strerror or inner}); "
                "set HF_DATASETS_CACHE (or HF_HOME) to a folder you can write")
    if not isinstance(inner, FileNotFoundError) and type(inner).__name__ not in ("DatasetNotFoundError",
                                                                                 "DataFilesNotFoundError"):
        return ""
    here = f"no file or folder {Path(cfg.dataset).absolute()}"
    if datasets.config.HF_HUB_OFFLINE:
        return (f"{here}, and no Hub dataset {cfg.dataset!r} in datasets' cache {datasets.config.HF_DATASETS_CACHE} "
                "(offline: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)")
    return f"{here}, and {_innermost(e)}"


def _json_line(path: Path, e: BaseException) -> str:
    """For a JSON Lines file that does not parse, the first line that is not valid JSON (the parser only says
    'Trailing data at position N', which helps nobody find it)."""
    if not (path.is_file() and path.suffix == ".jsonl"):
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line)
                    except (ValueError, RecursionError) as bad:
                        return f" (line {number}: {getattr(bad, 'msg', None) or str(bad)[:100]})"
    except OSError:
        pass
    return ""


def local_splits(path: Path) -> dict[str, list[Path]]:
    """The files of each split of a local file or folder, as `load_dataset(DIR)` infers them: `train/` and
    `test/` folders, the Hub layout `data/train-*.jsonl` + `data/test-*.jsonl`, split names in file names
    (`dev.jsonl`, ...); files that name no split are all `train`. One file is the `train` split."""
    if path.is_file():
        if path.suffix not in LOCAL_BUILDERS:
            raise HsxError(f"{path}: unsupported file type {path.suffix!r}; use {', '.join(LOCAL_BUILDERS)}")
        return {"train": [path]}
    import os

    from datasets.data_files import DataFilesDict, get_data_patterns

    root = path.resolve()  # (datasets gives resolved paths)
    try:
        found = DataFilesDict.from_patterns(get_data_patterns(str(root)), base_path=str(root))
    except Exception:  # noqa: BLE001  (datasets raises EmptyDatasetError for a folder with no data files)
        found = {}
    splits = {str(k): sorted(Path(f) for f in v if Path(f).suffix in LOCAL_BUILDERS and not any(
        part.startswith(".") for part in Path(os.path.relpath(f, root)).parts)) for k, v in found.items()}
    splits = {k: v for k, v in splits.items() if v}
    if not splits:
        raise HsxError(f"{path}: no {', '.join(LOCAL_BUILDERS)} files in this folder")
    kinds = {LOCAL_BUILDERS[f.suffix] for fs in splits.values() for f in fs}
    if len(kinds) > 1:
        raise HsxError(f"{path}: mixed file types ({', '.join(sorted(kinds))}); keep one type per folder")
    return splits


def _innermost(e: BaseException) -> str:
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {first}"


def input_fingerprint(cfg: ExtractConfig, ds) -> dict[str, Any]:
    """What identifies the input data: a local file or folder by its files' names, sizes and sha256 (content,
    not how its path is spelled: hsx.fingerprint) and the configuration read; a Hub dataset by its name and
    datasets' fingerprint (which differs by configuration)."""
    from hsx.fingerprint import files_identity

    path = Path(cfg.dataset)
    if path.exists():  # (datasets' fingerprint of a local file includes temp paths)
        files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
        config = {"config": cfg.dataset_config} if cfg.dataset_config is not None else {}  # (none: as before)
        return {"split": cfg.split, **config, **files_identity(path, files)}
    return {"dataset": cfg.dataset, "split": cfg.split, "fingerprint": ds._fingerprint}
