"""The output format, in one place: storage dtypes, the columns of a row, their Arrow/datasets types, bytes per
token, encode (GPU states -> stored bytes) and decode (stored bits -> torch), and the JSON records of an output
dir (hsx.json, .hsx/summary.json, .hsx/job.json, manifest and upload ledger lines) as typed, checked records.

A row is `sample_id` int64, `input_ids` int32 and `loss_mask` int8 per token, `num_tokens` int32, then the state
columns, each a list (one entry per token) of fixed-size lists, and a per-row flag:

    hidden_states          L x hidden values   of the storage dtype (the stored layers side by side)
    final_hidden_state     hidden values       with final_hidden (the final norm's output)
    hidden_states_scale    L float32           fp8 only: one scale per token and layer (absmax / 448)
    final_hidden_state_scale  1 float32        fp8 with final_hidden
    topk_logits            K bfloat16 bits     with --topk-logits K (int16 bits, whatever the storage dtype)
    topk_ids               K int32
    policy_ids             K int32             with --teacher-policy K (hsx.policy: the serving distribution)
    policy_logprobs        K float16           its renormalised log-probs, most likely first, -inf: left out
    policy_tail            1 float32           the mass it leaves out (1 - kept mass under the full distribution)
    has_nonfinite          bool per row        with --nonfinite keep

Arrow has no bfloat16 or float8: their bits are stored as int16 / uint8, marked by the datasets feature id
("bfloat16", "float8_e4m3fn"). Bytes per token are exactly what the Arrow value buffers hold (tiny shape, layers
1 3 + final, bf16: 2 x 64 x 2 + 64 x 2 = 384 state bytes; top-k 8 adds 8 x (2 + 4) = 48; input_ids and
loss_mask add 5, and each row 12 + 4 per list column). `hsx plan`'s bytes_per_token is the state columns' (384,
or 432 with top-k 8), token_bytes the 5, bytes_per_row the rest.

Imports nothing heavy at module level (hsx.config and the CLI import it): pyarrow, datasets and torch are
imported by the functions that need them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

# ---- storage dtypes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dtype:
    """How values of one type are stored: `bits` is the Arrow and numpy type holding them (bfloat16 and float8
    have none of their own), `torch` the torch dtype those bits are a view of."""
    name: str
    itemsize: int  # bytes per value
    bits: str  # Arrow / numpy type of the stored values
    torch: str  # torch dtype name the bits reinterpret as
    feature_id: str | None = None  # datasets `Value(bits, id=...)` marking reinterpreted bits


DTYPES: dict[str, Dtype] = {d.name: d for d in (
    Dtype("bfloat16", 2, "int16", "bfloat16", "bfloat16"),
    Dtype("float16", 2, "float16", "float16"),
    Dtype("float32", 4, "float32", "float32"),
    Dtype("float8_e4m3", 1, "uint8", "float8_e4m3fn", "float8_e4m3fn"),
    Dtype("int64", 8, "int64", "int64"),
    Dtype("int32", 4, "int32", "int32"),
    Dtype("int8", 1, "int8", "int8"),
)}
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3")  # --storage-dtype
DEFAULT_STORAGE_DTYPE = "bfloat16"  # --storage-dtype's default, and what an hsx.json that names none was written in
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")  # --dtype (what the model computes in)
SCALED_DTYPE = "float8_e4m3"  # stored with a float32 scale per token and layer
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ---- columns ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    """One stored column of per-token values: its name, width (values per token) and storage type."""
    name: str
    width: int
    dtype: str  # a key of DTYPES

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        """Bytes per token."""
        return self.width * self.itemsize

    @property
    def arrow_type(self):
        import pyarrow as pa

        return pa.from_numpy_dtype(DTYPES[self.dtype].bits)

    def value(self):
        from datasets import Value

        d = DTYPES[self.dtype]
        return Value(d.bits, id=d.feature_id) if d.feature_id else Value(d.bits)


# The columns every output row carries from the tokenized input, before the states (in this order); data.py's
# tokenized rows start with them, the engine passes them through, export copies them.
ROW_COLUMNS = ("sample_id", "input_ids", "loss_mask", "num_tokens")
TOKEN_COLUMNS = (Column("input_ids", 1, "int32"), Column("loss_mask", 1, "int8"))  # List(Value), not nested
ROW_SCALARS = (Column("sample_id", 1, "int64"), Column("num_tokens", 1, "int32"))
OFFSET_BYTES = 4  # Arrow list offsets (int32) per row and list column



def human_bytes(n: float) -> str:
    """A size as every message and card shows it: decimal units, one decimal place (bytes as a whole number)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@dataclass(frozen=True)
