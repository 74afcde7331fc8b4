"""DeepSpeed ZeRO: the DeepSpeed JSON from configs/ds and our config (config), the engine's DeepSpeed mechanisms
(deepspeed), consolidation of its checkpoints by name (consolidate) and the bytes each rank owns (memory)."""
