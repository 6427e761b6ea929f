"""Measuring our own labels against truth (simulator sidecars, torch's memory profiler): used by tests and
benchmarks, never by an analysis."""
