"""Text to batches: the o200k tokenizer and the compact vocabulary (vocab), where stories come
from (sources), the on-disk token cache (token_cache), batches on the device (batches), and the
synthetic tasks of the papers (tasks)."""
