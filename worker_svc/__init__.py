"""Worker service: resolve SHM features, encode, run the model, sample."""
