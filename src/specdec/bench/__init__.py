"""`specdec bench`: every method on the same prompts, in the same process, interleaved per prompt.

datasets.py loads prompts; records.py keeps one JSONL record per measured generation; runner.py
measures; peers.py runs other engines on the same prompts; report.py turns records into
report.md, report.json and charts; cli.py wires them.
"""
