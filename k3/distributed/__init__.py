"""Parallelism applied from outside the single-device model (SPEC §8).

kcp.py: KCP, context parallelism for KDA (and the short-conv halo it needs) over a torch.distributed group.
moonep.py: the MoonEP planner, exactly balanced expert parallelism with at most E/R replicas per rank.
"""