class OutputFormat:
    """What one output stores: `num_layers` layers of `hidden` values, the final-norm state, the storage dtype,
    top-k logits, the has_nonfinite flag. Everything about the columns follows from it."""
    num_layers: int
    hidden: int
    final_hidden: bool = False
    storage_dtype: str = DEFAULT_STORAGE_DTYPE
    topk: int = 0
    flag_nonfinite: bool = False
    policy: int = 0  # --teacher-policy K

    @classmethod
    def of_job(cls, cfg, layers: list[int], hidden: int, final_hidden: bool) -> "OutputFormat":
        """The format a job's config (its storage dtype, top-k logits, `nonfinite`) gives `layers` (and the
        final-norm state) of a model `hidden` wide: where a job's format is made (hsx.target.model.Target's, the checks
        of hsx.config.target_layers)."""
        return cls(len(layers), int(hidden), final_hidden, cfg.storage_dtype, cfg.topk_logits,
                   cfg.nonfinite == "keep", cfg.teacher_policy)

    @classmethod
    def of(cls, info: "Info | Summary") -> "OutputFormat":
        """The format an hsx.json (or summary) describes."""
        return cls(len(info.layers), info.hidden_size, info.final_hidden, info.storage_dtype,
                   info.config.topk_logits, info.config.nonfinite == "keep", info.config.teacher_policy)

    def problem(self) -> str | None:
        """Why this format cannot be written (None: it can)."""
        if not self.num_layers and not self.policy:
            return "--layers is required (only a --teacher-policy job stores no layers)"
        if not self.num_layers and self.storage_dtype == SCALED_DTYPE:
            return "a policy-only job stores no hidden states to keep in float8_e4m3: drop --storage-dtype"
        if self.storage_dtype not in STORAGE_DTYPES:
            return f"--storage-dtype must be one of {', '.join(STORAGE_DTYPES)}, not {self.storage_dtype!r}"
        if self.topk and not self.final_hidden:
            return "--topk-logits comes from the final-norm state: add --final-hidden (or use the eagle3 preset)"
        return None

    def state_columns(self) -> list[Column]:
        """The state columns, in the order `encode` lays them out (and the map function writes them): fp8 adds
        one float32 scale per token and layer; top-k target logits add their bf16 values and int32 ids last, the
        teacher policy its columns after them. A policy-only output (no layers) has no hidden_states."""
        cols = [Column("hidden_states", self.num_layers * self.hidden, self.storage_dtype)] if self.num_layers else []
        if self.final_hidden:
            cols.append(Column("final_hidden_state", self.hidden, self.storage_dtype))
        if self.storage_dtype == SCALED_DTYPE and self.num_layers:
            cols.append(Column("hidden_states_scale", self.num_layers, "float32"))
            if self.final_hidden:
                cols.append(Column("final_hidden_state_scale", 1, "float32"))
        if self.topk:
            cols += [Column("topk_logits", self.topk, "bfloat16"), Column("topk_ids", self.topk, "int32")]
        if self.policy:
            cols += [Column("policy_ids", self.policy, "int32"), Column("policy_logprobs", self.policy, "float16"),
                     Column("policy_tail", 1, "float32")]
        return cols

    @property
    def values_per_token(self) -> int:
        """Hidden-state values per token (stored layers + final-norm state): what the GPU captures and holds."""
        return (self.num_layers + int(self.final_hidden)) * self.hidden

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token of the state columns (fp8 scales and top-k included): what extraction writes per token
        besides the tokenized input's `token_bytes`."""
        return sum(c.nbytes for c in self.state_columns())

    @property
    def token_bytes(self) -> int:
        """Bytes per token of input_ids and loss_mask (5)."""
        return sum(c.nbytes for c in TOKEN_COLUMNS)

    @property
    def bytes_per_row(self) -> int:
        """Fixed bytes per row: sample_id, num_tokens and an int32 offset per list column (has_nonfinite, one
        bit a row, is left out)."""
        lists = len(TOKEN_COLUMNS) + len(self.state_columns())
        return sum(c.nbytes for c in ROW_SCALARS) + OFFSET_BYTES * lists

    def features(self):
        """The output schema as datasets.Features."""
        from datasets import Features, List, Value

        f = {"sample_id": Value("int64"), "input_ids": List(Value("int32")), "loss_mask": List(Value("int8")),
             "num_tokens": Value("int32")}
        for c in self.state_columns():
            f[c.name] = List(List(c.value(), length=c.width))
        if self.flag_nonfinite:
            f["has_nonfinite"] = Value("bool")  # rows whose states hold NaN/Inf
        return Features(f)


