"""kvbaton: disaggregated LLM inference serving."""

__version__ = "0.1.0"
