"""The learner: one step (``trainer``: packing, the no-gradient pass ``prepare``, the ``objective``, the ``policy``'s
forward passes), the background loop (``loop``), the data modes beside RL (``training``)."""
