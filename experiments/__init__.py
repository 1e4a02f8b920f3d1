"""The paper's experiments, one command each (`knnper experiment NAME --out DIR`): the layer above
export and benchmarks, so it may use all of them."""
