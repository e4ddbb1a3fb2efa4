"""`python -m hsx ...` is the `hsx` command; it is what every process of `hsx launch` (or `accelerate launch -m hsx`,
torchrun -m hsx) runs."""

from hsx.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
