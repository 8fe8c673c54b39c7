"""Search-R1's retriever: the index and its HTTP server (one file that stands alone on nodes without cloudrl),
and the client the rollout workers ask. The built-in search task is agents/search_task.py."""
