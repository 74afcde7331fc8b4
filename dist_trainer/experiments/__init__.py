"""Experiments that run the trainer's regimes and compare what they measure with what is predicted."""
