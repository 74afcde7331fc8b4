"""The torch-free floor: facts of the model, its training and its files that every layer above reads. It imports
nothing of the package but ``facts/`` itself, and neither torch nor numpy (``tests/test_architecture.py``), so the
config, the layout rules and the planner load without them. Nothing is imported here.

    model_names.py   the model's module names (first stage, per layer, last stage)
    model_shape.py   shape arithmetic: padded vocabulary, k/v sharding, parameters per module on one TP rank
    finetune.py      which parameters train (train.freeze, LoRA targets, trainable experts per ep rank)
    quant_sizes.py   int8 base weights and low-bit AdamW moments: which linears, their bytes, their rules
    span.py          T5 span corruption's counts and lengths
    sources.py       a mixture's sources as data.sources names them
    hf_config.py     Hugging Face folders: is a path one, its config.json
    hf_files.py      which safetensors shard holds which tensor; every tensor read
"""
