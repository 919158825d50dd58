"""The learner: pure losses (``losses``), one step (``trainer``), the background loop (``loop``)."""
