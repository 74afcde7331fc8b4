"""Training health (issue 13): what a run records about itself, and the tools that show it.

    names.py      the stable metric names and parameter groups (torch-free; README "Watching a run")
    hooks.py      the step hooks the engines call and what the monitor reads of an engine
    monitor.py    the trainer's step hooks: non-finite guard, spike policy, signals, noise scale, stragglers
    signals.py    per-layer signals summed over the pieces each rank owns, reduced over the grid
    noise.py      the gradient noise scale (McCandlish et al. 2018, appendix A.1)
    spikes.py     the running-statistics spike detector
    attention.py  `dist-trainer attention`: attention maps and per-head diagnostics from a checkpoint
    report.py     `dist-trainer report`: PNGs of a run from its metrics.jsonl

The hang report lives with the collectives it numbers (``parallel/comm.py``, ``parallel/watchdog.py``).
"""
