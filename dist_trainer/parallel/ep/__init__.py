"""Expert parallelism: each MoE layer's experts split over ep_size data-parallel ranks (docs/moe.md).

comms.py (the token all-to-all as an autograd Function), apply.py (keep this rank's experts, move the dispatch
buffer through the all-to-all), grad.py (expert gradients reduced over the expert-data-parallel group).
DeepSpeed's MoE conventions for ZeRO-1/2 live in ``engines/deepspeed_zero.py``.
"""
