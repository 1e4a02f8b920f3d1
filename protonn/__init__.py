"""ProtoNN compression of a client's datastore (training side). Inference math lives in
edge_runtime so devices need no torch.

The face: `ProtoNNClassifier`, scikit-learn style (`fit`, `predict_proba`)."""

from edge_runtime.face import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"ProtoNNClassifier": "training"})
