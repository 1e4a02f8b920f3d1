"""Thin script: the code is experiments.protonn_grid (shared with `knnper experiment`); see its
docstring for what it measures and its flags."""

import sys

from experiments.protonn_grid import main

if __name__ == "__main__":
    sys.exit(main())
