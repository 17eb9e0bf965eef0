"""Re-summarize gpu-drafter-pipeline-13's complete online results (online.json, proof.json, 05's offline figures)
with the fixed metric names, and check notebook 05's online assertions on them."""
import json, sys
from pathlib import Path
from eagle3kit.acceptance import experiment
from eagle3kit.target import resolve_target

step = Path(sys.argv[1])
results = json.loads((step / "online.json").read_text())
for r in results["servers"].values():
    if "by_concurrency" in r:
        r["by_concurrency"] = {int(c): m for c, m in r["by_concurrency"].items()}
plan, _ = experiment.load_partial(step / "online")
plan.target = str(resolve_target("embedded:smollm2"))
proofs = json.loads((step / "proof.json").read_text())
recorded = json.loads((step / "metrics.json").read_text())
off = {k: v for k, v in recorded.items() if k.startswith("offline_")}
m = experiment.summarize(plan, results, proofs, {"main": off})
bad = [k for k in m if not k.isidentifier()]
checks = {
    "metric names are identifiers": not bad,
    "online_required_servers_failed == 0": m["online_required_servers_failed"] == 0,
    "export_params_unloaded == 0": m["export_params_unloaded"] == 0,
    "export logits within 5 %, argmax > 95 %": m["export_logits_max_rel_err"] < 0.05 and m["export_logits_argmax_agreement"] > 0.95,
    "doctor verified both": m["doctor_verified"] and m["offbyone_doctor_verified"],
    "doctor passes export, flags off-by-one": m["doctor_ok"] and not m["offbyone_doctor_ok"],
    "negative control accepts less": m["negative_control_accept_length"] < m["online_accept_length"],
}
out = {"checks": checks, "metrics": {k: v for k, v in m.items() if isinstance(v, (int, float, str, bool))}}
print(json.dumps(checks, indent=1))
for k in sorted(m):
    if "outputs_identical" in k or "common_prefix" in k:
        print(k, round(m[k], 3))
json.dump(out, open(sys.argv[2], "w"), indent=1, default=str)
