"""Simulation: the cost-model executor and its driver, traces, workload generators,
metrics and the scaling benchmark. Shares the core's scheduler and step, never copies them.
"""
