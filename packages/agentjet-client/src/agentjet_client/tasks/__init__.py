"""What a run plays: the agent declaration, task sources, rewards and judges."""
