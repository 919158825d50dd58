"""A run of agents over tasks: the runner and its rollouts, tracks, isolation, task order, try, progress, config
and report."""
