"""From a finished run to per-device bundles: ONNX export, int8 quantization, budget-driven
datastore choice, bundle writing."""
