"""What the server tells people and tools about itself: the runtime's counters and history (``metrics``),
Prometheus exposition (``exposition``), tensorboard and wandb sinks (``sinks``), one trajectory token by
token (``inspection``), and the dashboard page (``dashboard/index.html``)."""
