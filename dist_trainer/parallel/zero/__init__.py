"""DeepSpeed ZeRO: the DeepSpeed JSON from configs/ds and our config (config), the mechanisms DeepSpeed needs from
our layout (deepspeed: the mpu, TP and pipeline tags, the partitioned init) and the bytes each rank owns (memory).
Its checkpoint files are read by ``checkpoint/deepspeed_files.py``."""
