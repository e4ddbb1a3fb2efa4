"""`python -m hsx.demo` regenerates the shipped demo assets in this folder."""

from hsx.demo import main

if __name__ == "__main__":
    main()
