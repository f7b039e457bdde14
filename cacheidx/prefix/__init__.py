"""Prefix sharing (``spec/prefix-sharing.txt``): plan which prompt computes which tokens,
hold the pages with reference counts, and report what sharing saves.

>>> from cacheidx import prefix
>>> p = prefix.plan([[10, 20, 30, 40], [10, 20, 30, 50, 60, 70], [80, 90, 70],
...                  [10, 20, 30, 50], [10, 20, 30, 50]], page_size=2)
>>> p.order.tolist(), p.shared.tolist(), p.parent.tolist()
([0, 3, 4, 1, 2], [0, 2, 2, 4, 0], [-1, 0, 0, 4, -1])
"""

from .cache import CachedPage, GroupPages, Hold, Match, PrefixCache, lru
from .pages import STRATEGIES, PageError, Pages, Simulation, simulate, walk
from .plan import Plan, plan
from .report import Report, report
from .schedule import Schedule, Wave, schedule

__all__ = [
    "STRATEGIES",
    "CachedPage",
    "GroupPages",
    "Hold",
    "Match",
    "PrefixCache",
    "PageError",
    "Pages",
    "Plan",
    "Report",
    "Schedule",
    "Simulation",
    "plan",
    "report",
    "schedule",
    "simulate",
    "walk",
    "lru",
    "Wave",
]
