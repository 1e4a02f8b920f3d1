"""The paper's experiments, one command each (`knnper experiment NAME --out DIR`): the layer above
export and benchmarks, so it may use all of them.

The face: `EXPERIMENTS` by name; `run_table` / `run_seeds` are `knnper bench table` (one
partition, or several seeds), run as `TableOptions` says."""

from edge_runtime.face import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__,
    {
        "EXPERIMENTS": "registry",
        "run_table": "tables",
        "run_seeds": "tables",
        "TableOptions": "tables",
        "BenchError": "tables",
    },
)
