"""The planner's axes, one entry each (``base.Axis``): a new axis in the planner is one module here and its line
in ``AXES``. The order is the search's loop order (outermost first) and the order of a step's terms."""

from __future__ import annotations

from dist_trainer.planner.axes import cp, dp, ep, pp, tp
from dist_trainer.planner.axes.base import Axis, AxisTime, SearchSpace, StepContext, StepTime, ring_time

AXES: tuple[Axis, ...] = (tp.AXIS, pp.AXIS, cp.AXIS, dp.AXIS, ep.AXIS)

__all__ = ["AXES", "Axis", "AxisTime", "SearchSpace", "StepContext", "StepTime", "ring_time"]
