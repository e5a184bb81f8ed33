"""The embedded default job: `tiny-demo.yaml` and its assets (a tiny random-weight Qwen3.5-architecture config, a small
tokenizer, synthetic chat rows), shipped inside the package so the quick start runs from any folder.

Data only: no code of the package lives here.
"""
