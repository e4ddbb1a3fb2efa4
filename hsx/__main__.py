"""`python -m hsx ...` and `accelerate launch -m hsx ...` are the same as the `hsx` command."""

from hsx.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
