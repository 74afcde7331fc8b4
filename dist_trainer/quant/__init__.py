"""Low-bit storage (docs/low_bit.md): frozen base weights in int8 (``int8.py`` the maths, ``modules.py`` the module
classes that replace frozen linears); the torch-free sizes the planner and the rules read are
``facts/quant_sizes.py``."""