def encode(states: list, num_layers: int, storage_dtype: str):
    """The batch's state columns as one flat uint8 tensor, in `state_columns` order (top-k and the teacher policy
    left out: the engine appends them), on the device. `states`: the captured layers (tokens, num_layers x hidden) and,
    with final_hidden, the final-norm state (tokens, hidden).

    fp8 (e4m3) scales each token's vector of each layer by its absolute maximum / 448, so every layer keeps
    its own range (residual-stream magnitudes grow by orders of magnitude with depth)."""
    import torch

    if storage_dtype != SCALED_DTYPE:
        dtype = getattr(torch, DTYPES[storage_dtype].torch)
        return torch.cat([x.to(dtype).reshape(-1).view(torch.uint8) for x in states])
    quantized, scales = [], []
    for x, groups in zip(states, (num_layers, 1)):
        n = x.shape[0]
        xf = x.float().view(n, groups, -1)
        scale = xf.abs().amax(-1).clamp_min(1e-30) / FP8_MAX
        quantized.append((xf / scale[..., None]).to(torch.float8_e4m3fn).reshape(-1).view(torch.uint8))
        scales.append(scale.reshape(-1).view(torch.uint8))
    return torch.cat(quantized + scales)


def decode(bits, dtype: str):
    """Stored values (a torch tensor of the dtype's `bits` type) as torch values of `dtype`: a view, no copy."""
    import torch

    d = DTYPES[dtype]
    return bits.view(getattr(torch, d.torch)) if d.bits != d.torch else bits


def dequantize(q, scale):
    """bfloat16 x = q * scale of fp8 states q (..., hidden) with one float32 scale per token and layer."""
    import torch

    return (q.float() * scale.reshape(*q.shape[:-1], 1)).to(torch.bfloat16)


def bits_dtype(dtype):
    """The integer torch dtype holding a torch dtype's bits where CPU kernels may not copy it natively."""
    import torch

    return {getattr(torch, d.torch): getattr(torch, d.bits) for d in DTYPES.values() if d.bits != d.torch}.get(dtype)


def storage_dtype_of(features) -> str:
    """The storage dtype of an output's `hidden_states` feature (the default when it cannot tell)."""
    try:
        value = features["hidden_states"].feature.feature
    except (KeyError, TypeError, AttributeError):
        return DEFAULT_STORAGE_DTYPE
    for name in STORAGE_DTYPES:
        d = DTYPES[name]
        if d.feature_id is not None and getattr(value, "id", None) == d.feature_id:
            return name
    if value.dtype == "uint8":
        return SCALED_DTYPE
    return value.dtype if value.dtype in STORAGE_DTYPES else DEFAULT_STORAGE_DTYPE


# Why an input row was skipped: the keys of hsx.json's counts.skipped (and `hsx.stream`'s counts), each with what it
# means. docs/inputs.md lists them all (tests/test_data.py checks both ways).
SKIP_REASONS: dict[str, str] = {
    "missing_value": "the row's column of the dataset's format (messages, text, input_ids, ...) is null",
    "mixed_input_formats": "the row's column of the dataset's format is null, and a column of another format holds "
                           "its data: the file mixes formats, and hsx reads one format per dataset",
    "missing_prompt": "prompt/completion rows: the prompt is null",
    "missing_completion": "prompt/completion rows: the completion is null",
    "missing_response": "prompt/response rows: the response is null",
    "bad_conversation": "the conversation is a string that is not a JSON list of messages",
    "empty_conversation": "the conversation is an empty list, or not a list",
    "message_not_a_mapping": "a message is not an object",
    "missing_role": "a message has neither role nor from",
    "missing_content": "a message has neither content nor value",
    "bad_tool_calls": "a message's tool_calls are not a list of objects",
    "bad_function_call": "a ShareGPT function_call turn is not a JSON {name, arguments} call (or a list of them)",
    "bad_content": "a content part is not an object, or a text part has no text",
    "non_text_content": "a content part is an image, audio or other non-text part",
    "null_content": "a message's content is null (an assistant message with tool_calls aside)",
    "no_assistant_turn": "no assistant message: nothing to supervise",
    "empty_text": "text rows: the text is empty or whitespace",
    "bad_input_ids": "input_ids rows: not a list of integers in int32 range",
    "empty_input": "input_ids rows: an empty list",
    "bad_loss_mask": "input_ids rows: loss_mask is not a list of 0s and 1s",
    "loss_mask_length_mismatch": "input_ids rows: loss_mask's length differs from input_ids'",
    "token_id_out_of_range": "a token id outside the model's vocabulary",
    "no_supervised_tokens": "the loss mask supervises no token",
    "no_supervised_tokens_after_truncation": "no supervised token is left after the cut at --max-length",
    "chat_template_error": "the chat template raised on the row",
    "chat_template_timeout": "the chat template's renders of the row ran over their CPU time bound",
    "chat_template_output_too_long": "the chat template rendered more than its size bound for the row",
    "mask_template_error": "a turn does not sit where the template's renders say: no exact mask",
    "prompt_turn_unattributed": "the prompt's own assistant turns cannot be told apart from the completion",
    "message_not_rendered": "the template renders nothing of a message of a role other than user, assistant, system",
    "tool_call_not_rendered": "the template renders nothing of one of the row's tool calls",
    "generated_tokens_mismatch": "a turn `hsx regenerate` answered does not render as the ids the target generated: "
                                 "the template rewrites earlier turns (Qwen3 drops their reasoning; regenerate "
                                 "with --rows per-turn) or the row was edited",
    "oom": "a single row that does not fit the GPU's memory alone",
    "nonfinite": "the row's states hold NaN or Inf (--nonfinite skip)",
}


