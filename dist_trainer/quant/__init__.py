"""Low-bit storage (docs/low_bit.md): the int8 maths (``int8.py``: group-wise absmax codes, the int8 product,
dequantising readers). The swap of frozen linears for their int8 classes is a ``parallelize`` step
(``parallel/int8.py``); the torch-free sizes the planner and the rules read are ``facts/quant_sizes.py``."""
