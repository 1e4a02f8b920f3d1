"""Server side of kNN-Per: data, partitions, models, federated algorithms, simulation and
evaluation.

The face: `RunConfig` and `train` make a run directory that `load_run` reads back
(`LoadedRun`); `evaluate_run` scores methods on it; `build_algorithm` (by name, `ALGORITHMS`)
with a `TrainingConfig` and `simulate` are the loop underneath; `load_dataset`,
`make_partition` and `build_model` are its parts."""

from edge_runtime.face import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__,
    {
        "RunConfig": "run",
        "LoadedRun": "run",
        "train": "run",
        "load_run": "run",
        "evaluate_run": "run_evaluation",
        "ALGORITHMS": "algorithms",
        "build_algorithm": "algorithms",
        "TrainingConfig": "training_config",
        "ClientData": "algorithms.base",
        "simulate": "simulation",
        "Dataset": "data",
        "load_dataset": "data",
        "Partition": "partition",
        "make_partition": "partition",
        "EmbedHeadModel": "models",
        "build_model": "models",
        "KnnperError": "errors",
    },
)
