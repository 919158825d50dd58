"""How finished episodes reach the server: the durable spool, the sender, admission (each keeps its own counts)."""
