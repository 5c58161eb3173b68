"""Snapshots, the fallback of last resort: written in the background, stored on any fsspec URL."""
