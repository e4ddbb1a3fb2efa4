"""The Python API, for notebooks and scripts: `hsx.extract(...)` runs the job `hsx extract` runs and returns its
rows; `hsx.stream(...)` runs the same job without writing it and yields its rows to a training loop in the same
process; `hsx.plan(...)` returns the plan `hsx plan --json` prints.

All take the recipe's keys as keyword arguments (`model=`, `dataset=`, `layers=[1, -1]`, `output_dir=`, ...),
or `config="recipes/X.yaml"` plus keywords that override its keys, and parse them as the CLI parses a recipe and
its flags (hsx.config): an unknown key, a wrong type or a quoted boolean is an HsxError of one line. Heavy
imports (torch, datasets, transformers, and the config's yaml) happen on the call, not at `import hsx`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
from typing import Any

# The options that only concern what `hsx extract` writes: the output dir, resuming it, publishing it.
OUTPUT_OPTIONS = ("output_dir", "overwrite", "check_crc", "push_to_hub", "push_mode", "delete_after_upload",
                  "hub_private", "hub_revision", "hub_overwrite", "max_pending_gb")


def _paths_as_text(config, options: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """A pathlib.Path (or any os.PathLike) given for the recipe or a key means its path, as on the command line."""
    from hsx.errors import UsageError

    if config is not None and not isinstance(config, (str, os.PathLike)):
        raise UsageError(f"config must be the path of a YAML recipe, got {type(config).__name__}")
    return (None if config is None else os.fspath(config),
            {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in options.items()})


def extract(config: str | os.PathLike | None = None, **options: Any):
    """Run (or continue) an extraction job and return its rows, a `datasets.Dataset` (what `hsx.load(output_dir)`
    returns: memory-mapped, no copy).

    `hsx.extract(model="Qwen/Qwen3-8B", dataset="chats.jsonl", layers="eagle3", output_dir="out/q")`, or
    `hsx.extract(config="recipes/eagle3-qwen3-8b.yaml", output_dir="out/q", limit=1000)`. Calling it again with
    the same options continues the job where it stopped, and is a no-op once it is complete; progress and the
    summary line are printed as by the CLI. Under `accelerate launch` (several processes, one job), a process whose
    units are written while others still run returns None: the last one to finish writes hsx.json and returns the
    rows. `hsx.stream` runs the same job without writing it."""
    from hsx.config import load_config
    from hsx.load import load
    from hsx.run import extract as run_extract

    config, options = _paths_as_text(config, options)
    cfg = load_config(config, options)
    if run_extract(cfg).get("complete") is False:  # this rank's part is done; another rank finalizes
        return None
    return load(cfg.output_dir)


def regenerate(config: str | os.PathLike | None = None, **options: Any) -> dict[str, Any]:
    """Run (or continue) `hsx regenerate`: the target's own answers for a dataset's conversations, written to
    `output_dir` as a dataset `hsx.extract(dataset=output_dir, ...)` reads (docs/regenerate.md). Takes its recipe's
    keys as keywords (`model=`, `dataset=`, `output_dir=`, `servers=`, `temperature=`, `n=`, ...), or
    `config="recipes/X.yaml"` plus keywords that override them; returns the job's summary (`complete`, `written`,
    `skipped` and `errors` by reason, counted in conversations; `rows_written`, `answers`, `tokens`). Calling it
    again continues the job."""
    from hsx.config import load_regenerate_config
    from hsx.regeneration import regenerate as run_regenerate

    config, options = _paths_as_text(config, options)
    return run_regenerate(load_regenerate_config(config, options))


def stream(config: str | os.PathLike | None = None, **options: Any) -> Stream:
    """The job's rows, computed as `hsx.extract` computes them (tokenize → length buckets → model → engine, the
    same steps and code) and handed to you instead of written: for a training loop on the machine the model runs
    on. Takes `hsx.extract`'s options, except that it writes nothing:

    - the options about the output (`output_dir`, `overwrite`, `check_crc`, `push_to_hub`, `push_mode`,
      `delete_after_upload`, `hub_private`, `hub_revision`, `hub_overwrite`, `max_pending_gb`) given as keywords
      are an error; the same keys in the recipe are ignored, so an extract recipe streams as it is. `tp_size` > 1
      is refused (a whole model copy runs in each process; `gpus_per_copy` spreads one over this process's GPUs).
    - each row is a dict of CPU torch tensors, exactly `hsx.torch_view`'s row of the written output for the same
      options (bit for bit): `sample_id`, `num_tokens`, `input_ids` and `loss_mask` (T,), `hidden_states`
      (T, layers, hidden), `final_hidden_state` (T, hidden) with final_hidden, `topk_*` with topk_logits,
      `has_nonfinite` with nonfinite keep; fp8 states come dequantized to bfloat16. Batch them with
      `hsx.collate` (README, "Use with your trainer"), then move the batch to the GPU: the engine's output
      already comes to the host through pinned memory, overlapped with the next forwards.
    - rows come in the output's order (length bucket, then sample_id): shuffle within a buffer if the trainer
      needs it. `sample_id` is the input row's index, as in the written output.
    - `.counts` says what happened so far, in hsx.json's terms (`rows_in`, `truncated`, `skipped` by reason,
      and this process's `rows` and `tokens`); complete once the last row is read.
    - tokenized rows are cached in datasets' cache (HF_DATASETS_CACHE/hsx/), so a second epoch tokenizes nothing.
    - under `accelerate launch`/torchrun, each process streams its share of the units (the split `hsx extract`
      uses; shares differ by up to one unit's tokens, so let the loop handle uneven ends, e.g. stop at the shortest
      rank or accelerate's `join_uneven_inputs`); create your Accelerator before reading the stream.
    - it is a generator: `break`, `close()`, or an exception inside `with hsx.stream(...) as rows:` stops the
      GPU thread and drops the model and its buffers (a bare `for` left by an exception holds them until its
      traceback goes: use `with`). Nothing runs until the first row is asked for. It hands its rows out once:
      iterating it again after it ended (closed, or read to its end) is an HsxError, never 0 rows.
    """
    from hsx.config import ExtractConfig, UsageError, load_config

    config, options = _paths_as_text(config, options)
    given = sorted(k for k in OUTPUT_OPTIONS if options.get(k) is not None)
    if given:
        raise UsageError(f"hsx.stream writes nothing, so it takes no {', '.join(given)} (hsx.extract does)")
    cfg = load_config(config, options, required=("model", "dataset"))
    default = ExtractConfig()
    return Stream(dataclasses.replace(cfg, **{k: getattr(default, k) for k in OUTPUT_OPTIONS}))


class Stream(collections.abc.Generator):
    """`hsx.stream`'s rows: a generator (iterate it, `close()` it, or use it as a context manager) with `counts`.
    A loop left by `break` drops it, and Python closes the generator inside it then (its `finally` stops the GPU
    thread).

    It hands its rows out once: iterating it again once it has ended (closed, or every row read) raises
    HsxError, where a plain generator would give 0 rows and a training loop's next epoch would silently be empty.
    Call `hsx.stream(...)` again for another pass."""

    def __init__(self, cfg, log=print, model=None):
        from hsx.job import StreamCounts
        from hsx.run import stream as run_stream

        self._counts = StreamCounts()
        self._rows = run_stream(cfg, self._counts, log, model)
        self._ended: str | None = None  # "closed" or "read to its end"

    @property
    def counts(self) -> dict[str, Any]:
        return self._counts.as_dict()

    def _check_open(self) -> None:
        if self._ended is not None:
            from hsx.errors import HsxError

            raise HsxError(f"this hsx.stream was {self._ended}: a stream hands its rows out once; call "
                           "hsx.stream(...) again for another pass")

    def __iter__(self) -> Stream:
        self._check_open()
        return self

    def send(self, value):
        self._check_open()
        try:
            return self._rows.send(value)
        except StopIteration:
            self._ended = "read to its end"
            raise

    def throw(self, *exc):
        return self._rows.throw(*exc)

    def close(self) -> None:
        self._rows.close()
        self._ended = self._ended or "closed"

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan(config: str | os.PathLike | None = None, *, shape: str | None = None, tokens: int | None = None,
         gpu: str | None = None, gpu_memory_gib: float | None = None, rate: float | None = None,
         **options: Any) -> dict[str, Any]:
    """A job's weights, memory, token budget, GPUs, disk and time before it runs: the dict `hsx plan --json`
    prints for the same recipe and keys (`shape`, `tokens`, `gpu`, `gpu_memory_gib` and `rate` are the plan's
    own flags). Offline for local models and the shapes that ship in hsx.cost; nothing is downloaded."""
    from hsx.cost import DEFAULT_GPU, job_plan

    config, options = _paths_as_text(config, options)
    return job_plan(config, options, shape=shape, tokens=tokens, gpu=gpu or DEFAULT_GPU,
                    gpu_memory_gib=gpu_memory_gib, rate=rate)
