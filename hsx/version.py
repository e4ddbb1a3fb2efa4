"""The version of hsx: the one place the number is written (pyproject.toml reads it; hsx.json records it).
A module of its own so that the library below `hsx` (the package's API) can name it without importing upward."""

__version__ = "0.1.0"
