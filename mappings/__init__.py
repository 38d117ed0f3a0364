"""Per-architecture mapping tables, looked up by the HF `architectures` entry from an explicit registry."""
