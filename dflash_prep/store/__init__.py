"""Shards out: the atomic, size-rolled webdataset writer lanes and their per-rank index, the committed
state and the manifest, the locks on an output folder, and the bytes a record takes on disk.

May import: `target`, `plan`, `data`, `recipe` and the ground floor.
"""
