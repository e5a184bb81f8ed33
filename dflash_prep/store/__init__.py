"""Shards out: the atomic, size-rolled webdataset writer lanes and their per-rank index, the committed
state and the manifest, the locks on an output folder, and the bytes a record takes on disk; an output in an object
store (remote.py: staged shards uploaded and committed by the index in the store) and its leases (lease.py).

May import: `target`, `plan`, `data`, `recipe` and the ground floor.
"""
