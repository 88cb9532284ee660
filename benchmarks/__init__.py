"""Benchmarks, run by hand from the project folder as modules (``.venv/bin/python -m benchmarks.workflow``);
the figures and the commands that produced them are in ``BENCHMARKS.md``."""
