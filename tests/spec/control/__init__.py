"""Tests of trimpass.spec.control."""
