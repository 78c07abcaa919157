"""The layout planner (`interleaf plan`, parallel.plan="auto"): candidates.py enumerates
the layouts of a cluster, costs.py prices their actions from a measured device profile,
search.py prunes them by the memory model and ranks them by the simulator."""