LAYOUT_NOTE = "hsx output layout: "  # hsx.load's Dataset carries its row layout in `info.description`, after this
MAX_LAYOUT_NOTE_BYTES = 1 << 16


@dataclass(frozen=True)
class StoredLayout:
    """How a row's `hidden_states` split into layers x hidden: what hsx.torch_view needs of a `datasets.Dataset`
    of an output (its features give only the width, layers x hidden, unless the final-norm state is stored).
    `hsx.load` writes it into the Dataset's `info.description` (`note`), which datasets keeps through select,
    shuffle, filter and map; `of_note` reads it back, checked."""
    layers: list[int]
    num_model_layers: int
    hidden_size: int
    storage_dtype: str

    @classmethod
    def of(cls, info: "Info | Summary") -> "StoredLayout":
        return cls(list(info.layers), info.num_model_layers, info.hidden_size, info.storage_dtype)

    def note(self) -> str:
        import json

        return LAYOUT_NOTE + json.dumps({"layers": self.layers, "num_model_layers": self.num_model_layers,
                                         "hidden_size": self.hidden_size, "storage_dtype": self.storage_dtype})

    @classmethod
    def of_note(cls, text: Any) -> "StoredLayout | None":
        """The layout a Dataset's `info.description` carries (None when it carries none); Damaged when it is not
        what `note` writes."""
        import json

        if not isinstance(text, str) or not text.startswith(LAYOUT_NOTE):
            return None
        if len(text) > MAX_LAYOUT_NOTE_BYTES:
            raise Damaged("the layout note is longer than hsx writes")
        try:
            d = json.loads(text[len(LAYOUT_NOTE):])
        except ValueError:
            raise Damaged("the layout note is not JSON") from None
        _check(d, {k: _OUTPUT_CHECKS[k] for k in ("layers", "num_model_layers", "hidden_size", "storage_dtype")})
        if max(d["layers"]) >= d["num_model_layers"]:
            raise Damaged(f"layers {d['layers']} do not fit a model of {d['num_model_layers']} layers")
        return cls(list(d["layers"]), d["num_model_layers"], d["hidden_size"], d["storage_dtype"])


# ---- JSON records of an output dir --------------------------------------------------------------------------------

class Damaged(ValueError):
    """A record is not what hsx writes (the message says what is wrong, in a few words)."""


