"""Environments people already have, run unchanged as AgentJet agents: ``gym`` (a gymnasium text
environment), with the model's calls captured token-exact like any agent's."""
