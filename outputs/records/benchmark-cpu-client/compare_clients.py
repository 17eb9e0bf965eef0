# The capture client before (fe548d8: clear() in the request threads, one polling waiter per request) and after
# (journal) against the same stand-in server, 2,000 requests at concurrency 256, two rounds. Run from the repo root:
#   git show fe548d8:src/eagle3kit/capture/client.py > /tmp/old_client.py && .venv/bin/python <this file>
import sys, time, importlib.util, multiprocessing as mp, shutil
from pathlib import Path
sys.path.insert(0, "benchmarks")
from client_throughput import serve
from eagle3kit.capture.client import CaptureClient
spec = importlib.util.spec_from_file_location("old_client", "/tmp/old_client.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
if __name__ == "__main__":
    d = Path("/tmp/cmpc"); shutil.rmtree(d, ignore_errors=True); d.mkdir()
    q = mp.get_context("spawn").Queue(); p = mp.get_context("spawn").Process(target=serve, args=(q, str(d)), daemon=True); p.start()
    url = f"http://127.0.0.1:{q.get()}"
    prompts = {f"s{i}": list(range(1366)) for i in range(2000)}
    for rnd in range(2):
        for name, cls in (("old", old.CaptureClient), ("new", CaptureClient)):
            for f in d.iterdir():
                if f.is_file() and not f.name.startswith("_"): f.unlink()
            c = cls(url, d, timeout=60); t = time.time()
            ms = c.capture_many(prompts.items(), concurrency=256)
            assert all(m["status"] == "ok" for m in ms), ms[0]
            print(rnd, name, f"{2000/(time.time()-t):,.0f} req/s", flush=True)
    p.kill()
