"""Acceptance: how many draft tokens the target accepts, offline and in SGLang's own speculative decoding.

offline.py    chained drafting over held-out captured samples, exactly as serving chains it (tau against n)
online.py     SGLang servers with the exported drafter (EAGLE3) and without, same prompts: accept length, tokens/s
experiment.py notebook 05's online experiment: every drafter and setting against plain in one run, its metrics
outputs_match.py  how far the servers' replies agree with plain's and with the stored replies
drafthook.py  a forward hook for SGLang's draft model: what SGLang feeds the draft, its outputs and its weights
proof.py      the load proof and the doctor's check from what drafthook recorded
compare.py    any set of runs' metrics.json side by side: table and plots
"""
