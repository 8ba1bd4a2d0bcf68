"""Data: sources and dataset formats, partitions, federated and node data, synthetic generators, client sampling."""