# How big a record hsx writes can be: each grows with what it lists (hsx.json and summary.json a unit per entry,
# job.json an input file per entry, a ledger a line per unit), sized here from generous counts. A bigger file is
# not hsx's (damaged or forged) and is refused before it is parsed: parsed whole, 1 GiB of JSON such as
# `[[],[],...]` is ~20 GB of Python objects.
MAX_UNITS = 1_000_000  # units of one job: petabytes at the default unit size (hsx.job.UNIT_BYTES), and ten times
# the files the Hub advises one repo to hold (each unit is a file there)
MAX_INPUT_FILES = 1_000_000  # files of a local dataset folder, each in job.json with its size and sha256
UNIT_ENTRY_BYTES = 320  # a unit's entry in hsx.json (~155 bytes, indented), its manifest line (~230; 262 at most)
INPUT_FILE_ENTRY_BYTES = 256  # an input file's entry in job.json: ~100 bytes and its path in the folder
RECORD_REST_BYTES = 16 << 20  # the rest of a record: its config, kernels, every rank's numbers (~2 KB each)
MAX_INFO_BYTES = MAX_UNITS * UNIT_ENTRY_BYTES + RECORD_REST_BYTES  # hsx.json, summary.json: 337 MB
MAX_JOB_BYTES = MAX_INPUT_FILES * INPUT_FILE_ENTRY_BYTES + RECORD_REST_BYTES  # job.json: 272 MB
# A ledger: a line per unit and as many again (a unit redone after damage, a trainer's partial progress); read a
# line at a time, each at most MAX_LEDGER_LINE_BYTES (exported.jsonl's lines name a destination path).
MAX_LEDGER_BYTES = 2 * MAX_UNITS * UNIT_ENTRY_BYTES  # 640 MB
MAX_LEDGER_LINE_BYTES = 64 << 10
# An export's journal (hsx.export's DEST/hsx-export.jsonl), read a line at a time as a ledger is: a line per source
# unit listing every file written for it (in the SpecForge and speculators layouts a file per row) and a line per
# unit a --delete-source export released.
MAX_EXPORT_FILES = 10_000_000  # files of one export: a file per row, each MBs of states at real hidden sizes
MAX_EXPORT_FILES_PER_UNIT = 1_000_000  # rows of one unit: a default unit (hsx.job.UNIT_BYTES) of a million rows
# holds about one token of a 1024-wide model per row
EXPORT_FILE_ENTRY_BYTES = 128  # a file's entry in its line: path, bytes and CRC-32 (~60 bytes; +9 per 256 MiB)
JOURNAL_UNIT_BYTES = 256  # a unit's line without its files, and its release line (~80 bytes each)
MAX_JOURNAL_LINE_BYTES = MAX_EXPORT_FILES_PER_UNIT * EXPORT_FILE_ENTRY_BYTES + JOURNAL_UNIT_BYTES  # 128 MB
MAX_JOURNAL_BYTES = MAX_EXPORT_FILES * EXPORT_FILE_ENTRY_BYTES + MAX_UNITS * JOURNAL_UNIT_BYTES  # 1.5 GB


UNIT_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]*")  # a unit's name, and a file name under data/: never a path


def is_plain_name(v: Any) -> bool:
    """A plain file name inside a folder (never a path out of it, never a dot-file)."""
    return isinstance(v, str) and UNIT_NAME.fullmatch(v) is not None


def _is_int(v: Any, least: int = 0) -> bool:
    return type(v) is int and v >= least


def _first_problem(obj: dict[str, Any], checks: dict[str, tuple[Any, str]]) -> str | None:
    """`checks`: key -> (predicate of its value, what it must be). The first key missing or failing."""
    for key, (ok, must) in checks.items():
        if key not in obj:
            return f"key {key!r} is missing"
        if not ok(obj[key]):
            return f"{key} must be {must}, got {str(obj[key])[:60]!r}"
    return None


def _check(obj: Any, checks: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise Damaged("not a JSON object")
    why = _first_problem(obj, checks)
    if why:
        raise Damaged(why)
    return obj


def _layers_ok(v: Any) -> bool:  # (empty: a policy-only output)
    return isinstance(v, list) and all(_is_int(i) for i in v) and len(set(v)) == len(v)


_STRING = (lambda v: isinstance(v, str), "a string")
_COUNT = (_is_int, "a non-negative integer")


@dataclass(frozen=True)
class RecordedConfig:
    """The job's config as hsx.json records it: every key kept (`raw`), the ones readers use checked."""
    nonfinite: str = "skip"
    topk_logits: int = 0
    dtype: str = "bfloat16"
    teacher_policy: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    CHECKS = {
        "nonfinite": (lambda v: v in ("skip", "keep"), "skip or keep"),
        "topk_logits": (lambda v: _is_int(v), "a non-negative integer"),
        "teacher_policy": (lambda v: _is_int(v), "a non-negative integer"),
        "dtype": (lambda v: v in COMPUTE_DTYPES, f"one of {', '.join(COMPUTE_DTYPES)}"),
    }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RecordedConfig":
        present = {k: c for k, c in cls.CHECKS.items() if k in d}
        why = _first_problem(d, present)
        if why:
            raise Damaged("config." + why)
        return cls(**{k: d[k] for k in present}, raw=d)

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        return self.raw


@dataclass(frozen=True)
class Counts:
    rows_in: int
    rows_written: int  # 0 in a summary (nothing is written at planning time)
    tokens_written: int
    truncated: int
    skipped: dict[str, Any]
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], required: tuple[str, ...]) -> "Counts":
        for key in required:
            if not _is_int(d.get(key)):
                raise Damaged(f"counts.{key} must be a non-negative integer, got {d.get(key)!r}")
        if not isinstance(d.get("skipped"), dict):
            raise Damaged("counts.skipped must be an object")
        written = {k: d[k] if _is_int(d.get(k)) else 0 for k in ("rows_written", "tokens_written")}
        return cls(rows_in=d["rows_in"], **written, truncated=d["truncated"], skipped=d["skipped"], raw=d)


