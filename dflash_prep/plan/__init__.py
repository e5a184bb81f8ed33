"""Lengths in, batches out: the token-budget, length-grouped plan (padded batches or packed rows), its split over
ranks, and the host-side collation of a planned batch.

Owns: `planner` (shapes, batches, packed rows, rank split, resume filter), `batches` (`SampleInfo`, `Batch`, the
padded and packed collate functions, the DataLoader dataset of planned batches).
May import: `data`, `recipe` and the ground floor.
"""
