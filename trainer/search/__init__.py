"""Search-R1: the retriever server, its client, and the built-in search task."""
