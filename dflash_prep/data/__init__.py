"""Rows in: load a dataset, render chat rows with the model's template, token ids and the assistant loss mask.

Owns: `rows` (load, tokenize with `datasets.map`, skips counted by reason with their detail), `conversation` (every
accepted row shape as OpenAI messages), `chat` (the template's own rendering and the loss-mask convention of
docs/FORMAT.md), `samples` (a row's samples: whole or one per turn, `data.samples`, regenerated turns from the
engine's own token ids).
May import: `recipe` and the ground floor.
"""
