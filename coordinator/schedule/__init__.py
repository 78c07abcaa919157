"""Training-step schedules as data: build, validate, simulate and draw per-rank programs.

`build_programs` lowers a schedule name into one action list per pipeline rank
(compute order, then point-to-point communication placed so that it cannot deadlock
under rendezvous semantics, then gradient sync); the same lists are what stage servers
execute.
"""

from .compute_order import compute_order
from .links import LINKS
from .lowering import build_programs
from .render import timeline_table, write_png
from .simulate import (
    Blocked,
    CostModel,
    DeadlockError,
    SimResult,
    peak_activations,
    simulate,
)
from .validate import ProgramError, validate_programs

__all__ = [
    "LINKS",
    "Blocked",
    "CostModel",
    "DeadlockError",
    "ProgramError",
    "SimResult",
    "build_programs",
    "compute_order",
    "peak_activations",
    "simulate",
    "timeline_table",
    "validate_programs",
    "write_png",
]
