"""Device-side kNN-Per: numpy + onnxruntime only (hnswlib optional). Imports nothing from the
server-side packages, so a device can install it without torch."""
