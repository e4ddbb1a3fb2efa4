"""hsx: hidden states out of chosen layers of a Hugging Face causal LM, fast, into an Arrow dataset.

The package reads top to bottom as the data flow:
config → data → buckets → model → capture → extract → sink → load → export / vocab (trainers' layouts, the
draft vocabulary), with run wiring them together
(the only module that knows about processes and ranks) and cli parsing the command line.
"""

__version__ = "0.1.0"

from hsx.load import collate, load, torch_stream, torch_view  # noqa: E402  (consumer side)
from hsx.export import export_specforge, export_speculators  # noqa: E402

__all__ = ["__version__", "load", "torch_view", "torch_stream", "collate", "export_specforge", "export_speculators"]
