"""Extraction: run a Hugging Face model over text and stream mergeable sums into the warehouse."""
