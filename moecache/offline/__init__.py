"""The offline wing: replaying recorded routing traces (replay: the one driver, simulate; steps:
a trace as each model's steps and the next uses the offline optima read; cli: the command
line) through the core's engine, the global-budget and upstream-llama.cpp cache models
(budget, upstream), with the modelled cost (cost) and the policies tried and not shipped
(experiments). No libllama here: it imports the core only (tests/test_layout.py)."""
