"""Pipeline stages: the split of the model into this rank's stages (split) and the torch.distributed.pipelining
schedules that run them (schedule)."""
