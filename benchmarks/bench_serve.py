"""`k3 serve` over HTTP against its own engine, in one run (SPEC §7): what a serving user gets, and what it costs.

    python benchmarks/bench_serve.py [--url URL] [--endpoint completions|chat] [--concurrency 1,64] [--rate R]
        [--requests N] [--prompt-len 51 | 40:60] [--output-len 512] [--shared-prefix 0] [--client-procs 2]
        [--client aiohttp|raw] [--engine] [--json out.json] [-- SERVE ARGS, e.g. --preset small --random-init]

Without ``--url`` it starts ``k3 serve SERVE ARGS`` itself and reports the time until ``/health`` says ready, then
the first request's TTFT (cold) against the warm median. Each scenario (one per ``--concurrency``, or Poisson
arrivals at ``--rate`` requests/s) streams ``--requests`` requests (default 4 x concurrency, at least 8) with
``ignore_eos``, so every request writes its ``--output-len`` tokens. Reported: request and output-token throughput
over the window (first request sent to last one done), TTFT, TPOT ((last chunk - first chunk) / (tokens - 1)) and
inter-chunk latency (ITL, per text-carrying chunk) at p50/p90/p99, tokens per chunk, errors, cached prompt tokens,
the server's CPU use (its process and the engine's, from /proc) and the clients' own, and on CUDA the GPU's busy
share (nvidia-smi, every 100 ms). ``--client-procs P`` splits the clients over P processes: the same total from 1
and 2 processes shows the client is not the bottleneck. ``--engine`` also measures, in a separate process and with
the same model and engine options, the engine alone at the same batch (its steady decode rate and step time), so
the server/engine ratio is printed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402
from benchmarks.serve_client import make_jobs, run_jobs  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _get(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str, float]:
    """``k3 serve`` on a free port; (process, base URL, seconds until /health said ready)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "k3", "serve", *serve_args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"k3 serve exited with {proc.returncode} before it was ready")
        try:
            code, body = _get(url + "/health")
            if code == 200 and body.get("ready", True):
                return proc, url, time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live children (the engine's process)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids = [pid]
    try:
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick
        except OSError:
            pass
    return total


class GpuBusy:
    """nvidia-smi's utilization.gpu every 100 ms while running (None where there is no nvidia-smi)."""

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,"
                                          "nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        self.samples = []
        if self.proc is not None:
            self.proc.terminate()
            out = self.proc.communicate()[0]
            self.samples = [float(x.split(",")[0]) for x in out.split() if x.strip()]

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


def _client_proc(url, model, jobs, concurrency, client, t0):
    c0 = time.process_time()
    recs = run_jobs(url, model, jobs, concurrency, client, t0)
    return recs, time.process_time() - c0


def scenario(url: str, model: str, jobs, concurrency: int, procs: int, client: str, server_pid: int | None) -> dict:
    shares = [jobs[i::procs] for i in range(procs)]
    conc = [max(1, concurrency // procs + (i < concurrency % procs)) for i in range(procs)]
    t0 = time.time() + 0.5 + 0.3 * procs  # every client process starts sending at the same moment
    cpu0 = cpu_seconds(server_pid) if server_pid else None
    with GpuBusy() as gpu, ProcessPoolExecutor(procs) as ex:
        outs = list(ex.map(_client_proc, [url] * procs, [model] * procs, shares, conc, [client] * procs, [t0] * procs))
    recs = [r for recs, _ in outs for r in recs]
    ok = [r for r in recs if not r["error"] and r["chunks"]]
    start, end = min(r["start"] for r in recs), max(r["end"] for r in recs)
    window = end - start
    ttft = [r["chunks"][0] - r["start"] for r in ok]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["completion_tokens"] - 1) for r in ok if r["completion_tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tokens = sum(r["completion_tokens"] for r in ok)
    row = {"concurrency": concurrency, "requests": len(recs), "errors": len(recs) - len(ok),
           "first_error": next((r["error"] for r in recs if r["error"]), ""), "window_s": window,
           "req_per_s": len(ok) / window, "output_tok_s": tokens / window,
           "tokens_per_chunk": tokens / max(1, sum(len(r["chunks"]) for r in ok)),
           "cached_tokens": sum(r["cached_tokens"] for r in ok), "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
           "client_cpu": [c / window for _, c in outs], "gpu_busy": gpu.mean}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = pct(xs, q) * 1e3
    if server_pid:
        row["server_cpu"] = (cpu_seconds(server_pid) - cpu0) / window
    return row


def engine_rate(serve_args: list[str], batch: int, prompt_len: int, output_len: int) -> dict:
    """The engine alone with ``k3 serve SERVE ARGS``'s model and options (in this process: call it in a child)."""
    import torch

    from k3.cli import build_parser
    from k3.cli.serve import build_engine
    from k3.inference.api import GenerationRequest, SamplingParams

    args = build_parser().parse_args(["serve", *serve_args])
    eng = build_engine(args)
    eng.warmup()
    V = eng.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    hs = [eng.submit(GenerationRequest(tuple(torch.randint(3, V, (prompt_len,), generator=g).tolist()), params))
          for _ in range(batch)]
    while any(s.pending > 1 for s in eng.running) or len(eng.running) < batch:
        eng.step()
    for _ in range(3):
        eng.step()
    steps, t0 = 0, time.perf_counter()
    while len(eng.running) == batch and steps < output_len - 8:
        eng.step()
        steps += 1
    dt = time.perf_counter() - t0
    for h in hs:
        h.cancel()
    return {"batch": batch, "steps": steps, "step_ms": dt / steps * 1e3, "tok_s": batch * steps / dt}


def pyspy(path: str | None, proc) -> subprocess.Popen | None:
    """py-spy on the server and its engine-core child for 6 s (started with the scenario), as collapsed stacks."""
    if not path or proc is None or not shutil.which("py-spy"):
        return None
    return subprocess.Popen(["py-spy", "record", "-p", str(proc.pid), "--subprocesses", "--duration", "6", "--rate",
                             "200", "--format", "raw", "--nonblocking", "-o", path], stdout=subprocess.DEVNULL)


def top_frames(path: str, n: int = 15) -> list[tuple[str, float]]:
    """The frames holding the most samples at the top of the stack (self time), as shares of all samples."""
    self_t: dict[str, int] = {}
    total = 0
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        stack, _, count = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        self_t[leaf] = self_t.get(leaf, 0) + int(count)
        total += int(count)
    return [(f, c / total) for f, c in sorted(self_t.items(), key=lambda kv: -kv[1])[:n]]


def _lens(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    return int(lo), int(hi or lo)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else ["--preset", "tiny", "--random-init"]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="an existing server (its base URL, without /v1); default: start k3 serve")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--rate", type=float, help="Poisson arrivals (requests/s) instead of fixed concurrency")
    ap.add_argument("--requests", type=int, help="requests per scenario (default 4 x concurrency, at least 8)")
    ap.add_argument("--prompt-len", default="51")
    ap.add_argument("--output-len", default="512")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix common to every prompt")
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--client", choices=["aiohttp", "raw"], default="aiohttp")
    ap.add_argument("--engine", action="store_true", help="measure the engine alone at the same batches too")
    ap.add_argument("--pyspy", help="record the server's processes with py-spy during the busiest scenario (a file)")
    ap.add_argument("--json")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    meta = header()
    out = {"meta": meta, "serve_args": serve_args, "args": vars(args), "rows": [], "engine": []}
    proc, url = None, args.url
    if url is None:
        proc, url, out["startup_s"] = start_server(serve_args)
        print(f"k3 serve ready after {out['startup_s']:.1f} s", file=sys.stderr)
    try:
        model = _get(url + "/v1/models")[1]["data"][0]["id"]
        vocab = _get(url + "/health")[1].get("vocab_size", 256)
        pl, ol = _lens(args.prompt_len), _lens(args.output_len)
        if proc is not None:  # the first request after ready, alone
            job = make_jobs(args.endpoint, 1, pl, ol, vocab, args.shared_prefix, None, 1)
            rec = run_jobs(url, model, job, 1, args.client, time.time())[0]
            out["first_ttft_ms"] = (rec["chunks"][0] - rec["start"]) * 1e3 if rec["chunks"] else None
        levels = [0] if args.rate else [int(c) for c in args.concurrency.split(",")]
        for c in levels:
            n = args.requests or max(8, 4 * c)
            jobs = make_jobs(args.endpoint, n, pl, ol, vocab, args.shared_prefix, args.rate, 2 + c)
            spy = pyspy(args.pyspy, proc) if c == max(levels) else None
            row = scenario(url, model, jobs, c or n, args.client_procs, args.client, proc.pid if proc else None)
            row["rate"] = args.rate
            if spy is not None:
                spy.wait(timeout=60)
                out["pyspy_top"] = top_frames(args.pyspy)
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if args.engine:
        for c in sorted({r["concurrency"] for r in out["rows"]}):
            # its own (spawned: no CUDA state forked) process: the server's GPU memory is free again
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
                out["engine"].append(ex.submit(engine_rate, serve_args, c, pl[1], ol[1]).result())
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def report(out: dict) -> None:
    m = out["meta"]
    print(f"# bench_serve  {m['date']}  {m['commit']}  {m['machine']}  torch {m['torch']}  "
          f"k3 serve {' '.join(out['serve_args'])}")
    if "startup_s" in out:
        warm = [r["ttft_p50_ms"] for r in out["rows"] if r["concurrency"] == 1] or [out["rows"][0]["ttft_p50_ms"]]
        print(f"ready after {out['startup_s']:.1f} s; first request TTFT {out.get('first_ttft_ms') or float('nan'):.0f}"
              f" ms (warm median {warm[0]:.0f} ms)")
    eng = {e["batch"]: e for e in out["engine"]}
    print("| conc | req/s | out tok/s | engine tok/s | ratio | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms "
          "| tok/chunk | errors | server CPU | client CPU | GPU busy |")
    print("|" + "---|" * 13)
    for r in out["rows"]:
        e = eng.get(r["concurrency"])
        busy = f"{r['gpu_busy']:.0f}%" if r["gpu_busy"] is not None else "n/a"
        etok = f"{e['tok_s']:,.0f}" if e else "-"
        ratio = f"{r['output_tok_s'] / e['tok_s']:.2f}x" if e else "-"
        conc = r["concurrency"] or f"rate {r['rate']}"
        clients = "+".join(f"{100 * c:.0f}%" for c in r["client_cpu"])
        print(f"| {conc} | {r['req_per_s']:.2f} | {r['output_tok_s']:,.0f} | {etok} | {ratio} | "
              f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.2f} / {r['tpot_p99_ms']:.2f} | "
              f"{r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | {r['tokens_per_chunk']:.2f} | {r['errors']} | "
              f"{100 * r.get('server_cpu', float('nan')):.0f}% | {clients} | {busy} |")
    for frame, share in out.get("pyspy_top", []):
        print(f"py-spy self {100 * share:5.1f}%  {frame}")
    for e in out["engine"]:
        print(f"engine alone, batch {e['batch']}: {e['tok_s']:,.0f} tokens/s, step {e['step_ms']:.2f} ms")


if __name__ == "__main__":
    main()
