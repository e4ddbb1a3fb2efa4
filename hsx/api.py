"""The Python API, for notebooks and scripts: `hsx.extract(...)` runs the job `hsx extract` runs and returns its
rows; `hsx.plan(...)` returns the plan `hsx plan --json` prints.

Both take the recipe's keys as keyword arguments (`model=`, `dataset=`, `layers=[1, -1]`, `output_dir=`, ...),
or `config="recipes/X.yaml"` plus keywords that override its keys, and parse them as the CLI parses a recipe and
its flags (hsx.config): an unknown key, a wrong type or a quoted boolean is an HsxError of one line. Heavy
imports (torch, datasets, transformers, and the config's yaml) happen on the call, not at `import hsx`.
"""

from __future__ import annotations

import os
from typing import Any



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
    summary line are printed as by the CLI. Under `accelerate launch` (several processes, one job), a process whose units are
    written while others still run returns None: the last one to finish writes hsx.json and returns the rows."""
    from hsx.config import load_config
    from hsx.load import load
    from hsx.run import extract as run_extract

    config, options = _paths_as_text(config, options)
    cfg = load_config(config, options)
    if run_extract(cfg).get("complete") is False:  # this rank's part is done; another rank finalizes
        return None
    return load(cfg.output_dir)


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
