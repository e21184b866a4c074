"""Worked examples of the plug-in points (docs/extending.md): each is exercised by tests/test_examples.py."""
