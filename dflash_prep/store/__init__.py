"""Outputs on disk: the record store every stage commits its files through (record_store.py: the rename, the
per-rank index, the repair, the committed set, the manifest); the extraction's size-rolled webdataset writer lanes
and its shard records (writer.py, manifest.py); the locks on an output folder; the bytes a record takes on disk; an
output in an object store (remote.py: staged shards uploaded and committed by the index in the store) and its leases
(lease.py).

May import: `target`, `plan`, `data`, `recipe` and the ground floor.
"""
