"""What reads an output: the reader drafter trainers iterate, the exporters to the peer trainers' layouts, the draft
vocabulary.

May import: `store`, `target`, `plan`, `data`, `recipe` and the ground floor.
"""
