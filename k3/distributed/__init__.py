"""Parallelism applied from outside the single-device model (SPEC §8).

kcp.py: KCP, context parallelism for KDA (and the short-conv halo it needs) over a torch.distributed group.
moonep.py: the MoonEP planner, exactly balanced expert parallelism with at most E/R replicas per rank.
expert_parallel.py: LatentMoE across ranks on that plan (all_to_all dispatch/combine, replica weights, grads).
context_parallel.py: the whole model over a sequence split across ranks (KCP in KDA layers, gathered MLA latents).
plan.py: the one training plan over a ("dp", "ep", "cp") mesh (sizes may be 1): FSDP2, MoonEP experts, KCP.
process_group.py: joining torchrun's process group, and the small collectives around it.
"""
