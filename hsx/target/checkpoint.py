"""The untrusted model folder checked before transformers reads it: each file's size, config.json's layer count, the
safetensors headers against the config (names, shapes, dtypes, FP8 scales), and the loaded weights finite.

A model folder (local or a Hub snapshot) can be damaged or hostile: every file hsx or transformers parses is refused
past a size first, and every tensor the config describes is checked in the headers before a byte of weights is read,
so a bad folder ends in one HsxError naming the file or tensor, never a crash deep in a load.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hsx.config import HsxError
from hsx.files import DuplicateKey, unique_keys
from hsx.target import fp8

MAX_MODEL_LAYERS = 10_000  # the deepest released LMs have ~200; a config past this is damaged or hostile
# The JSON files hsx reads from a model folder, refused past these sizes before it or transformers parses them
# (parsed whole, 1 GB of JSON such as `[[],[],...]` is ~20 GB of Python objects). Real ones are far smaller:
MAX_CONFIG_BYTES = 16 << 20  # config.json: a few KB, a vision-language model's (text and vision configs) < 1 MB
MAX_CHECKPOINT_TENSORS = 1_000_000  # tensors one checkpoint lists: the largest released (1T-parameter MoEs with
# FP8 scales, thousands of shards) list ~10^5
INDEX_ENTRY_BYTES = 160  # a tensor's entry in model.safetensors.index.json: its name and its shard (~100 bytes)
MAX_INDEX_BYTES = MAX_CHECKPOINT_TENSORS * INDEX_ENTRY_BYTES + (1 << 20)  # 161 MB (with its metadata)
CHECKPOINT_INDEX = "model.safetensors.index.json"


def check_model_file(path: Path, limit: int) -> bool:
    """Whether a file of a model folder is there (False when it is not): HsxError in one line naming it when it
    is not a regular file or over `limit` bytes. Links are followed (a Hub snapshot's files are links to the
    cache's blobs)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise HsxError(f"{_shown(str(path))} is not a regular file; the model folder is damaged")
    if st.st_size > limit:
        raise HsxError(f"{_shown(str(path))} is {st.st_size:,} bytes, more than any {_shown(path.name)} is "
                       f"({limit:,} at most); the model folder is damaged or not a model's")
    return True


def _shown(name: str) -> str:
    """A file name as one printable line (a folder's or a Hub repo's names are read, not chosen)."""
    return name if name.isprintable() else ascii(name)


def read_model_json(path: Path, limit: int) -> bytes | None:
    """The bytes of a JSON file of a model folder (None when there is none), checked by `check_model_file`."""
    if not check_model_file(path, limit):
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > limit:  # (it grew since the stat)
        raise HsxError(f"{path} is more than {limit:,} bytes, more than any {path.name} is; the model folder is "
                       "damaged or not a model's")
    return data


def hub_config(repo: str, revision: str | None) -> Path | None:
    """A Hub id's config.json in the HF cache (fetched as transformers would), so it is checked before it is
    parsed; None where there is none (transformers' own reading then says why). Its size is asked first: one
    past MAX_CONFIG_BYTES is refused, not downloaded (offline, the cache's copy is bounded as it is read)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if not constants.HF_HUB_OFFLINE:
        _refuse_oversize_on_hub(repo, _hub_entries(
            lambda api: api.get_paths_info(repo, ["config.json"], revision=revision)))
    try:
        return Path(hf_hub_download(repo, "config.json", revision=revision))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError):
        return None


# The other files transformers reads from a model folder (or a tokenizer's) before any weight, bounded before it
# opens them: a hostile folder's 50 GB tokenizer.json is a memory blow-up inside transformers, not one line. Two
# kinds of bound, each far above real files. Vocabulary-sized files: a tokenizer.json is 2-35 MB (Gemma 3's 262k
# tokens: 33 MB), a sentencepiece tokenizer.model a few MB (Gemma 3's: 4.7 MB), vocab.json and merges.txt a few MB;
# tokenizer_config.json and added_tokens.json may list every added token (Gemma 3's: 1.2 MB).
MAX_TOKENIZER_BYTES = 512 << 20
# Config-sized, held to MAX_CONFIG_BYTES: generation_config.json is ~1 KB, special_tokens_map.json a few KB, a chat
# template (chat_template.jinja / .json, additional_chat_templates/*.jinja) < 100 KB.
CONFIG_SIZED = frozenset({"config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja",
                          "chat_template.json"})
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # more named templates, one *.jinja each (transformers reads all)
# Every other file a tokenizer or config reader can open as text is held to MAX_TOKENIZER_BYTES, whatever its name:
# which files a tokenizer reads is its class's (spiece.model, bpe.codes, source.spm, entity_vocab.json, emoji.json,
# vocab.bpe, ...) and its config's to name, so no list of names covers them, while their kinds are few
# (READABLE_SUFFIXES); resolve_model_path's download patterns, which match at any depth, are among them. Other files
# (weights, code, archives, data, images, a README) are neither downloaded by hsx nor opened before the weights:
# not bounded here, so a repo or folder holding a large one is not refused for it.
READABLE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".spm", ".codes", ".vocab", ".bpe")


def model_file_limit(path: str) -> int | None:
    """The bound of a file of a model folder or Hub repo (`path` in it, '/'-separated) before transformers reads
    or downloads it; None for files no tokenizer or config reader opens as text (READABLE_SUFFIXES)."""
    folder, _, name = path.rpartition("/")
    if not name.lower().endswith(READABLE_SUFFIXES):
        return None
    if (folder == CHAT_TEMPLATE_DIR and name.endswith(".jinja")) or (not folder and name in CONFIG_SIZED):
        return MAX_CONFIG_BYTES
    if not folder and name == CHECKPOINT_INDEX:
        return MAX_INDEX_BYTES
    return MAX_TOKENIZER_BYTES


def _hub_unreachable() -> tuple[type[BaseException], ...]:
    """What a Hub call raises when the Hub cannot say (then the download that follows says why, and what it brings
    is bounded as it is read): an HTTP error (an unknown, gated or private repo or revision), the HTTP client's
    connection errors and timeouts (huggingface_hub.errors imports that client's HTTPError, their base), OSError
    (offline mode, nothing cached, sockets), a source that is not a repo id. Anything else is a bug, not hidden."""
    from huggingface_hub import errors

    return errors.HfHubHTTPError, getattr(errors, "HTTPError", OSError), OSError, errors.HFValidationError


def check_model_files(source: str, revision: str | None = None, local_files_only: bool = False) -> None:
    """HsxError in one line when a file that transformers may read from `source` (a model or tokenizer folder, or
    a Hub id) is over its bound (`model_file_limit`) or not a regular file, before transformers opens it: a
    folder's files (its top level and CHAT_TEMPLATE_DIR, where transformers reads) are stat'ed; a Hub id's sizes,
    every file of the repo, are asked of the Hub before anything is downloaded, or, offline (HF_HUB_OFFLINE,
    `local_files_only`), its snapshot in the HF cache is stat'ed."""
    if Path(source).is_dir():
        _check_folder_files(Path(source))
        return
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE or local_files_only:
        try:
            folder = snapshot_download(source, revision=revision, local_files_only=True)
        except _hub_unreachable():  # nothing cached (or not a Hub id): transformers says what is missing
            return
        _check_folder_files(Path(folder))
        return
    _refuse_oversize_on_hub(source, _hub_entries(
        lambda api: api.list_repo_tree(source, recursive=True, revision=revision)))


def _check_folder_files(folder: Path) -> None:
    for sub in ("", CHAT_TEMPLATE_DIR):
        try:
            with os.scandir(folder / sub) as entries:
                names = [e.name for e in entries if not _is_folder(e)]  # (a folder is no file transformers reads)
        except OSError:
            continue  # (no such folder: nothing transformers would read there)
        for name in names:
            limit = model_file_limit(f"{sub}/{name}" if sub else name)
            if limit is not None:
                check_model_file(folder / sub / name, limit)


def _is_folder(entry: os.DirEntry) -> bool:
    """Whether an entry is a folder, links followed (as transformers' opening would); one that cannot be stat'ed
    (a link loop) is left to check_model_file, which says why, so it cannot hide the others."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _hub_entries(list_files) -> list:
    """What `list_files(HfApi())` lists (RepoFile-like: path, size); [] when the Hub cannot say (`_hub_unreachable`:
    the download that follows says why, and what it brings is bounded as it is read)."""
    from huggingface_hub import HfApi

    try:
        return list(list_files(HfApi()))
    except _hub_unreachable():
        return []


def _refuse_oversize_on_hub(repo: str, entries: list) -> None:
    for entry in entries:
        path = getattr(entry, "path", None)
        limit = model_file_limit(path) if isinstance(path, str) else None
        sizes = [getattr(entry, "size", None), getattr(getattr(entry, "lfs", None), "size", None)]
        size = max((s for s in sizes if type(s) is int), default=None)  # (an LFS file's: its object's)
        if limit is not None and size is not None and size > limit:
            raise HsxError(f"{repo}: its {_shown(path)} on the Hub is {size:,} bytes, more than any "
                           f"{_shown(path.rpartition('/')[2])} is ({limit:,} at most); not downloaded")


def check_layer_count(config_file: Path | None, name: str) -> None:
    """HsxError unless a config.json (a folder's, or a Hub id's in the HF cache) is at most MAX_CONFIG_BYTES and
    its num_hidden_layers (its own, and its text_config's) is an integer in [1, MAX_MODEL_LAYERS], checked before
    transformers reads it: its config
    classes build per-layer lists (layer_types) from that count, so 99,999,999,999 never returns."""
    if config_file is None or not config_file.parent.is_dir():
        return  # (none to read: transformers says what is missing)
    data = read_model_json(config_file, MAX_CONFIG_BYTES)
    if data is None:
        return
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        return  # (transformers' own reading says what is wrong, caught in read_model_config)
    for part in (config, config.get("text_config")) if isinstance(config, dict) else ():
        layers = part.get("num_hidden_layers") if isinstance(part, dict) else None
        if layers is not None and (type(layers) is not int or not 1 <= layers <= MAX_MODEL_LAYERS):
            raise HsxError(f"the config of model {name!r} says num_hidden_layers = {layers!r}; hsx takes models "
                           f"of 1 to {MAX_MODEL_LAYERS:,} decoder layers")


def checkpoint_keys(path: str) -> list[str]:
    """The tensor names of a local safetensors checkpoint (from the index, else the files' headers)."""
    folder = Path(path)
    if (folder / CHECKPOINT_INDEX).exists():
        return list(index_weight_map(folder))
    from safetensors import SafetensorError, safe_open

    keys: list[str] = []
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                keys.extend(st.keys())
        except (OSError, ValueError, RuntimeError, SafetensorError):  # (transformers says what is wrong)
            continue
    return keys


def index_weight_map(folder: Path) -> dict[str, Any]:
    """The checkpoint index's weight_map (tensor name -> shard file), {} without an index or a readable one (the
    files' own headers, or transformers, say what is there); HsxError when it is over MAX_INDEX_BYTES."""
    data = read_model_json(folder / CHECKPOINT_INDEX, MAX_INDEX_BYTES)
    try:
        weight_map = json.loads(data).get("weight_map") if data is not None else None
    except (ValueError, RecursionError, AttributeError):
        return {}
    return weight_map if isinstance(weight_map, dict) else {}


SINGLE_CHECKPOINT = "model.safetensors"  # what transformers loads, where it is there, before any index
# A safetensors file's JSON header, parsed here (in Python: ~10 objects per 100 bytes of a real one) before
# transformers reads the file. Real ones take ~100 bytes per tensor: a shard's a few MB, 16 MB is ~130,000 tensors
# in one file (safetensors' own bound, 100 MB, would be a 1-2 GB parse). And at most one bracket, brace or comma per
# 4 bytes (a real entry has 7-10 in 50-150 bytes; `[],[],...` has 2 per 3): a hostile header makes no more objects
MAX_HEADER_BYTES = 16 << 20
HEADER_BYTES_PER_TOKEN = 4
# bytes per element of the safetensors dtypes (others, sub-byte ones, are not sized here)
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2, "F16": 2,
              "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}
SCALE_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "U8": torch.uint8, "F8_E8M0": torch.float8_e8m0fnu}
DAMAGED = "the model folder is damaged, or its config.json does not describe its weights"


class StoredTensor(NamedTuple):
    """One tensor of a checkpoint, as its file's safetensors header describes it."""
    file: Path
    dtype: str  # safetensors' name: F8_E4M3, F32, BF16, ...
    shape: tuple[int, ...]
    start: int  # its bytes are [start, end) of the file
    end: int


def checkpoint_files(folder: Path) -> tuple[list[str], dict[str, Any]] | None:
    """The safetensors files transformers loads from a folder, with the index's weight_map ({} for one file):
    model.safetensors where there is one, else the shards the index names; None when there is neither file or no
    readable index (transformers says what is missing). HsxError in one line when a shard the index names is not
    in the folder (or not a file, or a path leading out of it)."""
    if check_model_file(folder / SINGLE_CHECKPOINT, 1 << 62):
        return [SINGLE_CHECKPOINT], {}
    weight_map = index_weight_map(folder)
    first: dict[str, str] = {}  # shard → the first tensor the index puts in it (named when the shard is not there)
    for key, shard in weight_map.items():
        if not isinstance(shard, str):  # (transformers sorts the names: a number among them is its TypeError)
            raise HsxError(f"{CHECKPOINT_INDEX} puts {_shown(key)} in {_shown(repr(shard)[:60])}, which is no file "
                           f"name; {DAMAGED}")
        first.setdefault(shard, _shown(key))
    for shard, listed in first.items():
        parts = Path(shard).parts
        if not parts or Path(shard).is_absolute() or ".." in parts:
            raise HsxError(f"{CHECKPOINT_INDEX} puts {listed} in {_shown(shard)}, outside the model folder; {DAMAGED}")
        if not check_model_file(folder / shard, 1 << 62):
            raise HsxError(f"{CHECKPOINT_INDEX} puts {listed} in {_shown(shard)}, which is not in the model folder; "
                           f"{DAMAGED}")
    return (sorted(first), weight_map) if first else None


def stored_tensors(folder: Path, files: tuple[list[str], dict[str, Any]] | None = None
                   ) -> dict[str, StoredTensor] | None:
    """Every tensor transformers loads from a folder (every tensor of each of its `checkpoint_files`), from the
    files' headers alone; None where `checkpoint_files` is. HsxError in one line naming the file and tensor when a
    header is malformed or sizes a tensor past its file, a tensor is in two shards, or the index puts a tensor in
    a shard that does not hold it."""
    names, weight_map = files or checkpoint_files(folder) or (None, None)
    if names is None:
        return None
    tensors: dict[str, StoredTensor] = {}
    paths = {shard: folder / shard for shard in names}  # (one Path per file: its tensors' `file`, compared by id)
    for shard in names:
        header = _safetensors_header(paths[shard], shard)
        for key in header.keys() & tensors.keys():
            raise HsxError(f"{_shown(key)} is in both {_shown(tensors[key].file.name)} and {_shown(shard)}; "
                           f"{DAMAGED}")
        tensors.update(header)
    for key, shard in weight_map.items():
        if isinstance(shard, str) and (key not in tensors or tensors[key].file is not paths[shard]):
            raise HsxError(f"{CHECKPOINT_INDEX} puts {_shown(key)} in {_shown(shard)}, which does not hold it; "
                           f"{DAMAGED}")
    return tensors


def _safetensors_header(path: Path, shown: str) -> dict[str, StoredTensor]:
    """The tensors a safetensors file's header describes, each named once, checked to lie within the file and to
    take the bytes its dtype and shape take, the tensors tiling the file's data as safetensors requires."""
    def damaged(why: str) -> HsxError:
        return HsxError(f"{_shown(shown)}: {why}; {DAMAGED}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise damaged(f"its safetensors header length ({n:,} bytes) does not fit its {size:,} bytes")
            raw = f.read(n)
            if (raw.count(b"[") + raw.count(b"{") + raw.count(b",")) * HEADER_BYTES_PER_TOKEN > n:
                raise damaged("its safetensors header is not a list of tensors (too many brackets and commas)")
            header = json.loads(raw, object_pairs_hook=unique_keys)
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    except DuplicateKey as e:
        raise damaged(f"its safetensors header names {_shown(e.key)} twice") from None
    except (ValueError, RecursionError):
        raise damaged("its safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise damaged("its safetensors header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(type(v) is str for v in meta.values())):
        raise damaged("its safetensors header's __metadata__ is not a map of strings (safetensors refuses it)")
    base, room, tensors = 8 + n, size - 8 - n, {}
    for key, entry in header.items():  # (a checkpoint lists up to ~10^5: kept to plain comparisons)
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (type(dtype) is str and type(shape) is list and type(start) is int and type(end) is int
                  and 0 <= start <= end <= room)
            elements = 1
            for d in shape:
                ok = ok and type(d) is int and d >= 0
                elements *= d
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise damaged(f"the header's entry for {_shown(key)} is not a dtype, shape and offsets within the file")
        item = ITEM_BYTES.get(dtype)
        if item is not None and end - start != elements * item:
            raise damaged(f"{_shown(key)} takes {end - start:,} bytes, not the {elements * item:,} its {dtype} "
                          f"{shape} take")
        tensors[key] = StoredTensor(path, dtype, tuple(shape), base + start, base + end)
    # safetensors itself refuses a file whose tensors do not tile its data (a gap, two sharing bytes, bytes left
    # over): refused here too, in one line, rather than as its exception from transformers' loader
    at = base
    for key, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != at:
            raise damaged(f"{_shown(key)}'s bytes start at {t.start - base:,}, not at {at - base:,} where the "
                          "tensor before it ends (tensors overlap or leave a gap)")
        at = t.end
    if at != size:
        raise damaged(f"its tensors end at byte {at - base:,} of its {room:,} bytes of data")
    return tensors


# Checkpoints that passed `check_checkpoint` (their files' sizes and times, and the quantization): a job checks
# the model when it reads its facts and again when it loads it
_CHECKED: set[tuple] = set()


def check_checkpoint(path: str, name: str, text_config) -> None:
    """HsxError in one line naming the tensor when a checkpoint's stored tensors are not what its config's
    quantization declares (`fp8.stored_problems`, from the safetensors headers) or a block scale is zero, negative,
    NaN or inf (`fp8.scale_problem`, over the scales read straight from the files: 1/16,384 of the weights'
    elements). A checkpoint of another quantization method is transformers' to load (`fp8.quantization_of` refuses
    one it does not know)."""
    folder = Path(path)
    try:
        quant = fp8.quantization_of(text_config)
        if quant is None and getattr(text_config, "quantization_config", None) is not None:
            return
        files = checkpoint_files(folder) if folder.is_dir() else None
        if files is None:
            return
        stats = [(folder / f).stat() for f in files[0]]
        key = (str(folder), repr(quant), tuple((f, st.st_size, st.st_mtime_ns) for f, st in zip(files[0], stats)))
        if key in _CHECKED:
            return
        tensors = stored_tensors(folder, files)
        problems = fp8.stored_problems(tensors, quant)
        if problems:
            more = f" (and {len(problems) - 1:,} more like it)" if len(problems) > 1 else ""
            raise HsxError(f"{_shown(problems[0])}{more}; {DAMAGED}")
        if quant is not None:
            _check_scale_values(tensors)
    except OSError as e:
        raise HsxError(f"model {name!r}: cannot read {e.filename or 'its files'}: {e.strerror or e}") from None
    except HsxError as e:
        raise HsxError(f"model {name!r}: {e}") from None
    _CHECKED.add(key)


def _check_scale_values(tensors: dict[str, StoredTensor]) -> None:
    """HsxError naming the first scale tensor (in file order) that holds a value `fp8.scale_problem` refuses: the
    scales of each file and dtype read into one buffer (one pread each) and checked in one reduction, the tensor
    looked for only where that finds one."""
    groups: dict[tuple[Path, str], list[str]] = {}
    for k in sorted((k for k in tensors if k.endswith(fp8.SCALE_SUFFIX)),
                    key=lambda k: (tensors[k].file, tensors[k].start)):
        groups.setdefault((tensors[k].file, tensors[k].dtype), []).append(k)
    for (file, dtype), keys in groups.items():
        fd = os.open(file, os.O_RDONLY)
        try:
            chunks = [os.pread(fd, tensors[k].end - tensors[k].start, tensors[k].start) for k in keys]
        finally:
            os.close(fd)
        for k, chunk in zip(keys, chunks):
            if len(chunk) != tensors[k].end - tensors[k].start:
                raise HsxError(f"{_shown(file.name)} ends inside {_shown(k)} (it was cut short); {DAMAGED}")
        data = b"".join(chunks)
        values = torch.frombuffer(bytearray(data), dtype=SCALE_TORCH[dtype]) if data else torch.empty(0)
        if fp8.scale_problem("", values) is None:
            continue
        at = 0
        for k, chunk in zip(keys, chunks):
            n = len(chunk) // values.element_size()
            why = fp8.scale_problem(_shown(k), values[at:at + n].view(tensors[k].shape))
            if why:
                raise HsxError(f"{why}; the model folder is damaged")
            at += n


def text_weights_prefix(keys: list[str]) -> str | None:
    """The prefix of the decoder's weights in a checkpoint: the one that holds both `embed_tokens.weight` and
    `layers.*` ("model." for a CausalLM, "model.language_model." or "language_model.model." for vision-language
    checkpoints). None when there is no such single prefix (other naming): transformers decides alone."""
    emb = "embed_tokens.weight"
    candidates = {k[: -len(emb)] for k in keys if k.endswith(emb) and (k == emb or k[: -len(emb)].endswith("."))}
    candidates = {p for p in candidates if any(k.startswith(p + "layers.") for k in keys)}
    return candidates.pop() if len(candidates) == 1 else None


def check_loaded_weights(base: torch.nn.Module, info: dict, model: str) -> None:
    """Refuse a model whose parameters were not all read from the checkpoint: transformers fills missing ones with
    random values and only logs it (a warning we silence), which would make every hidden state silently wrong."""
    params = dict(base.named_parameters())
    missing = sorted(k for k in info.get("missing_keys", ()) if k in params)
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ()))
    if missing or mismatched:
        what = missing or mismatched
        raise HsxError(f"model {model!r}: {len(what)} weight(s) of the decoder were not found in the checkpoint "
                       f"({'missing' if missing else 'shape mismatch'}: {', '.join(what[:3])}"
                       f"{', ...' if len(what) > 3 else ''}); refusing to extract from randomly initialized weights")


def check_used_scales(base: torch.nn.Module, info: dict, model: str, prefix: str | None) -> None:
    """Refuse an FP8 checkpoint's weight whose block scales transformers read but left unused (`prefix`: the
    checkpoint's prefix of the decoder's weights, as its unexpected keys are named): the weight holds the stored
    e4m3 values unscaled (`check_checkpoint` has made sure the weights beside scales are e4m3)."""
    params = dict(base.named_parameters())
    for scale in sorted(str(k) for k in info.get("unexpected_keys", ()) if str(k).endswith(fp8.SCALE_SUFFIX)):
        weight = scale[:-len(fp8.SCALE_SUFFIX)]
        if prefix and weight.startswith(prefix):
            weight = weight[len(prefix):]
        if weight in params:
            raise HsxError(f"model {model!r}: transformers loaded {_shown(weight)} without its block scales "
                           f"{_shown(scale)}, left unused (a module it does not quantize, or fused FP8 experts it "
                           "dequantizes on a device without FP8); refusing to extract from unscaled FP8 weights")


NAN_BYTES = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}  # (mask, value) of NaN/inf bytes


def check_finite_weights(base: torch.nn.Module, model: str) -> None:
    """HsxError naming the first parameter that holds a NaN or inf (a damaged weight, or one dequantized with a
    damaged scale), as loaded: otherwise every state it reaches is NaN and the job would stop on the first row as if
    the data were at fault. One reduction per tensor on its device (a float32 sum, NaN/inf bytes of e4m3 / e5m2
    counted in chunks), one host sync per device."""
    found: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, p in base.named_parameters():
        if p.is_floating_point() and p.numel() and (p.dtype in NAN_BYTES or p.element_size() > 1):
            found.setdefault(p.device, []).append((name, p))
    for params in found.values():
        with torch.no_grad():
            flags = torch.stack([_nonfinite(p) for _, p in params])
        if bool(flags.any()):
            raise HsxError(f"model {model!r}: its weight {_shown(params[int(flags.nonzero()[0])][0])} holds NaN or "
                           "inf values; the model folder is damaged")


def _nonfinite(p: torch.Tensor) -> torch.Tensor:
    if p.dtype in NAN_BYTES:
        mask, value = NAN_BYTES[p.dtype]
        flat = p.detach().reshape(-1).view(torch.uint8)
        return torch.stack([((c & mask) == value).any() for c in flat.split(1 << 26)]).any()
    return ~torch.isfinite(p.detach().sum(dtype=torch.float32))
