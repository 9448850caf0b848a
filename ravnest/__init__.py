"""Ravnest: train large neural networks together on ordinary, unequal machines."""

__version__ = "0.1.0"
