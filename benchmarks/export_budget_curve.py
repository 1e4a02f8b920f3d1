"""Thin script: the code is experiments.budget_curve (shared with `knnper experiment`); see its
docstring for what it measures and its flags."""

import sys

from experiments.budget_curve import main

if __name__ == "__main__":
    sys.exit(main())
