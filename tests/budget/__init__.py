"""Tests of trimpass.budget."""
