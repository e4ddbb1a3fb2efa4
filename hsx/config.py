"""What a job is: one dataclass, read from a YAML recipe and overridden by command-line flags.

Every field is a YAML key (snake_case), a flag (kebab-case) and a keyword of `config_from`; an unknown key is an
error, not a warning, so a typo in a recipe never silently runs the wrong job. Each key's type is its annotation
(FIELD_KINDS) and every value is parsed to it without coercion: booleans are YAML 1.2's unquoted true/false only
(a quoted "false" is a non-empty string, which Python would take as True), integers are integers, choices and
ranges are checked (CHOICES, MINIMUM, MAXIMUM: every integer key has a largest value, so none overflows
or allocates what no machine holds), and a wrong one is one HsxError line naming the key. Each key's help,
default, choices and least value are written once, in its field's metadata (HfArgumentParser's convention): the
flags and `--help` are built from them, but values never go through HfArgumentParser (its parse_dict does not
type-check). Layers are
resolved against the model's depth here too: integers (negatives count from the end) or one preset name
(`eagle3`, `dflash`, `dflash-K`), giving sorted, distinct, non-negative decoder-layer indices; a preset's K is
bounded by the depth before any list is built (`dflash-999999` once built a million-entry list first).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hsx.errors import HsxError, UsageError, one_line  # noqa: F401  (raised here; also imported from here)
from hsx.schema import COMPUTE_DTYPES, DEFAULT_STORAGE_DTYPE, STORAGE_DTYPES

LAYER_CONVENTION = (
    "layer i is the output of decoder layer i (0-based), before the final norm: transformers' "
    "output_hidden_states[i+1] for i < N-1 and a forward hook for i = N-1; final_hidden_state is the output of "
    "the final norm (transformers' hidden_states[N]), the input of lm_head"
)


EXPERTS_CHOICES = ("auto", "hsx_grouped", "grouped_mm", "eager")  # hsx.target.moe; the last two are transformers' own
# hsx.target.fp8_gemm's block-scaled GEMMs after auto (auto: the first of deepgemm, cublas, fbgemm, triton that works
# on the device, fastest first by the GEMM rates in docs/benchmarks.md)
FP8_GEMM_CHOICES = ("auto", "cublas", "deepgemm", "fbgemm", "flashinfer", "triton")
PROMPT_COMPLETION_FORMATS = ("chat", "text")  # hsx.data: how string prompt/completion rows are read


# The largest value of an integer key, and why (a value above it is refused in one line, before anything
# allocates or overflows): token counts are int32 in the output (`num_tokens`) and in the packed batch's
# cu_seqlens; everything else indexes numpy int64 arrays.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
TOKENS_INT32 = (INT32_MAX, "token counts are int32")
ROWS_INT64 = (INT64_MAX, "row and sample indices are int64")


def _key(default: Any = dataclasses.MISSING, *, help: str, choices: tuple[str, ...] | None = None,
         minimum: float | None = None, maximum: tuple[int, str] | None = None,
         default_factory: Any = dataclasses.MISSING, advanced: bool = False) -> Any:
    """A config key: `field(default=..., metadata={"help": ..., "choices": ..., "minimum": ..., "maximum": ...})`,
    the one place of a key's help, default, choices and range (HfArgumentParser's convention; hsx.cli builds each
    flag from it, and parse_value checks values against it). `maximum` is (largest value, why); an integer key
    without one gets ROWS_INT64. `advanced`: a kernel choice whose default picks what works fastest on the device,
    set to benchmark or to step around a kernel (its flag is listed under ADVANCED_HELP in --help)."""
    metadata = {"help": help, **({"choices": choices} if choices else {}),
                **({"minimum": minimum} if minimum is not None else {}),
                **({"maximum": maximum} if maximum is not None else {}), **({"advanced": True} if advanced else {})}
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass
class ExtractConfig:
    # What to run and on what.
    model: str = _key("", help="local folder or Hub id of the target model")
    revision: str | None = _key(None, help="model revision (branch, tag or commit) on the Hub")
    tokenizer: str | None = _key(None, help="tokenizer folder or Hub id (default: the model's)")
    dataset: str = _key("", help="Hub id, or a local .jsonl/.json/.parquet/.arrow file or folder")
    dataset_config: str | None = _key(None, help="the dataset's configuration name (a Hub dataset's, or one a local "
                                      "folder's README.md lists under `configs`)")
    split: str = _key("train", help="input split (slicing like train[:1000] works)")
    limit: int | None = _key(None, minimum=1, help="only the first N input rows: for trying a recipe out")
    # What to capture.
    layers: list[int] | str = _key(default_factory=list, help="decoder layers (0-based, negatives from the end), "
                                   "e.g. `1 -1` or `1,-1`, or a preset: eagle3, dflash, dflash-K")
    layers_from: str | None = _key(None, help="take the layers from a draft's own config (a config.json, a draft "
                                   "checkpoint folder or a Hub id): SpecForge, z-lab, speculators and EAGLE drafts, "
                                   "each in its own index convention (docs/trainers.md); instead of --layers")
    final_hidden: bool = _key(False, help="also store the final-norm output (transformers' hidden_states[N]) as "
                              "final_hidden_state")
    topk_logits: int = _key(0, minimum=0, maximum=(INT32_MAX, "token ids are int32"),
                            help="also store the target's top-K logits and token ids per token (from "
                            "the final-norm state, in chunks; needs --final-hidden or a preset that includes it)")
    teacher_policy: int = _key(0, minimum=0, maximum=(INT32_MAX, "token ids are int32"),
                               help="store the target's serving distribution per token as a teacher, beside the "
                               "layers or alone (no layers: no hidden states, no hooks): its K likeliest tokens at "
                               "the serving temperature, then the nucleus, renormalised (int32 ids, float16 log "
                               "probabilities, minus infinity where the nucleus left one out), and the mass left "
                               "out; from the final norm's output, which then runs (stored only with --final-hidden)")
    teacher_top_p: float = _key(1.0, minimum=1e-9, help="--teacher-policy: the nucleus kept of the K likeliest "
                                "tokens (1: all K)")
    teacher_temperature: float = _key(1.0, minimum=0.0, help="--teacher-policy: the serving temperature (0: "
                                      "greedy)")
    max_length: int = _key(4096, minimum=1, maximum=TOKENS_INT32, help="longer rows are truncated (and counted)")
    chat_template_kwargs: dict[str, Any] = _key(default_factory=dict, help="JSON object passed to the chat "
                                                "template, e.g. '{\"enable_thinking\": false}'")
    prompt_completion: str = _key("chat", choices=PROMPT_COMPLETION_FORMATS, help="rows whose prompt and "
                                  "completion are strings (TRL's standard form): chat, a user and an assistant turn "
                                  "through the chat template (what a chat server renders); text, prompt + completion + "
                                  "eos as plain text, loss on the completion (TRL's SFT). Lists of messages are chat")
    # Where it goes.
    output_dir: str = _key("", help="where the Arrow dataset goes; rerunning the same command there continues "
                           "the job")
    storage_dtype: str = _key(DEFAULT_STORAGE_DTYPE, choices=STORAGE_DTYPES,
                              help="bfloat16 is bit-exact for bf16 compute; float8_e4m3 is lossy, with per-token scales, "
                              "read back as bfloat16")
    strict: bool = _key(False, help="stop at the first unusable input row instead of skipping and counting it")
    allow_empty: bool = _key(False, help="a job that writes no row (every input row skipped) succeeds with an "
                             "empty dataset instead of failing")
    # Publishing (token from HF_TOKEN / `hf auth login`, never recorded).
    push_to_hub: str | None = _key(None, help="a Hub dataset repo to upload the output to (token from HF_TOKEN or "
                                   "`hf auth login`)")
    push_mode: str = _key("end", choices=("end", "stream"), help="end: upload once the job is complete; stream: "
                          "upload units as they are committed")
    delete_after_upload: bool = _key(False, help="stream mode: delete a unit locally once the Hub has it (outputs "
                                     "bigger than the disk)")
    hub_private: bool = _key(True, help="create the repo private, or public (--no-hub-private)")
    hub_revision: str | None = _key(None, help="branch to push to (created if missing)")
    hub_overwrite: bool = _key(False, help="push even into a repo (or --hub-revision) that holds another job's "
                               "output or files hsx did not push: replace its hsx.json and README.md and delete its "
                               "data/train-*.arrow files (refused without it)")
    max_pending_gb: float | None = _key(None, minimum=1e-6, help="train while extracting: before each unit, wait "
                                        "while this many GB of committed units are not yet consumed by a trainer "
                                        "reading the dir with hsx.follow (docs/follow.md)")
    elastic: str | None = _key(None, help="HOST:PORT of torchrun's c10d --rdzv-endpoint: claim units through its "
                               "store as processes go, so nodes may be lost or join while the job runs; each "
                               "node's ranks agree among themselves only (docs/scale-out.md)")
    nonfinite: str = _key("skip", choices=("skip", "keep"), help="rows whose states hold NaN/Inf: skip (and count) "
                          "them, or keep them with has_nonfinite set")
    overwrite: bool = _key(False, help="delete what hsx wrote in --output-dir and start over")
    # Off by default: reading every unit kept costs minutes per TB (hsx.checksums' rates in docs/benchmarks.md).
    check_crc: bool = _key(False, help="on resume or rerun, check the CRC-32 of every unit kept (off: sizes of "
                           "all, CRC-32 of the units of the interrupted run)")
    # How fast. None changes which rows, tokens or masks are written; packing and tensor parallelism change the
    # states only within bf16 rounding (dtype, part of the job's fingerprint, by its own precision), as do the
    # kernels chosen here. Outside the fingerprint, so a resume may change them (hsx.schema.RUN_VARIANT_KEYS: a
    # resume that does says so in a notice): hsx.json's `run` records what the run that finished the job used
    # (compile, sdpa_backend, packing, experts_implementation, fp8_gemm), and run.values_used every value the
    # runs that wrote its units used.
    dtype: str = _key("bfloat16", choices=COMPUTE_DTYPES, help="compute dtype of the model")
    attn_implementation: str = _key("sdpa", advanced=True, help="transformers attention implementation")
    sdpa_backend: str = _key("flash", choices=("flash", "cudnn", "efficient", "default"), advanced=True,
                             help="attention kernel for sdpa on CUDA (`default`: torch's own pick; why flash: "
                             "docs/benchmarks.md, cuDNN attention's host overhead)")
    experts_implementation: str = _key("auto", choices=EXPERTS_CHOICES, advanced=True, help="MoE experts: "
                                       "hsx_grouped (two grouped GEMMs, hsx.target.moe), grouped_mm (transformers'), "
                                       "eager "
                                       "(a loop over experts); auto: hsx_grouped on CUDA, transformers' choice on CPU")
    fp8_gemm: str = _key("auto", choices=FP8_GEMM_CHOICES, advanced=True, help="FP8 targets on CUDA: the block-scaled "
                         "GEMM (deepgemm: DeepGEMM where installed, from 8192 rows, its kernels built before the "
                         "first batch; cublas: torch's _scaled_mm; fbgemm: fbgemm-gpu-genai's, slower than cuBLAS; "
                         "flashinfer: flashinfer-python's copy of DeepGEMM's kernels, rows as deepgemm, not measured "
                         "yet: never chosen by auto; triton: hsx's, slower than bf16); each checked against a float32 "
                         "product first, the next running where it fails (one warning); auto: the first of "
                         "deepgemm, cublas, fbgemm, triton that works")
    packing: str = _key("auto", choices=("auto", "varlen", "none"), advanced=True, help="varlen: each batch as one "
                        "packed sequence (torch's flash varlen attention); none: right-padded batches; auto: varlen on "
                        "one GPU per copy where the model allows it, else none")
    gpus_per_copy: int = _key(1, minimum=1, help="GPUs one model copy is spread over (device_map); launch one "
                              "process per group: `hsx launch --num_processes GPUS/N extract ...`")
    tp_size: int = _key(1, minimum=1, help="tensor parallel: shard each model copy over this many processes (one "
                        "per GPU) with transformers' tp_plan; data parallel across the groups")
    ep_size: int = _key(1, minimum=1, help="expert parallel: shard a mixture of experts' routed experts over this "
                        "many processes (one per GPU, of one machine), each process on its own batches, the rest of "
                        "the model whole in each (docs/scale-out.md)")
    token_budget: int | None = _key(None, minimum=1, maximum=TOKENS_INT32,
                                    help="tokens per batch, padding included (default: 16384 on "
                                    "GPU, 4096 on CPU)")
    unit_tokens: int | None = _key(None, minimum=1, maximum=TOKENS_INT32,
                                   help="tokens per output file, the grain of commit and resume "
                                   "(default: ~2 GiB of states)")
    compile: str = _key("auto", choices=("auto", "on", "off"), advanced=True,
                        help="torch.compile the model (auto: on for CUDA)")
    num_proc: int | None = _key(None, minimum=1, help="tokenization processes (default: up to 8 for 20k+ rows; "
                                "never more than the cores this process may run on)")
    trust_remote_code: bool = _key(False, help="run the model repo's own code")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(ExtractConfig)}
# The keys whose value is one of a few names (flags get them as argparse `choices`), and the integer keys' least
# values (None is allowed where the field's type says `| None`): views of the fields' metadata.
CHOICES = {name: f.metadata["choices"] for name, f in FIELDS.items() if "choices" in f.metadata}
ADVANCED = tuple(name for name, f in FIELDS.items() if f.metadata.get("advanced"))  # kernel choices (`_key`)
MINIMUM = {name: f.metadata["minimum"] for name, f in FIELDS.items() if "minimum" in f.metadata}
MAXIMUM = {name: f.metadata.get("maximum", ROWS_INT64) for name, f in FIELDS.items()}
REQUIRED = ("model", "dataset", "output_dir")  # the keys a job needs (a stream, hsx.stream, writes nothing)


def default_of(name: str) -> Any:
    """Key `name`'s default value (a fresh one for a list or a mapping)."""
    f = FIELDS[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few hundred bytes; anything near this is not one


def _field_kinds(cls: type | None = None) -> dict[str, tuple[str, bool]]:
    """Each key's kind (bool, int, str, layers, mapping) and whether null is allowed, from the annotations of `cls`
    (ExtractConfig by default): the one place a key's type is declared (flags are built from it too, in hsx.cli)."""
    cls = cls or ExtractConfig
    kinds = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        nullable = type(None) in args
        args = tuple(a for a in args if a is not type(None))
        if name == "layers":
            kind = "layers"
        elif args == (bool,):
            kind = "bool"
        elif args == (int,):
            kind = "int"
        elif args == (float,):
            kind = "float"
        elif args == (str,):
            kind = "str"
        elif typing.get_origin(args[0]) is dict:
            kind = "mapping"
        else:  # a new field of a new type: decide here how it is parsed
            raise TypeError(f"{cls.__name__}.{name}: no parser for {hint}")
        kinds[name] = (kind, nullable)
    return kinds


FIELD_KINDS = _field_kinds()


@dataclass(frozen=True)
class Keys:
    """The key tables of one config dataclass (ExtractConfig's are this module's FIELDS, FIELD_KINDS, CHOICES,
    MINIMUM and MAXIMUM; `hsx regenerate`'s RegenerateConfig has its own): what parse_value, read_recipe and the
    command line's flags read a key's type, range and help from."""
    cls: type
    fields: dict
    kinds: dict
    choices: dict
    minimum: dict
    maximum: dict

    @classmethod
    def of(cls, config_class: type) -> Keys:
        fields = {f.name: f for f in dataclasses.fields(config_class)}
        return cls(config_class, fields, _field_kinds(config_class),
                   {n: f.metadata["choices"] for n, f in fields.items() if "choices" in f.metadata},
                   {n: f.metadata["minimum"] for n, f in fields.items() if "minimum" in f.metadata},
                   {n: f.metadata.get("maximum", ROWS_INT64) for n, f in fields.items()})

    def default_of(self, name: str) -> Any:
        f = self.fields[name]
        return f.default_factory() if f.default is dataclasses.MISSING else f.default


EXTRACT_KEYS = Keys(ExtractConfig, FIELDS, FIELD_KINDS, CHOICES, MINIMUM, MAXIMUM)


def _shown(value: Any) -> str:
    text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"


def _shown_int(value: int) -> str:
    digits = len(str(abs(value))) if value.bit_length() < 14000 else None  # (str() of a huge int is refused)
    return f"{value:,}" if digits is not None and digits <= 30 else "an integer of over 30 digits"


def parse_value(name: str, value: Any, keys: Keys = EXTRACT_KEYS) -> Any:
    """`value` as key `name`'s declared type (in `keys`: ExtractConfig's by default), or HsxError naming the key. No
    coercion: a YAML `"512"` is a string, not 512, and `"false"`/`no`/`0` are not booleans (the false that
    `trust_remote_code: "false"` would be in Python is True)."""
    MINIMUM, MAXIMUM, CHOICES = keys.minimum, keys.maximum, keys.choices  # noqa: N806  (the tables of `keys`)
    kind, nullable = keys.kinds[name]
    if value is None:
        if nullable:
            return None
        raise HsxError(f"{name} must not be null")
    if kind == "bool":
        if type(value) is not bool:
            raise HsxError(f"{name} must be true or false (unquoted), got {_shown(value)}")
        return value
    if kind == "int":
        if type(value) is not int:
            raise HsxError(f"{name} must be an integer, got {_shown(value)}")
        if name in MINIMUM and value < MINIMUM[name]:
            raise HsxError(f"{name} must be at least {MINIMUM[name]}" + (" (or null)" if nullable else "")
                           + f", got {value}")
        most, why = MAXIMUM[name]
        if value > most:
            raise HsxError(f"{name} must be at most {most:,} ({why}), got {_shown_int(value)}")
        return value
    if kind == "float":  # an integer or a finite decimal (YAML `4`, `0.5`), never a string or a boolean
        if type(value) not in (int, float) or not math.isfinite(value):
            raise HsxError(f"{name} must be a number, got {_shown(value)}")
        if name in MINIMUM and value < MINIMUM[name]:
            raise HsxError(f"{name} must be at least {MINIMUM[name]}" + (" (or null)" if nullable else "")
                           + f", got {value}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise HsxError(f"{name} must be a string, got {_shown(value)}")
        if "\x00" in value:
            raise HsxError(f"{name} must not contain a NUL character")
        if name in CHOICES and value not in CHOICES[name]:
            raise HsxError(f"{name} must be one of {', '.join(CHOICES[name])}, got {value!r}")
        return value
    if kind == "layers":
        layers = parse_layer_spec(value)
        if layers in ([], ""):
            raise HsxError("--layers is required: integers (negatives count from the end) or a preset "
                           "(eagle3, dflash, dflash-K); or --layers-from DRAFT")
        return layers
    # mapping: a YAML mapping, or a JSON object (how a flag gives it)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:  # (a JSONDecodeError, or an int of over 4300 digits)
            raise HsxError(f"{name} must be a JSON object: {one_line(e, 150)}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise HsxError(f"{name} must be a mapping with string keys, got {_shown(value)}")
    return value


def config_from(options: Mapping[str, Any], required: tuple[str, ...] = REQUIRED) -> ExtractConfig:
    """An ExtractConfig from keyword options (Python's `hsx.extract(**options)`, or a recipe merged with flags):
    unknown keys, wrong types and out-of-range values are HsxError, one line naming the key."""
    unknown = sorted(str(k) for k in options if k not in FIELDS)
    if unknown:
        raise HsxError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    cfg = ExtractConfig(**{k: parse_value(k, v) for k, v in options.items()})
    return check_config(cfg, required, parsed=options)


def config_overrides(args) -> dict[str, Any]:
    """The config flags given on a command line (argparse's namespace; an unset flag is None, and leaves the
    recipe's key)."""
    return {k: getattr(args, k) for k in FIELDS if getattr(args, k, None) is not None}


def config_of(args) -> ExtractConfig:
    """The job's config from --config and the flags of a command line; any problem with them is a usage error."""
    return load_config(args.config, config_overrides(args))


def load_config(path: str | None, overrides: dict[str, Any], required: tuple[str, ...] = REQUIRED) -> ExtractConfig:
    """Read a YAML recipe (optional), apply flag overrides (None: not given), and check the result. Every problem
    is a UsageError: a recipe or option wrong by itself, found before anything is read (`hsx extract` and
    `hsx plan` exit 2, as `hsx.extract()` and `hsx.plan()` raise it)."""
    values: dict[str, Any] = {}
    try:
        if path:
            values = _resolve_recipe_paths(read_recipe(path), Path(path).parent)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return config_from(values, required)
    except UsageError:
        raise
    except HsxError as e:
        raise UsageError(str(e)) from None


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core booleans and integers: only true/false are booleans (YAML 1.1's
    yes/no/on/off/y/n stay strings, and so get refused for a boolean key), `1:30` is not sexagesimal 90, and
    dates stay strings. Duplicate keys and anchors/aliases (exponential expansions) are refused."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a recipe",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:int",
                                    re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                    list("-+0123456789"))


def _yaml_int(loader, node):
    text = loader.construct_scalar(node)
    return int(text[2:], 8) if text.startswith("0o") else int(text, 0) if text.startswith("0x") else int(text)


_RecipeLoader.add_constructor("tag:yaml.org,2002:int", _yaml_int)


def read_small_file(path: str, limit: int, what: str) -> bytes:
    """At most `limit` + 1 bytes of a file the user named, which must be a regular file: opened without waiting
    (a FIFO there would block forever, a device never end), HsxError in one line otherwise."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise HsxError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise HsxError(f"{what} {path} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(limit + 1)
        except OSError as e:
            raise HsxError(f"cannot read {what} {path}: {e.strerror or e}") from None


def read_recipe(path: str, keys: Keys = EXTRACT_KEYS) -> dict[str, Any]:
    """A YAML recipe's keys, each parsed to its declared type; HsxError (one line, naming the file) for a file
    that is not UTF-8 YAML, not a mapping, or has an unknown key or a wrong value."""
    blob = read_small_file(path, MAX_RECIPE_BYTES, "config")
    if len(blob) > MAX_RECIPE_BYTES:
        raise HsxError(f"config {path}: over {MAX_RECIPE_BYTES >> 20} MiB; a recipe is a small YAML file")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HsxError(f"config {path}: not UTF-8 text (byte {e.start}); a recipe is a YAML file") from None
    if "\x00" in text:
        raise HsxError(f"config {path}: holds NUL bytes; a recipe is a YAML file")
    try:
        raw = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise HsxError(f"config {path}: not valid YAML: {_yaml_problem(e)}") from None
    except (ValueError, OverflowError) as e:  # a scalar YAML matched that does not build (a 5000-digit int)
        raise HsxError(f"config {path}: not a value hsx reads: {one_line(e, 150)}") from None
    except RecursionError:
        raise HsxError(f"config {path}: nested too deeply to be a recipe") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise HsxError(f"config {path}: expected a mapping of keys to values, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in keys.fields)
    if unknown:
        raise HsxError(f"config {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(keys.fields)}")
    try:
        return {k: parse_value(k, v, keys) for k, v in raw.items()}
    except HsxError as e:
        raise HsxError(f"config {path}: {e}") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        mark = e.problem_mark
        return f"{e.problem}" + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark else "")
    return " ".join(str(e).split())


def _resolve_recipe_paths(values: dict[str, Any], recipe_dir: Path) -> dict[str, Any]:
    """A relative path in a recipe that does not exist from the working directory but does from the recipe's
    folder is read from there (stored normalized: `recipes/../data/x.jsonl` -> `data/x.jsonl`). Anything else (a
    path that exists here, an absolute path, a Hub id) is left as written. `~/` starts at the home folder, as on
    a command line (no Hub id starts with `~`; a folder literally named `~` in the working directory was made)."""
    for key in ("model", "tokenizer", "dataset", "output_dir"):
        v = values.get(key)
        if isinstance(v, str) and (v == "~" or v.startswith("~/")):
            values[key] = os.path.expanduser(v)
    for key in ("model", "tokenizer", "dataset"):
        v = values.get(key)
        if isinstance(v, str) and v and not os.path.isabs(v) and not _exists(v) and _exists(recipe_dir / v):
            values[key] = os.path.normpath(recipe_dir / v)
    return values


def _exists(path: str | Path) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):  # a name too long for the filesystem is no file
        return False


# What hsx and transformers' apply_chat_template give the template themselves (the method's parameters, the
# conversation as `messages`, the tokenizer's special tokens): a chat_template_kwargs key of these names would
# replace them, or change how the render is tokenized, behind hsx's back.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens", "extra_special_tokens"})


def check_config(cfg: ExtractConfig, required: tuple[str, ...] = REQUIRED,
                 parsed: Collection[str] = ()) -> ExtractConfig:
    """Every key's type and range (as `parse_value`; the keys in `parsed` were already, and are not parsed again),
    then what keys require of each other. A default is checked too: the empty `layers` is '--layers is required'.
    Returns the config with its values parsed ('1,-1' -> [1, -1]) as a new one: the caller's is left as it was."""
    layers_from = parse_value("layers_from", cfg.layers_from)
    no_layers = cfg.layers in ([], "", ())
    if layers_from and not no_layers:
        raise HsxError("--layers and --layers-from both choose the layers: give one")
    # no layers: a policy-only job (--teacher-policy K alone stores the policy, no hidden states)
    policy_only = no_layers and not layers_from and parse_value("teacher_policy", cfg.teacher_policy) > 0
    skip = set(parsed) | ({"layers"} if (layers_from or policy_only) and no_layers else set())
    cfg = dataclasses.replace(cfg, **{name: parse_value(name, getattr(cfg, name)) for name in FIELDS
                                      if name not in skip})
    for name in required:
        if not getattr(cfg, name):
            raise HsxError(f"--{name.replace('_', '-')} is required")
    if cfg.push_to_hub:
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(cfg.push_to_hub)
        except ValueError as e:
            raise HsxError(f"--push-to-hub {cfg.push_to_hub!r}: {e}") from None
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(cfg.chat_template_kwargs))
    if reserved:
        raise HsxError(f"chat_template_kwargs may not set {', '.join(reserved)}: hsx passes "
                       f"{'it' if len(reserved) == 1 else 'them'} to the template itself")
    if cfg.delete_after_upload and not (cfg.push_to_hub and cfg.push_mode == "stream"):
        raise HsxError("--delete-after-upload needs --push-to-hub REPO and --push-mode stream")
    if cfg.hub_overwrite and not cfg.push_to_hub:
        raise HsxError("--hub-overwrite needs --push-to-hub REPO")
    if cfg.teacher_top_p > 1:
        raise HsxError(f"teacher_top_p must be at most 1 (a probability mass), got {cfg.teacher_top_p}")
    if (cfg.teacher_top_p != 1 or cfg.teacher_temperature != 1) and not cfg.teacher_policy:
        raise HsxError("--teacher-top-p and --teacher-temperature shape --teacher-policy K: give it too")
    if cfg.tp_size > 1 and cfg.gpus_per_copy > 1:
        raise HsxError("--tp-size and --gpus-per-copy are two ways to split a model copy: choose one")
    if cfg.elastic is not None and not cfg.elastic.strip():  # (an empty one ran silently as a fixed split)
        raise UsageError("--elastic '': give HOST:PORT, the address of torchrun's --rdzv-endpoint (or leave "
                         "--elastic out for a fixed split of the units)")
    if cfg.ep_size > 1 and (cfg.tp_size > 1 or cfg.gpus_per_copy > 1):
        raise HsxError("--ep-size shards the experts over processes that each run a whole copy of the rest; it does "
                       "not combine with --tp-size or --gpus-per-copy: choose one")
    if cfg.ep_size > 1 and cfg.elastic:
        raise HsxError("--ep-size with --elastic is not supported yet: an expert-parallel group runs in lockstep "
                       "over a process group, and --elastic ranks share none (docs/scale-out.md)")
    return cfg


def check_topk_logits(topk_logits: int, vocab_size: int, flag: str = "--topk-logits") -> None:
    """Top-k of a vocabulary of V needs k <= V (known once the model's config is read)."""
    if topk_logits > vocab_size:
        raise HsxError(f"{flag} {topk_logits} is more than the model's vocabulary ({vocab_size} tokens)")


def target_layers(cfg: ExtractConfig, text_config, resolved: tuple[list[int], bool] | None = None,
                  draft=None) -> tuple[list[int], bool]:
    """The layers and final-norm choice `cfg` asks of a model with this text config (or `resolved`, those of a model
    loaded already), refused as extract and plan both refuse them: an output format that cannot be written
    (`schema.OutputFormat.problem`), a top-k larger than the vocabulary. With --layers-from, the draft's
    (`draft`: hsx.drafts.DraftLayers, read here when not given)."""
    from hsx.schema import OutputFormat

    if resolved is None and cfg.layers_from:
        from hsx.drafts import draft_layers

        draft = draft or draft_layers(cfg.layers_from, text_config)
        resolved = draft.layers, cfg.final_hidden or draft.final_hidden
    layers, final_hidden = resolved or resolve_layers(cfg.layers or [], int(text_config.num_hidden_layers),
                                                      cfg.final_hidden)
    problem = OutputFormat.of_job(cfg, layers, text_config.hidden_size, final_hidden).problem()
    if problem:
        raise UsageError(problem)
    check_topk_logits(cfg.topk_logits, int(text_config.vocab_size))
    check_topk_logits(cfg.teacher_policy, int(text_config.vocab_size), "--teacher-policy")
    return layers, final_hidden


# ---- layers -------------------------------------------------------------------------------------------------

PRESET_RE = re.compile(r"(eagle3|dflash(?:-([0-9]{1,6}))?)")  # fullmatch; K of 7+ digits is no model's depth
LAYERS_HELP = "expected integers (negatives count from the end) or one preset (eagle3, dflash, dflash-K)"


def parse_layer_spec(spec: list | str | int) -> list[int] | str:
    """Normalise `1,-1`, `[1, -1]`, `"1 -1"`, `["1", "-1"]` to [1, -1]; leave a preset name as a string (it needs
    N). Booleans, floats, nested lists and anything else are refused (UsageError), never converted."""
    if type(spec) is int:
        return [spec]
    if isinstance(spec, str):
        s = spec.strip()
        if PRESET_RE.fullmatch(s):
            return s
        tokens = [t for t in re.split(r"[,\s]+", s) if t]
    elif isinstance(spec, (list, tuple)):
        if len(spec) == 1 and isinstance(spec[0], str):
            return parse_layer_spec(spec[0])
        tokens = []
        for item in spec:
            if type(item) is int:
                tokens.append(str(item))
            elif isinstance(item, str):
                tokens += [t for t in re.split(r"[,\s]+", item.strip()) if t]
            else:
                raise UsageError(f"--layers: {_shown(item)} is not a layer; {LAYERS_HELP}")
    else:
        raise UsageError(f"--layers {_shown(spec)}: {LAYERS_HELP}")
    if not all(re.fullmatch(r"[-+]?[0-9]+", t) for t in tokens):
        raise UsageError(f"--layers {_shown(spec)}: {LAYERS_HELP}")
    if any(len(t) > 12 for t in tokens):  # (Python refuses to parse ints of over 4300 digits)
        raise UsageError(f"--layers {_shown(spec)}: layer index out of range")
    return [int(t) for t in tokens]


def preset_layers(name: str, num_layers: int) -> tuple[list[int], bool]:
    """Layers and whether the final-norm state is included, for a preset on a model of `num_layers` layers."""
    n = num_layers
    m = PRESET_RE.fullmatch(name)
    if not m:
        raise UsageError(f"unknown layer preset {name!r}; known: eagle3, dflash, dflash-K")
    if name == "eagle3":
        return [1, n // 2 - 1, n - 4], True
    k = int(m.group(2)) if m.group(2) else 5
    if k < 1:
        raise UsageError(f"layer preset {name!r}: K must be at least 1")
    if k == 1:
        return [n // 2], False
    if k > n - 3:  # K layers spread over 1..N-3: more than N-3 of them must repeat (checked before building any)
        raise UsageError(f"layer preset {name!r}: {k} layers spread over 1..{n - 3} of a model with {n} layers "
                       f"would be duplicates; K can be at most {max(1, n - 3)} here")
    return [round(1 + j * (n - 4) / (k - 1)) for j in range(k)], False


def resolve_layers(spec: list[int] | str, num_layers: int, final_hidden: bool) -> tuple[list[int], bool]:
    """Turn a layer spec into sorted non-negative indices (and the final-hidden flag a preset may add). A layer
    the model does not have, or a duplicate, is a wrong argument: UsageError (exit 2)."""
    if isinstance(spec, str):
        layers, preset_final = preset_layers(spec, num_layers)
        final_hidden = final_hidden or preset_final
        where = f"preset {spec!r}"
    else:
        layers, where = list(spec), "--layers"
    resolved = []
    for i in layers:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise UsageError(f"{where}: layer {i} is out of range for a model with {num_layers} layers "
                           f"(valid: {-num_layers}..{num_layers - 1})")
        resolved.append(j)
    if len(set(resolved)) != len(resolved):
        raise UsageError(f"{where}: duplicate layers {layers} (resolved: {resolved})")
    return sorted(resolved), final_hidden


def layers_run(num_layers: int, layers: list[int], final_hidden: bool) -> int:
    """How many decoder layers a job runs: up to the deepest stored one, or all of them for the final-norm state
    (the norm follows the last layer)."""
    return num_layers if final_hidden else max(layers) + 1


# ---- hsx regenerate ---------------------------------------------------------------------------------------------

REGENERATE_TURNS = ("all", "last")  # hsx.regenerate: which assistant turns are asked of the target
REGENERATE_ROWS = ("per-conversation", "per-turn")  # hsx.regenerate: one output row per conversation, or per answer


@dataclass
class RegenerateConfig:
    """`hsx regenerate`'s keys (docs/regenerate.md): the target's own answers for a dataset's prompts, written as a
    dataset `hsx extract --dataset` reads."""
    # What to run and on what (as extract's keys).
    model: str = _key("", help="local folder or Hub id of the target model (its tokenizer and chat template; the "
                      "model itself runs in-process unless --servers is given)")
    tokenizer: str | None = _key(None, help="tokenizer folder or Hub id (default: the model's)")
    dataset: str = _key("", help="Hub id, or a local .jsonl/.json/.parquet/.arrow/.csv file or folder (chat rows: "
                        "messages, conversations, prompt[+completion])")
    dataset_config: str | None = _key(None, help="the dataset's configuration name")
    split: str = _key("train", help="input split (slicing like train[:1000] works)")
    limit: int | None = _key(None, minimum=1, help="only the first N input rows: for trying a recipe out")
    allow_empty: bool = _key(False, help="an input of no rows succeeds with an empty output instead of failing")
    output_dir: str = _key("", help="where the regenerated dataset goes; rerunning the same command there "
                           "continues the job")
    overwrite: bool = _key(False, help="delete what hsx regenerate wrote in --output-dir and start over")
    # The engine.
    servers: str | None = _key(None, help="comma-separated base URLs of OpenAI-compatible servers (vLLM, SGLang, "
                               "`transformers serve`), e.g. http://host:8000/v1; default: the model in-process on "
                               "transformers' continuous batching")
    served_model_name: str | None = _key(None, help="the model name sent to the servers (default: --model)")
    concurrency: int = _key(32, minimum=1, maximum=(4096, "threads per server"),
                            help="requests in flight per server (in-process: per batch of the continuous batcher)")
    timeout: float = _key(600.0, minimum=1.0, help="seconds one request may take before it is retried elsewhere")
    retries: int = _key(3, minimum=0, maximum=(100, "attempts per request"),
                        help="retries of a failed request (with backoff, on the least loaded other server)")
    dtype: str = _key("auto", choices=("auto", *COMPUTE_DTYPES), help="in-process: compute dtype (auto: "
                      "bfloat16 on CUDA, float32 on CPU)")
    trust_remote_code: bool = _key(False, help="run the model repo's own code (in-process)")
    # Sampling.
    temperature: float = _key(0.0, minimum=0.0, help="sampling temperature (0: greedy)")
    top_p: float = _key(1.0, minimum=0.0, help="nucleus sampling: keep the smallest set of tokens of this total "
                        "probability (1: off)")
    top_k: int = _key(0, minimum=0, maximum=TOKENS_INT32, help="keep the K most likely tokens (0: off)")
    max_new_tokens: int = _key(2048, minimum=1, maximum=TOKENS_INT32, help="longest answer, in tokens; longer ones "
                               "are cut and flagged (finish_reason length)")
    seed: int = _key(0, minimum=0, maximum=(2**31 - 1, "seeds are int32 on servers"), help="sampling seed (each "
                     "conversation and sample gets its own, derived from it)")
    n: int = _key(1, minimum=1, maximum=(1024, "samples per conversation"), help="answers (samples) per "
                  "conversation, each one output row")
    # What is regenerated, and how it is kept.
    turns: str = _key("all", choices=REGENERATE_TURNS, help="all: every assistant turn in order, each conditioned on "
                      "the regenerated ones before it; last: only the final answer")
    rows: str = _key("per-conversation", choices=REGENERATE_ROWS, help="per-conversation: one output row holding "
                     "every regenerated answer; per-turn: one row per regenerated answer, ending at it and "
                     "supervised on it alone (SpecForge's and speculators' layout; the fix for templates that "
                     "rewrite earlier turns, such as Qwen3's dropped reasoning)")
    enable_thinking: bool | None = _key(None, help="the chat template's thinking switch (Qwen3, SmolLM3, ...): sets "
                                        "chat_template_kwargs' enable_thinking")
    chat_template_kwargs: dict[str, Any] = _key(default_factory=dict, help="JSON object passed to the chat "
                                                "template, e.g. '{\"enable_thinking\": false}' (give extract the same)")
    reasoning: str = _key("keep", choices=("keep", "drop"), help="keep the answer's reasoning (think block, or a "
                          "server's reasoning_content) in the stored answer, or drop it (the answer's token ids are "
                          "then not stored)")
    cut_answers: str = _key("keep", choices=("keep", "skip"), help="answers cut by --max-new-tokens: keep (the "
                            "conversation ends there; extract leaves the end-of-turn the template adds unsupervised) "
                            "or skip the conversation (counted)")
    unit_size: int = _key(256, minimum=1, maximum=(1 << 20, "conversations per unit"), help="input rows per output "
                          "file, the grain of commit and resume")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


REGENERATE_KEYS = Keys.of(RegenerateConfig)


def regenerate_config_from(options: Mapping[str, Any]) -> RegenerateConfig:
    """A RegenerateConfig from keyword options or a recipe merged with flags: unknown keys, wrong types and
    out-of-range values are HsxError, one line naming the key."""
    unknown = sorted(str(k) for k in options if k not in REGENERATE_KEYS.fields)
    if unknown:
        raise HsxError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(REGENERATE_KEYS.fields)}")
    values = {k: parse_value(k, v, REGENERATE_KEYS) for k, v in options.items()}
    cfg = RegenerateConfig(**values)
    for name in REGENERATE_KEYS.fields:  # (a config built in Python: its defaults and values checked too)
        if name not in values:
            parse_value(name, getattr(cfg, name), REGENERATE_KEYS)
    for name in ("model", "dataset", "output_dir"):
        if not getattr(cfg, name):
            raise HsxError(f"--{name.replace('_', '-')} is required")
    if cfg.top_p > 1 or cfg.top_p == 0:
        raise HsxError(f"top_p must be in (0, 1], got {cfg.top_p}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(cfg.chat_template_kwargs))
    if reserved:
        raise HsxError(f"chat_template_kwargs may not set {', '.join(reserved)}: hsx passes "
                       f"{'it' if len(reserved) == 1 else 'them'} to the template itself")
    if cfg.enable_thinking is not None:
        kwargs = cfg.chat_template_kwargs
        if kwargs.get("enable_thinking", cfg.enable_thinking) != cfg.enable_thinking:
            raise HsxError("enable_thinking and chat_template_kwargs' enable_thinking disagree: give one")
        cfg = dataclasses.replace(cfg, chat_template_kwargs={**kwargs, "enable_thinking": cfg.enable_thinking})
    return cfg


def load_regenerate_config(path: str | None, overrides: dict[str, Any]) -> RegenerateConfig:
    """`hsx regenerate`'s config from a YAML recipe (optional) and flag overrides (None: not given); every problem
    is a UsageError (exit 2), found before anything is read."""
    values: dict[str, Any] = {}
    try:
        if path:
            values = _resolve_recipe_paths(read_recipe(path, REGENERATE_KEYS), Path(path).parent)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return regenerate_config_from(values)
    except UsageError:
        raise
    except HsxError as e:
        raise UsageError(str(e)) from None
