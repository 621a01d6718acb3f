"""Chat with and batch-run Hugging Face causal LMs through a paged, prefix-shared KV cache."""

__version__ = "0.1.0"
