"""What reads an output (a folder or an object-store URL): the reader drafter trainers iterate (follow.py: while
the extraction runs), the exporters to the peer trainers' layouts, the draft vocabulary.

May import: `store`, `target`, `plan`, `data`, `recipe` and the ground floor.
"""
