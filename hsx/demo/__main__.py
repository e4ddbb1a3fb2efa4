"""`python -m hsx.demo` regenerates the shipped demo assets in this folder, training the model's weights."""

from hsx.demo import main

if __name__ == "__main__":
    main()
