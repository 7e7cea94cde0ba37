"""The prepared GPU check: build a bundle here (prepare.py), run it on the lent GPU machine (run.sh)."""
