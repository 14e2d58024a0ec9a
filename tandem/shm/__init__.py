"""Single-writer, multi-reader object store over a shared-memory file (bytes only)."""
