"""backfill: co-serve best-effort work in the idle capacity of online LLM inference."""

__version__ = "0.1.0"
