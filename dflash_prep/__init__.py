"""dflash-prep: fast, exact, resumable hidden-state extraction for training speculative-decoding drafters."""

__version__ = "0.1.0"
