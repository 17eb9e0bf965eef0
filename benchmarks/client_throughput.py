"""The capture client's own ceiling, on the CPU: requests per second against a stand-in server that answers at once.

Baseline in the same run: the plain HTTP loop of ``extract_throughput.py`` (what its "plain prefill" pass sends)
against the same server. The stand-in server runs in its own process (asyncio, keep-alive HTTP/1.1); after
answering it writes a marker (file and journal line, ``format.write_marker``), as the writer process would, for
plain requests too (in another folder), so that it does the same work for both kinds and the ratio is the
client's own. What the ratio shows: whether the client can keep a server busy that answers N requests per
second. On the GPU the SGLang server answered 300-600 requests per second (1,366-token prompts at 0.4-0.8 M
tokens/s); the client must sustain well more than that.

usage: python benchmarks/client_throughput.py [--requests 4000] [--concurrency 64 256] [--out DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def serve(port_q, capture_dir: str) -> None:
    """The stand-in server (its own process)."""
    from eagle3kit.capture.format import write_marker
    from eagle3kit.capture.rid import parse_rid

    plain_dir = Path(capture_dir) / "plain"
    plain_dir.mkdir(exist_ok=True)
    body_ok = json.dumps({"text": "", "meta_info": {"cached_tokens": 0}}).encode()
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body_ok)).encode()
            + b"\r\n\r\n")

    async def handle(reader, writer):
        loop = asyncio.get_running_loop()
        try:
            while True:
                headers = await reader.readuntil(b"\r\n\r\n")
                n = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                         if line.lower().startswith(b"content-length"))
                req = json.loads(await reader.readexactly(n))
                writer.write(head + body_ok)
                await writer.drain()
                parsed = parse_rid(req["rid"])
                # a capture request's marker follows, as the writer process writes it; a plain request gets one
                # too, elsewhere, so that the server does the same work for both and the ratio is the client's
                key, where = (parsed[0], capture_dir) if parsed else (req["rid"], plain_dir)
                loop.run_in_executor(None, write_marker, where, key, 0,
                                     {"status": "ok", "key": key, "bytes": 0, "n_tokens": len(req["input_ids"])})
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
        port_q.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def main(argv=None):
    from eagle3kit.capture.client import CaptureClient
    from extract_throughput import fresh_start, plain_prefill

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--tokens", type=int, default=1366, help="prompt length (the ShareGPT mean of the GPU runs)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default="/tmp/eagle3kit-client-bench")
    p.add_argument("--out", default=None, help="folder for metrics.json")
    a = p.parse_args(argv)
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=serve, args=(q, str(d)), daemon=True)
    proc.start()
    url = f"http://127.0.0.1:{q.get(timeout=60)}"
    prompts = {f"s{i}": list(range(i % 1000, i % 1000 + a.tokens)) for i in range(a.requests)}
    res: dict = {"requests": a.requests, "tokens_per_request": a.tokens}
    try:
        client = CaptureClient(url, d, timeout=60)
        for rnd in range(a.rounds):
            for c in a.concurrency:
                t = time.time()
                plain_prefill(url, prompts, c)
                plain = a.requests / (time.time() - t)
                fresh_start(d)
                t = time.time()
                markers = client.capture_many(prompts.items(), concurrency=c)
                capture = a.requests / (time.time() - t)
                bad = sum(m.get("status") != "ok" for m in markers)
                if bad:
                    raise SystemExit(f"{bad} captures failed: {next(m for m in markers if m['status'] != 'ok')}")
                for k, v in (("plain", plain), ("capture", capture)):
                    res[f"{k}_conc{c}_requests_per_s"] = max(res.get(f"{k}_conc{c}_requests_per_s", 0), v)
                print(f"round {rnd} conc {c}: plain {plain:,.0f} requests/s, capture client {capture:,.0f}",
                      flush=True)
    finally:
        proc.kill()
    for c in a.concurrency:
        res[f"ratio_conc{c}"] = res[f"capture_conc{c}_requests_per_s"] / res[f"plain_conc{c}_requests_per_s"]
    width = max(map(len, res))
    for k, v in res.items():
        print(f"{k.ljust(width)}  {v:,.3f}" if isinstance(v, float) else f"{k.ljust(width)}  {v}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "metrics.json").write_text(json.dumps(res, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
