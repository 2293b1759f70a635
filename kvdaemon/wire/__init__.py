"""What the daemon and its clients share: the protocol catalogue, handle frames, paths, sizes, dtypes."""
