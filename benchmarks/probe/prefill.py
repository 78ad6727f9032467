"""GPU probe: the eager prefill step's host and device time on small, by batch of prompts."""
import sys, time, torch
sys.path.insert(0, ".")
from k3.cli import build_parser
from k3.cli.serve import build_engine
from k3.inference.api import GenerationRequest, SamplingParams
args = build_parser().parse_args(["serve", "--preset", "small", "--random-init", "--device", "cuda"])
eng = build_engine(args); eng.warmup()
V = eng.model.config.vocab_size
g = torch.Generator().manual_seed(0)
p1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
def run(nreq, L, reps=3):
    ts = []
    for r in range(reps):
        hs = [eng.submit(GenerationRequest(tuple(torch.randint(3, V, (L,), generator=g).tolist()), p1)) for _ in range(nreq)]
        torch.cuda.synchronize(); t0 = time.perf_counter()
        while eng.has_work:
            eng.step()
        torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    print(f"prefill {nreq} x {L}: {min(ts)*1e3:.1f} ms (all {[round(t*1e3,1) for t in ts]})", flush=True)
for n, L in [(1, 51), (8, 51), (32, 51), (1, 1500), (4, 1500)]:
    run(n, L)
from torch.profiler import profile, ProfilerActivity
hs = [eng.submit(GenerationRequest(tuple(torch.randint(3, V, (51,), generator=g).tolist()), p1)) for _ in range(8)]
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    while eng.has_work:
        eng.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
