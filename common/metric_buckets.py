"""Histogram buckets that the coordinator's and the stage servers' metrics share.

A job's step time (interleaf_step_seconds, coordinator/metrics.py) is its slowest
rank's (interleaf_rank_step_seconds, stageserver/metrics.py): with the same buckets the
two histograms compare bucket by bucket, so they are defined once, here.
"""

# From a tiny CPU model's step (milliseconds) to a large pipeline's (minutes).
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
