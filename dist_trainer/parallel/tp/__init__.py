"""Megatron tensor parallelism: the f/g operators and SP collectives (comms), the parallel layers (layers), the
module-name plan that applies them (apply), TP gradient steps (grad) and checkpoint resharding across tp (reshard)."""
