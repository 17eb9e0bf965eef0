"""The drafter: speculators' ``Eagle3DraftModel`` configured as SGLang 0.5.14 runs it, trained on captured states.

vocab.py      draft vocabulary from loss-masked token frequencies (``d2t``/``t2d`` as SGLang and speculators read them)
model.py      the drafter and the target's head (final norm + full lm_head: the teacher)
ttt.py        the training-time-test forward: k chained draft steps, each fed the previous step's own hidden state
objective.py  losses per step, step weights, chained acceptance counts (acc, conditional acc, tau)
data.py       captured samples (eagle3kit data sets, speculators exports) aligned, packed and streamed
training_setup.py  before the first step: data sources (files or the live stream), target head, vocabulary, the
              drafter on its device, attention path and compiled layers (``setup``, ``Run``, ``Dist``)
train.py      the loop: AdamW, warmup + cosine, clipping, bf16 autocast, exact resume, held-out evaluation, DDP
checkpoint.py the resume point: written atomically, read back without unpickling code, the RNG states
export.py     SGLang's LlamaForCausalLMEagle3 and speculators' Eagle3Speculator checkpoints
"""
