"""The recipe: YAML sections mapped onto frozen dataclasses, validation, and content fingerprints of a job's inputs.

Owns: `schema` (every recipe section, load, `--set` overrides, `RecipeError`), `fingerprints` (hashes of rows and
weights that say whether two runs read the same inputs).
May import: `dflash_prep.io`, `dflash_prep.errors`, `dflash_prep.faults` only.
"""
