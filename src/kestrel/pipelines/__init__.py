"""Input pipelines: turning files on disk into the tensors a checkpoint expects."""
