"""hsx: hidden states out of chosen layers of a Hugging Face causal LM, fast, into an Arrow dataset.

The package reads top to bottom as the data flow:
config → data → buckets → model → capture → engine → sink → load → export / vocab (trainers' layouts, the
draft vocabulary), with job (the job's steps: claim → tokenize → units → engine → commit → finish) and run
(running them as one rank of a launch: the only module that knows about processes and ranks), cost pricing a job
before it runs, card describing the output, errors naming what goes wrong, and on top cli and commands (the command
line) and api (`hsx.extract()`, `hsx.stream()` and `hsx.plan()`, the same jobs from Python).
"""

from hsx.version import __version__
from hsx.api import extract, plan, regenerate, stream  # noqa: E402  (running a job, streaming one, planning one)
from hsx.load import collate, load, read_info, torch_stream, torch_view  # noqa: E402  (consumer side)
from hsx.follow import follow  # noqa: E402  (train while extracting)

__all__ = ["__version__", "extract", "regenerate", "stream", "plan", "load", "read_info", "torch_view", "torch_stream", "collate", "follow", "export_specforge", "export_speculators"]


def __getattr__(name: str):
    """The trainer exports, imported on first use: they need the output dir's machinery (and with it yaml and the
    rest of hsx.config), which `import hsx` keeps out of a notebook's start."""
    if name in ("export_specforge", "export_speculators"):
        from hsx import export

        return getattr(export, name)
    raise AttributeError(f"module 'hsx' has no attribute {name!r}")
