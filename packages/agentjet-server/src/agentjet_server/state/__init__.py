"""A run's state on disk: the state directory and its checkpoints (``checkpoint``: weights, optimizer,
version, buffer cursor, written atomically) and restoring from them and saving them (``recovery``)."""
