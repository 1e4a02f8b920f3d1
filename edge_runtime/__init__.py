"""Device-side kNN-Per: numpy + onnxruntime only (hnswlib optional). Imports nothing from the
server-side packages, so a device can install it without torch.

The face: `Runtime` loads a bundle and predicts (`predict_proba`, `add`); `write_bundle` /
`read_bundle` write and verify one (from the `BundleFields` its writer decides), whose
`Manifest` says what it holds (its encoder's `InputSpec`...) and which `ModelVersion` it
runs; `make_datastore` builds a flat, HNSW or ProtoNN datastore
from its recipe string (a new backend: `register_backend`, and `check_backend` checks it);
`PersonalHead` is kNN-Per's interpolation of the kNN, the global model
and an optional `LinearHead`, chosen per client on validation (`ClientSplits`); `Budget` is a
device's bytes; `init_bundle` builds a bundle on the device from its own data;
`write_portable` writes the one-file ONNX predictor."""

import os as _os
import sys as _sys

if _sys.argv and _os.path.basename(_sys.argv[0]) in ("knnper-edge", "knnper"):
    # a console script: Ctrl-C is one line and 130 from here on, not a traceback from inside
    # an import (the script's own handling takes over once its modules are loaded)
    from .interrupt import exit_while_starting

    exit_while_starting(_os.path.basename(_sys.argv[0]))
del _os, _sys

from .face import lazy_face  # noqa: E402

__all__, __getattr__, __dir__ = lazy_face(
    __name__,
    {
        "Runtime": "runtime",
        "UpdateReport": "runtime",
        "Bundle": "bundle",
        "read_bundle": "bundle",
        "write_bundle": "bundle",
        "BundleFields": "manifest",
        "InputSpec": "preprocess",
        "Manifest": "manifest",
        "ModelVersion": "versions",
        "make_datastore": "datastores",
        "BaseDatastore": "datastores",
        "register_backend": "datastores",
        "check_backend": "datastores",
        "KNNHead": "knn",
        "PersonalHead": "personal_head",
        "ClientSplits": "personal_head",
        "LinearHead": "linear_head",
        "Budget": "budget",
        "init_bundle": "device_init",
        "InitSettings": "device_choice",
        "write_portable": "portable",
        "generate_key_pair": "signing",
        "BundleError": "errors",
        "BudgetExceeded": "errors",
        "BundleBusy": "errors",
        "SignatureError": "errors",
    },
)
