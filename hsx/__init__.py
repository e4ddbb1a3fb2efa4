"""hsx: hidden states out of chosen layers of a Hugging Face causal LM, fast, into an Arrow dataset.

The Python API: running a job (`hsx.extract`, `hsx.regenerate`), streaming one (`hsx.stream`), pricing one
(`hsx.plan`), and reading an output (`hsx.load`, `hsx.torch_view`, `hsx.follow`, ...) or exporting it for a
drafter trainer (`hsx.export_*`, hsx.exports' table). The package's map, module by module in data-flow order, is
docs/design.md ("The code, in data-flow order"), held true by tests/test_imports.py and tests/test_docs.py.
"""

from hsx.version import __version__
from hsx.api import extract, plan, regenerate, stream  # noqa: E402  (running a job, streaming one, planning one)
from hsx.load import collate, load, read_info, torch_stream, torch_view  # noqa: E402  (consumer side)
from hsx.follow import follow  # noqa: E402  (train while extracting)
from hsx.exports import EXPORTS as _EXPORTS  # noqa: E402  (the trainer exports, imported on first use)

__all__ = ["__version__", "extract", "regenerate", "stream", "plan", "load", "read_info", "torch_view", "torch_stream",
           "collate", "follow", *(spec.function for spec in _EXPORTS)]


def __getattr__(name: str):
    """The trainer exports, imported on first use: they need the output dir's machinery (and with it yaml and the
    rest of hsx.config), which `import hsx` keeps out of a notebook's start."""
    if name in {spec.function for spec in _EXPORTS}:
        from hsx import export

        return getattr(export, name)
    raise AttributeError(f"module 'hsx' has no attribute {name!r}")
