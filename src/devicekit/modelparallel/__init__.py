"""devicekit.modelparallel: one model over several devices: split, pipeline, partition, plans."""