@dataclass(frozen=True)
class FileEntry:
    """One file of a finished output as hsx.json lists it: readers check names and sizes (and CRCs) against it."""
    file: str
    bytes: int
    crc32: str | None = None
    unit: str | None = None
    rows: int = 0

    @classmethod
    def from_dict(cls, e: Any) -> "FileEntry":
        if not (isinstance(e, dict) and is_plain_name(e.get("file")) and _is_int(e.get("bytes"))
                and isinstance(e.get("crc32"), (str, type(None)))
                and (e.get("unit") is None or is_plain_name(e["unit"]))):
            raise Damaged("`files` is damaged (each entry needs a file name in data/, bytes and crc32)")
        rows = e.get("rows", 0)
        return cls(e["file"], e["bytes"], e.get("crc32"), e.get("unit"), rows if _is_int(rows) else 0)

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "unit": self.unit, "rows": self.rows, "bytes": self.bytes, "crc32": self.crc32}


_OUTPUT_CHECKS = {  # hsx.json and summary.json alike
    "model": _STRING,
    "layers": (_layers_ok, "a list of distinct non-negative integers"),
    "hidden_size": (lambda v: _is_int(v, 1), "a positive integer"),
    "num_model_layers": (lambda v: _is_int(v, 1), "a positive integer"),
    "final_hidden": (lambda v: type(v) is bool, "true or false"),
    "storage_dtype": (lambda v: v in STORAGE_DTYPES, f"one of {', '.join(STORAGE_DTYPES)}"),
    "max_length": (lambda v: _is_int(v, 1), "a positive integer"),
    "counts": (lambda v: isinstance(v, dict), "an object"),
    "config": (lambda v: isinstance(v, dict), "an object"),
}


def _output_fields(d: dict[str, Any], checks: dict[str, tuple[Any, str]], counts: tuple[str, ...]) -> dict[str, Any]:
    _check(d, {**_OUTPUT_CHECKS, **checks})
    if max(d["layers"], default=-1) >= d["num_model_layers"]:
        raise Damaged(f"layers {d['layers']} do not fit a model of {d['num_model_layers']} layers")
    config = RecordedConfig.from_dict(d["config"])
    vocab = d.get("vocab_size")
    if vocab is not None and not (_is_int(vocab, 1) and vocab <= 2**31):
        raise Damaged("vocab_size must be a positive integer (input_ids are int32)")
    return dict(model=d["model"], layers=list(d["layers"]), hidden_size=d["hidden_size"],
                num_model_layers=d["num_model_layers"], final_hidden=d["final_hidden"],
                storage_dtype=d["storage_dtype"], max_length=d["max_length"],
                counts=Counts.from_dict(d["counts"], counts), config=config, vocab_size=vocab,
                fingerprint=d.get("fingerprint") if isinstance(d.get("fingerprint"), str) else None, raw=d)


