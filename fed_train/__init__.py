"""Server side of kNN-Per: data, partitions, models, federated algorithms, simulation and
evaluation."""
