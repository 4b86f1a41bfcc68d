"""Planning a run before (or instead of) running it: trace one block or the whole train step,
count what a remat policy saves and recomputes, compile for a target, choose a policy.

Imports go one way: plan reads the trainer's step builder (ember/trainer/step.py, state.py);
the trainer never imports plan. `remat.policy=auto` is resolved here before the loop starts.
"""