@dataclass(frozen=True)
class _Output:
    MAX_BYTES = MAX_INFO_BYTES  # (a class constant: hsx.files.read_json's bound)

    model: str
    layers: list[int]
    hidden_size: int
    num_model_layers: int
    final_hidden: bool
    storage_dtype: str
    max_length: int
    counts: Counts
    config: RecordedConfig
    vocab_size: int | None
    fingerprint: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def format(self) -> OutputFormat:
        return OutputFormat.of(self)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object as read, with any field changed by `replace` written back (key order kept)."""
        return dict(self.raw)


@dataclass(frozen=True)
class Info(_Output):
    """hsx.json: what was run, the counts, and (finished) the list of files."""
    complete: bool = False
    files: tuple[FileEntry, ...] | None = None  # None: an older hsx's hsx.json, which lists none
    token_frequencies: dict[str, Any] | None = None
    model_path: str | None = None

    @classmethod
    def from_dict(cls, d: Any) -> "Info":
        fields = _output_fields(d, {"complete": (lambda v: type(v) is bool, "true or false")},
                                ("rows_in", "rows_written", "tokens_written", "truncated"))
        files = d.get("files")
        if files is not None and not isinstance(files, list):
            raise Damaged("`files` is damaged (each entry needs a file name in data/, bytes and crc32)")
        freqs = d.get("token_frequencies")
        if freqs is not None and not (isinstance(freqs, dict) and all(
                _is_int(freqs.get(k)) for k in ("vocab_size", "supervised_tokens"))):
            raise Damaged("token_frequencies is damaged (needs integer vocab_size and supervised_tokens)")
        path = d.get("model_path")
        return cls(**fields, complete=d["complete"],
                   files=None if files is None else tuple(FileEntry.from_dict(e) for e in files),
                   token_frequencies=freqs, model_path=path if isinstance(path, str) else None)

    def to_dict(self) -> dict[str, Any]:
        return {**self.raw, "complete": self.complete}

    def unfinished(self) -> "Info":
        return replace(self, complete=False)


@dataclass(frozen=True)
class Summary(_Output):
    """.hsx/summary.json: written at planning time; finalization and `hsx merge` build hsx.json from it."""
    unit_names: list[str] = field(default_factory=list)
    command: str = ""

    @classmethod
    def from_dict(cls, d: Any) -> "Summary":
        fields = _output_fields(d, {
            "unit_names": (lambda v: isinstance(v, list) and all(is_plain_name(u) for u in v), "a list of unit names"),
            "command": _STRING, "hsx_version": _STRING, "layer_convention": _STRING}, ("rows_in", "truncated"))
        return cls(**fields, unit_names=list(d["unit_names"]), command=d["command"])


@dataclass(frozen=True)
class JobRecord:
    """.hsx/job.json: the fingerprint of what decides the output (hsx.fingerprint.job_fingerprint)."""
    MAX_BYTES = MAX_JOB_BYTES

    fingerprint: str
    inputs: dict[str, Any]
    given: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> "JobRecord":
        _check(d, {"fingerprint": (lambda v: isinstance(v, str) and bool(v), "a string"),
                   "inputs": (lambda v: isinstance(v, dict), "an object")})
        given = d.get("given")
        return cls(d["fingerprint"], d["inputs"], given if isinstance(given, dict) else {})

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "inputs": self.inputs, "given": self.given}


@dataclass(frozen=True)
class ManifestRecord:
    """One line of .hsx/manifest-<rank>.jsonl: a committed unit."""
    unit: str
    file: str
    bytes: int
    rows: int
    tokens: int
    crc32: str | None = None
    session: str | None = None
    skipped_oom: int = 0
    skipped_nonfinite: int = 0
    nonfinite_kept: int = 0

    COUNTS = ("skipped_oom", "skipped_nonfinite", "nonfinite_kept")  # summed into hsx.json's counts

    @classmethod
    def from_dict(cls, d: Any) -> "ManifestRecord":
        unit = d.get("unit") if isinstance(d, dict) else None
        _check(d, {"unit": (is_plain_name, "a unit name"),
                   "file": (lambda v: v == f"train-{unit}.arrow", f"train-{unit}.arrow"),
                   "bytes": _COUNT, "rows": _COUNT, "tokens": _COUNT})
        if not isinstance(d.get("crc32", ""), str):
            raise Damaged("crc32 must be a string")
        for key in cls.COUNTS:
            if not _is_int(d.get(key, 0)):
                raise Damaged(f"{key} must be a non-negative integer")
        session = d.get("session")
        return cls(unit, d["file"], d["bytes"], d["rows"], d["tokens"], d.get("crc32"),
                   session if isinstance(session, str) else None, *(d.get(k, 0) for k in cls.COUNTS))


@dataclass(frozen=True)
class UploadRecord:
    """One line of .hsx/uploaded-*.jsonl: a file a Hub push committed (path in the repo, size, CRC-32)."""
    file: str
    bytes: int
    crc32: str | None = None

    @classmethod
    def from_dict(cls, d: Any) -> "UploadRecord":
        _check(d, {"file": (lambda v: isinstance(v, str), "a path in the repo"), "bytes": _COUNT})
        crc = d.get("crc32")
        return cls(d["file"], d["bytes"], crc if isinstance(crc, str) else None)


@dataclass(frozen=True)
class ConsumedRecord:
    """One line of .hsx/consumed-<consumer>.jsonl (hsx.follow): rows [0, `row`) of a committed unit were consumed
    by that trainer; `row` == `rows` means the whole unit (a later line of the same unit supersedes an earlier)."""
    unit: str
    file: str
    bytes: int
    rows: int
    row: int
    crc32: str | None = None

    @classmethod
    def from_dict(cls, d: Any) -> "ConsumedRecord":
        unit = d.get("unit") if isinstance(d, dict) else None
        _check(d, {"unit": (is_plain_name, "a unit name"),
                   "file": (lambda v: v == f"train-{unit}.arrow", f"train-{unit}.arrow"),
                   "bytes": _COUNT, "rows": _COUNT, "row": _COUNT})
        if d["row"] > d["rows"]:
            raise Damaged(f"row {d['row']} is past the unit's {d['rows']} rows")
        crc = d.get("crc32")
        return cls(unit, d["file"], d["bytes"], d["rows"], d["row"], crc if isinstance(crc, str) else None)


CONSUMER_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")  # a consumer's name: it names its ledger files


@dataclass(frozen=True)
class ConsumersRecord:
    """.hsx/consumers.json: the consumers an output serves (hsx.follow with delete_consumed, `hsx serve
    --consumers`, `hsx consumers --declare`), each by name with what declared it; a unit is deleted only once every
    declared consumer not `retired` (`hsx consumers --retire`) consumed it whole. A retired name stays retired."""
    declared: dict[str, str]  # name -> what declared it ("hsx.follow", "hsx serve", ...)
    retired: dict[str, str]  # name -> when it was retired (UTC, ISO 8601)

    MAX_BYTES = 4 << 20

    @classmethod
    def from_dict(cls, d: Any) -> "ConsumersRecord":
        def names(v: Any) -> bool:
            return isinstance(v, dict) and all(isinstance(k, str) and CONSUMER_NAME.fullmatch(k)
                                               and isinstance(x, str) and len(x) <= 200 for k, x in v.items())

        _check(d, {"declared": (names, "an object of consumer name -> what declared it"),
                   "retired": (names, "an object of consumer name -> when it was retired")})
        return cls(dict(d["declared"]), dict(d["retired"]))

    def to_dict(self) -> dict[str, Any]:
        return {"declared": dict(sorted(self.declared.items())), "retired": dict(sorted(self.retired.items()))}


# How a run computed the states, outside the job's fingerprint (a resume may change them: hsx.config says why):
# each run's values are in its rank's .hsx/runs-<rank>.jsonl, and hsx.json's run.values_used lists every value the
# runs that wrote the output's units used.
RUN_VARIANT_KEYS = ("compile", "sdpa_backend", "packing", "experts_implementation", "fp8_gemm")


def _is_setting(v: Any) -> bool:
    return isinstance(v, (bool, int)) or (isinstance(v, str) and len(v) <= 200)


@dataclass(frozen=True)
class RunRecord:
    """One line of .hsx/runs-<rank>.jsonl: the RUN_VARIANT_KEYS values one run (`session`, as in its manifest
    lines) of that rank extracted with, recorded before its first unit is committed."""
    session: str
    settings: dict[str, Any]

    @classmethod
    def from_dict(cls, d: Any) -> "RunRecord":
        _check(d, {"session": (lambda v: isinstance(v, str), "a string")})
        for key in RUN_VARIANT_KEYS:
            if key in d and not _is_setting(d[key]):
                raise Damaged(f"{key} must be a name or a flag, got {str(d[key])[:60]!r}")
        return cls(d["session"], {k: d[k] for k in RUN_VARIANT_KEYS if k in d})


def values_used(records: list[RunRecord]) -> dict[str, list]:
    """Every value each RUN_VARIANT_KEYS key took over `records`, each once (True is not 1), in their order."""
    used: dict[str, list] = {}
    seen: set[tuple[str, str, Any]] = set()
    for rec in records:
        for key, value in rec.settings.items():
            if (key, type(value).__name__, value) not in seen:
                seen.add((key, type(value).__name__, value))
                used.setdefault(key, []).append(value)
    return {k: used[k] for k in RUN_VARIANT_KEYS if k in used}


def merged_values(*values: dict[str, list]) -> dict[str, list]:
    """values_used's union of several of its results (each value once, in their order)."""
    return values_used([RunRecord("", {k: v}) for used in values for k, vs in used.items() for v in vs])

