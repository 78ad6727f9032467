"""Parallelism applied from outside the single-device model (SPEC §8).

moonep.py: the MoonEP planner, exactly balanced expert parallelism with at most E/R replicas per rank.
"""
