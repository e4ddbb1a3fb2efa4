"""The trainer exports, one table: `hsx --help`'s `export-*` subcommands (hsx.cli), what runs them
(hsx.commands) and hsx's lazily imported `hsx.export_*` functions (hsx/__init__.py) are read from it. An export is
its function in hsx.export, its row here, and its own flags in hsx.cli. It imports nothing, so `import hsx` and
`hsx --help` stay light."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Export:
    function: str  # hsx.export's function, and the hsx attribute of that name
    summary: str  # the subcommand's line in `hsx --help`
    options: tuple[str, ...]  # the keyword arguments the subcommand passes on from its flags of the same names

    @property
    def command(self) -> str:
        """The subcommand: `hsx export-specforge` runs hsx.export.export_specforge."""
        return self.function.replace("_", "-")


EXPORTS: tuple[Export, ...] = (
    Export("export_specforge", "write an output as SpecForge's offline EAGLE-3, DFlash or DSpark files",
           ("layers", "layout", "overwrite", "delete_source")),
    Export("export_speculators", "write an output as speculators' offline training dir",
           ("layers", "draft_vocab_size", "overwrite", "delete_source")),
)
