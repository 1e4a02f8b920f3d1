"""ProtoNN compression of a client's datastore (training side). Inference math lives in
edge_runtime so devices need no torch."""
