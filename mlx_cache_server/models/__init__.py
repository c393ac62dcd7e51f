"""The configured models: where their files come from (a folder, a hub id's download, a
GGUF import, the embedded default model), each loaded as an engine or an embedder, and
which of them stay loaded (the pool and its residency policy)."""
