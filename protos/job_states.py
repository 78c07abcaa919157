"""The values of JobStatus.state (interleaf.proto), in the order a job passes through
them. Here, beside the wire format, so the coordinator and the clients read them from
one place without the client importing the coordinator (and torch with it)."""

FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
"""A job in one of these never changes again; its watchers' streams end."""
JOB_STATES = ("PENDING", "SETTING_UP", "RUNNING", "RECOVERING", *FINAL_STATES)
