"""longctx: long-context LLM pretraining on packed sequences with document masking."""

from longctx.batch import IGNORE_INDEX, PackedBatch

__all__ = ["IGNORE_INDEX", "PackedBatch"]
__version__ = "0.1.0"
