"""Reading a compiled step: its kernels, collectives and traffic (hlo.py), the roofline (cost.py), the predicted step
(predict.py), and the step compiled with its scheduler told those predicted times (schedule.py). It imports nothing
of the trainer or the planner: both read compiled programs through it.
"""
