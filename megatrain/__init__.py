"""megatrain: full-precision training of Hugging Face causal LMs larger than GPU memory, on one GPU."""

__version__ = "0.1.0"
