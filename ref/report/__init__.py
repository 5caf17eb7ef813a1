"""Reports drawn from simulator and engine runs: the policy comparison, its plots, and the
step timeline."""
