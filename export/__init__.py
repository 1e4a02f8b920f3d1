"""From a finished run to per-device bundles: ONNX export, int8 quantization, budget-driven
datastore choice, bundle writing.

The face: `export_run` writes one bundle per client within its `Budget` (edge_runtime's),
with `ExportSettings`; the budget profiles (`uniform_budgets`, `weak_strong_budgets`,
`lognormal_budgets`, `load_budgets`) give each client its total; `run_demo` is `knnper demo`."""

from edge_runtime.face import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__,
    {
        "export_run": "exporter",
        "ExportSettings": "exporter",
        "build_encoder": "exporter",
        "uniform_budgets": "profiles",
        "weak_strong_budgets": "profiles",
        "lognormal_budgets": "profiles",
        "load_budgets": "profiles",
        "run_demo": "demo",
        "ExportError": "errors",
        "BudgetInvalid": "errors",
    },
)
