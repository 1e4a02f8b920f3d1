"""Thin script: the code is experiments.distribution_shift (shared with `knnper experiment`);
see its docstring for what it measures and its flags."""

import sys

from experiments.distribution_shift import main

if __name__ == "__main__":
    sys.exit(main())
