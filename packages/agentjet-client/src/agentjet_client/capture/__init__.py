"""What an episode's calls become: the recorder, the transports and proxy that capture, the episode handle, the
adapters of agent frameworks."""
